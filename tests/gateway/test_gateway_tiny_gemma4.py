"""The same comparisons as test_gateway_openai.py on a fresh random tiny Gemma 4 E-model checkpoint
(E2B-like: text + vision + an audio tower, per-layer embeddings, shared KV): nothing in the gateway
path leans on the demo model's weights, and audio goes through SMG's OpenAI endpoint.

The checkpoint gets the demo's chat template (plus the audio branch an E-model's template has: one
`<|audio|>` per audio part) and tokenizer_config (same special-token layout), which is what SMG
renders prompts from; its tokenizer reaches SMG through GetTokenizer only. SMG 1.13.0 forwards an
OpenAI `input_audio` part as a `media_refs` AUDIO item (`data:audio/<format>;base64,...`) beside that
anchor; the replica decodes it as mmserve.v1 does. A random model emits arbitrary bytes, mostly no
valid UTF-8, which SMG holds back (text and logprobs) where we show replacement characters; so both
requests carry the same JSON schema (`response_format`), whose grammar keeps the output valid UTF-8,
and text, tokens and logprobs are compared exactly."""

from __future__ import annotations

import base64
import random
import shutil
import time

import grpc
import pytest
from audio_clips import tones, wav
from gateway_cases import assert_same, media_request, png, streamed_text
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc
from smg_harness import Fleet
from test_gateway_kv_events import BLOCK, RouterIndex, read_until

from mmserve.clients import Client
from mmserve.clients.messages import message
from mmserve.config import DEMO_MODEL_DIR
from mmserve.model.spec import load_spec
from mmserve.model.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(600)

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 5}}, "required": ["word"],
          "additionalProperties": False}
# Room for the whole schema in byte tokens ({"word":"..."}, five characters of up to 4 bytes each), so
# the answer never stops inside a character (SMG holds an incomplete one back, we show U+FFFD).
MAX_TOKENS = 40
VIDEO_PART = "{% elif part['type'] == 'video' %}<|video|>"
AUDIO_PART = "{% elif part['type'] == 'audio' %}<|audio|>"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, gemma4_fixtures):
    root = tmp_path_factory.mktemp("tiny_gemma4_gateway")
    gemma4_fixtures.make_checkpoint(root, config=gemma4_fixtures.e_model_config(), seed=1234)
    shutil.copy(DEMO_MODEL_DIR / "tokenizer_config.json", root / "tokenizer_config.json")
    template = (DEMO_MODEL_DIR / "chat_template.jinja").read_text()
    assert VIDEO_PART in template
    (root / "chat_template.jinja").write_text(template.replace(VIDEO_PART, VIDEO_PART + AUDIO_PART))
    return root


@pytest.fixture(scope="module")
def fleet(checkpoint):
    # Replica 0 a `serve` process (the last test drains it by SIGTERM and reads its exit), replica 1 in-process.
    with Fleet(2, policy="cache_aware", model=checkpoint, in_process=1) as f:
        yield f


@pytest.mark.parametrize("media", ["text", "image", "video", "audio", "image+audio+audio"])
def test_random_gemma4_through_smg_matches_mmserve_v1(fleet, checkpoint, media, make_video):
    """Audio as OpenAI `input_audio` parts (fresh random tones, WAV): the same prompt tokens and greedy
    answer as the same clips sent as mmserve.v1 audio parts."""
    tokenizer = load_tokenizer(checkpoint)
    seed = random.randrange(10**6)
    clips = tuple(wav(tones(seed + k, 1.0 + k / 2)) for k in range(media.count("audio")))
    v1_parts, content = media_request("What is shown here?", png(5) if "image" in media else None,
                                      make_video(11, num_frames=8) if media == "video" else None, clips)
    with Client(fleet.replicas[0].address) as c:
        ours = c.generate([message("user", *v1_parts)], max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                          json_schema=SCHEMA)
    client = fleet.openai()
    model = fleet.model_id()
    request = dict(model=model, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=MAX_TOKENS,
                   response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}})
    reply = client.chat.completions.create(logprobs=True, **request)
    assert_same(reply.choices[0], ours, tokenizer)
    assert reply.usage.completion_tokens == ours.usage.completion_tokens
    assert reply.usage.prompt_tokens == ours.usage.prompt_tokens
    text, reasons, _ = streamed_text(client.chat.completions.create(stream=True, **request))
    assert text == ours.text and len(reasons) == 1, seed


def test_audio_is_published_in_the_gateway_tokens(fleet, checkpoint):
    """A request as SMG sends it (one `<|audio|>` anchor per clip, the clips as data: URLs) on a
    replica's VllmEngine door: its KV events speak the gateway's ids past both anchors, each clip
    mapped by its own segments (a 31 s clip is two, 750 + 25 soft tokens), so a cache-aware gateway
    matches the request's own ids (tests/gateway/test_gateway_kv_events.py's index)."""
    tok, spec = load_tokenizer(checkpoint), load_spec(checkpoint)
    seed = random.randrange(10**6)
    long, short = wav(tones(seed, 31.0)), wav(tones(seed + 1, 1.0))
    enc, audio = tok.encode, spec.audio_token_id
    ids = ([spec.bos_token_id, tok.token_id("<|turn>")] + enc("user\nFirst:") + [audio] + enc("then:") + [audio]
           + enc("Which of the two clips is longer, and by how much? " * 2)
           + [tok.token_id("<turn|>")] + enc("\n") + [tok.token_id("<|turn>")] + enc("model\n"))
    request = vpb.GenerateRequest(request_id=f"two-clips-{seed}", tokenized=vpb.TokenizedInput(input_ids=ids),
                                  sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=2, top_p=1.0))
    for clip in (long, short):
        request.media_refs.items.add(modality=common_pb2.AUDIO,
                                     url="data:audio/wav;base64," + base64.b64encode(clip).decode())
    with grpc.insecure_channel(fleet.replicas[1].address) as channel:
        stub = vpb_grpc.VllmEngineStub(channel)
        stream = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=120)
        index = RouterIndex()
        index.apply(next(stream))   # the snapshot: events run from here
        out = list(stub.Generate(request, timeout=120))[-1].complete
        assert out.prompt_tokens == len(ids) - 2 + (1 + 750 + 1) + (1 + 25 + 1) + (1 + 25 + 1), seed
        shift = out.prompt_tokens - len(ids)
        backed = min(len(ids), (out.prompt_tokens // BLOCK) * BLOCK - shift) // BLOCK
        second_anchor = [i for i, t in enumerate(ids) if t == spec.audio_token_id][1]
        assert backed > second_anchor // BLOCK + 1
        read_until(stream, index, lambda: index.match(ids) >= backed)
        stream.cancel()


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
