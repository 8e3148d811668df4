"""MMServer.drain(): readiness drops, new Generate calls get UNAVAILABLE, the in-flight stream finishes."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from mmserve.clients import Client, ClientError
from mmserve.server.health import GENERATION_SERVICE


def test_drain_lets_in_flight_streams_finish(start_server, served_model):
    server = start_server(served_model)
    client = Client(server.address, timeout=60)
    stream = client.stream(prompt="count", max_tokens=80, temperature=0, ignore_eos=True)
    deltas = iter(stream)
    next(deltas)
    drained = asyncio.run_coroutine_threadsafe(server.app.drain(grace_s=60), server._loop)
    with Client(server.address, timeout=10) as other:
        for _ in range(200):  # readiness flips first thing in drain()
            if other.health(GENERATION_SERVICE) == "NOT_SERVING":
                break
        assert other.health(GENERATION_SERVICE) == "NOT_SERVING"
        assert other.health() == "SERVING"  # still alive: in-flight work continues
        with pytest.raises(ClientError) as refused:
            other.generate(prompt="new work", max_tokens=2)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    list(deltas)
    assert stream.result.finish_reason == "length"
    assert stream.result.usage.completion_tokens == 80 == len(stream.result.token_ids)
    assert drained.result(60) is True
    client.close()
