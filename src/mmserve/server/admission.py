"""Request size admission with a message a person can act on.

grpc refuses an oversize message itself, but only with "Received message larger than max (N vs M)",
which names neither the option nor what to do. So the transport limit is set to twice
`--max-message-bytes` (`transport_receive_limit`) and this interceptor refuses anything above
`--max-message-bytes` from the raw byte count, before deserializing, with RESOURCE_EXHAUSTED naming
the flag. Only payloads beyond twice the limit still get grpc's own (also RESOURCE_EXHAUSTED) text.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from mmserve.server.handlers import around, replace_behavior

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE = 2**31 - 1


def transport_receive_limit(max_message_bytes: int) -> int:
    """grpc's own receive limit: headroom above ours so our clearer refusal gets the chance to run."""
    return min(2 * max_message_bytes, GRPC_MAX_MESSAGE)


def too_large_message(size: int, limit: int) -> str:
    return (f"request message is {size} bytes, more than the limit of {limit} bytes "
            f"(--max-message-bytes / MMSERVE_MAX_MESSAGE_BYTES); send fewer or smaller media, "
            f"or raise the limit on the server and the client")


@dataclass(frozen=True)
class _TooLarge:
    """Stands in for a request whose bytes were never parsed."""

    size: int


class MessageSizeLimit(grpc.aio.ServerInterceptor):
    """Refuses request messages above `max_message_bytes` with RESOURCE_EXHAUSTED naming the flag."""

    def __init__(self, max_message_bytes: int):
        self.limit = max_message_bytes

    def _deserializer(self, inner: Callable[[bytes], object] | None) -> Callable[[bytes], object]:
        def deserialize(raw: bytes) -> object:
            if len(raw) > self.limit:
                return _TooLarge(len(raw))
            return inner(raw) if inner else raw
        return deserialize

    def _guarded(self, behavior: Callable) -> Callable:
        """`behavior`, preceded by the size check."""
        return around(behavior, self._refuse_too_large)

    async def _refuse_too_large(self, request, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, _TooLarge):
            log.info("refused a %d-byte request message (limit %d)", request.size, self.limit)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, too_large_message(request.size, self.limit))

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:  # every streaming-request RPC here is reflection
            return handler
        return replace_behavior(handler, self._guarded, self._deserializer(handler.request_deserializer))
