"""A hostile request beside a bystander, on a real `mmserve serve` process (rel_process.ServeProcess):
the bystander is a normal stream sent right after the hostile requests on the same channel; it must
finish with its usual tokens and, where the hostile request is refused, a TTFT within 2x of idle
runs alternating with it (medians). Memory is the serving process's peak RSS (VmHWM, reset before the
hostile requests) over its RSS before them. Shared by the hostile-input tests of images, text and
frames (test_rel_hostile_inputs.py) and of audio (test_rel_audio_flood.py)."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable

from mmserve.clients import AsyncClient, ClientError

ATTEMPTS = 3  # the machine is shared: a bystander run slowed by someone else's load is retried
ROUNDS = 3    # idle and beside runs per attempt, alternating: one run's TTFT under load varies ~2x


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


def cpu_ticks(pid: int) -> int:
    """The process's user + system CPU time so far, in clock ticks (/proc/PID/stat fields 14, 15)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


async def quiet(pid: int, window_s: float = 0.05, timeout_s: float = 30.0) -> None:
    """Wait until the process spends no CPU tick over a window: an idle run measured after a hostile
    round starts only once nothing of that round still runs (work left running after the refusal
    would otherwise slow the idle runs as much as the bystander, and hide)."""
    deadline = time.monotonic() + timeout_s
    ticks = cpu_ticks(pid)
    while True:
        await asyncio.sleep(window_s)
        now = cpu_ticks(pid)
        if now == ticks:
            return
        assert time.monotonic() < deadline, f"the server kept using CPU for {timeout_s:g} s after the hostile requests"
        ticks = now


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
               decoding_from_rss: int = 0, slack_s: float = 0.0,
               rounds: int = ROUNDS) -> tuple[list, int, float, float]:
    """`rounds` times: an idle bystander run, then `copies` hostile requests with another bystander
    right behind them on one channel, whose output is then compared with the same request run
    alone; one more idle run closes the attempt. Each idle run waits for a quiet server.
    `bystander()` gives a new request's arguments (fresh content: its TTFT includes a real prefill). Idle and beside runs alternate, so a change in the
    machine's load reaches both medians alike. Returns (every round's hostile outcomes, the largest
    peak RSS growth over the RSS before a round's hostile requests, the idle TTFTs' median, the
    bystander TTFTs' median); retried up to `attempts` times while that median misses 2x of idle (1
    where only memory is asserted: a rerun reuses memory the first attempt took).
    `decoding_from_rss`: start the bystander only once the server's RSS grew that much (the hostile
    request is being decoded, as in the probe). `slack_s`: added to 2x idle in the retry bound, where
    the idle TTFT is a few tens of ms and the stall the test looks for is seconds."""
    pid = server.proc.pid

    async def attempt():
        errors, growth, idle, beside = [], 0, [], []
        async with AsyncClient(f"127.0.0.1:{server.port}", timeout=120) as client:
            for _ in range(rounds):
                await quiet(pid)
                idle.append((await timed_stream(client, **bystander()))[0])
                before = reset_peak(pid)
                hostile = [asyncio.ensure_future(outcome(client, hostile_messages)) for _ in range(copies)]
                deadline = time.monotonic() + 30
                while decoding_from_rss and rss(pid, "VmRSS") - before < decoding_from_rss:
                    assert time.monotonic() < deadline and not all(h.done() for h in hostile), "no decode seen"
                    await asyncio.sleep(0.005)
                ask = bystander()
                took, got = await timed_stream(client, **ask)
                beside.append(took)
                errors += await asyncio.gather(*hostile)
                growth = max(growth, rss(pid, "VmHWM") - before)
                _, alone = await timed_stream(client, **ask)
                assert got == alone, "the bystander's output changed beside the hostile request"
            await quiet(pid)
            idle.append((await timed_stream(client, **bystander()))[0])
        return errors, growth, statistics.median(idle), statistics.median(beside)

    for _ in range(attempts):
        errors, growth, idle, beside = asyncio.run(attempt())
        print(f"idle TTFT {idle * 1e3:.0f} ms, beside {beside * 1e3:.0f} ms (medians), RSS growth {growth / 2**20:.1f} MiB")
        if beside <= 2 * idle + slack_s:
            break
    return errors, growth, idle, beside
