"""Query-range table fill (numpy, per-request clipping) against a per-request Python range scan,
and the whole metadata build's tensor allocations per step.

    python bench/metadata.py            # full grid; JSON to bench/results/metadata.json
    python bench/metadata.py --smoke    # seconds; JSON to a temp file

Each request holds F video frames of 70 soft tokens (Gemma 4's video default) between 7 text
tokens; every step schedules a 2048-token budget split over R requests, each chunk at a random
offset inside its prompt. The scan is what a per-token Python builder does: for every scheduled
token, look through its request's ranges. Both must give the same table (checked every config).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmserve.attention.backend import FULL, SLIDING, LayerAttentionSpec
from mmserve.core.kv_cache.manager import KVCacheManager
from mmserve.core.kv_cache.planner import plan_pools
from mmserve.core.sched.output import ScheduledRequest
from mmserve.request import Request
from mmserve.sampling_params import SamplingParams
from mmserve.worker.block_table import BlockTables
from mmserve.worker.step_inputs import StepInputBuilder, fill_query_ranges

logger = logging.getLogger("bench.metadata")
RESULTS = Path(__file__).resolve().parent / "results" / "metadata.json"
TOKENS_PER_FRAME, GAP, BUDGET, BLOCK = 70, 7, 2048, 16
SPECS = {SLIDING: LayerAttentionSpec(SLIDING, 8, 4, 256, window=1024, bidirectional=True),
         FULL: LayerAttentionSpec(FULL, 8, 1, 512, window=None, bidirectional=False)}


def make_request(rid: str, frames: int, rng: random.Random) -> Request:
    ranges, pos = [], 20
    for _ in range(frames):
        ranges.append((pos + GAP, pos + GAP + TOKENS_PER_FRAME - 1))
        pos += GAP + TOKENS_PER_FRAME
    n = pos + 30
    return Request(rid, [rng.randrange(100, 1000) for _ in range(n)], SamplingParams(), mm_ranges=ranges)


def python_scan(out: np.ndarray, qsl: list[int], ctx: list[int], ranges: list[list[tuple[int, int]]]) -> int:
    """The baseline: per scheduled token, scan its request's ranges."""
    any_hit = False
    for r, rg in enumerate(ranges):
        for i in range(qsl[r], qsl[r + 1]):
            q = ctx[r] + i - qsl[r]
            row = (-1, -1)
            for s, e in rg:
                if s < e and s <= q <= e:
                    row, any_hit = (s, e), True
                    break
            out[i] = row
    return qsl[-1] if any_hit else 0


class _NewStorages(TorchDispatchMode):
    """Counts op outputs whose storage is none of the builder's persistent buffers."""

    def __init__(self, owned: set[int]):
        super().__init__()
        self.owned, self.new = owned, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.owned:
                self.new += 1
        return result


def time_us(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def bench_config(frames: int, num_reqs: int, reps: int, seed: int) -> dict:
    rng = random.Random(seed)
    reqs = [make_request(f"r{i}", frames, rng) for i in range(num_reqs)]
    chunk = max(1, BUDGET // num_reqs)
    max_len = max(r.num_prompt_tokens for r in reqs)
    kv = KVCacheManager(plan_pools([SLIDING, FULL], SPECS, block_size=BLOCK, dtype_bytes=2,
                                   num_kv_blocks=num_reqs * (max_len // BLOCK + 2) + 1).pools, BLOCK,
                        max_model_len=max_len + BLOCK)
    scheduled = []
    for r in reqs:
        n = min(chunk, r.num_prompt_tokens)
        r.num_computed_tokens = rng.randrange(0, r.num_prompt_tokens - n + 1)
        kv.allocate(r, n)
        scheduled.append(ScheduledRequest(r, n, r.num_computed_tokens, True,
                                          block_updates=kv.take_block_updates(r.request_id)))
    qsl = np.concatenate([[0], np.cumsum([s.num_tokens for s in scheduled])]).astype(np.int32)
    ctx = np.array([s.num_computed_tokens for s in scheduled], dtype=np.int64)
    ranges_np = [r.mm_ranges_np for r in reqs]
    ranges_py = [list(r.mm_ranges) for r in reqs]
    T = int(qsl[-1])
    fast, slow = np.zeros((BUDGET, 2), np.int32), np.zeros((BUDGET, 2), np.int32)
    n_fast = fill_query_ranges(fast, qsl, ctx, ranges_np)
    n_slow = python_scan(slow, qsl.tolist(), ctx.tolist(), ranges_py)
    if n_fast != n_slow or (n_fast and not np.array_equal(fast[:T], slow[:T])):
        raise AssertionError(f"fill and scan disagree at frames={frames} requests={num_reqs}")
    fill_us = time_us(lambda: fill_query_ranges(fast, qsl, ctx, ranges_np), reps)
    scan_us = time_us(lambda: python_scan(slow, qsl.tolist(), ctx.tolist(), ranges_py), max(1, reps // 10))

    width = -(-(max_len + BLOCK) // BLOCK)
    builder = StepInputBuilder(SPECS, max_num_tokens=BUDGET, max_num_seqs=max(num_reqs, 1),
                               max_blocks_per_req=width, block_size=BLOCK, device="cpu")
    tables = BlockTables(SPECS, width)
    rows = tables.apply(scheduled)
    builder.build(scheduled, tables.rows, rows)   # warm-up
    counter = _NewStorages({b.dev.untyped_storage().data_ptr() for b in builder.buffers()})
    with counter:
        builder.build(scheduled, tables.rows, rows)
    build_us = time_us(lambda: builder.build(scheduled, tables.rows, rows), reps)
    return dict(frames=frames, requests=num_reqs, tokens=T, fill_us=round(fill_us, 1), scan_us=round(scan_us, 1),
                speedup=round(scan_us / fill_us, 1), build_us=round(build_us, 1), new_tensors_per_build=counter.new)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a few configs, few repetitions; JSON to a temp file")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    frames_grid = [1, 8, 64] if args.smoke else [1, 8, 16, 32, 46, 64]
    reqs_grid = [1, 16] if args.smoke else [1, 8, 32, 128, 256]
    reps = 5 if args.smoke else 50
    rows = [bench_config(f, r, reps, seed=f * 1000 + r) for f in frames_grid for r in reqs_grid]
    print(f"{'frames':>6} {'reqs':>5} {'tokens':>6} {'fill us':>9} {'scan us':>10} {'speedup':>8} "
          f"{'build us':>9} {'new tensors':>11}")
    for row in rows:
        print(f"{row['frames']:>6} {row['requests']:>5} {row['tokens']:>6} {row['fill_us']:>9.1f} "
              f"{row['scan_us']:>10.1f} {row['speedup']:>7.1f}x {row['build_us']:>9.1f} "
              f"{row['new_tensors_per_build']:>11}")
    out = args.out or (Path(tempfile.mkdtemp()) / "metadata.json" if args.smoke else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"budget_tokens": BUDGET, "tokens_per_frame": TOKENS_PER_FRAME,
                               "torch": torch.__version__, "rows": rows}, indent=2))
    logger.info("wrote %s", out)
    return 0 if all(r["new_tensors_per_build"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
