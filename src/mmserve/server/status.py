"""The one place that maps mmserve.errors to gRPC status codes.

Every handler funnels failures through `abort_with` (or `end_with`, which does not raise), so a client sees the same code for the same
cause whichever RPC raised it. Besides the code and message, the status carries standard
`google.rpc` details (BadRequest.FieldViolation for bad input, RetryInfo for retryable limits,
ResourceInfo for what was not found) in `grpc-status-details-bin`, which grpc clients in every
language know how to read.

Every text that leaves here is bounded (`bounded`): a message may quote the client's input (a schema,
a path, a parser's excerpt), and the status travels in metadata, which grpc caps at 16 KiB in all;
over it the client would get "metadata size exceeds hard limit" (RESOURCE_EXHAUSTED) instead of the
real status.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from mmserve.errors import (
    EngineInternalError,
    EngineUnavailableError,
    InvalidInputError,
    LimitExceededError,
    MMServeError,
    NotFoundError,
    RequestAbortedError,
)

logger = logging.getLogger(__name__)

DETAILS_KEY = "grpc-status-details-bin"
# A status message's UTF-8 bytes at most: it travels percent-encoded in grpc-message and again inside
# the details' base64, so even a message of non-ASCII text stays far below grpc's 16 KiB of metadata.
MAX_MESSAGE_BYTES = 1024
MAX_FIELD_BYTES = 256
# How long a client should back off before retrying a request refused by a retryable limit.
RETRY_DELAY_S = 1.0


def bounded(text: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`text` cut to at most `limit` UTF-8 bytes (on a character boundary), saying how much was cut."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    kept = data[:limit - 32].decode("utf-8", "ignore")
    return f"{kept}... ({len(data) - len(kept.encode())} bytes cut)"


@dataclass(frozen=True)
class MappedStatus:
    """A gRPC status ready to send: code, message (bounded) and the google.rpc details to attach."""

    code: grpc.StatusCode
    message: str
    details: tuple[any_pb2.Any, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", bounded(self.message))

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        if not self.details:
            return ()
        status = status_pb2.Status(code=_rpc_code(self.code), message=self.message, details=list(self.details))
        return ((DETAILS_KEY, status.SerializeToString()),)


def _rpc_code(code: grpc.StatusCode) -> int:
    return code_pb2.Code.Value(code.name)


def _pack(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def map_error(exc: BaseException, request_id: str = "") -> MappedStatus:
    """Translate an exception into the status the client sees."""
    if isinstance(exc, InvalidInputError):
        violation = error_details_pb2.BadRequest.FieldViolation(field=bounded(exc.field, MAX_FIELD_BYTES),
                                                                description=bounded(str(exc)))
        return MappedStatus(grpc.StatusCode.INVALID_ARGUMENT, str(exc),
                            (_pack(error_details_pb2.BadRequest(field_violations=[violation])),))
    if isinstance(exc, LimitExceededError):
        if exc.retryable:
            delay = duration_pb2.Duration()
            delay.FromTimedelta(datetime.timedelta(seconds=RETRY_DELAY_S))
            return MappedStatus(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{exc}; retry after {RETRY_DELAY_S:g}s with backoff",
                                (_pack(error_details_pb2.RetryInfo(retry_delay=delay)),))
        return MappedStatus(grpc.StatusCode.INVALID_ARGUMENT, str(exc))   # permanent: retrying cannot help
    if isinstance(exc, NotFoundError):
        info = error_details_pb2.ResourceInfo(resource_type=exc.resource_type,
                                              resource_name=bounded(exc.resource_name, MAX_FIELD_BYTES),
                                              description=bounded(str(exc)))
        return MappedStatus(grpc.StatusCode.NOT_FOUND, str(exc), (_pack(info),))
    if isinstance(exc, EngineUnavailableError):
        return MappedStatus(grpc.StatusCode.UNAVAILABLE, str(exc) or "engine unavailable")
    if isinstance(exc, RequestAbortedError):
        return MappedStatus(grpc.StatusCode.CANCELLED, str(exc) or f"request {request_id} was aborted")
    if isinstance(exc, EngineInternalError):
        text = str(exc)
        if request_id and request_id not in text:
            text = f"{text} (request {request_id})"
        return MappedStatus(grpc.StatusCode.INTERNAL, text)
    if isinstance(exc, MMServeError):
        return MappedStatus(grpc.StatusCode.INTERNAL, f"{exc} (request {request_id})")
    logger.exception("unexpected error in request %s", request_id, exc_info=exc)
    return MappedStatus(grpc.StatusCode.INTERNAL,
                        f"internal error {type(exc).__name__} (request {request_id}); see the server log")


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException, request_id: str = "") -> None:
    """End the RPC with the status `exc` maps to (raises, as context.abort does)."""
    status = map_error(exc, request_id)
    await context.abort(status.code, status.message, status.trailing_metadata())


def end_with(context: grpc.aio.ServicerContext, exc: BaseException, request_id: str = "") -> None:
    """Set the status `exc` maps to; a streaming handler that returns next sends it. Unlike
    `abort_with` it raises nothing: grpc keeps the AbortError it raises on the call's state, and
    that error's traceback holds the handler's frames (the request and its media included), which
    hold the context and so that state: a reference cycle only a full collection frees."""
    status = map_error(exc, request_id)
    context.set_code(status.code)
    context.set_details(status.message)
    if metadata := status.trailing_metadata():
        context.set_trailing_metadata(metadata)
