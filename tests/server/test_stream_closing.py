"""A streaming call that ends mid-write ends its handler at once, through every wrapper in the chain.

grpc.aio drives an async-generator handler as `async for item in gen: await write(item)`. When the
client cancels while that write waits, grpc leaves the generator suspended at `yield`: its `finally`
(where the servicers abort the engine request and release its media) runs only when the generator
is freed. A reference cycle through the generator defers that to the cyclic collector, and a
collection can be seconds away. CI saw a cancelled request decode 25 more steps that way.

The handler here has no await of its own, so every cancellation lands in the write: exactly the
case above. A cycle holds the generator and the collector is off, so nothing but the server closing it can
run its `finally`. Real gRPC server and client on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import sys

import grpc
import pytest

from mmserve.server.admission import MessageAdmission
from mmserve.server.drain import DrainGate
from mmserve.server.handlers import ClosingStreamsInterceptor
from mmserve.server.rpc_metrics import RpcMetricsInterceptor

METHOD = "/test.Streams/Endless"
CHUNK = b"x" * (256 * 1024)   # a few of these fill the HTTP/2 window of a client that stops reading


def _this_generator():
    """The async generator whose body calls this."""
    frame = sys._getframe(1)
    return next(o for o in gc.get_referrers(frame) if inspect.isasyncgen(o) and o.ag_frame is frame)


async def _cancel_mid_write(interceptors: list) -> bool:
    """Whether the handler's `finally` ran after the client cancelled mid-stream."""
    ended = asyncio.Event()

    async def endless(request, context):
        held = [_this_generator()]   # the stream in a reference cycle (production's: an error's traceback)
        held.append(held)
        del held
        try:
            while True:
                yield CHUNK
        finally:
            ended.set()

    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Streams", {"Endless": grpc.unary_stream_rpc_method_handler(endless)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream(METHOD)(b"")
            assert await call.read() == CHUNK   # the stream runs; the client stops reading, then cancels
            call.cancel()
            with contextlib.suppress(TimeoutError):   # a bound on a wait, not a timing assertion
                await asyncio.wait_for(ended.wait(), timeout=10.0)
    finally:
        await server.stop(None)
    return ended.is_set()


def _server_chain(counted: list) -> list:
    """The server's order: closing first, then RPC metrics, message admission and the drain gate."""
    return [ClosingStreamsInterceptor(), RpcMetricsInterceptor(lambda rpc, code: counted.append((rpc, code))),
            MessageAdmission(1 << 20, 1 << 24), DrainGate(gated_methods=(METHOD,))]


@pytest.mark.parametrize("chain", [_server_chain, lambda counted: [ClosingStreamsInterceptor()]],
                         ids=["server-chain", "closing-alone"])
def test_a_cancel_mid_write_closes_the_handler(chain):
    counted: list[tuple[str, str]] = []
    interceptors = chain(counted)
    gc.disable()
    try:
        ended = asyncio.run(_cancel_mid_write(interceptors))
    finally:
        gc.enable()
        gc.collect()
    assert ended, "the handler's finally never ran: the stream was left suspended at its yield"
    if len(interceptors) > 1:
        assert counted == [("Endless", "CANCELLED")]
