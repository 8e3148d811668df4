"""grpc.health.v1 with two levels, and server reflection.

Service "" answers "is the process up" (SERVING once listening); "mmserve.v1.Generation" answers
"send me work" (SERVING only after the model is loaded and warmed, NOT_SERVING while draining).
Kubernetes points liveness at the first and readiness at the second.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mmserve.api import pb

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
OVERALL = health.OVERALL_HEALTH
HEALTH_SERVICE = health.SERVICE_NAME

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """Owns the health servicer and moves the two services through live -> ready -> draining."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()

    def add_to_server(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set_live(self) -> None:
        await self.servicer.set(OVERALL, _SERVING)
        await self.servicer.set(GENERATION_SERVICE, _NOT_SERVING)

    async def set_ready(self) -> None:
        await self.servicer.set(GENERATION_SERVICE, _SERVING)

    async def set_dead(self) -> None:
        """The engine process died: neither live nor ready, so the orchestrator restarts this server."""
        await self.servicer.set(OVERALL, _NOT_SERVING)
        await self.servicer.set(GENERATION_SERVICE, _NOT_SERVING)

    async def set_draining(self) -> None:
        """Readiness drops first so load balancers stop sending work before the listener closes."""
        await self.servicer.set(GENERATION_SERVICE, _NOT_SERVING)


def enable_reflection(server: grpc.aio.Server, extra_services: tuple[str, ...] = ()) -> None:
    """Let grpcurl/grpcui `list` and `describe` the API without the .proto files."""
    reflection.enable_server_reflection((GENERATION_SERVICE, HEALTH_SERVICE, *extra_services, reflection.SERVICE_NAME),
                                        server)
