"""Run every benchmark, then the plots: the one command behind docs/benchmarks.md (`make bench`).

Each script prints its table and writes JSON into bench/results/; `plot.py` turns the JSON into
docs/img/*.png. With --smoke every script runs in its seconds-long mode and writes nothing under
bench/results/ (tests/bench runs this list so no script can rot).
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
# In the order docs/benchmarks.md presents them.
SCRIPTS = ("attention.py", "recompile.py", "metadata.py", "step_overhead.py", "async_overlap.py", "graph_coverage.py",
           "offline.py", "serving.py", "cpu_contention.py", "moe.py", "structured.py", "video_decode.py", "prefix_cache.py", "gateway.py",
           "kv_events.py", "tensor_parallel.py", "gpu_check.py", "speculative.py", "kv_planner.py", "fair_share.py",
           "block_size.py", "observer_cost.py", "prefill_cap.py")
PLOT = "plot.py"

logger = logging.getLogger("bench.run_all")


def run(script: str, extra: list[str]) -> float:
    """Run one script to completion (raises on failure); returns its wall time in seconds."""
    start = time.perf_counter()
    subprocess.run([sys.executable, str(BENCH_DIR / script), *extra], check=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="every script in its seconds-long mode, no plots")
    p.add_argument("--only", nargs="*", default=None, help="run just these scripts (e.g. serving.py)")
    args = p.parse_args(argv)
    scripts = [s for s in SCRIPTS if args.only is None or s in args.only]
    extra = ["--smoke"] if args.smoke else []
    timings = {}
    for script in scripts:
        if not (BENCH_DIR / script).exists():
            logger.warning("skipping %s: not written yet", script)
            continue
        logger.info("running %s %s", script, " ".join(extra))
        timings[script] = run(script, extra)
    if not args.smoke:
        timings[PLOT] = run(PLOT, [])
    for script, seconds in timings.items():
        logger.info("%-18s %7.1f s", script, seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
