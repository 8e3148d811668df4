"""The VllmEngine door's place in the server, with no model loaded (cheap): registered by default
and gone with --no-enable-vllm-engine-api, behind the same API keys, unhealthy and UNAVAILABLE
while loading, and gated by drain like mmserve.v1's Generate."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from mmserve.config import DEMO_MODEL_DIR, EngineConfig, ServerConfig
from mmserve.engine.async_engine import AsyncEngine
from mmserve.model.spec import load_spec_without_transformers
from mmserve.server.app import build_server


def _listening(server_config: ServerConfig, check) -> None:
    engine_config = EngineConfig(model=str(DEMO_MODEL_DIR), device="cpu", dtype="float32")

    async def run():
        server = build_server(AsyncEngine(engine_config), server_config, engine_config,
                              spec=load_spec_without_transformers(engine_config.model))
        port = await server.listen()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await check(server, vpb_grpc.VllmEngineStub(channel))
        finally:
            await server.stop()

    asyncio.run(run())


async def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        response = call()
        if hasattr(response, "__aiter__"):
            async for _ in response:
                pass
        else:
            await response
    return e.value.code(), e.value.details()


GENERATE = vpb.GenerateRequest(request_id="r", tokenized=vpb.TokenizedInput(input_ids=[2, 4]))


def test_on_by_default_unhealthy_and_unavailable_while_loading_then_drain_gated():
    async def check(server, stub):
        health = await stub.HealthCheck(vpb.HealthCheckRequest())
        assert not health.healthy and "loading" in health.message
        code, message = await _code(lambda: stub.Generate(GENERATE))
        assert code == grpc.StatusCode.UNAVAILABLE and "loading" in message
        code, _ = await _code(lambda: stub.GetModelInfo(vpb.GetModelInfoRequest()))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert (await stub.GetLoads(vpb.GetLoadsRequest())).loads[0].max_running_requests == 64
        code, message = await _code(lambda: stub.Embed(vpb.EmbedRequest()))
        assert code == grpc.StatusCode.UNIMPLEMENTED and "embeddings" in message
        server.gate.start_draining()
        code, message = await _code(lambda: stub.Generate(GENERATE))
        assert code == grpc.StatusCode.UNAVAILABLE and "draining" in message
    _listening(ServerConfig(host="127.0.0.1", port=0, worker_threads=1), check)


def test_off_with_the_flag():
    async def check(server, stub):
        code, _ = await _code(lambda: stub.HealthCheck(vpb.HealthCheckRequest()))
        assert code == grpc.StatusCode.UNIMPLEMENTED
    _listening(ServerConfig(host="127.0.0.1", port=0, worker_threads=1, enable_vllm_engine_api=False), check)


def test_behind_the_same_api_keys(monkeypatch):
    monkeypatch.setenv("MMSERVE_API_KEYS", "secret-key")

    async def check(server, stub):
        code, _ = await _code(lambda: stub.HealthCheck(vpb.HealthCheckRequest()))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        health = await stub.HealthCheck(vpb.HealthCheckRequest(), metadata=(("authorization", "Bearer secret-key"),))
        assert not health.healthy   # authenticated; still loading
    _listening(ServerConfig(host="127.0.0.1", port=0, worker_threads=1), check)


def test_listed_by_reflection():
    """grpcurl can describe the gateway door without the .proto."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def check(server, stub):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            listing = reflection_pb2.ServerReflectionRequest(list_services="")
            describe = reflection_pb2.ServerReflectionRequest(file_containing_symbol="vllm.grpc.engine.VllmEngine")
            responses = [r async for r in reflect.ServerReflectionInfo(iter([listing, describe]))]
            assert "vllm.grpc.engine.VllmEngine" in {s.name for s in responses[0].list_services_response.service}
            assert responses[1].file_descriptor_response.file_descriptor_proto
    _listening(ServerConfig(host="127.0.0.1", port=0, worker_threads=1), check)


def test_an_abort_is_bounded_like_mmserve_v1s():
    """The probe sent an 8 MiB Abort of 100k ids: refused unread (INVALID_ARGUMENT naming the method's
    16 KiB limit, as mmserve.v1's Abort); one gateway-sized id still goes through."""
    async def check(server, stub):
        ids = [f"chatcmpl-{i:06d}-{'x' * 64}" for i in range(100_000)]
        code, message = await _code(lambda: stub.Abort(vpb.AbortRequest(request_ids=ids)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "Abort message" in message and str(16 * 2**10) in message
        assert len(message) < 400
        await stub.Abort(vpb.AbortRequest(request_ids=[ids[0]]))
    _listening(ServerConfig(host="127.0.0.1", port=0, worker_threads=1), check)
