"""Count every RPC by method and final gRPC status code (`mmserve_rpc_requests_total{rpc, code}`).

The engine's metrics only see requests it admitted; a dashboard's error rate must also count the
calls refused at the edge (bad input, auth, message size, draining). This interceptor runs first in
the chain, so it sees every call, and reads the code the call ended with: the one a handler aborted
with, CANCELLED when the client went away, UNKNOWN for an escaped exception, else OK.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable

import grpc

from mmserve.server.handlers import replace_behavior


def _code(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    if isinstance(error, asyncio.CancelledError | GeneratorExit):   # closed mid-stream: the call went away
        return grpc.StatusCode.CANCELLED.name
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # grpc.aio reports an aborted call's code as the wire's number
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), "UNKNOWN")
    return "OK" if error is None else "UNKNOWN"


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """`count(rpc, code)` once per call, however it ends."""

    def __init__(self, count: Callable[[str, str], None]):
        self._count = count

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        rpc = details.method.rsplit("/", 1)[-1]
        return replace_behavior(handler, lambda behavior: self._wrap(behavior, rpc))

    def _wrap(self, behavior: Callable, rpc: str) -> Callable:
        count = self._count
        if inspect.isasyncgenfunction(behavior):
            async def stream(request, context):
                error = None
                try:
                    async with contextlib.aclosing(behavior(request, context)) as items:
                        async for item in items:
                            yield item
                except BaseException as e:
                    error = e
                    raise
                finally:
                    count(rpc, _code(context, error))
                    error = None   # its traceback holds this frame: a cycle keeping the request's frames
            return stream

        async def call(request, context):
            error = None
            try:
                return await behavior(request, context)
            except BaseException as e:
                error = e
                raise
            finally:
                count(rpc, _code(context, error))
                error = None
        return call
