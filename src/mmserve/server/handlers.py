"""Rewriting grpc.aio method handlers, for the interceptors (auth, admission, drain).

A grpc.aio interceptor cannot see a call's request or its end; it can only hand back a different
handler. These helpers build one of the same kind (unary/streaming) around the original behavior.
"""

from __future__ import annotations

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
                async for item in behavior(request, context):
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
