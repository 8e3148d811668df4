"""FairPool: slots handed round-robin between requests over a real thread pool."""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor

from mmserve.engine.input.fair_pool import FairPool


class GrantOrder(ThreadPoolExecutor):
    """A thread pool that notes each job's name as FairPool hands it a slot (`submit`, on the event
    loop): the order the pool decides, which the order its threads then start in may not keep."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.granted: list[str] = []

    def submit(self, fn, /, *args, **kwargs):
        self.granted.append(fn.args[-1].args[0])   # FairPool's partial(_in_background, partial(job, name))
        return super().submit(fn, *args, **kwargs)


def test_a_newcomer_starts_while_one_request_has_many_jobs_queued():
    """A holds its cap (workers - 1) and has 20 more jobs waiting; B's first job starts at once,
    and once A's jobs are released the two alternate. The order is the pool's grants: three
    threads starting three jobs may run them in another order."""
    async def main():
        with GrantOrder(3) as executor:
            pool = FairPool(executor, 3)
            gate, started = threading.Event(), []

            def job(name):
                started.append(name)
                gate.wait(10)
                return name

            a = [asyncio.ensure_future(pool.run("A", functools.partial(job, f"A{k}"))) for k in range(20)]
            await asyncio.sleep(0)  # let A's jobs ask for slots first
            b = [asyncio.ensure_future(pool.run("B", functools.partial(job, f"B{k}"))) for k in range(2)]
            deadline = asyncio.get_running_loop().time() + 5
            while "B0" not in started:
                assert asyncio.get_running_loop().time() < deadline, started
                await asyncio.sleep(0.01)
            assert executor.granted == ["A0", "A1", "B0"] and sorted(started) == ["A0", "A1", "B0"]
            gate.set()
            assert await asyncio.gather(*a, *b) == [f"A{k}" for k in range(20)] + ["B0", "B1"]
            assert executor.granted.index("B1") < executor.granted.index("A5")  # not sent to the back of A's queue
            assert sorted(started) == sorted(executor.granted)
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


def test_cancelling_one_owners_waiting_jobs_together_hands_no_slot_to_a_cancelled_wait():
    """Two waiting jobs of one owner cancelled at once (a live session closing, a request with many
    images aborted) just as the first was granted a slot: handing that slot on must skip the other,
    already cancelled, turn instead of granting it (InvalidStateError, and the slot leaked)."""
    async def main():
        with ThreadPoolExecutor(2) as executor:
            pool = FairPool(executor, 2)   # one slot per owner
            gate = threading.Event()
            running = asyncio.ensure_future(pool.run("A", lambda: gate.wait(10)))
            waiting = [asyncio.ensure_future(pool.run("A", lambda: "late")) for _ in range(2)]
            await asyncio.sleep(0.05)
            gate.set()
            while len(pool._waiting.get("A", ())) == 2:   # until the first waiter is granted the freed slot
                await asyncio.sleep(0)
            for task in waiting:   # before the granted waiter has run
                task.cancel()
            await running
            results = await asyncio.gather(*waiting, return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) for r in results), results
            assert await pool.run("B", lambda: "next") == "next"
            assert pool._busy == 0 and not pool._waiting and not pool._held

    asyncio.run(main())
