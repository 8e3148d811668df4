"""A bad request is refused before the door spends work on it, and a bug in a check leaves a mapped
status: sampling and logit_bias are checked before any media decode at both doors (a logit_bias
outside the vocabulary used to be refused by the engine core, after the media were decoded; the
VllmEngine door decoded every data: URL before mapping the sampling params), and an unexpected error
in mmserve.v1's checks leaves INTERNAL, not a bare UNKNOWN."""

from __future__ import annotations

import asyncio
import base64

import grpc
from rel_engine import read_stream
from rel_server import stream_status
from rel_strategies import png
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

import mmserve.server.servicer as v1_servicer
import mmserve.server.vllm_engine.servicer as gateway_servicer
from mmserve.api.mmserve.v1 import generation_pb2 as pb
from mmserve.api.mmserve.v1 import generation_pb2_grpc as pb_grpc
from mmserve.model.spec import load_spec_without_transformers
from mmserve.server.in_flight import InFlightRequests


def test_bad_sampling_is_refused_before_the_gateway_doors_media_decode(rel_server, monkeypatch):
    spec = load_spec_without_transformers(rel_server.engine_config.model)
    decoded = []
    media_inputs = gateway_servicer.media_inputs

    def recorded(refs, **kwargs):
        decoded.append(len(refs.items))
        return media_inputs(refs, **kwargs)

    monkeypatch.setattr(gateway_servicer, "media_inputs", recorded)
    image = vpb.MediaRef(modality=common_pb2.IMAGE,
                         url="data:image/png;base64," + base64.b64encode(png(1)).decode())

    def request(**sampling) -> vpb.GenerateRequest:
        return vpb.GenerateRequest(
            request_id="refused", tokenized=vpb.TokenizedInput(input_ids=[2, spec.image_token_id, 10]),
            media_refs=vpb.MediaRefs(items=[image]), sampling_params=vpb.SamplingParams(max_tokens=4, **sampling))

    async def scenario():
        async with grpc.aio.insecure_channel(rel_server.address) as ch:
            gateway = vpb_grpc.VllmEngineStub(ch)
            too_many = await stream_status(gateway.Generate(request(n=9999)))
            outside = await stream_status(gateway.Generate(request(logit_bias={spec.vocab_size + 5: 1.0})))
            fine = await stream_status(gateway.Generate(request()))
            return too_many, outside, fine

    too_many, outside, fine = asyncio.run(scenario())
    assert too_many[0] == grpc.StatusCode.INVALID_ARGUMENT and "got 9999 (--max-n)" in too_many[1], too_many
    assert outside[0] == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in outside[1], outside
    assert fine[0] == grpc.StatusCode.OK, fine
    assert decoded == [1]   # the accepted request's image only


def test_a_logit_bias_outside_the_vocabulary_is_refused_before_input_processing(rel_server, monkeypatch,
                                                                                  make_video):
    vocab_size = load_spec_without_transformers(rel_server.engine_config.model).vocab_size
    processed = []
    preprocess = InFlightRequests.preprocess

    async def recorded(self, request_id, processing):
        processed.append(request_id)
        return await preprocess(self, request_id, processing)

    monkeypatch.setattr(InFlightRequests, "preprocess", recorded)
    request = pb.GenerateRequest(request_id="biased", messages=[pb.Message(role="user", parts=[
        pb.Part(text="describe"), pb.Part(video=pb.Video(data=make_video(seed=5, num_frames=4), num_frames=4))])],
        sampling=pb.SamplingParams(max_tokens=4, logit_bias={vocab_size: 1.0}))

    async def scenario():
        async with grpc.aio.insecure_channel(rel_server.address) as ch:
            return await read_stream(pb_grpc.GenerationStub(ch).Generate(request))

    result = asyncio.run(scenario())
    assert result.code == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in result.details, result
    assert processed == []


def test_an_unexpected_error_in_a_check_leaves_internal(rel_server, monkeypatch):
    async def broken_check(*args):
        raise RuntimeError("a bug in a check")

    monkeypatch.setattr(v1_servicer, "check_response_format", broken_check)

    async def scenario():
        async with grpc.aio.insecure_channel(rel_server.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            result = await read_stream(stub.Generate(pb.GenerateRequest(
                request_id="buggy", messages=[pb.Message(role="user", parts=[pb.Part(text="hi")])],
                sampling=pb.SamplingParams(max_tokens=4))))
            assert not (await stub.Abort(pb.AbortRequest(request_id="buggy"))).found   # its id is free again
            return result

    result = asyncio.run(scenario())
    assert result.code == grpc.StatusCode.INTERNAL and "RuntimeError" in result.details, result
