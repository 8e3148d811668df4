"""Admission control on a real server: beyond --max-waiting-requests a request is refused at once
with RESOURCE_EXHAUSTED and a google.rpc.RetryInfo; the admitted ones are unaffected."""

from __future__ import annotations

import asyncio
import time

import grpc
from google.rpc import error_details_pb2, status_pb2
from rel_engine import read_stream, steps_with, text_request, wait_load

from mmserve.api.mmserve.v1 import generation_pb2 as pb
from mmserve.api.mmserve.v1 import generation_pb2_grpc as pb_grpc

LONG_RUN = 900   # decode steps each of the two running requests takes (EOS ignored)


def test_queue_full_is_resource_exhausted_with_retry_info(small_server):
    """At once, not after waiting: when the refusal arrives, the batch is still the two long runs
    (neither has ended: LONG_RUN decode steps each) and the queue still the three waiting. A seat
    frees only when a run ends, so a refusal that waited for one cannot see that, at any load; a
    wall-clock bound on the refusal (1 s) could fail on a busy machine. The steps run-0 ran while the
    refusal was on its way are printed: the margin, against LONG_RUN."""
    cfg = small_server.engine_config
    assert (cfg.max_num_seqs, cfg.max_waiting_requests) == (2, 3)

    async def scenario():
        async with grpc.aio.insecure_channel(small_server.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            running = [stub.Generate(text_request(f"run-{i}", LONG_RUN)) for i in range(2)]
            for call in running:
                await call.read()  # admitted and decoding
            waiting = [stub.Generate(text_request(f"wait-{i}", 3)) for i in range(3)]
            await wait_load(stub, running=2, waiting=3)
            sent = time.perf_counter()
            refused = await read_stream(stub.Generate(text_request("one-too-many", 3)))
            answered = time.perf_counter()
            load = await stub.GetServerLoad(pb.GetServerLoadRequest())
            assert (load.running_requests, load.waiting_requests) == (2, 3), load
            assert not any(call.done() for call in running), "a long run ended before the refusal came"
            steps = steps_with(small_server.observer, "run-0", sent) - steps_with(small_server.observer, "run-0", answered)
            print(f"refused in {(answered - sent) * 1e3:.0f} ms, {steps} steps of run-0 (of its {LONG_RUN})")
            assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
            assert "--max-waiting-requests" in refused.details and "retry" in refused.details
            details = dict(refused.trailers)["grpc-status-details-bin"]
            info = error_details_pb2.RetryInfo()
            assert status_pb2.Status.FromString(details).details[0].Unpack(info)
            assert info.retry_delay.ToTimedelta().total_seconds() > 0
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
