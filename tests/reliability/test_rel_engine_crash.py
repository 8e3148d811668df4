"""The engine process dies (kill -9, as the OOM killer does) or wedges (SIGSTOP: alive, silent) under a
real `mmserve serve`: the stream in flight ends with UNAVAILABLE naming what happened, liveness and
readiness turn NOT_SERVING, and the server process exits non-zero so its orchestrator restarts it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rel_engine import read_stream, text_request
from rel_process import ServeProcess, process_exists

from mmserve.api.mmserve.v1 import generation_pb2_grpc as pb_grpc
from mmserve.server.health import GENERATION_SERVICE

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _first_not_serving(channel, service: str) -> int:
    """Watch `service` until it reports NOT_SERVING (the Watch stream sees it before the server stops)."""
    async for update in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service)):
        if update.status == NOT_SERVING:
            return update.status
    raise AssertionError(f"{service!r} never reported NOT_SERVING")


def _signal_the_engine_mid_stream(server: ServeProcess, sig: int, names: str) -> None:
    """Two streams running, `sig` to the engine process: both end UNAVAILABLE with `names` in their
    message, liveness and readiness turn NOT_SERVING, and the server exits non-zero."""
    port = server.wait_port(180)

    async def scenario():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await server.wait_serving(ch)
            watches = [asyncio.ensure_future(_first_not_serving(ch, s)) for s in ("", GENERATION_SERVICE)]
            stub = pb_grpc.GenerationStub(ch)
            calls = [stub.Generate(text_request(f"doomed-{i}", 500)) for i in range(2)]
            for call in calls:
                assert (await call.read()).delta.token_ids
            assert server.engine_pid is not None, server.log
            os.kill(server.engine_pid, sig)
            for call in calls:
                result = await asyncio.wait_for(read_stream(call), 60)
                assert result.code == grpc.StatusCode.UNAVAILABLE, result
                assert names in result.details and result.final is None, result.details
            assert await asyncio.wait_for(asyncio.gather(*watches), 30) == [NOT_SERVING, NOT_SERVING]

    asyncio.run(scenario())
    assert server.proc.wait(60) != 0, server.log


@pytest.mark.slow
def test_killed_engine_fails_in_flight_requests_and_the_server_exits_nonzero(tiny_checkpoint):
    server = ServeProcess("--port", "0", "--model", str(tiny_checkpoint), "--device", "cpu",
                          "--max-num-seqs", "4", "--worker-threads", "1")
    try:
        _signal_the_engine_mid_stream(server, signal.SIGKILL, "killed by SIGKILL")
        assert "engine died" in server.log
    finally:
        server.stop()


WORKER_PID = re.compile(r"tensor-parallel rank 1: process (\d+) started")


@pytest.mark.slow
def test_a_wedged_engine_is_killed_after_the_stall_timeout(tiny_checkpoint, tmp_path):
    """Rank 0 of a TP=2 engine stopped mid-stream (SIGSTOP: alive, sending nothing, as a hung kernel or a
    deadlock leaves it): past --engine-stall-timeout-s the front end kills it; the streams end
    UNAVAILABLE naming the stall, health turns NOT_SERVING, the server exits non-zero, rank 1 follows,
    and nothing is left in TMPDIR (the ranks' rendezvous directory leaked whenever the engine was killed)."""
    server = ServeProcess("--port", "0", "--model", str(tiny_checkpoint), "--device", "cpu", "--max-num-seqs", "4",
                          "--worker-threads", "1", "--tensor-parallel-size", "2", "--engine-stall-timeout-s", "3",
                          "--tensor-parallel-timeout-s", "2",
                          env={"TMPDIR": str(tmp_path)})
    try:
        _signal_the_engine_mid_stream(server, signal.SIGSTOP, "killed by the front end: it sent nothing for 3s")
        assert not process_exists(int(WORKER_PID.search(server.log).group(1))), "rank 1 outlived the server"
        assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())
    finally:
        if server.engine_pid is not None:   # a failed run must not leave a stopped engine behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.engine_pid, signal.SIGCONT)
        server.stop()
