"""What fair shares between clients cost the scheduler per step: the admission order of a full
waiting queue (`Scheduler._admission_order`, core/sched/fair_share.py) with 1, 8 and 64 clients.

    python bench/fair_share.py           # bench/results/fair_share.json
    python bench/fair_share.py --smoke   # a few calls per row; JSON to a temp file

Model-free and CPU-only: the order is computed every step that has requests waiting, before any
admission, so this is the whole of the feature's per-step cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "scheduler"))
from sched_helpers import make_request, make_scheduler  # noqa: E402  (the scheduler tests' tiny KV pools)

RESULTS = Path(__file__).resolve().parent / "results" / "fair_share.json"
WAITING = 256   # --max-waiting-requests' default
RUNNING = 128   # --max-num-seqs' CUDA default
CLIENTS = (1, 8, 64)


def order_us(owners: int, calls: int) -> float:
    sched = make_scheduler(max_num_seqs=RUNNING)
    sched.running = [make_request(f"run{i}", 8, owner=bytes([i % owners])) for i in range(RUNNING)]
    sched.waiting = [make_request(f"wait{i}", 8, owner=bytes([i % owners])) for i in range(WAITING)]
    return timeit.timeit(sched._admission_order, number=calls) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="20 calls per row instead of 2000; JSON to a temp file")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    calls = 20 if args.smoke else 2000
    rows = []
    print(f"{'clients':>8} {'waiting':>8} {'running':>8} {'order (us/step)':>16}")
    for owners in CLIENTS:
        rows.append({"clients": owners, "waiting": WAITING, "running": RUNNING, "order_us": order_us(owners, calls)})
        print(f"{owners:>8} {WAITING:>8} {RUNNING:>8} {rows[-1]['order_us']:>16.0f}")
    out = args.out or (Path(tempfile.mkdtemp()) / "fair_share.json" if args.smoke else RESULTS)
    out.write_text(json.dumps({"calls_per_row": calls, "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
