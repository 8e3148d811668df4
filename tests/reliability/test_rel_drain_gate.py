"""DrainGate and drain() on a real server. The health Watch stream stands in for a long Generate
stream (it is a real server-streaming RPC that stays open); the full SIGTERM path with the engine
is tested in test_rel_sigterm.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mmserve.server.drain import DRAINING_MESSAGE, DrainGate, ShutdownSignals, drain
from mmserve.server.health import GENERATION_SERVICE, Health

WATCH = "/grpc.health.v1.Health/Watch"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _server(gate: DrainGate) -> tuple[grpc.aio.Server, Health, int]:
    server = grpc.aio.server(interceptors=[gate])
    health = Health()
    health.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set_live()
    await health.set_ready()
    return server, health, port


def test_drain_refuses_new_streams_and_cuts_off_after_grace():
    grace_s = 0.6

    async def scenario():
        gate = DrainGate([WATCH])
        server, health, port = await _server(gate)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE))
            assert (await watch.read()).status == SERVING
            assert gate.inflight == 1
            started = time.monotonic()
            draining = asyncio.ensure_future(drain(server, gate, grace_s, set_not_serving=health.set_draining))
            # Readiness drops while the in-flight stream is still open ...
            assert (await watch.read()).status == NOT_SERVING
            # ... new gated calls are refused as retryable, ungated ones (liveness) still answer.
            refused = stub.Watch(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE))
            try:
                await refused.read()
                raise AssertionError("a new stream was admitted while draining")
            except grpc.aio.AioRpcError as e:
                assert (e.code(), e.details()) == (grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
            live = await stub.Check(health_pb2.HealthCheckRequest(service=""))
            assert live.status == SERVING
            clean = await draining
            assert not clean and time.monotonic() - started >= grace_s
            # The stream still open after the grace period is cut off, visibly to its client.
            assert await watch.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            await asyncio.sleep(0.05)
            assert gate.inflight == 0

    asyncio.run(scenario())


def test_drain_returns_as_soon_as_streams_end():
    async def scenario():
        gate = DrainGate([WATCH])
        server, health, port = await _server(gate)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == SERVING
            started = time.monotonic()
            draining = asyncio.ensure_future(drain(server, gate, 30.0, set_not_serving=health.set_draining))
            await asyncio.sleep(0.2)
            assert not draining.done() and gate.draining
            watch.cancel()  # the last in-flight stream ends
            assert await asyncio.wait_for(draining, 5) is True
            assert time.monotonic() - started < 5 and gate.inflight == 0

    asyncio.run(scenario())


def test_signals_request_then_force():
    async def scenario():
        signals = ShutdownSignals()
        signals.install()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(signals.requested.wait(), 2)
            assert not signals.forced.is_set()
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.wait_for(signals.forced.wait(), 2)
        finally:
            loop = asyncio.get_running_loop()
            loop.remove_signal_handler(signal.SIGTERM)
            loop.remove_signal_handler(signal.SIGINT)

    asyncio.run(scenario())
