"""The shared-memory ring rank 0's step messages take to its node's other ranks (executor/message_ring.py).

Readers here are threads of the test process mapping the segment by name, as a worker process
does (the spawned path runs in tests/server/test_server_tensor_parallel.py and
tests/reliability/test_rel_tensor_parallel.py): every message arrives whole and in order at every
reader, whatever its size against the slots and the ring (a message longer than the whole ring
streams through it while the readers free slots); the writer never waits while a slot is free, and
when a reader stops reading it reports the rank lost (`alive`) or gives up after its timeout as a
failed collective; once unlinked the segment has no name left, and readers read on.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading

import pytest
import torch

from mmserve.executor.message_ring import MessageRing, RingTimeout
from mmserve.model.parallel import CollectiveError

SLOT = 4096


def reading(reader, out: queue.Queue, attach: bool = True) -> threading.Thread:
    """A thread that maps `reader` (unless mapped) and puts every message it reads until None."""
    def run():
        if attach:
            reader.attach()
        try:
            while (msg := reader.read()) is not None:
                out.put(msg)
        finally:
            reader.close()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_every_reader_gets_every_message_whole_and_in_order_whatever_its_size():
    ring = MessageRing(2, multiprocessing.get_context("spawn"), slots=4, slot_bytes=SLOT)
    outs = [queue.Queue() for _ in ring.readers]
    threads = [reading(r, q) for r, q in zip(ring.readers, outs, strict=True)]
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1000, ())))
    sizes = [0, 1, SLOT - 8 - 100, SLOT, 3 * SLOT + 5, 9 * SLOT]   # within a slot, across slots, past the ring
    messages = [{"i": i, "pixels": torch.rand(n // 4, generator=gen), "ids": list(range(i))}
                for i, n in enumerate(sizes * 3)]
    for m in messages:
        ring.write(m, alive=lambda: None, timeout_s=30)
    ring.write(None, alive=lambda: None, timeout_s=30)
    for t in threads:
        t.join(30)
    for q in outs:
        got = [q.get_nowait() for _ in messages]
        assert q.empty()
        for a, b in zip(got, messages, strict=True):
            assert a["i"] == b["i"] and a["ids"] == b["ids"] and torch.equal(a["pixels"], b["pixels"])
    ring.close()


def test_a_reader_that_stops_reading_is_found_by_the_writer():
    """A reader that never reads: the writer fills the free slots without waiting, then calls
    `alive` while it waits (which names a dead rank by raising), or, if every rank lives, gives up
    after its timeout with a collective error (what a hung rank's collective gives)."""
    ring = MessageRing(1, multiprocessing.get_context("spawn"), slots=3, slot_bytes=SLOT)
    for i in range(3):   # three free slots: no wait
        ring.write(i, alive=pytest.fail, timeout_s=30)

    class Lost(BaseException):
        pass

    def lost():
        raise Lost("rank 1 died")
    with pytest.raises(Lost):
        ring.write(3, alive=lost, timeout_s=30)
    calls = []
    with pytest.raises(RingTimeout, match="read no step message for 0.1s") as info:
        ring.write(3, alive=lambda: calls.append(1), timeout_s=0.1)
    assert isinstance(info.value, CollectiveError) and calls
    ring.close()


def test_the_unlinked_segment_has_no_name_and_its_readers_read_on():
    ring = MessageRing(1, multiprocessing.get_context("spawn"), slots=2, slot_bytes=SLOT)
    path = f"/dev/shm/{ring.readers[0].name.lstrip('/')}"
    assert not os.path.isdir("/dev/shm") or os.path.exists(path)
    out = queue.Queue()
    ring.readers[0].attach()
    ring.unlink()
    assert not os.path.exists(path)
    thread = reading(ring.readers[0], out, attach=False)
    for i in range(5):
        ring.write(i, alive=lambda: None, timeout_s=30)
    ring.write(None, alive=lambda: None, timeout_s=30)
    thread.join(30)
    assert [out.get_nowait() for _ in range(5)] == list(range(5))
    ring.close()
