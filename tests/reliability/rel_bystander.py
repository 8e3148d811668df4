"""A hostile request beside a bystander, on a real `mmserve serve` process (rel_process.ServeProcess):
the bystander is a normal stream sent right after the hostile requests on the same channel; it must
finish with its usual tokens and, where the hostile request is refused, a TTFT within 2x of an idle
run measured in the same test. Memory is the serving process's peak RSS (VmHWM, reset before the
hostile requests) over its RSS before them. Shared by the hostile-input tests of images, text and
frames (test_rel_hostile_inputs.py) and of audio (test_rel_audio_flood.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from mmserve.clients import AsyncClient, ClientError

ATTEMPTS = 3  # the machine is shared: a bystander run slowed by someone else's load is retried


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


async def timed_stream(client: AsyncClient, **ask) -> tuple[float, tuple[int, ...]]:
    """(TTFT in seconds, the token ids) of one stream."""
    started, first, ids = time.perf_counter(), None, []
    async for delta in client.stream(timeout=120, **ask):
        first = first or time.perf_counter()
        ids.extend(delta.token_ids)
    assert first is not None
    return first - started, tuple(ids)


async def outcome(client: AsyncClient, messages) -> ClientError | None:
    try:
        await client.generate(messages, timeout=120, max_tokens=4, temperature=0)
    except ClientError as e:
        return e
    return None


def run_beside(server, bystander: Callable[[], dict], hostile_messages, copies: int = 1, attempts: int = ATTEMPTS,
               decoding_from_rss: int = 0, slack_s: float = 0.0) -> tuple[list, int, float, float]:
    """Idle bystander runs, then `copies` hostile requests with another bystander right behind them
    on one channel, whose output is then compared with the same request run alone. `bystander()`
    gives a new request's arguments (fresh content: its TTFT includes a real prefill). Returns (hostile
    outcomes, peak RSS growth over the RSS before them, idle TTFT, bystander TTFT); retried up to
    `attempts` times while the bystander misses 2x of idle (1 where only memory is asserted: a rerun
    reuses memory the first attempt took). `decoding_from_rss`: start the bystander only once the
    server's RSS grew that much (the hostile request is being decoded, as in the probe). `slack_s`: added
    to 2x idle in the retry bound, where the idle TTFT is a few tens of ms and the stall the test looks
    for is seconds."""
    pid = server.proc.pid

    async def attempt():
        async with AsyncClient(f"127.0.0.1:{server.port}", timeout=120) as client:
            idle = sorted([(await timed_stream(client, **bystander()))[0] for _ in range(3)])[1]  # the median
            before = reset_peak(pid)
            hostile = [asyncio.ensure_future(outcome(client, hostile_messages)) for _ in range(copies)]
            deadline = time.monotonic() + 30
            while decoding_from_rss and rss(pid, "VmRSS") - before < decoding_from_rss:
                assert time.monotonic() < deadline and not all(h.done() for h in hostile), "no decode seen"
                await asyncio.sleep(0.005)
            ask = bystander()
            beside, got = await timed_stream(client, **ask)
            errors = await asyncio.gather(*hostile)
            growth = rss(pid, "VmHWM") - before
            _, alone = await timed_stream(client, **ask)
        assert got == alone, "the bystander's output changed beside the hostile request"
        return errors, growth, idle, beside

    for _ in range(attempts):
        errors, growth, idle, beside = asyncio.run(attempt())
        print(f"idle TTFT {idle * 1e3:.0f} ms, beside {beside * 1e3:.0f} ms, RSS growth {growth / 2**20:.1f} MiB")
        if beside <= 2 * idle + slack_s:
            break
    return errors, growth, idle, beside
