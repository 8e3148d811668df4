"""The requests the server's front doors are serving, by client id, shared by mmserve.v1 and VllmEngine.

One registry for both doors, so that an id is unique across them (the engine sees one namespace),
an Abort through either door reaches only the caller's own requests (finding 9 of the hardening
issue: the key that created a request is the only one that can abort it), and an Abort that arrives
before the engine has the request (while the door still checks it or decodes its media, or before
all of its samples are admitted) stops it there: a door registers the id before its first await.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from mmserve.engine.parallel_sampling import generate_samples, sample_id
from mmserve.engine.types import DERIVED_ID_SEPARATOR, EngineRequest, RequestOutput
from mmserve.errors import InvalidInputError, RequestAbortedError


def caller_key(context: grpc.aio.ServicerContext) -> bytes:
    """Who is calling: a digest of the credentials presented (the API key), so a request can be
    aborted only with the key that created it, and the scheduler shares seats fairly between keys
    (every caller is the same without)."""
    value = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), "")
    return hashlib.sha256(value.encode() if isinstance(value, str) else value).digest()


@dataclass
class InFlight:
    """A request as Abort sees it: whose it is, how many samples it has in the engine, whether it was
    aborted (what runs after the Abort reads it), the step before the engine that an Abort cancels,
    and what else an Abort must end (a live session, whose engine requests run under derived ids)."""

    owner: bytes
    n: int
    aborted: bool = False
    on_abort: Callable[[], None] | None = field(default=None, repr=False)
    before_engine: asyncio.Task | None = field(default=None, repr=False)


Result = TypeVar("Result")


class InFlightRequests:
    def __init__(self, engine) -> None:
        self._engine = engine
        self._requests: dict[str, InFlight] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request_id: str, owner: bytes, n: int, field: str = "request_id",
            on_abort: Callable[[], None] | None = None) -> None:
        """Register a client's id (a request's with `n` samples, a live session's with none and the
        `on_abort` that ends it), refusing one in flight or one holding the separator of the ids the
        server derives from it (`types.derived_id`)."""
        if DERIVED_ID_SEPARATOR in request_id:
            raise InvalidInputError(field, f"must not contain {DERIVED_ID_SEPARATOR!r}: it is reserved for the ids "
                                    "the server derives (parallel samples, live sessions' contexts and questions)")
        if request_id in self._requests:
            raise InvalidInputError(field, f"{request_id!r} is already in flight; ids must be unique")
        self._requests[request_id] = InFlight(owner, n, on_abort=on_abort)

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    @contextlib.contextmanager
    def checking(self, request_id: str) -> Iterator[None]:
        """A door's checks after `add`: if one refuses the request (or an Abort or the client ends
        it there), its id is free again."""
        try:
            yield
        except BaseException:
            self.remove(request_id)
            raise

    async def before_engine(self, request_id: str, step: Coroutine[object, object, Result]) -> Result:
        """Run a step of the request before the engine has it (a door's awaited check, input
        processing) as a task Abort can cancel, which stops its decodes at once; RequestAbortedError
        if the request was aborted before or during it."""
        running = self._requests[request_id]
        if running.aborted:
            step.close()
            raise RequestAbortedError(f"request {request_id} was aborted")
        running.before_engine = asyncio.ensure_future(step)
        try:
            # No local holds the task: its error's traceback holds this frame, and a task held
            # here would hold that error back (a cycle keeping the request's media alive).
            result = await running.before_engine
        except asyncio.CancelledError:
            if running.aborted and not asyncio.current_task().cancelling():
                raise RequestAbortedError(f"request {request_id} was aborted") from None
            raise
        finally:
            running.before_engine = None
        if running.aborted:
            raise RequestAbortedError(f"request {request_id} was aborted")
        return result

    async def preprocess(self, request_id: str, processing: Coroutine) -> EngineRequest:
        """Input processing, abortable (`before_engine`), its request owned by the caller."""
        engine_request = await self.before_engine(request_id, processing)
        engine_request.owner = self._requests[request_id].owner   # the scheduler shares seats fairly
        return engine_request

    def generate(self, request_id: str, engine_request: EngineRequest) -> AsyncIterator[tuple[int, RequestOutput]]:
        """`generate_samples` of the request, ending it aborted if an Abort came before all of its
        samples were in the engine (that Abort found none or only some of them there)."""
        running = self._requests[request_id]
        return generate_samples(self._engine, engine_request, aborted=lambda: running.aborted)

    def abort(self, request_id: str, owner: bytes | None) -> bool:
        """Abort the request with exactly this id if `owner` created it (None: the server itself, e.g.
        a stream torn down mid-way): every sample in the engine, and the step before the engine that
        is running (`before_engine`); marked aborted, so nothing of it starts afterwards. False when
        there is no such request of this caller."""
        running = self._requests.get(request_id)
        if running is None or (owner is not None and running.owner != owner):
            return False
        running.aborted = True
        # every sample of an n > 1 request (sample 0 may have ended while the others run)
        for i in range(running.n):
            self._engine.abort(sample_id(request_id, i))
        if running.before_engine is not None:
            running.before_engine.cancel()
        if running.on_abort is not None:
            running.on_abort()
        return True
