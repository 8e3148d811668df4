"""The front end's telemetry per engine step: TelemetryObserver.on_step's time at R decoding requests.

    python bench/observer_cost.py            # R = 1, 16, 64, 256; 12B dims; JSON to bench/results/
    python bench/observer_cost.py --smoke    # seconds; JSON to a temp file

Why: the observer (spans, Prometheus metrics, MFU/MBU from the perf model) runs on the front end's
asyncio loop, the one that streams every gRPC response, once per engine step. On a GPU a 12B decode
step is a few milliseconds, so its per-step cost is a share of the front end's core that grows with
the batch. Each step is a synthetic StepRecord of R decode items (random context lengths), billed
through the real perf model and Prometheus instruments (no exporter attached: the SDK's cost of
recording, not of shipping). Run it under two trees (PYTHONPATH) back to back to compare them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mmserve.ipc.records import ScheduledItem, StepRecord
from mmserve.metrics.peaks import DevicePeaks
from mmserve.metrics.perf_model import PerfModel
from mmserve.metrics.prometheus import EngineMetrics
from mmserve.metrics.telemetry import TelemetryObserver
from mmserve.model.spec import load_spec
from mmserve.request import Request
from mmserve.sampling_params import SamplingParams

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gemma4_family"
RESULTS = Path(__file__).resolve().parent / "results" / "observer_cost.json"


def measure(perf: PerfModel, num_requests: int, steps: int, rng: random.Random) -> float:
    """Median seconds of one on_step at `num_requests` decoding requests."""
    observer = TelemetryObserver(perf, DevicePeaks("bench", 989e12, 4.8e12, "bench"),
                                 metrics=EngineMetrics(prometheus=True, otlp=False))
    requests = [Request(f"r{i}", list(range(rng.randrange(100, 4000))), SamplingParams()) for i in range(num_requests)]
    for r in requests:
        observer.on_request_queued(r)
    times = []
    for step in range(steps):
        items = [ScheduledItem(r.request_id, 1, len(r.prompt_token_ids) + step + 1, False, 0, request=r) for r in requests]
        now = time.perf_counter()
        record = StepRecord(step, now, now + 0.01, 0, 10_000_000, items, num_requests, 0, 0.5)
        start = time.perf_counter()
        observer.on_step(record)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="R = 1 and 16, 20 steps")
    p.add_argument("--model", default="12b_unified", help="a config in tests/fixtures/gemma4_family")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    sizes, steps = ((1, 16), 20) if args.smoke else ((1, 16, 64, 256), args.steps)
    perf = PerfModel(load_spec(FIXTURES / f"{args.model}.json"), dtype="bfloat16")
    rng = random.Random(0)
    rows = [{"requests": r, "on_step_ms": 1e3 * measure(perf, r, steps, rng)} for r in sizes]
    print(f"{'requests':>8}  {'on_step ms':>10}  {'us / request':>12}")
    for row in rows:
        print(f"{row['requests']:8d}  {row['on_step_ms']:10.3f}  {1e3 * row['on_step_ms'] / row['requests']:12.1f}")
    path = Path(tempfile.mkstemp(suffix=".json")[1]) if args.smoke else RESULTS
    path.write_text(json.dumps({"command": "python bench/observer_cost.py" + (" --smoke" if args.smoke else ""),
                                "model": args.model, "steps": steps, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
