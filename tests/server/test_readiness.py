"""Listening before the model is loaded: alive, not ready, Generate refused with UNAVAILABLE."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from mmserve.clients import AsyncClient, ClientError
from mmserve.config import EngineConfig, ServerConfig
from mmserve.engine.async_engine import AsyncEngine
from mmserve.model.spec import load_spec_without_transformers
from mmserve.server.app import build_server
from mmserve.server.health import GENERATION_SERVICE


def test_live_before_ready(served_model):
    engine_config = EngineConfig(model=str(served_model), device="cpu", dtype="float32", max_num_seqs=4,
                                 max_num_batched_tokens=256, kv_cache_bytes=8 * 2**20)
    server_config = ServerConfig(host="127.0.0.1", port=0, worker_threads=1)

    async def run():
        server = build_server(AsyncEngine(engine_config), server_config, engine_config,
                              spec=load_spec_without_transformers(engine_config.model))
        port = await server.listen()
        try:
            async with AsyncClient(f"127.0.0.1:{port}", timeout=30) as client:
                assert await client.health() == "SERVING"
                assert await client.health(GENERATION_SERVICE) == "NOT_SERVING"
                load = await client.server_load()
                assert (load.running_requests, load.draining) == (0, False)
                for call in (client.generate(prompt="hi", max_tokens=1), client.model_info()):
                    with pytest.raises(ClientError) as info:
                        await call
                    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "loading" in info.value.message
                await server.load()
                assert await client.health(GENERATION_SERVICE) == "SERVING"
                result = await client.generate(prompt="hi", max_tokens=2, temperature=0, ignore_eos=True)
                assert len(result.token_ids) == 2
        finally:
            await server.stop()
        async with AsyncClient(f"127.0.0.1:{port}", timeout=5) as client:
            with pytest.raises(ClientError) as gone:
                await client.health()
            assert gone.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(run())
