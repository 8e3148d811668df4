"""Scaling past one replica: two real servers on loopback, one client target naming both, and
round robin spreads the requests (what a headless Service's DNS answer gives a client in a cluster)."""

from __future__ import annotations

import grpc
import pytest
from deploy_loop import LoopThread

from mmserve.clients import Client
from mmserve.config import EngineConfig, ServerConfig
from mmserve.engine.async_engine import AsyncEngine
from mmserve.model.spec import load_spec_without_transformers
from mmserve.server.app import build_server

REQUESTS = 20


class CountGenerate(grpc.aio.ServerInterceptor):
    """Counts the Generate (`count`) and UploadMedia (`uploads`) calls a replica receives."""

    def __init__(self) -> None:
        self.count = 0
        self.uploads = 0

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.endswith("/Generate"):
            self.count += 1
        elif handler_call_details.method.endswith("/UploadMedia"):
            self.uploads += 1
        return await continuation(handler_call_details)


@pytest.fixture(scope="module")
def replicas(served_model):
    loop = LoopThread()
    engine_config = EngineConfig(model=str(served_model), device="cpu", max_num_seqs=4,
                                 kv_cache_bytes=16 * 2**20)
    counters, servers = [CountGenerate(), CountGenerate()], []

    async def start(counter: CountGenerate):
        server = build_server(AsyncEngine(engine_config),
                              ServerConfig(host="127.0.0.1", port=0, worker_threads=1), engine_config,
                              spec=load_spec_without_transformers(engine_config.model), interceptors=[counter])
        await server.start()
        return server

    try:
        for counter in counters:
            servers.append(loop.call(start(counter), timeout=300))
        yield servers, counters
    finally:
        for server in servers:
            loop.call(server.stop())
        loop.close()


def test_round_robin_spreads_requests_over_both_replicas(replicas):
    servers, counters = replicas
    target = "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
    with Client(target, timeout=60) as client:
        assert client.health("mmserve.v1.Generation") == "SERVING"
        for i in range(REQUESTS):
            result = client.generate(prompt=f"Say something {i}.", max_tokens=2, temperature=0.0)
            assert len(result.token_ids) >= 1
    counts = [c.count for c in counters]
    assert sum(counts) == REQUESTS
    assert min(counts) >= REQUESTS // 4, f"unbalanced: {counts}"


def test_each_replica_reports_its_own_load(replicas):
    servers, _ = replicas
    for server in servers:
        with Client(f"127.0.0.1:{server.port}", timeout=10) as client:
            load = client.server_load()
            assert load.max_num_seqs == 4 and not load.draining


def test_an_upload_and_the_requests_naming_it_meet_on_one_replica(replicas, video_bytes, tmp_path):
    """Media live on the replica that received them: the client keeps those calls on one replica
    while its other calls still spread."""
    servers, counters = replicas
    target = "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(video_bytes)
    before = [(c.count, c.uploads) for c in counters]
    with Client(target, timeout=60) as client:
        ref = client.upload(clip, progress=False)
        for _ in range(6):
            assert client.generate(prompt="Describe the video.", video=ref, max_tokens=2).token_ids
    calls = [(c.count - n, c.uploads - u) for c, (n, u) in zip(counters, before, strict=True)]
    assert sorted(calls) == [(0, 0), (6, 1)], f"media calls spread over replicas: {calls}"
