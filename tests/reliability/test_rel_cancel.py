"""Abort, client cancel and deadlines stop a request within one engine step and free its resources,
whenever the Abort comes: while the door still checks the request, or before its samples are admitted."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import grpc
import pytest
from rel_engine import read_stream, steps_with
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from mmserve.api.mmserve.v1 import generation_pb2 as pb
from mmserve.api.mmserve.v1 import generation_pb2_grpc as pb_grpc
from mmserve.server.in_flight import InFlightRequests
from mmserve.structured_output.compiler import FormatCompiler

LONG = 400  # tokens: far more than a test waits for


def _long_request(request_id: str, video: bytes | None = None, max_tokens: int = LONG) -> pb.GenerateRequest:
    parts = [pb.Part(text="tell a long story")]
    if video is not None:
        parts.append(pb.Part(video=pb.Video(data=video, num_frames=4)))
    return pb.GenerateRequest(request_id=request_id, messages=[pb.Message(role="user", parts=parts)],
                              sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _first_tokens(call, n: int = 2) -> int:
    seen = 0
    while (response := await call.read()) is not grpc.aio.EOF:
        seen += len(response.delta.token_ids)
        if seen >= n:
            return seen
    raise AssertionError("the stream ended before its first tokens")


def test_abort_rpc_stops_within_one_step(rel_server):
    rid = f"abort-{uuid.uuid4().hex[:8]}"

    async def scenario():
        async with grpc.aio.insecure_channel(rel_server.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            call = stub.Generate(_long_request(rid))
            await _first_tokens(call)
            assert (await stub.Abort(pb.AbortRequest(request_id=rid))).found
            aborted_at = time.perf_counter()
            result = await read_stream(call)
            assert result.code == grpc.StatusCode.CANCELLED and rid in result.details
            assert result.final is None and len(result.token_ids) < LONG
            # Idempotent: a second Abort finds nothing; an unknown id neither.
            assert not (await stub.Abort(pb.AbortRequest(request_id=rid))).found
            assert not (await stub.Abort(pb.AbortRequest(request_id="never-sent"))).found
            return aborted_at

    aborted_at = asyncio.run(scenario())
    rel_server.wait_quiet()
    # The step already running when the abort arrived may finish with it; no later one.
    assert steps_with(rel_server.observer, rid, aborted_at) <= 1
    rel_server.assert_nothing_leaked()


def test_client_cancel_and_deadline_stop_the_engine_request(rel_server, make_video, monkeypatch):
    video = make_video(seed=3, num_frames=6)
    cancelled, expired = f"cancel-{uuid.uuid4().hex[:8]}", f"deadline-{uuid.uuid4().hex[:8]}"
    aborted_at: dict[str, float] = {}   # when the server handed each abort to the engine
    engine_abort = rel_server.engine.abort

    def recording_abort(request_id: str) -> bool:
        aborted_at.setdefault(request_id, time.perf_counter())
        return engine_abort(request_id)

    monkeypatch.setattr(rel_server.engine, "abort", recording_abort)   # still the real abort, timed

    async def scenario():
        async with grpc.aio.insecure_channel(rel_server.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            call = stub.Generate(_long_request(cancelled, video))
            await _first_tokens(call)
            call.cancel()
            started = time.monotonic()
            result = await read_stream(stub.Generate(_long_request(expired, video), timeout=0.5))
            assert result.code == grpc.StatusCode.DEADLINE_EXCEEDED and result.final is None
            assert time.monotonic() - started < 5

    asyncio.run(scenario())
    rel_server.wait_quiet()
    observer = rel_server.observer
    ends = {rid: (reason, error) for rid, reason, error in observer.finished}
    for rid in (cancelled, expired):
        reason, error = ends[rid]
        assert reason is None and error is not None, f"{rid} finished normally instead of being aborted"
        # The server's handler learns of the cancel over the loopback connection, however long its
        # loop takes (CI's loaded cores: 25 steps once); from then on the step already running may
        # finish with it, no later one.
        assert rid in aborted_at, f"the server never aborted {rid} in the engine"
        assert steps_with(observer, rid, aborted_at[rid]) <= 1
    rel_server.assert_nothing_leaked()


@pytest.fixture
def held_compile(monkeypatch):
    """The front end's compile worker held on this test's response_format (an enum of a fresh tag) until
    the test releases it: (the tag's schema, set once the compile started, the release)."""
    tag = f"tag-{uuid.uuid4().hex}"
    started, release = threading.Event(), threading.Event()
    build = FormatCompiler._build

    def held_build(self, fmt):
        if tag in fmt.spec:
            started.set()
            release.wait()
        return build(self, fmt)

    monkeypatch.setattr(FormatCompiler, "_build", held_build)
    yield json.dumps({"enum": [tag]}), started, release
    release.set()


@pytest.mark.parametrize("door", ["mmserve.v1", "VllmEngine"])
def test_an_abort_while_the_door_compiles_the_response_format_ends_the_request(rel_server, held_compile, door):
    """The id used to be registered only after the awaited checks: such an Abort found nothing and the
    request then ran to its end."""
    schema, started, release = held_compile
    rid = f"checking-{uuid.uuid4().hex[:8]}"

    async def scenario():
        async with grpc.aio.insecure_channel(rel_server.address) as ch:
            stub, gateway = pb_grpc.GenerationStub(ch), vpb_grpc.VllmEngineStub(ch)
            if door == "mmserve.v1":
                request = _long_request(rid, max_tokens=16)
                request.sampling.ignore_eos = False
                request.sampling.response_format.json_schema = schema
                call = stub.Generate(request)
            else:
                call = gateway.Generate(vpb.GenerateRequest(
                    request_id=rid, tokenized=vpb.TokenizedInput(input_ids=[2, 10, 11]), stream=True,
                    sampling_params=vpb.SamplingParams(max_tokens=16, json_schema=schema)))
            await asyncio.to_thread(started.wait)
            if door == "mmserve.v1":
                assert (await stub.Abort(pb.AbortRequest(request_id=rid))).found
            else:
                await gateway.Abort(vpb.AbortRequest(request_ids=[rid]))
            release.set()   # the compile ends: the request must not go on to the engine
            code, details = grpc.StatusCode.OK, ""
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as e:
                code, details = e.code(), e.details()
            assert code == grpc.StatusCode.CANCELLED and rid in details, (code, details)
            assert not (await stub.Abort(pb.AbortRequest(request_id=rid))).found   # its id is free again

    asyncio.run(scenario())
    assert rid not in rel_server.observer.queued
    rel_server.assert_nothing_leaked()


def test_an_abort_before_the_samples_are_admitted_stops_every_sample(rel_server, monkeypatch):
    """n > 1: the samples are admitted over a few loop turns after input processing; an Abort in them
    found no sample in the engine, answered found, and every sample then ran to max_tokens."""
    rid = f"samples-{uuid.uuid4().hex[:8]}"
    processed, release = threading.Event(), threading.Event()
    preprocess = InFlightRequests.preprocess

    async def held_after_processing(self, request_id, processing):   # those turns, stretched
        engine_request = await preprocess(self, request_id, processing)
        if request_id == rid:
            processed.set()
            await asyncio.to_thread(release.wait)
        return engine_request

    monkeypatch.setattr(InFlightRequests, "preprocess", held_after_processing)

    async def scenario():
        async with grpc.aio.insecure_channel(rel_server.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            request = _long_request(rid, max_tokens=24)
            request.sampling.n = 3
            call = stub.Generate(request)
            try:
                await asyncio.to_thread(processed.wait)
                assert (await stub.Abort(pb.AbortRequest(request_id=rid))).found
            finally:
                release.set()
            return await read_stream(call)

    result = asyncio.run(scenario())
    assert result.code == grpc.StatusCode.CANCELLED and result.final is None and not result.token_ids, result
    rel_server.assert_nothing_leaked()
