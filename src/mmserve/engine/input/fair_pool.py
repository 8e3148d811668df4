"""The input worker pool, shared fairly between requests.

A thread pool serves jobs first come, first served: a request with 300 images queues 300 decodes,
and every later request waits behind all of them. Here a job first waits for a slot, and slots go
round-robin over the requests that are waiting, one job each; no request holds more than
`workers - 1` slots, so while there are two workers a newcomer's first job starts at once.

Jobs run at a lower CPU priority (nice +WORKER_NICENESS on their thread): decoding is bulk work,
and the event loop (health, every stream) and the engine process must win the cores from it, or
one request's decode slows every other request's tokens where cores are few.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Executor
from typing import TypeVar

T = TypeVar("T")
WORKER_NICENESS = 10
_lowered = threading.local()


def _in_background(fn: Callable[[], T]) -> T:
    """Run `fn` with this worker thread's CPU priority lowered (once per thread; Linux nice is per
    thread, and raising it needs no privilege)."""
    if not getattr(_lowered, "done", False):
        _lowered.done = True
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), WORKER_NICENESS))
        except (AttributeError, OSError):  # no per-thread priorities here: run at the normal one
            pass
    return fn()


class FairPool:
    def __init__(self, executor: Executor, workers: int) -> None:
        self.executor = executor
        self.workers = max(1, workers)
        self.per_owner = max(1, self.workers - 1)
        self._busy = 0
        self._held: collections.Counter[Hashable] = collections.Counter()
        self._waiting: dict[Hashable, collections.deque[asyncio.Future]] = {}  # insertion order = turn order

    async def run(self, owner: Hashable, fn: Callable[[], T]) -> T:
        """Run `fn` on a worker once `owner` gets a slot. Cancelling stops the wait, not a started `fn`
        (jobs check their own DecodeControl); its slot is freed when `fn` returns."""
        await self._acquire(owner)
        return await asyncio.shield(self._start(owner, fn))

    def _start(self, owner: Hashable, fn: Callable[[], T]) -> asyncio.Future:
        try:
            future = asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(_in_background, fn))
        except BaseException:  # the executor is shut down: give the slot back
            self._release(owner)
            raise
        future.add_done_callback(functools.partial(self._finished, owner))
        return future

    def _finished(self, owner: Hashable, future: asyncio.Future) -> None:
        self._release(owner)
        if not future.cancelled():
            future.exception()  # read: once `run`'s caller was cancelled, shield leaves it unread (asyncio logs it)

    async def _acquire(self, owner: Hashable) -> None:
        turn = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(owner, collections.deque()).append(turn)
        self._grant()
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release(owner)  # granted just as we were cancelled: hand the slot on
            else:
                self._forget(owner, turn)
            raise

    def _free_for(self, owner: Hashable) -> bool:
        return self._busy < self.workers and self._held[owner] < self.per_owner

    def _take(self, owner: Hashable) -> None:
        self._busy += 1
        self._held[owner] += 1

    def _release(self, owner: Hashable) -> None:
        self._busy -= 1
        self._held[owner] -= 1
        if not self._held[owner]:
            del self._held[owner]
        self._grant()

    def _grant(self) -> None:
        """Hand free slots to waiting owners in turn; an owner served goes to the back of the line."""
        progressed = True
        while self._busy < self.workers and progressed:
            progressed = False
            for owner in list(self._waiting):
                if not self._free_for(owner):
                    continue
                queue = self._waiting.pop(owner)
                turn = queue.popleft()
                if queue:
                    self._waiting[owner] = queue  # back of the line
                progressed = True
                if turn.done():   # cancelled while it waited (its waiter has not run yet): skip it
                    break
                self._take(owner)
                turn.set_result(None)
                break

    def _forget(self, owner: Hashable, turn: asyncio.Future) -> None:
        queue = self._waiting.get(owner)
        if queue is None:
            return
        try:
            queue.remove(turn)
        except ValueError:
            pass
        if not queue:
            del self._waiting[owner]
