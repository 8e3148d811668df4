"""Rank 0's per-step messages to the other ranks of its node, through a shared-memory ring.

`broadcast_object_list` pickles the message, copies it to the device, runs two broadcasts on the
compute stream and copies it back on every rank: 0.2-0.5 ms of collective work per step under NCCL.
Here rank 0 pickles once into a ring of slots in shared memory and each local rank copies it out
(vLLM's `MessageQueue` is the model). Unlike vLLM's, no side spins: each reader has a semaphore of
slots written and not yet read by it, and one of slots it has released, so a reader sleeps until
rank 0 writes (a futex wake-up, microseconds) and an idle server costs no CPU; the semaphore
operations are also the memory barriers that order the slot's bytes between the processes. A
message longer than a slot streams through consecutive slots as the readers free them.

The segment is unlinked once every reader has attached (`unlink`): its memory lives while mapped,
so nothing is left behind whichever process dies. Liveness: a reader that died or hangs shows in
the step's collectives (rank 0 writes without waiting while a slot is free), or, when the ring is
full, as a writer that waits past `timeout_s` or finds a rank dead (`alive` raises); a reader whose
rank 0 died is ended by its orphan watch (executor/worker_rank.py). Ranks on other nodes cannot
map it: a group over several nodes keeps the collective.
"""

from __future__ import annotations

import pickle
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

from mmserve.model.parallel import CollectiveError

SLOTS = 8
SLOT_BYTES = 2 << 20   # a decode step's message is a few KiB; a new request's pixels stream through several
HEADER = struct.Struct("<q")   # each slot: the whole message's length, then this slot's part of its pickle
POLL_S = 0.05   # how often a writer waiting for a slot checks that every reader's rank still lives


class RingTimeout(CollectiveError):
    """A reader did not free a slot within the writer's timeout (reported as a collective that failed)."""


@dataclass
class RingReader:
    """One reader's end, handed to its process at spawn (the semaphores travel only then)."""

    name: str
    slots: int
    slot_bytes: int
    filled: Any   # multiprocessing.Semaphore: slots written for this reader and not read yet
    freed: Any    # multiprocessing.Semaphore: slots this reader has released
    _shm: shared_memory.SharedMemory | None = None
    _next: int = 0

    def attach(self) -> None:
        """Map the ring (in the reader's process), before the writer unlinks it."""
        self._shm = _attach(self.name)

    def read(self) -> Any:
        """The next message (waits for it)."""
        buf, parts, total, got = self._shm.buf, [], None, 0
        while total is None or got < total:
            self.filled.acquire()
            start = self._next * self.slot_bytes
            (total,) = HEADER.unpack_from(buf, start)
            n = min(total - got, self.slot_bytes - HEADER.size)
            parts.append(bytes(buf[start + HEADER.size:start + HEADER.size + n]))
            got += n
            self._next = (self._next + 1) % self.slots
            self.freed.release()
        return pickle.loads(b"".join(parts))

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    def __getstate__(self) -> dict:   # to the reader's process: the handle, never a mapping
        return {**self.__dict__, "_shm": None, "_next": 0}


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment without registering it with the resource tracker (which spawned
    processes share with rank 0): the writer created it and removes it."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)   # Python >= 3.13
    except TypeError:
        pass
    register = resource_tracker.register   # before 3.13, attaching registers the segment as this process's
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


class MessageRing:
    """The writer's end (rank 0), created before the readers' processes are spawned; `readers[i]`
    goes to the i-th of them. `ctx`: the multiprocessing context they are spawned with."""

    def __init__(self, num_readers: int, ctx, *, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES):
        self.slots, self.slot_bytes = slots, slot_bytes
        self._shm = shared_memory.SharedMemory(create=True, size=slots * slot_bytes)
        self.readers = [RingReader(self._shm.name, slots, slot_bytes, ctx.Semaphore(0), ctx.Semaphore(slots))
                        for _ in range(num_readers)]
        self._next = 0
        self._linked = True

    def write(self, obj: Any, *, alive: Callable[[], None], timeout_s: float) -> None:
        """Send `obj` to every reader. Waits only while a slot is still unread by some reader; then
        `alive()` is called every POLL_S (it raises if a reader's rank is gone) and RingTimeout
        raised past `timeout_s`."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        buf, room, sent = self._shm.buf, self.slot_bytes - HEADER.size, 0
        while True:
            for reader in self.readers:
                self._wait_free(reader, alive, timeout_s)
            start = self._next * self.slot_bytes
            part = data[sent:sent + room]
            HEADER.pack_into(buf, start, len(data))
            buf[start + HEADER.size:start + HEADER.size + len(part)] = part
            sent += len(part)
            self._next = (self._next + 1) % self.slots
            for reader in self.readers:
                reader.filled.release()
            if sent >= len(data):
                return

    @staticmethod
    def _wait_free(reader: RingReader, alive: Callable[[], None], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not reader.freed.acquire(timeout=POLL_S):
            alive()
            if time.monotonic() > deadline:
                raise RingTimeout(f"a rank read no step message for {timeout_s:g}s")

    def unlink(self) -> None:
        """Remove the segment's name once every reader has mapped it (the memory lives on while mapped)."""
        if self._linked:
            self._linked = False
            self._shm.unlink()

    def close(self) -> None:
        self.unlink()
        self._shm.close()
