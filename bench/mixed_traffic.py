"""Mixed traffic for bench/serving.py: Poisson arrivals of unlike requests, the server against
transformers' static batching on a virtual clock.

Requests arrive as a Poisson process; each has 1-16 frames and asks for 4-128 tokens (ignore_eos,
so every request gets exactly what it asked for). The server gets them at their arrival times (an
open loop) and streams tokens back. Static batching takes them in arrival order in batches of N:
a batch starts when its last request has arrived and the previous batch is done, is left-padded,
and runs to its longest request's max_tokens; a request's first token comes at the batch's first
step, its last when the batch ends (generate returns the whole batch at once). Each batch's time is
measured by really running transformers' generate on it; only the queueing is virtual.

Useful tokens = what the requests asked for; wasted tokens = padded rows still decoding after their
own request was done (the batch's longest max_tokens minus each request's). Throughput = useful
tokens / (last completion - first arrival).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MixedRequest:
    index: int
    arrival_s: float
    num_frames: int
    max_tokens: int
    seed: int


@dataclass
class Timing:
    """One request's latencies, seconds from its arrival."""

    ttft_s: float
    e2e_s: float
    tokens: int

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


def workload(count: int, rate_per_s: float, seed: int, *, max_frames: int = 16, min_tokens: int = 4,
             max_tokens: int = 128) -> list[MixedRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(count):
        out.append(MixedRequest(i, t, rng.randint(1, max_frames), rng.randint(min_tokens, max_tokens), 10_000 + i))
        t += rng.expovariate(rate_per_s)
    return out


def summary(name: str, requests: list[MixedRequest], timings: list[Timing], wasted: int = 0) -> dict:
    useful = sum(r.max_tokens for r in requests)
    end = max(r.arrival_s + t.e2e_s for r, t in zip(requests, timings, strict=True))
    span = end - min(r.arrival_s for r in requests)
    tpots = [t.tpot_s for t in timings if t.tpot_s is not None]

    def pct(values, q):
        return float(np.percentile(values, q)) if values else float("nan")

    return dict(system=name, requests=len(requests), useful_tokens=useful, wasted_tokens=wasted, span_s=span,
                useful_tokens_per_s=useful / span,
                ttft_p50_s=pct([t.ttft_s for t in timings], 50), ttft_p99_s=pct([t.ttft_s for t in timings], 99),
                tpot_p50_s=pct(tpots, 50), tpot_p99_s=pct(tpots, 99),
                e2e_p50_s=pct([t.e2e_s for t in timings], 50), e2e_p99_s=pct([t.e2e_s for t in timings], 99))


# --- the server: an open loop --------------------------------------------------------------------

async def run_server(address: str, requests: list[MixedRequest], videos: dict[int, bytes], prompt: str) -> list[Timing]:
    from mmserve.clients import AsyncClient, user_message

    async with AsyncClient(address) as client:
        start = time.perf_counter()

        async def one(r: MixedRequest) -> Timing:
            await asyncio.sleep(max(0.0, start + r.arrival_s - time.perf_counter()))
            sent = time.perf_counter()
            stamps: list[float] = []
            stream = client.stream([user_message(prompt, video=videos[r.index], num_frames=r.num_frames)],
                                   max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True,
                                   request_id=f"mixed-{r.index}")
            async for delta in stream:
                if delta.token_ids:
                    stamps.extend([time.perf_counter()] * len(delta.token_ids))
            # Latency counts from the scheduled arrival, so a client that fell behind cannot hide queueing.
            arrival = start + r.arrival_s
            assert len(stamps) == r.max_tokens, (r, len(stamps))
            return Timing(stamps[0] - min(arrival, sent), stamps[-1] - min(arrival, sent), len(stamps))

        return list(await asyncio.gather(*(one(r) for r in requests)))


# --- static batching on a virtual clock ----------------------------------------------------------

def run_static(model, make_batch, requests: list[MixedRequest], batch_size: int, generate) -> tuple[list[Timing], int]:
    """`make_batch(requests) -> kwargs` (decode + preprocess + left-pad, timed as part of the batch);
    `generate(model, kwargs, max_tokens) -> (tokens, clock)` with clock.steps the per-step times."""
    clock = 0.0
    timings: list[Timing] = []
    wasted = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        start = max(clock, max(r.arrival_s for r in batch))
        longest = max(r.max_tokens for r in batch)
        t0 = time.perf_counter()
        _, steps = generate(model, make_batch(batch), longest)
        first = steps.steps[0] - t0
        duration = time.perf_counter() - t0
        clock = start + duration
        wasted += sum(longest - r.max_tokens for r in batch)
        timings += [Timing(start + first - r.arrival_s, clock - r.arrival_s, r.max_tokens) for r in batch]
    return timings, wasted
