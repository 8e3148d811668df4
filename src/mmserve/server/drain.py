"""Graceful drain on SIGTERM/SIGINT: go NOT_SERVING, refuse new work, let in-flight streams finish.

Order matters for rolling updates: readiness drops first so load balancers stop routing here,
new `Generate` and `UploadMedia` calls get UNAVAILABLE (retryable: another replica will take
them) while health, reflection, Abort and load queries keep working, and only when the in-flight
calls are done or the grace period is over does `server.stop()` close the listener and cancel what
is left.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterable

import grpc

from mmserve.server.handlers import around, rejecting_handler, replace_behavior

log = logging.getLogger(__name__)

GENERATE_METHOD = "/mmserve.v1.Generation/Generate"
UPLOAD_METHOD = "/mmserve.v1.Generation/UploadMedia"
LIVE_METHOD = "/mmserve.v1.Generation/Live"   # a session in flight ends itself when the drain starts (server/live.py)
VLLM_GENERATE_METHOD = "/vllm.grpc.engine.VllmEngine/Generate"   # the gateway door (server/vllm_engine/)
UNGATED_GRACE_S = 1.0
DRAINING_MESSAGE = "server is draining (shutting down); retry on another replica"


class DrainGate(grpc.aio.ServerInterceptor):
    """Counts in-flight calls of the gated methods; once draining, refuses new ones with UNAVAILABLE."""

    def __init__(self, gated_methods: Iterable[str] = (GENERATE_METHOD, UPLOAD_METHOD, LIVE_METHOD,
                                                              VLLM_GENERATE_METHOD)):
        self._gated = frozenset(gated_methods)
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False

    @property
    def inflight(self) -> int:
        return self._inflight

    def start_draining(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when no gated call is in flight within `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(timeout_s, 0.0))
        except TimeoutError:
            return False
        return True

    def _enter(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def _exit(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    async def _enter_call(self, request, context: grpc.aio.ServicerContext) -> None:
        self._enter()

    def _counted(self, behavior: Callable) -> Callable:
        """`behavior` wrapped so the gate counts it from start to end."""
        return around(behavior, self._enter_call, self._exit)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method not in self._gated:
            return handler
        if self.draining:
            return rejecting_handler(handler, grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
        return replace_behavior(handler, self._counted)


class ShutdownSignals:
    """Turns SIGTERM/SIGINT into an asyncio event; a second signal asks to skip the grace period."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.forced = asyncio.Event()

    def install(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        loop = loop or asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.requested.is_set():
            log.warning("second %s: stopping without waiting for in-flight requests", sig.name)
            self.forced.set()
        else:
            log.info("%s received: draining", sig.name)
        self.requested.set()


async def drain(server: grpc.aio.Server, gate: DrainGate, grace_s: float, *,
                set_not_serving: Callable[[], Awaitable[None]] | None = None,
                forced: asyncio.Event | None = None) -> bool:
    """Drain `server`: readiness NOT_SERVING (`set_not_serving`, e.g. Health.set_draining), new
    gated calls UNAVAILABLE, wait up to `grace_s` for the in-flight ones (less if `forced` gets set),
    then stop the server. True when nothing was cut off."""
    if set_not_serving is not None:
        await set_not_serving()
    gate.start_draining()
    deadline = time.monotonic() + grace_s
    log.info("draining: %d in-flight requests, grace %.1fs", gate.inflight, grace_s)
    waiters = [asyncio.ensure_future(gate.wait_idle(grace_s))]
    if forced is not None:
        waiters.append(asyncio.ensure_future(forced.wait()))
    _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    clean = gate.inflight == 0
    if not clean:
        log.warning("drain: cutting off %d in-flight requests", gate.inflight)
    # Ungated calls (unary queries, health Watch streams) get a short grace, never the whole period.
    await server.stop(min(UNGATED_GRACE_S, max(0.0, deadline - time.monotonic())) if clean else 0)
    return clean
