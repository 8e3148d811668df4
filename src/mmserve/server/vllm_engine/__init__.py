"""The `vllm.grpc.engine.VllmEngine` front door (the SMG / llm-d worker protocol), beside mmserve.v1.

Stubs come from the pinned `smg-grpc-proto` package; docs/gateway.md says what goes through.
"""

from __future__ import annotations

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc

from mmserve.server.vllm_engine.servicer import VllmEngineServicer

VLLM_ENGINE_SERVICE = "vllm.grpc.engine.VllmEngine"


class _Handlers:
    """Collects the generated method handlers instead of registering them."""

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers = dict(handlers)


def add_vllm_engine(server, engine, engine_config, server_config, processor, draining, in_flight) -> VllmEngineServicer:
    """Register the VllmEngine servicer on `server` (a grpc.aio.Server); `processor()` and
    `draining()` are the server's own (the InputProcessor once loaded, the drain state), `in_flight`
    the registry it shares with mmserve.v1 (server/in_flight.py). SubscribeKvEvents streams messages
    it serialized itself (a snapshot once for all its subscribers: kv_events.py), so its handler has
    no serializer."""
    servicer = VllmEngineServicer(engine, engine_config, server_config, processor, draining, in_flight)
    generated = _Handlers()
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, generated)
    handlers = generated.handlers
    handlers["SubscribeKvEvents"] = grpc.unary_stream_rpc_method_handler(
        servicer.SubscribeKvEvents, request_deserializer=common_pb2.SubscribeKvEventsRequest.FromString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(VLLM_ENGINE_SERVICE, handlers),))
    server.add_registered_method_handlers(VLLM_ENGINE_SERVICE, handlers)
    return servicer
