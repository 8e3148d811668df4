"""Wire priority: higher runs first when the server schedules by priority (one sequence at a time)."""

from __future__ import annotations

import threading
import time

from loopback_server import LoopbackServer, RecordingObserver, engine_config

from mmserve.clients import Client
from mmserve.config import ServerConfig


def test_higher_priority_runs_first(served_model):
    # The order requests end in as the server saw it (the observer runs in the engine's step order),
    # not the order client threads wake up in: a loaded machine reorders those.
    order = RecordingObserver()
    server = LoopbackServer(engine_config(served_model, max_num_seqs=1, scheduling_policy="priority"),
                            ServerConfig(host="127.0.0.1", port=0, worker_threads=2), observer=order).start()
    try:
        def run(name: str, priority: int) -> None:
            with Client(server.address, timeout=120) as client:
                client.generate(prompt=name, max_tokens=4, temperature=0, ignore_eos=True, priority=priority,
                                request_id=name)

        with Client(server.address, timeout=120) as client:
            long_tokens = client.model_info().context_length - 32
            blocker = client.stream(prompt="block", max_tokens=long_tokens, temperature=0, ignore_eos=True,
                                    request_id="block")
            next(iter(blocker))  # the only sequence slot is taken
            threads = [threading.Thread(target=run, args=(name, prio))
                       for name, prio in (("low", -5), ("mid", 0), ("high", 7))]
            for i, t in enumerate(threads, 1):  # they queue up in this order, lowest priority first
                t.start()
                while client.server_load().waiting_requests < i:
                    time.sleep(0.01)
            blocker.cancel()  # frees the slot: the queue now runs by priority alone
            for t in threads:
                t.join(120)
        assert [rid for rid, _, _ in order.finished if rid != "block"] == ["high", "mid", "low"]
    finally:
        server.stop()
