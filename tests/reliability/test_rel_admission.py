"""Admission control on a real server: beyond --max-waiting-requests a request is refused at once
with RESOURCE_EXHAUSTED and a google.rpc.RetryInfo; the admitted ones are unaffected."""

from __future__ import annotations

import asyncio
import time

import grpc
from google.rpc import error_details_pb2, status_pb2
from rel_engine import read_stream, text_request, wait_load

from mmserve.api.mmserve.v1 import generation_pb2 as pb
from mmserve.api.mmserve.v1 import generation_pb2_grpc as pb_grpc


def test_queue_full_is_resource_exhausted_with_retry_info(small_server):
    cfg = small_server.engine_config
    assert (cfg.max_num_seqs, cfg.max_waiting_requests) == (2, 3)

    async def scenario():
        async with grpc.aio.insecure_channel(small_server.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            running = [stub.Generate(text_request(f"run-{i}", 900)) for i in range(2)]
            for call in running:
                await call.read()  # admitted and decoding
            waiting = [stub.Generate(text_request(f"wait-{i}", 3)) for i in range(3)]
            await wait_load(stub, running=2, waiting=3)
            started = time.monotonic()
            refused = await read_stream(stub.Generate(text_request("one-too-many", 3)))
            refused_in = time.monotonic() - started
            assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
            assert "--max-waiting-requests" in refused.details and "retry" in refused.details
            details = dict(refused.trailers)["grpc-status-details-bin"]
            info = error_details_pb2.RetryInfo()
            assert status_pb2.Status.FromString(details).details[0].Unpack(info)
            assert info.retry_delay.ToTimedelta().total_seconds() > 0
            assert refused_in < 1.0, "a full queue must refuse at once, not after waiting"
            # Free the two slots: the waiting requests then run to completion.
            for i in range(2):
                assert (await stub.Abort(pb.AbortRequest(request_id=f"run-{i}"))).found
            for call in running:
                assert (await read_stream(call)).code == grpc.StatusCode.CANCELLED
            for call in waiting:
                result = await read_stream(call)
                assert result.code is None and result.final.usage.completion_tokens == 3
            # With room again, the same request is admitted.
            again = await read_stream(stub.Generate(text_request("one-too-many", 3)))
            assert again.code is None and len(again.token_ids) == 3

    asyncio.run(scenario())
    small_server.assert_nothing_leaked()
