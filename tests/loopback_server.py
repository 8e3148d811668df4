"""A real MMServer + AsyncEngine on 127.0.0.1 (port 0), driven from its own thread and event loop.

The engine core runs in its own process, as `mmserve serve` runs it (forked from the test process's
preloaded forkserver: engine_forkserver.py), unless the config says `engine_process=False`: then on a
thread, where a test can reach `server.engine.core`. Shared by the
session server fixtures in tests/conftest.py and the reliability suite's `ServerThread`, which adds
a recording observer (`RecordingObserver`, here for any test's server) and leak checks.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass, field
from pathlib import Path

from mmserve.config import EngineConfig, ServerConfig
from mmserve.engine.observer import NullObserver
from mmserve.ipc.records import StepRecord


class RecordingObserver(NullObserver):
    """Observer hooks (run by the front end) that remember every step and every request's end."""

    def __init__(self) -> None:
        self.queued: list[str] = []
        self.steps: list[StepRecord] = []
        self.finished: list[tuple[str, str | None, BaseException | None]] = []

    def on_request_queued(self, request) -> None:
        self.queued.append(request.request_id)

    def on_step(self, record: StepRecord) -> None:
        self.steps.append(record)

    def on_request_finished(self, request, finish_reason, error) -> None:
        self.finished.append((request.request_id, finish_reason, error))

    def end_counts(self) -> collections.Counter:
        return collections.Counter(rid for rid, _, _ in self.finished)


def engine_config(model: str | Path, **overrides) -> EngineConfig:
    """Small, CPU-friendly engine options for tests; `overrides` are EngineConfig fields. One torch
    thread: tiny models gain nothing from more on this shared 2-core machine. An engine that cannot
    start fails its module in two minutes, not the default fifteen (a tiny model starts in seconds)."""
    options = dict(model=str(model), device="cpu", dtype="float32", max_num_batched_tokens=256, max_num_seqs=8,
                   prefill_batched_tokens=0, kv_cache_bytes=16 * 2**20, default_num_frames=4, engine_threads=1,
                   engine_ready_timeout_s=120.0)
    options.update(overrides)
    return EngineConfig(**options)


@dataclass
class LoopbackServer:
    engine_config: EngineConfig
    server_config: ServerConfig = field(default_factory=lambda: ServerConfig(port=0, worker_threads=2))
    observer: object = None  # engine hooks; None: the ones setup_observability builds from the configs
    metrics: object = None   # EngineMetrics for the per-RPC counter; None: setup_observability's (with observer=None)
    observability: object = None
    port: int = 0
    app: object = None
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None
    _thread: threading.Thread | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _error: BaseException | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def engine(self):
        return self.app.engine

    @property
    def async_loop(self) -> bool:
        """Whether its engine runs the async loop (its --async-scheduling on its device): a test of
        what one loop does asks (the suite may run with MMSERVE_ASYNC_SCHEDULING=on)."""
        import torch

        from mmserve.core.engine_core import uses_async_scheduling

        return uses_async_scheduling(self.engine_config, torch.device(self.engine_config.device))

    def start(self, timeout_s: float = 300.0) -> LoopbackServer:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="mmserve-test-server",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"server did not start within {timeout_s}s")
        if self._error is not None:
            raise RuntimeError("server failed to start") from self._error
        return self

    async def _main(self) -> None:
        from mmserve.engine.async_engine import AsyncEngine
        from mmserve.model.spec import load_spec_without_transformers
        from mmserve.server.app import build_server
        from mmserve.server.observability import setup_observability

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            observer, metrics = self.observer, self.metrics
            spec = load_spec_without_transformers(self.engine_config.model)
            if observer is None:
                self.observability = setup_observability(self.engine_config, self.server_config, spec=spec,
                                                         configure_global_tracing=False)
                observer, metrics = self.observability.observer, self.observability.metrics
            engine = AsyncEngine(self.engine_config, observer=observer)
            self.app = build_server(engine, self.server_config, self.engine_config, spec=spec, metrics=metrics)
            self.port = await self.app.start()
        except BaseException as e:  # surfaced by start() in the test thread
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        await self._stop.wait()
        await self.app.stop()
        if self.observability is not None:
            self.observability.close()

    def call(self, coro, timeout_s: float = 60.0):
        """Run a coroutine on the server's loop (e.g. `server.engine` queries) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(60)
