"""Drain. `mmserve serve` as a real process (front end + engine process): SIGTERM mid-stream, to the
whole process group as systemd and supervisord send it, drains gracefully; the in-flight stream completes, readiness turns NOT_SERVING, new requests get
UNAVAILABLE, and the process exits 0 (its engine process too).
In process: a stream outliving the grace period is cut off and still ends exactly once."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from rel_engine import ServerThread, engine_config, read_stream, text_request
from rel_process import ServeProcess, child_pids, health, process_exists

from mmserve.api.mmserve.v1 import generation_pb2_grpc as pb_grpc
from mmserve.server.drain import DRAINING_MESSAGE
from mmserve.server.health import GENERATION_SERVICE

MAX_TOKENS = 120


@pytest.mark.slow
def test_sigterm_drains_in_flight_stream_then_exits_zero(tiny_checkpoint):
    server = ServeProcess("--port", "0", "--model", str(tiny_checkpoint), "--device", "cpu",
                          "--drain-grace-s", "30", "--max-num-seqs", "4", "--worker-threads", "1", own_session=True)
    try:
        port = server.wait_port(180)

        async def scenario():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                await server.wait_serving(ch)
                children.update(child_pids(server.proc.pid))
                stub = pb_grpc.GenerationStub(ch)
                call = stub.Generate(text_request("in-flight", MAX_TOKENS))
                first = await call.read()
                assert first.delta.token_ids
                os.killpg(server.proc.pid, signal.SIGTERM)   # the engine gets it too: it must not die of it
                # Readiness drops while liveness stays up, and new work is turned away as retryable.
                deadline = time.monotonic() + 10
                while await health(ch, GENERATION_SERVICE) != health_pb2.HealthCheckResponse.NOT_SERVING:
                    assert time.monotonic() < deadline, "readiness never went NOT_SERVING"
                    await asyncio.sleep(0.02)
                assert await health(ch, "") == health_pb2.HealthCheckResponse.SERVING
                refused = await read_stream(stub.Generate(text_request("too-late", 4)))
                assert (refused.code, refused.details) == (grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
                # The in-flight stream runs to its end.
                rest = await read_stream(call)
                assert rest.code is None, rest
                assert rest.final.usage.completion_tokens == MAX_TOKENS
                assert len(first.delta.token_ids) + len(rest.token_ids) == MAX_TOKENS

        children: set[int] = set()   # the engine process and multiprocessing's resource tracker
        asyncio.run(scenario())
        assert server.proc.wait(60) == 0, server.log
        assert "draining" in server.log
        assert server.engine_pid is not None and server.engine_pid in children, server.log
        # Both interpreters end without module teardown (mmserve/process_exit.py): what they held must
        # be released first: no process of theirs outlives them, the media spool is removed, the log
        # is complete to its last line.
        assert not [pid for pid in children if process_exists(pid)], server.log
        spool = re.search(r"uploaded media go to (\S+)", server.log)
        assert spool is not None and not Path(spool.group(1)).exists(), server.log
        assert server.lines[-1].rstrip().endswith("stopped"), server.log
    finally:
        server.stop()


def test_drain_grace_expiry_cuts_off_and_ends_every_request_once(tiny_checkpoint):
    """A stream longer than the grace period is cut off visibly, and still ends exactly once in the engine."""
    server = ServerThread(engine_config(tiny_checkpoint)).start()

    async def scenario():
        async with grpc.aio.insecure_channel(server.address) as ch:
            call = pb_grpc.GenerationStub(ch).Generate(text_request("too-long", 900))
            assert (await call.read()).delta.token_ids
            clean = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(server.app.drain(grace_s=0.3), server._loop))
            result = await read_stream(call)
            assert result.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), result
            assert result.final is None and len(result.token_ids) < 900
            return await clean

    try:
        assert asyncio.run(scenario()) is False
        ends = server.observer.end_counts()
        assert ends["too-long"] == 1 and set(ends) == set(server.observer.queued)
    finally:
        server.stop()
