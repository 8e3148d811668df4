"""Abort, client cancel and deadlines stop a request within one engine step and free its resources."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
from rel_engine import read_stream, steps_with

from mmserve.api.mmserve.v1 import generation_pb2 as pb
from mmserve.api.mmserve.v1 import generation_pb2_grpc as pb_grpc

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
