"""Hooks the metrics/tracing layer implements (the per-step record they get is ipc/records.py).

The front end calls them (mmserve.engine.output.processor), from the plain-data records the engine
core sends with each step's outputs; the engine process itself never runs an observer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from mmserve.ipc.records import StepRecord
from mmserve.metrics.peaks import DevicePeaks
from mmserve.request import Request

if TYPE_CHECKING:   # (the front end imports nothing of worker/: test_layout)
    from mmserve.worker.backend_check import BackendCheck


class EngineObserver(Protocol):
    def on_engine_started(self, peaks: DevicePeaks) -> None: ...

    def on_backends_checked(self, checks: tuple[BackendCheck, ...]) -> None: ...

    def on_request_queued(self, request: Request) -> None: ...

    def on_step(self, record: StepRecord) -> None: ...

    def on_first_token(self, request: Request) -> None: ...

    def on_request_finished(self, request: Request, finish_reason: str | None,
                            error: BaseException | None) -> None: ...


class NullObserver:
    """The default: observes nothing."""

    def on_engine_started(self, peaks: DevicePeaks) -> None:
        pass

    def on_backends_checked(self, checks: tuple[BackendCheck, ...]) -> None:
        pass

    def on_request_queued(self, request: Request) -> None:
        pass

    def on_step(self, record: StepRecord) -> None:
        pass

    def on_first_token(self, request: Request) -> None:
        pass

    def on_request_finished(self, request: Request, finish_reason: str | None,
                            error: BaseException | None) -> None:
        pass
