"""FairPool: slots handed round-robin between requests over a real thread pool."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from mmserve.engine.input.fair_pool import FairPool


def test_a_newcomer_starts_while_one_request_has_many_jobs_queued():
    """A holds its cap (workers - 1) and has 20 more jobs waiting; B's first job starts at once,
    and once A's jobs are released the two alternate."""
    async def main():
        with ThreadPoolExecutor(3) as executor:
            pool = FairPool(executor, 3)
            gate, started = threading.Event(), []

            def job(name):
                started.append(name)
                gate.wait(10)
                return name

            a = [asyncio.ensure_future(pool.run("A", lambda k=k: job(f"A{k}"))) for k in range(20)]
            await asyncio.sleep(0)  # let A's jobs ask for slots first
            b = [asyncio.ensure_future(pool.run("B", lambda k=k: job(f"B{k}"))) for k in range(2)]
            deadline = asyncio.get_running_loop().time() + 5
            while "B0" not in started:
                assert asyncio.get_running_loop().time() < deadline, started
                await asyncio.sleep(0.01)
            assert started[:2] == ["A0", "A1"] and started[2] == "B0" and len(started) == 3
            gate.set()
            assert await asyncio.gather(*a, *b) == [f"A{k}" for k in range(20)] + ["B0", "B1"]
            assert started.index("B1") < started.index("A5")  # B was not sent to the back of A's queue
            assert pool._busy == 0 and not pool._waiting and not pool._held

    asyncio.run(main())


def test_a_cancelled_wait_gives_its_turn_away():
    async def main():
        with ThreadPoolExecutor(1) as executor:
            pool = FairPool(executor, 1)
            gate = threading.Event()
            first = asyncio.ensure_future(pool.run("A", lambda: gate.wait(10)))
            waiting = asyncio.ensure_future(pool.run("B", lambda: "B"))
            await asyncio.sleep(0)  # both now hold or wait for the one slot
            assert pool._waiting.get("B")
            waiting.cancel()
            later = asyncio.ensure_future(pool.run("C", lambda: "C"))
            gate.set()
            assert await first is True and await later == "C"
            assert waiting.cancelled() and pool._busy == 0 and not pool._waiting

    asyncio.run(main())
