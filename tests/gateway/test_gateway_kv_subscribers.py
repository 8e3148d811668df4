"""SubscribeKvEvents under clients that loop subscribe/cancel against a large cache (a real `mmserve
serve`, demo model, blocks of one token so a few prompts cache thousands of blocks): a bystander's
request keeps its idle latency (within 2x), and subscriptions past the per-client bound are
refused with RESOURCE_EXHAUSTED naming the flag, while the others stream on.

The loops run in a process of their own (as separate clients would), reading each snapshot as raw
bytes and cancelling: what the server spends per subscription is what they measure."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc
from smg_harness import Replica

PER_CLIENT = 4
PROMPTS = 7          # distinct prompts of PROMPT_TOKENS tokens: about PROMPTS * PROMPT_TOKENS cached blocks
PROMPT_TOKENS = 1000

SUBSCRIBE_LOOPS = r"""
import asyncio, sys, grpc
address, loops = sys.argv[1], int(sys.argv[2])
REQUEST = bytes([0x10, 1])   # SubscribeKvEventsRequest(load_records_before_first_batch=True)

async def loop(channel, counts, i):
    subscribe = channel.unary_stream("/vllm.grpc.engine.VllmEngine/SubscribeKvEvents")   # raw bytes both ways
    while True:
        call = subscribe(REQUEST)
        counts[i] += len(await call.read())
        call.cancel()

async def main():
    counts = [0] * loops
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)]) as channel:
        tasks = [asyncio.ensure_future(loop(channel, counts, i)) for i in range(loops)]
        while True:
            await asyncio.sleep(0.5)
            print(sum(counts), flush=True)
            for t in tasks:
                if t.done():
                    t.result()

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def replica():
    server = Replica("--block-size", "1", "--num-kv-blocks", str(PROMPTS * PROMPT_TOKENS + 2048),
                     "--kv-events-max-subscribers-per-client", str(PER_CLIENT))
    try:
        server.wait_ready(time.monotonic() + 180)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stub(replica):
    with grpc.insecure_channel(replica.address, options=[("grpc.max_receive_message_length", -1)]) as channel:
        yield vpb_grpc.VllmEngineStub(channel)


def generate(stub, rid: str, ids: list[int], max_tokens: int) -> None:
    req = vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids), stream=False,
                              sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens, top_p=1.0))
    list(stub.Generate(req, timeout=120))


@pytest.fixture(scope="module")
def large_cache(stub) -> int:
    """Fill the cache with PROMPTS distinct prompts; returns the blocks a snapshot then holds."""
    for p in range(PROMPTS):
        generate(stub, f"fill-{p}", [2, *((p * 7 + i) % 300 + 20 for i in range(PROMPT_TOKENS - 1))], 1)
    stream = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)
    blocks = sum(len(e.stored.blocks) for e in next(stream).events)
    stream.cancel()
    return blocks


def bystander_latency(stub, tag: str, for_s: float) -> float:
    """Median seconds of a short request (a text prompt, 8 greedy tokens) that shares nothing cached,
    sent one after another for `for_s` seconds (at least 5 of them)."""
    times: list[float] = []
    until = time.perf_counter() + for_s
    while len(times) < 5 or time.perf_counter() < until:
        started = time.perf_counter()
        generate(stub, f"{tag}-{len(times)}", [2, *((len(times) * 13 + k) % 50 + 300 for k in range(24))], 8)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def test_a_bystander_keeps_its_latency_while_clients_loop_subscribe_and_cancel(replica, stub, large_cache):
    assert large_cache > 0.9 * PROMPTS * PROMPT_TOKENS, "the snapshot should be large"
    idle = bystander_latency(stub, "idle", 1.0)
    loops = subprocess.Popen([sys.executable, "-c", SUBSCRIBE_LOOPS, replica.address, str(PER_CLIENT)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = int(loops.stdout.readline())   # the loops run
        loaded = bystander_latency(stub, "loaded", 3.0)
    finally:
        loops.kill()
        received = max([first, *map(int, loops.communicate()[0].split())]) - first
    snapshots = received / (large_cache * 40)   # a block's event is at least ~40 bytes on the wire
    assert snapshots >= 8, f"the loops should have gone on reading snapshots, got {received} bytes"
    print(f"bystander: {idle:.3f} s idle, {loaded:.3f} s loaded; {snapshots:.0f} snapshots at most")
    assert loaded < 2 * idle, f"bystander median {loaded:.3f} s with the subscribe loops, {idle:.3f} s idle"


def test_subscriptions_past_the_per_client_bound_are_refused_and_the_others_stream_on(stub, large_cache):
    streams = [stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60) for _ in range(PER_CLIENT)]
    for s in streams:   # each opened and got its snapshot
        assert next(s).events[0].WhichOneof("data") == "cleared"
    extra = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)
    with pytest.raises(grpc.RpcError) as err:
        next(extra)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--kv-events-max-subscribers-per-client" in err.value.details()
    generate(stub, "after-refusal", [2, 20, 21, 22, 23, 24], 2)   # the open ones still get the cache's changes
    for s in streams:
        assert any(e.WhichOneof("data") == "stored" for e in next(s).events)
        s.cancel()
    again = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)   # room once they left
    deadline = time.monotonic() + 10
    while True:
        try:
            assert next(again).events[0].WhichOneof("data") == "cleared"
            break
        except grpc.RpcError as e:   # the cancelled streams' handlers may take a moment to end
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            again = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)
    again.cancel()
