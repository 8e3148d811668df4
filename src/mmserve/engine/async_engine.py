"""AsyncEngine: the front end's engine. The event loop never waits on compute.

The engine core runs in its own process (core_client.py); this side tracks every request
(output_processor.py: detokenise, stop strings, timings, the observer) and gives each one a stream
that `generate()` drains. A stream coalesces: a reader that falls behind gets one merged delta, not a
backlog. Leaving `generate()` early (the client went away) aborts the request in the core, so its
blocks and encoder cache are freed within one step. If the core dies, every request in flight ends
with EngineDeadError and `wait_dead()` returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from mmserve.config import EngineConfig
from mmserve.engine.core_client import CoreClient
from mmserve.engine.kv_event_hub import KvBatch, KvEventHub
from mmserve.engine.observer import EngineObserver
from mmserve.engine.output.processor import Event, OutputProcessor
from mmserve.engine.types import EngineRequest, ModelInfo, RequestOutput
from mmserve.errors import EngineDeadError, EngineUnavailableError, InvalidInputError
from mmserve.ipc.protocol import EngineCoreOutputs, EngineReady, ExtendRequest, LoadInfo
from mmserve.request import MultiModalInput

logger = logging.getLogger(__name__)


class RequestStream:
    """One request's outputs as the reader sees them: deltas merge while unread; an error comes last."""

    def __init__(self) -> None:
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        else:
            self._output = item if self._output is None else self._output.merged(item)
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        if self._output is not None:
            out, self._output = self._output, None
            if self._error is None:
                self._ready.clear()
            return out
        raise self._error


class AsyncEngine:
    """`observer` watches requests and steps (in this process); it gets the device peaks the engine
    measured (`on_engine_started`) once the engine is ready. `model`/`tokenizer`: preloaded objects,
    which keep the core on a thread of this process."""

    def __init__(self, config: EngineConfig, *, observer: EngineObserver | None = None, model=None, tokenizer=None):
        self.config = config
        self._observer = observer
        self._model, self._tokenizer = model, tokenizer
        self.client: CoreClient | None = None
        self.processor: OutputProcessor | None = None
        self.ready: EngineReady | None = None
        self._streams: dict[str, RequestStream] = {}
        self.kv_events = KvEventHub(config.block_size, config.kv_events_buffer,
                                    switch=lambda on: self.client.utility("set_kv_events", on))
        self._load: LoadInfo | None = None
        self._dead: asyncio.Event | None = None
        self.dead_error: EngineDeadError | None = None

    async def start(self) -> None:
        """Start the engine core (it loads the model) and wait until it is ready."""
        self._dead = asyncio.Event()
        self.client = CoreClient(self.config, model=self._model, on_outputs=self._on_outputs, on_exit=self._on_exit)
        try:
            self.ready = await self.client.start()
        except BaseException:
            await self.client.shutdown()
            raise
        tokenizer = self._tokenizer
        if tokenizer is None and (Path(self.config.model) / "tokenizer.json").is_file():
            from mmserve.model.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(self.config.model)
        self.processor = OutputProcessor(tokenizer, self._observer)
        self.processor.engine_started(self.ready.peaks, self.ready.backend_checks)
        logger.info("engine ready: %s (%s, %s), %d torch threads, KV cache %s", self.ready.model_name,
                    self.ready.backend, "own process" if not self.client.in_process else "in-process thread",
                    self.ready.torch_threads, self.ready.kv_capacity.describe() if self.ready.kv_capacity
                    else self.ready.kv_pool_blocks)

    def watch_stalls(self) -> None:
        """Kill the engine as wedged once it sends nothing for --engine-stall-timeout-s (core_client.py);
        the server calls it once warmed up."""
        self.client.watch_stalls()

    @property
    def core(self):
        """The EngineCore object when it runs in this process (tests, debugging); None otherwise."""
        return self.client.core if self.client is not None else None

    @property
    def is_running(self) -> bool:
        return self.processor is not None and not self.client.stopping

    async def wait_dead(self) -> EngineDeadError:
        """Returns (with the error) once the engine core has died unexpectedly."""
        await self._dead.wait()
        return self.dead_error

    # -- from the core ------------------------------------------------------------------------------

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        self._load = outputs.load
        for out in outputs.outputs:
            if out.num_cached_tokens:
                self.kv_events.cached(out.request_id, out.num_cached_tokens)
            if out.new_token_ids:
                self.kv_events.generated(out.request_id, out.new_token_ids)
        self.kv_events.apply(outputs.kv_events)   # before the outputs end requests (their views go with them)
        done = self.processor.process(outputs)
        self._dispatch(done.events)
        if done.stopped:
            self.client.abort(done.stopped)

    def _on_exit(self, error: EngineDeadError | None) -> None:
        self.kv_events.close(error or EngineUnavailableError("the engine shut down"))
        if self.processor is not None:
            self._dispatch(self.processor.fail_all(error or EngineUnavailableError("the engine shut down")))
        if error is not None:
            self.dead_error = error
            self._dead.set()

    def _dispatch(self, events: list[Event]) -> None:
        for rid, item in events:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put(item)

    # -- requests -----------------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Deltas, then exactly one output with finished=True; or raises the request's error
        (admission errors before anything is streamed)."""
        if not self.is_running:
            raise self.dead_error or EngineUnavailableError("the engine is not running")
        rid = request.request_id
        if rid in self._streams:
            raise InvalidInputError("request_id", f"{rid!r} is already in flight")
        self.processor.add(request)
        self.kv_events.track(request)
        stream = self._streams[rid] = RequestStream()
        finished = False
        try:
            try:
                self.client.add(request)
            except BaseException:
                self.processor.forget(rid)
                finished = True
                raise
            while not finished:
                try:
                    out = await stream.get()
                except asyncio.CancelledError:
                    raise   # the reader went away mid-wait: the request still runs, so it is aborted below
                except BaseException:
                    finished = True   # the request's own error: it has ended
                    raise
                finished = out.finished
                yield out
        finally:
            del self._streams[rid]
            self.kv_events.forget(rid)
            if not finished:
                self.abort(rid)

    def extend(self, request_id: str, token_ids: list[int], mm_ranges: list[tuple[int, int]],
               mm_inputs: list[MultiModalInput]) -> None:
        """Append to an open prompt (a live context that `generate` is streaming): the tokens are
        computed in the steps that follow, its stream reports them as `prefilled_tokens`."""
        state = self.processor.states.get(request_id) if self.processor is not None else None
        if state is None or not state.request.open_prompt:
            raise InvalidInputError("request_id", f"{request_id!r} is not a live context in flight")
        state.request.extend_prompt(token_ids, mm_ranges, mm_inputs)   # the observer's view, for the perf model
        self.client.extend(ExtendRequest(request_id, token_ids, mm_ranges, mm_inputs))

    def abort(self, request_id: str) -> bool:
        """Stop a request within one step. False if it is not in flight."""
        if self.processor is None or request_id not in self.processor.states:
            return False
        self._dispatch(self.processor.abort(request_id))
        self.client.abort([request_id])
        return True

    def subscribe_kv_events(self) -> AsyncIterator[KvBatch]:
        """What the prefix cache holds, then its changes, as routers see them (engine/kv_event_hub.py)."""
        if not self.is_running:
            raise self.dead_error or EngineUnavailableError("the engine is not running")
        return self.kv_events.subscribe()

    async def flush_prefix_cache(self, timeout_s: float = 0.0) -> bool:
        """Drop every cached prefix. The core refuses while requests are in flight; this retries until
        it is idle or `timeout_s` passed (0: one try). False if it never was idle."""
        if not self.is_running:
            raise self.dead_error or EngineUnavailableError("the engine is not running")
        deadline = asyncio.get_running_loop().time() + max(0.0, timeout_s)
        while True:
            if await self.client.utility("flush_prefix_cache"):
                return True
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)

    def load(self) -> LoadInfo:
        if self._load is None:
            return LoadInfo(0, 0, 0.0, self.config.max_num_seqs)
        in_transit = sum(not s.admitted for s in self.processor.states.values())
        return dataclasses.replace(self._load, waiting=self._load.waiting + in_transit)

    async def held_resources(self) -> dict:
        """Diagnostics: what the engine still holds, both sides, empty values when nothing is in flight
        (the leak checks read it; serving never does)."""
        held = await self.client.utility("held_resources")
        held["front_end_requests"] = sorted(self.processor.states)
        held["streams"] = sorted(self._streams)
        return held

    @property
    def model_info(self) -> ModelInfo:
        if self.ready is None:
            raise EngineUnavailableError("the engine has not started")
        r = self.ready
        return ModelInfo(name=r.model_name, context_length=r.max_model_len, tokens_per_frame=r.tokens_per_frame,
                         backend=r.backend, dtype=r.dtype, peaks=r.peaks, backend_checks=r.backend_checks,
                         kv_capacity=r.kv_capacity)

    async def shutdown(self) -> None:
        """Stop the engine core; requests still in flight end with EngineUnavailableError."""
        if self.client is None:
            return
        await self.client.shutdown()
