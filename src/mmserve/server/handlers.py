"""Rewriting grpc.aio method handlers, for the interceptors (auth, admission, drain).

A grpc.aio interceptor cannot see a call's request or its end; it can only hand back a different
handler. These helpers build one of the same kind (unary/streaming) around the original behavior.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc


def replace_behavior(
    handler: grpc.RpcMethodHandler, wrap: Callable[[Callable], Callable],
    request_deserializer: Callable[[bytes], object] | None = None,
) -> grpc.RpcMethodHandler:
    """`handler` with its behavior function replaced by `wrap(behavior)`, keeping the serializers
    (or taking `request_deserializer` instead of the original)."""
    kinds = {
        (False, False): (grpc.unary_unary_rpc_method_handler, handler.unary_unary),
        (False, True): (grpc.unary_stream_rpc_method_handler, handler.unary_stream),
        (True, False): (grpc.stream_unary_rpc_method_handler, handler.stream_unary),
        (True, True): (grpc.stream_stream_rpc_method_handler, handler.stream_stream),
    }
    make, behavior = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(wrap(behavior), request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer)


def rejecting_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler answering `code` without running `handler` and without reading the request: it is
    request-streaming whatever the method (grpc.aio dispatches on the handler, the client cannot
    tell), so a refused caller's message is never buffered whole nor parsed."""

    async def abort(requests, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    make = grpc.stream_stream_rpc_method_handler if handler.response_streaming else grpc.stream_unary_rpc_method_handler
    return make(abort, response_serializer=handler.response_serializer)


def around(behavior: Callable, before: Callable[[Any, grpc.aio.ServicerContext], Awaitable[None]],
           after: Callable[[], None] | None = None) -> Callable:
    """`behavior` preceded by `await before(request, context)` (which may abort the call) and, once
    that passed, followed by `after()` however the call ends. An async generator stays one."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            await before(request, context)
            try:
                async with contextlib.aclosing(behavior(request, context)) as items:
                    async for item in items:
                        yield item
            finally:
                if after is not None:
                    after()
        return stream

    async def call(request, context):
        await before(request, context)
        try:
            return await behavior(request, context)
        finally:
            if after is not None:
                after()
    return call


def written_stream(behavior: Callable) -> Callable:
    """An async-generator handler as a coroutine that writes each item itself.

    grpc.aio drives a generator handler with `async for ...: await write(item)`; when the call ends
    during that write (client cancel, deadline), the generator stays suspended at its `yield` and its
    `finally` (aborting the engine request, releasing its media) runs only once the garbage collector
    finds it, which a reference cycle can delay indefinitely. Driving it here closes it at once.
    """
    async def write_all(request, context):
        async with contextlib.aclosing(behavior(request, context)) as items:
            async for item in items:
                await context.write(item)
    return write_all


class ClosingStreamsInterceptor(grpc.aio.ServerInterceptor):
    """First in the chain: every response-streaming handler runs as `written_stream`, so the
    wrappers inside (each closing what it wraps) and the servicer end with the call."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not handler.response_streaming:
            return handler
        return replace_behavior(handler, lambda behavior: written_stream(behavior)
                                if inspect.isasyncgenfunction(behavior) else behavior)
