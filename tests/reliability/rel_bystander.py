"""A hostile request beside a bystander, on a real `mmserve serve` process (rel_process.ServeProcess):
the bystander is a normal stream sent right after the hostile requests on the same channel; it must
finish with its usual tokens (the same request run alone after them). What it must not do is wait
for the hostile requests' work, and that is read as an order of events the client sees, not as a
TTFT against an idle one (on 2 shared cores a wall-clock ratio measures the machine as much as the
server): how many hostile requests had ended when the bystander's first token arrived. A request
refused from its headers ends before a bystander's prefill does; one whose decode holds a worker is
still running when a bystander beside it, on the other worker, gets its token. Memory is the serving
process's peak RSS (VmHWM, reset before the hostile requests) over its RSS before them. Shared by the
hostile-input tests of images, text and frames (test_rel_hostile_inputs.py) and of audio
(test_rel_audio_flood.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from mmserve.clients import AsyncClient, ClientError

# A bystander streams this many tokens (EOS ignored): a refusal from headers must come before its last.
# Beside two busy loops at load 7-23 (6 salts) the audio floods' refusals came 2.7-13x sooner than the
# last of 32 tokens (the closest: 302 ms against 826), the other refusals 8-105x sooner; at 64 tokens one
# pixel-budget refusal came at 249 ms against the last token's 345 ms (1.4x), so 128. The bugs these tests
# guard refused at 4.3-9.3 s, far past 128 tokens (~0.2-1.4 s).
BYSTANDER_TOKENS = 128


def rss(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak(pid: int) -> int:
    """VmHWM := VmRSS; returns that RSS."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return rss(pid, "VmRSS")


async def outcome(client: AsyncClient, messages) -> ClientError | None:
    try:
        await client.generate(messages, timeout=120, max_tokens=4, temperature=0)
    except ClientError as e:
        return e
    return None


@dataclass
class Beside:
    errors: list                    # each hostile request's outcome: its ClientError, or None where served
    growth: int                     # the server's peak RSS growth over its RSS before the hostile requests
    ended_before_first_token: int   # hostile requests that had ended when the bystander's first token came
    ended_before_last_token: int    # ... and when its last token came


async def _stream_beside(client: AsyncClient, hostile: list[asyncio.Future], ask: dict) -> tuple[int, int, tuple]:
    """Stream `ask`; returns how many of `hostile` were done when its first token and its last token
    arrived, and its token ids. Both are seen by this one event loop, so "done" and "arrived" are in
    the order the client saw them. The times printed are for reading a failure and for the margins
    the tests quote; never asserted."""
    sent, ended, ids = time.perf_counter(), [], []
    ends, arrivals = [None] * len(hostile), []
    for k, h in enumerate(hostile):
        h.add_done_callback(lambda _, k=k: ends.__setitem__(k, time.perf_counter() - sent))
    async for delta in client.stream(timeout=120, **ask):
        if delta.token_ids:
            ended.append(sum(h.done() for h in hostile))
            arrivals.append(time.perf_counter() - sent)
        ids.extend(delta.token_ids)
    assert ended, "the bystander got no token"
    await asyncio.gather(*hostile)
    print(f"from the bystander's send: its first token at {arrivals[0] * 1e3:.0f} ms, its last at "
          f"{arrivals[-1] * 1e3:.0f} ms; the hostile requests ended at {[round(t * 1e3) for t in ends]} ms")
    return ended[0], ended[-1], tuple(ids)


def run_beside(server, bystander: Callable[[], dict], hostile_messages, copies: int = 1,
               decoding_from_rss: int = 0) -> Beside:
    """`copies` hostile requests with a bystander right behind them on one channel, whose output is
    then compared with the same request run alone. `bystander()` gives a new request's arguments
    (fresh content: its first token needs a real prefill). `decoding_from_rss`: send the bystander
    only once the server's RSS grew that much (the hostile request is being decoded, as in the probe)."""
    pid = server.proc.pid

    async def attempt() -> Beside:
        async with AsyncClient(f"127.0.0.1:{server.port}", timeout=120) as client:
            before = reset_peak(pid)
            hostile = [asyncio.ensure_future(outcome(client, hostile_messages)) for _ in range(copies)]
            deadline = time.monotonic() + 30
            while decoding_from_rss and rss(pid, "VmRSS") - before < decoding_from_rss:
                assert time.monotonic() < deadline and not all(h.done() for h in hostile), "no decode seen"
                await asyncio.sleep(0.005)
            ask = bystander()
            first, last, got = await _stream_beside(client, hostile, ask)
            errors = await asyncio.gather(*hostile)
            growth = rss(pid, "VmHWM") - before
            alone = [t async for delta in client.stream(timeout=120, **ask) for t in delta.token_ids]
            assert got == tuple(alone), "the bystander's output changed beside the hostile request"
        return Beside(errors, growth, first, last)

    beside = asyncio.run(attempt())
    print(f"of {copies} hostile requests, {beside.ended_before_first_token} ended before the bystander's first "
          f"token, {beside.ended_before_last_token} before its last; RSS growth {beside.growth / 2**20:.1f} MiB")
    return beside
