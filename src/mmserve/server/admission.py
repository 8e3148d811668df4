"""Request-message admission: size, decodability and bytes in flight, before any handler runs.

grpc refuses an oversize message itself, but only with "Received message larger than max (N vs M)",
which names neither the option nor what to do. So the transport limit sits a little above
`--max-message-bytes` (`transport_receive_limit`: grpc refuses bigger messages from their length
prefix, before buffering them) and this interceptor's deserializer sees the raw bytes first:

- a message above its method's limit (`--max-message-bytes`; an UploadMedia message: one chunk) is
  refused with INVALID_ARGUMENT naming the limit, without parsing it (resending it cannot succeed;
  grpc's own refusal, for a message more than the headroom over the limit, stays RESOURCE_EXHAUSTED);
- bytes that do not parse are refused with INVALID_ARGUMENT and one rate-limited log line (grpc
  would answer UNKNOWN and log a traceback per message: log flooding for the price of a packet);
- a unary request's bytes are held against `--max-inflight-message-bytes` from receipt to the end
  of its call, so many concurrent large messages get a retryable RESOURCE_EXHAUSTED instead of
  the server's memory.

Authentication runs before any of this (server/auth.py refuses without reading the message).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import grpc

from mmserve.server.handlers import replace_behavior

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE = 2**31 - 1
# Above our limit so a message slightly too large gets our refusal naming the flag, not grpc's.
TRANSPORT_HEADROOM_BYTES = 2**20


def transport_receive_limit(max_message_bytes: int) -> int:
    """grpc's own receive limit: just above ours, so our clearer refusal gets the chance to run
    while a message far beyond the limit is refused from its length prefix, never buffered."""
    return min(max_message_bytes + TRANSPORT_HEADROOM_BYTES, GRPC_MAX_MESSAGE)


def too_large_message(size: int, limit: int) -> str:
    return (f"request message is {size} bytes, more than the limit of {limit} bytes "
            f"(--max-message-bytes / MMSERVE_MAX_MESSAGE_BYTES); upload large media first with the "
            f"UploadMedia RPC (Python: client.upload(path), or Client.generate(video=path) does it; "
            f"`mmserve generate --video` too) and name them by media_id, or raise the limit")


@dataclass(frozen=True)
class MethodLimit:
    """A method's own message limit, instead of --max-message-bytes (UploadMedia: one chunk and its
    framing), and what to tell a client over it."""

    max_bytes: int
    advice: str


class RateLimitedLog:
    """At most one line per `interval_s`, counting what it left out: a flood of bad messages costs
    the log a line every few seconds, not a line (or a traceback) each."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger, self._interval, self._clock = logger, interval_s, clock
        self._next = 0.0
        self._suppressed = 0
        self._lock = threading.Lock()   # deserializers may run on any thread

    def warning(self, message: str, *args) -> None:
        with self._lock:
            now = self._clock()
            if now < self._next:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._next = self._suppressed, 0, now + self._interval
        more = f" ({suppressed} more like it in the last {self._interval:g}s)" if suppressed else ""
        self._logger.warning(message + more, *args)


class InflightBytes:
    """A budget of request bytes held by calls in progress (`--max-inflight-message-bytes`)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        self._lock = threading.Lock()

    def take(self, num_bytes: int) -> bool:
        with self._lock:
            if self.used + num_bytes > self.max_bytes and self.used > 0:   # one message always fits
                return False
            self.used += num_bytes
            return True

    def give(self, num_bytes: int) -> None:
        with self._lock:
            self.used -= num_bytes


@dataclass(frozen=True)
class _Refused:
    """Stands in for a request message that was never parsed (or never held): the status to send."""

    code: grpc.StatusCode
    message: str


@dataclass(frozen=True)
class _Held:
    """A parsed unary request and the bytes it holds in the in-flight budget until its call ends."""

    message: object
    size: int


class MessageAdmission(grpc.aio.ServerInterceptor):
    """Refuses oversize, undecodable and over-budget request messages before any handler sees them."""

    def __init__(self, max_message_bytes: int, max_inflight_bytes: int,
                 method_limits: Mapping[str, MethodLimit] | None = None) -> None:
        self.limit = max_message_bytes
        self.inflight = InflightBytes(max_inflight_bytes)
        self._method_limits = dict(method_limits or {})
        self._bad_log = RateLimitedLog(log)

    def _deserializer(self, method: str, inner: Callable[[bytes], object] | None,
                      hold: bool) -> Callable[[bytes], object]:
        own = self._method_limits.get(method)

        def deserialize(raw: bytes) -> object:
            size = len(raw)
            if own is None and size > self.limit:
                return _Refused(grpc.StatusCode.INVALID_ARGUMENT, too_large_message(size, self.limit))
            if own is not None and size > own.max_bytes:
                return _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                f"a {method.rsplit('/', 1)[-1]} message of {size} bytes is more than its limit of "
                                f"{own.max_bytes} bytes; {own.advice}")
            if hold and not self.inflight.take(size):
                return _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the server is holding {self.inflight.used} bytes of request messages in progress, "
                                f"at its limit of {self.inflight.max_bytes} (--max-inflight-message-bytes); retry "
                                f"after a moment with backoff")
            try:
                message = inner(raw) if inner else raw
            except Exception as e:   # noqa: BLE001 - any parse failure is the client's bytes
                if hold:
                    self.inflight.give(size)
                self._bad_log.warning("refused an undecodable %d-byte %s message: %s", size, method,
                                      type(e).__name__)
                return _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request message ({size} bytes) is not a valid protobuf message for {method}: "
                                f"regenerate the client from the published .proto files")
            return _Held(message, size) if hold else message
        return deserialize

    def _unary_guarded(self, behavior: Callable) -> Callable:
        """`behavior` for one received request: refused ones are answered, held bytes given back at the end."""
        async def admit(request, context: grpc.aio.ServicerContext):
            if isinstance(request, _Refused):
                log.info("refused a request message: %s", request.message)
                await context.abort(request.code, request.message)
            return request.message

        if inspect.isasyncgenfunction(behavior):
            async def stream(request, context):
                try:
                    async with contextlib.aclosing(behavior(await admit(request, context), context)) as items:
                        async for item in items:
                            yield item
                finally:
                    if isinstance(request, _Held):
                        self.inflight.give(request.size)
            return stream

        async def call(request, context):
            try:
                return await behavior(await admit(request, context), context)
            finally:
                if isinstance(request, _Held):
                    self.inflight.give(request.size)
        return call

    @staticmethod
    def _stream_guarded(behavior: Callable) -> Callable:
        """`behavior` over a request stream whose refused messages end the call with their status."""
        async def checked(requests, context: grpc.aio.ServicerContext):
            async for request in requests:
                if isinstance(request, _Refused):
                    log.info("refused a request message: %s", request.message)
                    await context.abort(request.code, request.message)
                yield request

        if inspect.isasyncgenfunction(behavior):
            async def stream(requests, context):
                async with contextlib.aclosing(behavior(checked(requests, context), context)) as items:
                    async for item in items:
                        yield item
            return stream

        async def call(requests, context):
            return await behavior(checked(requests, context), context)
        return call

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        streaming = handler.request_streaming
        wrap = self._stream_guarded if streaming else self._unary_guarded
        return replace_behavior(handler, wrap, self._deserializer(details.method, handler.request_deserializer,
                                                                  hold=not streaming))
