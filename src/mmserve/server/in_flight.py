"""The requests the server's front doors are serving, by client id, shared by mmserve.v1 and VllmEngine.

One registry for both doors, so that an id is unique across them (the engine sees one namespace),
an Abort through either door reaches only the caller's own requests (finding 9 of the hardening
issue: the key that created a request is the only one that can abort it), and an Abort that arrives
while a request's media are still decoding stops that decode before the engine ever has the request.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Coroutine
from dataclasses import dataclass, field

import grpc

from mmserve.engine.parallel_sampling import sample_id
from mmserve.engine.types import DERIVED_ID_SEPARATOR, EngineRequest
from mmserve.errors import InvalidInputError, RequestAbortedError


def caller_key(context: grpc.aio.ServicerContext) -> bytes:
    """Who is calling: a digest of the credentials presented (the API key), so a request can be
    aborted only with the key that created it, and the scheduler shares seats fairly between keys
    (every caller is the same without)."""
    value = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), "")
    return hashlib.sha256(value.encode() if isinstance(value, str) else value).digest()


@dataclass
class InFlight:
    """A request as Abort sees it: whose it is, how many samples it has in the engine, and the input
    processing task an early Abort cancels."""

    owner: bytes
    n: int
    aborted_early: bool = False
    preprocessing: asyncio.Task | None = field(default=None, repr=False)


class InFlightRequests:
    def __init__(self, engine) -> None:
        self._engine = engine
        self._requests: dict[str, InFlight] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request_id: str, owner: bytes, n: int, field: str = "request_id") -> None:
        """Register a client's id (a request's, a live session's), refusing one in flight or one
        holding the separator of the ids the server derives from it (`types.derived_id`)."""
        if DERIVED_ID_SEPARATOR in request_id:
            raise InvalidInputError(field, f"must not contain {DERIVED_ID_SEPARATOR!r}: it is reserved for the ids "
                                    "the server derives (parallel samples, live sessions' contexts and questions)")
        if request_id in self._requests:
            raise InvalidInputError(field, f"{request_id!r} is already in flight; ids must be unique")
        self._requests[request_id] = InFlight(owner, n)

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    async def preprocess(self, request_id: str, processing: Coroutine) -> EngineRequest:
        """Run input processing as a task Abort can cancel, which stops its decodes at once."""
        running = self._requests[request_id]
        running.preprocessing = asyncio.ensure_future(processing)
        try:
            # No local holds the task: its error's traceback holds this frame, and a task held
            # here would hold that error back (a cycle keeping the request's media alive).
            engine_request = await running.preprocessing
        except asyncio.CancelledError:
            if running.aborted_early and not asyncio.current_task().cancelling():
                raise RequestAbortedError(f"request {request_id} was aborted") from None
            raise
        finally:
            running.preprocessing = None
        if running.aborted_early:
            raise RequestAbortedError(f"request {request_id} was aborted")
        engine_request.owner = running.owner   # the scheduler shares seats fairly between callers
        return engine_request

    def abort(self, request_id: str, owner: bytes | None) -> bool:
        """Abort the request with exactly this id if `owner` created it (None: the server itself, e.g.
        a stream torn down mid-way): every sample in the engine, or its input processing if the engine
        does not have it yet. False when there is no such request of this caller."""
        running = self._requests.get(request_id)
        if running is None or (owner is not None and running.owner != owner):
            return False
        # every sample of an n > 1 request (sample 0 may have ended while the others run)
        if any([self._engine.abort(sample_id(request_id, i)) for i in range(running.n)]):
            return True
        running.aborted_early = True   # still decoding its media: stop it before the engine has it
        if running.preprocessing is not None:
            running.preprocessing.cancel()
        return True
