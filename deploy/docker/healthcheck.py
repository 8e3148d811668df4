"""Container health check: exit 0 when the server's grpc.health.v1 service reports SERVING.

Docker's HEALTHCHECK cannot speak gRPC, so the image runs this; Kubernetes uses its native gRPC
probes instead and never calls it.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str, timeout_s: float) -> bool:
    """True when `service` ("" = the whole server) is SERVING at `target`."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--service", default="", help='health service name; "" = the whole server')
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args(argv)
    return 0 if check(f"{args.host}:{args.port}", args.service, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
