"""The generation API's sampling extras through a real server: structured output that always parses
and validates on the demo task at temperature 1, logprobs with token texts, penalties and bias on
the wire (penalties are checked against a reference in tests/engine), and bad values refused with INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time

import grpc
import jsonschema
import pytest

from mmserve.clients import AsyncClient, Client, ClientError
from mmserve.model.tokenizer import load_tokenizer
from mmserve.multimodal.demo_task import CAPTION_SCHEMA, NUM_FRAMES, PROMPT, clip_for
from mmserve.multimodal.synthetic import COLOURS, DIRECTIONS, SHAPES

SCHEMAS = [
    CAPTION_SCHEMA,
    {"type": "object", "properties": {"shape": {"enum": list(SHAPES)}}, "required": ["shape"],
     "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": list(COLOURS)}, "moving": {"type": "boolean"}},
     "required": ["color", "moving"], "additionalProperties": False},
    {"type": "array", "items": {"enum": list(COLOURS)}, "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"direction": {"enum": list(DIRECTIONS)},
                                      "frames": {"type": "integer", "minimum": 1, "maximum": 8}},
     "required": ["direction", "frames"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def client(mmserve_server):
    with Client(mmserve_server.address, timeout=120) as c:
        yield c


def test_sampled_outputs_parse_and_validate_against_five_schemas(start_server, served_model):
    server = start_server(served_model, max_num_seqs=32)
    clips = [clip_for(1_000_000 + random.randrange(10_000))[0] for _ in range(10)]

    async def run():
        async with AsyncClient(server.address, timeout=300) as client:
            calls = [client.generate(prompt=PROMPT, video=clips[i % len(clips)], num_frames=NUM_FRAMES,
                                     max_tokens=96, temperature=1.0, json_schema=SCHEMAS[i % len(SCHEMAS)])
                     for i in range(100)]
            return await asyncio.gather(*calls)

    results = asyncio.run(run())
    for i, result in enumerate(results):
        assert result.finish_reason == "eos", (i, result.text, result.finish_detail)
        jsonschema.validate(json.loads(result.text), SCHEMAS[i % len(SCHEMAS)])
    assert len({r.text for r in results}) > len(SCHEMAS)   # sampled, not one answer per schema


def test_logprobs_and_token_texts_on_the_wire(client):
    video = clip_for(1_000_001)[0]
    result = client.generate(prompt=PROMPT, video=video, num_frames=NUM_FRAMES, max_tokens=8, temperature=0,
                             logprobs=True, top_logprobs=3, prompt_logprobs=True)
    assert len(result.logprobs) == len(result.token_ids) and result.prompt_logprobs
    assert result.usage.prompt_tokens == len(result.prompt_logprobs) + 1
    for token, lp in zip(result.token_ids, result.logprobs, strict=True):
        assert lp.token_id == token and lp.rank == 1 and lp.logprob <= 0
        assert [t.token_id for t in lp.top][0] == token and len(lp.top) == 3
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        assert math.isclose(lp.top[0].logprob, lp.logprob, rel_tol=1e-6)
    assert "".join(lp.text for lp in result.logprobs if lp.token_id not in (1, 5)) == result.text


def test_bias_and_a_cut_constraint_on_the_wire(client):
    video = clip_for(1_000_002)[0]
    base = dict(prompt=PROMPT, video=video, num_frames=NUM_FRAMES, max_tokens=6, temperature=0)
    favourite = client.generate(**base).token_ids[0] + 1
    biased = client.generate(**base, logit_bias={favourite: 100.0}, ignore_eos=True)
    assert biased.token_ids == (favourite,) * 6
    cut = client.generate(**base, json_schema=CAPTION_SCHEMA)
    assert cut.finish_reason == "length" and "response_format" in cut.finish_detail


@pytest.mark.parametrize("kwargs, field", [
    (dict(json_schema='{"type": "objekt"}'), "sampling.response_format.json_schema"),
    (dict(regex="(unclosed"), "sampling.response_format.regex"),
    (dict(grammar="root ::= nothing"), "sampling.response_format.grammar"),
    (dict(logit_bias={10**6: 1.0}), "sampling.logit_bias"),
    (dict(top_logprobs=30, logprobs=True), "sampling.top_logprobs"),
    (dict(min_tokens=99, max_tokens=4), "sampling.min_tokens"),
    (dict(presence_penalty=-3.0), "sampling.presence_penalty"),
])
def test_bad_values_are_invalid_argument_naming_the_field(client, kwargs, field):
    with pytest.raises(ClientError) as info:
        client.generate(prompt="hi", **kwargs)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.field == field


def test_n_samples_stream_with_indices_and_one_final(client):
    video = clip_for(1_000_003)[0]
    result = client.generate(prompt=PROMPT, video=video, num_frames=NUM_FRAMES, max_tokens=12, temperature=1.0,
                             seed=random.randrange(2**32), n=3, logprobs=True)
    assert [s.index for s in result.samples] == [0, 1, 2]
    assert result.text == result.samples[0].text and result.token_ids == result.samples[0].token_ids
    assert result.usage.completion_tokens == sum(s.completion_tokens for s in result.samples)
    one = client.generate(prompt=PROMPT, video=video, num_frames=NUM_FRAMES, max_tokens=1, temperature=1.0)
    assert result.perf.flops > one.perf.flops > 0   # the samples' shares of the work, summed
    for sample in result.samples:
        assert len(sample.token_ids) == sample.completion_tokens == len(sample.logprobs) > 0
        assert sample.finish_reason in ("eos", "length")
    with pytest.raises(ClientError) as info:
        client.generate(prompt="hi", n=client.model_info().context_length)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.field == "sampling.n"


def test_abort_by_id_stops_every_sample(client):
    stream = client.stream(prompt="hi", max_tokens=300, ignore_eos=True, temperature=1.0, n=3, request_id="n-abort")
    deltas = iter(stream)
    next(deltas)
    assert client.abort("n-abort")
    with pytest.raises(ClientError) as info:
        for _ in deltas:
            pass
    assert info.value.code == grpc.StatusCode.CANCELLED
    deadline = time.monotonic() + 30
    while client.server_load().running_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.server_load().running_requests == 0


def test_temperatures_below_the_greedy_bound_become_greedy_exactly_there():
    """vLLM's bound, 1e-5: below it a temperature is 0 (greedy) in SamplingParams itself, whichever door
    built it; at and above it, it stays what was asked."""
    from mmserve.sampling_params import GREEDY_TEMPERATURE, SamplingParams

    assert GREEDY_TEMPERATURE == 1e-5
    for tiny in (1e-45, 1e-38, 1e-10, 9.99e-6):
        assert SamplingParams(temperature=tiny).temperature == 0.0 and SamplingParams(temperature=tiny).greedy
    for kept in (1e-5, 1e-4, 0.7):
        assert SamplingParams(temperature=kept).temperature == kept and not SamplingParams(temperature=kept).greedy


def test_tiny_temperatures_answer_as_greedy_through_both_grpc_doors(client, mmserve_server):
    """The probe: temperature 1e-38 or 1e-45 (valid by the docs) overflowed logits / T to inf, the
    softmax to NaN, and the stream was pad tokens up to max_tokens. Now each answers with the greedy
    tokens, through mmserve.v1 and through the VllmEngine door (the OpenAI one, SMG, sends the latter:
    tests/gateway/test_gateway_openai.py)."""
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

    def v1(temperature):
        return client.generate(prompt="Name a colour.", max_tokens=8, ignore_eos=True, temperature=temperature).token_ids

    tok = load_tokenizer(mmserve_server.engine_config.model)
    prompt = [2, 4, *tok.encode("user\nName a colour."), 5, *tok.encode("\n"), 4, *tok.encode("model\n")]

    def door(temperature):
        request = vpb.GenerateRequest(request_id=f"tiny-{temperature}", tokenized=vpb.TokenizedInput(
            input_ids=prompt), sampling_params=vpb.SamplingParams(
            temperature=temperature, max_tokens=8, ignore_eos=True))
        with grpc.insecure_channel(mmserve_server.address) as channel:
            (response,) = list(vpb_grpc.VllmEngineStub(channel).Generate(request, timeout=60))
        return list(response.complete.output_ids)

    greedy_v1, greedy_door = v1(0.0), door(0.0)
    assert len(set(greedy_v1)) > 1   # not one token repeated: a real answer to compare with
    for tiny in (1e-38, 1e-45):
        assert v1(tiny) == greedy_v1, tiny
        assert door(tiny) == greedy_door, tiny
