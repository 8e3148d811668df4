"""The `vllm.grpc.engine.VllmEngine` front door (the SMG / llm-d worker protocol), beside mmserve.v1.

Stubs come from the pinned `smg-grpc-proto` package; docs/gateway.md says what goes through.
"""

from __future__ import annotations

from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from mmserve.server.vllm_engine.servicer import VllmEngineServicer

VLLM_ENGINE_SERVICE = "vllm.grpc.engine.VllmEngine"


def add_vllm_engine(server, engine, engine_config, server_config, processor, draining, in_flight) -> None:
    """Register the VllmEngine servicer on `server` (a grpc.aio.Server); `processor()` and
    `draining()` are the server's own (the InputProcessor once loaded, the drain state), `in_flight`
    the registry it shares with mmserve.v1 (server/in_flight.py)."""
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(
        VllmEngineServicer(engine, engine_config, server_config, processor, draining, in_flight), server)
