"""Wire priority: higher runs first when the server schedules by priority (one sequence at a time)."""

from __future__ import annotations

import threading
import time

from mmserve.clients import Client


def test_higher_priority_runs_first(start_server, served_model):
    server = start_server(served_model, max_num_seqs=1, scheduling_policy="priority")
    order: list[str] = []
    lock = threading.Lock()

    def run(name: str, priority: int, max_tokens: int) -> None:
        with Client(server.address, timeout=120) as client:
            client.generate(prompt=name, max_tokens=max_tokens, temperature=0, ignore_eos=True, priority=priority,
                            request_id=name)
        with lock:
            order.append(name)

    with Client(server.address, timeout=120) as client:
        long_tokens = client.model_info().context_length - 32
        blocker = client.stream(prompt="block", max_tokens=long_tokens, temperature=0, ignore_eos=True)
        next(iter(blocker))  # the only sequence slot is taken
        # Each runs long enough (24 tokens) that its client thread records the end before the next
        # one's ends: 2 tokens let a loaded machine's thread wake-up reorder them (CI under -n 2).
        threads = [threading.Thread(target=run, args=(name, prio, 24))
                   for name, prio in (("low", -5), ("mid", 0), ("high", 7))]
        for i, t in enumerate(threads, 1):  # they queue up in this order, lowest priority first
            t.start()
            while client.server_load().waiting_requests < i:
                time.sleep(0.01)
        blocker.cancel()  # frees the slot: the queue now runs by priority alone
        for t in threads:
            t.join(120)
    assert order == ["high", "mid", "low"]
