"""A real grpc.aio server with health, reflection and the generated (UNIMPLEMENTED) Generation base
servicer: enough to test transport and interceptors before/independently of the engine."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mmserve.api.mmserve.v1 import generation_pb2, generation_pb2_grpc
from mmserve.config import ServerConfig
from mmserve.server import tls


@contextlib.asynccontextmanager
async def serve(cfg: ServerConfig, interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                options: Sequence[tuple[str, int]] = ()) -> AsyncIterator[int]:
    server = grpc.aio.server(interceptors=list(interceptors), options=[("grpc.so_reuseport", 0), *options])
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    generation_pb2_grpc.add_GenerationServicer_to_server(generation_pb2_grpc.GenerationServicer(), server)
    names = (generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = tls.bind(server, f"{cfg.host}:{cfg.port}", tls.server_credentials(cfg))
    await server.start()
    try:
        yield port
    finally:
        await server.stop(0)


async def stream_status(call) -> tuple[grpc.StatusCode, str]:
    """Read a streaming call to its end: its status code (OK if none was raised) and details."""
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""
