"""What fair shares between clients cost the scheduler per step: the admission order of a full
waiting queue (`Scheduler._admission_order`, core/sched/fair_share.py) with 1, 8 and 64 clients.

    python bench/fair_share.py

Model-free and CPU-only: the order is computed every step that has requests waiting, before any
admission, so this is the whole of the feature's per-step cost.
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "scheduler"))
from sched_helpers import make_request, make_scheduler  # noqa: E402  (the scheduler tests' tiny KV pools)

WAITING = 256   # --max-waiting-requests' default
RUNNING = 128   # --max-num-seqs' CUDA default


def order_us(owners: int) -> float:
    sched = make_scheduler(max_num_seqs=RUNNING)
    sched.running = [make_request(f"run{i}", 8, owner=bytes([i % owners])) for i in range(RUNNING)]
    sched.waiting = [make_request(f"wait{i}", 8, owner=bytes([i % owners])) for i in range(WAITING)]
    n = 2000
    return timeit.timeit(sched._admission_order, number=n) / n * 1e6


def main() -> None:
    print(f"{'clients':>8} {'waiting':>8} {'running':>8} {'order (us/step)':>16}")
    for owners in (1, 8, 64):
        print(f"{owners:>8} {WAITING:>8} {RUNNING:>8} {order_us(owners):>16.0f}")


if __name__ == "__main__":
    main()
