"""One tenant must not hurt another (issue 27, findings 6-9), on one real `mmserve serve` process
with API keys, a small message limit and a small media spool: Abort reaches only the caller's own
requests, undecodable or oversize messages are refused cheaply before auth lets them cost anything,
and declared upload sizes take no spool space before their bytes arrive."""

from __future__ import annotations

import asyncio
import secrets

import grpc
import pytest
from rel_engine import read_stream, text_request
from rel_process import ServeProcess

from mmserve.api.mmserve.v1 import generation_pb2 as pb
from mmserve.api.mmserve.v1 import generation_pb2_grpc as pb_grpc

KEYS = [secrets.token_urlsafe(16), secrets.token_urlsafe(16)]
MAX_MESSAGE = 4 * 2**20


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("\n".join(KEYS) + "\n")
    proc = ServeProcess("--port", "0", "--device", "cpu", "--worker-threads", "1", "--max-num-seqs", "8",
                        "--api-keys-file", str(keys), "--max-message-bytes", str(MAX_MESSAGE),
                        "--media-dir-max-bytes", str(8 * 2**20), "--max-upload-bytes", str(4 * 2**20))
    try:
        proc.wait_port(120)

        async def ready():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{proc.port}") as ch:
                await proc.wait_serving(ch)

        asyncio.run(ready())
        yield proc
    finally:
        proc.stop()


def run(server: ServeProcess, scenario):
    async def main():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            return await scenario(pb_grpc.GenerationStub(ch))
    return asyncio.run(main())


def test_abort_reaches_only_the_callers_own_request_by_its_exact_id(server):
    victim_key, other_key = KEYS

    async def scenario(stub):
        victim = stub.Generate(text_request("victim", 120), metadata=bearer(victim_key))
        assert (await victim.read()).delta.token_ids
        for rid in ("victim", "vict", "victim#1"):
            assert not (await stub.Abort(pb.AbortRequest(request_id=rid), metadata=bearer(other_key))).found
        rest = await read_stream(victim)
        assert rest.code is None and rest.final.usage.completion_tokens == 120, rest

        mine = stub.Generate(text_request("mine", 400), metadata=bearer(victim_key))
        assert (await mine.read()).delta.token_ids
        assert (await stub.Abort(pb.AbortRequest(request_id="mine"), metadata=bearer(victim_key))).found
        assert (await read_stream(mine)).code == grpc.StatusCode.CANCELLED

    run(server, scenario)


def test_client_ids_cannot_collide_with_parallel_samples(server):
    """A client id "x#1" used to take sample 1 of another client's n=2 request "x" and fail it."""
    owner_key, other_key = KEYS

    async def scenario(stub):
        request = text_request("x", 40)
        request.sampling.n = 2
        owner = stub.Generate(request, metadata=bearer(owner_key))
        assert (await owner.read()).delta.token_ids
        squatter = await read_stream(stub.Generate(text_request("x#1", 4), metadata=bearer(other_key)))
        assert squatter.code == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in squatter.details, squatter
        assert "'#'" in squatter.details
        rest = await read_stream(owner)
        assert rest.code is None, rest
        assert [s.completion_tokens for s in rest.final.samples] == [40, 40]
        assert not (await stub.Abort(pb.AbortRequest(request_id="x"), metadata=bearer(other_key))).found

    run(server, scenario)
