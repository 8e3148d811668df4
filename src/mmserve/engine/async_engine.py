"""AsyncEngine: the asyncio face of EngineCore. The event loop never waits on compute.

The core's thread publishes each step's events with one `call_soon_threadsafe`; every request has
an asyncio.Queue that `generate()` drains. Leaving `generate()` early (the client went away)
aborts the request, so its blocks and encoder cache are freed within one step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from mmserve.config import EngineConfig
from mmserve.engine.core import EngineCore, Event
from mmserve.engine.observer import EngineObserver
from mmserve.engine.types import EngineRequest, LoadInfo, ModelInfo, RequestOutput
from mmserve.errors import EngineUnavailableError, InvalidInputError

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, observer: EngineObserver | None = None, model=None, tokenizer=None):
        self.config = config
        self._observer = observer
        self._model, self._tokenizer = model, tokenizer
        self.core: EngineCore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}

    async def start(self) -> None:
        """Load the model (off the event loop) and start the engine thread."""
        self._loop = asyncio.get_running_loop()
        self.core = await asyncio.to_thread(EngineCore, self.config, model=self._model, tokenizer=self._tokenizer,
                                            observer=self._observer)
        self._thread = threading.Thread(target=self.core.run, args=(self._publish, self._stop),
                                        name="mmserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def _publish(self, events: list[Event]) -> None:   # engine thread
        try:
            self._loop.call_soon_threadsafe(self._dispatch, events)
        except RuntimeError:   # the event loop is gone: nobody is left to read these streams
            logger.warning("event loop closed; dropped %d engine events", len(events))

    def _dispatch(self, events: list[Event]) -> None:  # event loop
        for rid, item in events:
            queue = self._streams.get(rid)
            if queue is not None:
                queue.put_nowait(item)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Deltas, then exactly one output with finished=True; or raises the request's error
        (admission errors before anything is queued)."""
        if not self.is_running:
            raise EngineUnavailableError("the engine is not running")
        rid = request.request_id
        if rid in self._streams:
            raise InvalidInputError("request_id", f"{rid!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        admitted = finished = False
        try:
            self.core.add_request(request)
            admitted = True
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            del self._streams[rid]
            if admitted and not finished:
                self.core.abort(rid)

    def abort(self, request_id: str) -> bool:
        return self.core is not None and self.core.abort(request_id)

    def load(self) -> LoadInfo:
        if self.core is None:
            return LoadInfo(0, 0, 0.0, self.config.max_num_seqs)
        return self.core.load()

    @property
    def model_info(self) -> ModelInfo:
        if self.core is None:
            raise EngineUnavailableError("the engine has not started")
        spec = self.core.model.spec
        return ModelInfo(name=Path(self.config.model).name, context_length=self.core.max_model_len,
                         tokens_per_frame=spec.video_max_soft_tokens,
                         backend=self.core.model.attention_backend,
                         dtype=self.config.dtype, peaks=self.core.peaks)

    async def shutdown(self) -> None:
        """Stop the engine thread; requests still in flight end with EngineUnavailableError."""
        if self._thread is None:
            return
        self._stop.set()
        self.core.wake()
        await asyncio.to_thread(self._thread.join)
        self._dispatch(self.core.shutdown_requests(EngineUnavailableError("the engine shut down")))
        self._thread = None
