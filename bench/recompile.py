"""Compilations per backend while the frame count changes (1..64 frames per step).

A backend whose kernel keys on the batch (frame count, ranges, batch composition) recompiles in
serving: seconds of stall per new video length. Counts: flex via dynamo's graph counter, FA4 via
its compile cache under FakeTensorMode for sm_90a (no GPU needed; needs flash-attn-4), reference
and sdpa for completeness (they compile nothing).

    python bench/recompile.py            # Gemma-like shapes, flex + reference + sdpa (+ fa4 if installed)
    python bench/recompile.py --smoke    # seconds: tiny shapes, flex/reference/sdpa, two frame counts

Prints a table and writes JSON (default bench/results/recompile.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from mmserve.attention import create_builder, create_impl
from mmserve.attention.backend import FULL, SLIDING, CommonAttentionMetadata, LayerAttentionSpec
from mmserve.attention.synthetic import Req, frames, make_batch, pool_for

log = logging.getLogger("bench.recompile")
RESULTS = Path(__file__).resolve().parent / "results" / "recompile.json"


@dataclass
class Count:
    backend: str
    layer: str
    frame_counts: list[int]
    compiles: int
    first_call_s: float
    later_calls_max_s: float


def video_step(num_frames: int, frame_tokens: int, budget: int) -> list[Req]:
    """A chunk of a video prompt (whole when it fits the budget), a decode and a short text request."""
    ranges = frames(6, num_frames, frame_tokens, 2)
    prompt = ranges[-1][1] + 6
    context = 0
    if prompt > budget - 40:
        context = next(s - 2 for s, _ in ranges if prompt - (s - 2) <= budget - 40)
    return [Req(context, prompt - context, ranges), Req(30, 1), Req(0, 30)]


def count_torch(backend: str, spec: LayerAttentionSpec, frame_counts: list[int], frame_tokens: int,
                budget: int) -> Count:
    impl, builder = create_impl(backend, spec), None
    before = counters["stats"]["unique_graphs"]
    times = []
    for n in frame_counts:
        reqs = video_step(n, frame_tokens, budget)
        # Block tables as wide as the engine's (max_model_len 8192 / 16), as in serving.
        batch = make_batch(reqs, spec, num_blocks=512, table_width=512, gen=torch.Generator().manual_seed(n))
        builder = builder or create_builder(backend, pool_for(batch, spec, max_num_tokens=budget))
        start = time.perf_counter()
        impl.forward(batch.q, batch.k, batch.v, batch.kv_cache, builder.build(batch.metadata))
        times.append(time.perf_counter() - start)
    return Count(backend, spec.layer_type, frame_counts, counters["stats"]["unique_graphs"] - before,
                 times[0], max(times[1:], default=0.0))


def count_fa4(spec: LayerAttentionSpec, frame_counts: list[int], frame_tokens: int) -> Count:
    """FA4's compile cache across frame counts, compiling for sm_90a under FakeTensorMode."""
    from flash_attn.cute.interface import _flash_attn_fwd
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mmserve.attention.fa4 import run_fa4

    before = len(_flash_attn_fwd.compile_cache.cache)
    times = []
    with FakeTensorMode():
        for n in frame_counts:
            T, R = n * (frame_tokens + 2) + 40, 3

            def e(*shape, dtype=torch.int32):
                return torch.empty(shape, dtype=dtype, device="cuda")
            md = CommonAttentionMetadata(T, R, T, T + 4096, e(R + 1), e(R), e(T, dtype=torch.int64),
                                         e(R, (T + 4096) // 16 + 1), e(T, dtype=torch.int64), 16, e(T, 2),
                                         None, None, None, None, None)
            q = torch.empty(T, spec.num_heads, spec.head_dim, dtype=torch.bfloat16, device="cuda")
            cache = torch.empty(4096, 16, spec.num_kv_heads, spec.head_dim, dtype=torch.bfloat16, device="cuda")
            start = time.perf_counter()
            run_fa4(q, cache, cache, md, spec)
            times.append(time.perf_counter() - start)
    return Count("fa4 (sm_90a, fake)", spec.layer_type, frame_counts, len(_flash_attn_fwd.compile_cache.cache) - before,
                 times[0], max(times[1:], default=0.0))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--no-fa4", action="store_true", help="skip the FA4 fake-mode compile count")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        specs = [LayerAttentionSpec(SLIDING, 2, 1, 32, window=16, bidirectional=True)]
        frame_counts, frame_tokens, budget = [1, 8], 6, 128
    else:
        specs = [LayerAttentionSpec(SLIDING, 8, 4, 256, window=1024, bidirectional=True),
                 LayerAttentionSpec(FULL, 8, 4, 512, window=None, bidirectional=False)]
        frame_counts, frame_tokens, budget = [1, 8, 16, 32, 46, 64], 70, 512
    results = []
    for spec in specs:
        for backend in ("reference", "sdpa", "flex"):
            small = [n for n in frame_counts if n <= 8] if backend == "reference" and not args.smoke else frame_counts
            results.append(count_torch(backend, spec, small, frame_tokens, budget))
            log.info("%s", results[-1])
    from mmserve.attention.fa4 import fa4_installed
    if not args.smoke and not args.no_fa4 and fa4_installed():
        os.environ.update({"FLASH_ATTENTION_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a", "FLASH_ATTENTION_NUM_SMS": "132"})
        results.append(count_fa4(specs[0], frame_counts, frame_tokens))
    print(f"{'backend':<20} {'layer':<18} {'frame counts':<24} {'compiles':>8} {'first s':>8} {'later max s':>11}")
    for r in results:
        print(f"{r.backend:<20} {r.layer:<18} {str(r.frame_counts):<24} {r.compiles:>8} {r.first_call_s:>8.2f} "
              f"{r.later_calls_max_s:>11.3f}")
    out = args.out or (Path(tempfile.gettempdir()) / "recompile_smoke.json" if args.smoke else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in results], indent=1))
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
