"""The same comparisons as test_gateway_openai.py on a fresh random tiny Gemma 4 checkpoint (text +
vision, sliding and full layers): nothing in the gateway path leans on the demo model's weights.

The checkpoint gets the demo's chat template and tokenizer_config (same special-token layout),
which is what SMG renders prompts from; its tokenizer reaches SMG through GetTokenizer only. A random
model emits arbitrary bytes, mostly no valid UTF-8, which SMG holds back (text and logprobs) where we
show replacement characters; so both requests carry the same JSON schema (`response_format`), whose
grammar keeps the output valid UTF-8, and text, tokens and logprobs are compared exactly."""

from __future__ import annotations

import shutil
import time

import pytest
from gateway_cases import assert_same, media_request, png, streamed_text
from smg_harness import Fleet

from mmserve.clients import Client
from mmserve.clients.messages import message
from mmserve.config import DEMO_MODEL_DIR
from mmserve.model.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(600)

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 5}}, "required": ["word"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, gemma4_fixtures):
    root = tmp_path_factory.mktemp("tiny_gemma4_gateway")
    gemma4_fixtures.make_checkpoint(root, seed=1234)
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL_DIR / name, root / name)
    return root


@pytest.fixture(scope="module")
def fleet(checkpoint):
    with Fleet(2, policy="cache_aware", model=checkpoint) as f:
        yield f


@pytest.mark.parametrize("media", ["text", "image", "video"])
def test_random_gemma4_through_smg_matches_mmserve_v1(fleet, checkpoint, media, make_video):
    tokenizer = load_tokenizer(checkpoint)
    v1_parts, content = media_request("What is shown here?", png(5) if media == "image" else None,
                                      make_video(11, num_frames=8) if media == "video" else None)
    with Client(fleet.replicas[0].address) as c:
        ours = c.generate([message("user", *v1_parts)], max_tokens=16, temperature=0, logprobs=True,
                          json_schema=SCHEMA)
    client = fleet.openai()
    model = fleet.model_id()
    request = dict(model=model, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=16,
                   response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}})
    reply = client.chat.completions.create(logprobs=True, **request)
    assert_same(reply.choices[0], ours, tokenizer)
    assert reply.usage.completion_tokens == ours.usage.completion_tokens
    assert reply.usage.prompt_tokens == ours.usage.prompt_tokens
    text, reasons, _ = streamed_text(client.chat.completions.create(stream=True, **request))
    assert text == ours.text and len(reasons) == 1


def test_a_draining_replica_hands_its_traffic_to_the_other(fleet):
    """Last in the module (it stops replica 0): SIGTERM drains it (VllmEngine Generate UNAVAILABLE,
    HealthCheck unhealthy, then the port closes); every request through SMG still succeeds."""
    draining, other = fleet.replicas
    draining.terminate()
    client, model = fleet.openai(), fleet.model_id()
    for i in range(4):
        reply = client.chat.completions.create(model=model, temperature=0, max_tokens=3,
                                               messages=[{"role": "user", "content": f"Say {i}"}],
                                               extra_headers={"x-request-id": f"after-drain-{i}"})
        assert reply.choices[0].finish_reason in ("stop", "length")
    assert draining.proc.wait(30) == 0   # a clean drain
    deadline = time.monotonic() + 10     # the access-log line follows the answer
    while not all(f"request after-drain-{i}" in other.log for i in range(4)):
        assert time.monotonic() < deadline, other.log[-3000:]
        time.sleep(0.05)
