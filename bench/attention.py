"""Attention backends on CPU: chunked video prefill (1..64 frames) and decode, sliding and full layers.

For each step it times reference, sdpa and compiled flex, plus flex on the same step without
frame ranges (plain causal/sliding: the floor the frames are measured against), checks every
backend against the reference, and counts work: the exact kept (q, k) pairs against the pairs
flex's block mask visits (and the share of its blocks that are full, i.e. mask-free), an ideal
128x128 tile list, and FA4 with a mask_mod on the windowed pieces fa4.py gives it (every tile of each
piece, SM100's 128-key tiles: bench/tile_analysis.py `fa4_visited_pairs`).

A second table ("batching") times sdpa's two plans on multi-request steps: one padded call per
group of requests ("batched") against one call per request ("loop"), and what the auto plan
picks, for the demo, the serving benchmark's 55M model and Gemma 4 head shapes.

    python bench/attention.py            # full run (a few minutes on 2 cores)
    python bench/attention.py --smoke    # seconds: tiny shapes; JSON to a temp file

Prints a table and writes JSON (default bench/results/attention.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tile_analysis import fa4_visited_pairs, kept_pairs, varlen_tiles

from mmserve.attention import create_builder, create_impl
from mmserve.attention.backend import FULL, SLIDING, LayerAttentionSpec
from mmserve.attention.fa4 import piece_len
from mmserve.attention.synthetic import Batch, Req, frames, make_batch, pool_for

log = logging.getLogger("bench.attention")
RESULTS = Path(__file__).resolve().parent / "results" / "attention.json"
BACKENDS = ("reference", "sdpa", "flex")


@dataclass
class Shape:
    sliding: LayerAttentionSpec
    full: LayerAttentionSpec | None
    frame_tokens: int       # soft tokens per frame
    frame_gap: int          # timestamp/boi/eoi text between frames
    budget: int             # max_num_batched_tokens: the chunk size
    frame_counts: list[int]
    decode_reqs: int
    repeats: int


FULL_SHAPE = Shape(
    sliding=LayerAttentionSpec(SLIDING, 8, 4, 256, window=1024, bidirectional=True),
    full=LayerAttentionSpec(FULL, 8, 4, 512, window=None, bidirectional=False),
    frame_tokens=70, frame_gap=8, budget=512, frame_counts=[1, 8, 16, 32, 64], decode_reqs=8, repeats=5)
# One layer type and one frame count: a single flex compile keeps it to seconds.
SMOKE_SHAPE = Shape(
    sliding=LayerAttentionSpec(SLIDING, 2, 1, 32, window=24, bidirectional=True),
    full=None,
    frame_tokens=10, frame_gap=2, budget=64, frame_counts=[4], decode_reqs=4, repeats=1)


@dataclass
class Row:
    layer: str
    scenario: str
    frames: int
    tokens: int
    context: int
    ms: dict[str, float]
    max_rel_err: dict[str, float]
    flex_vs_causal: float | None
    exact_pairs: int
    work_ratio: dict[str, float]
    first_call_s: dict[str, float]   # includes flex's compile on the first step of a layer type


def video_chunk(shape: Shape, num_frames: int) -> list[Req]:
    """The last chunk (<= budget tokens, ending between frames) of a video prompt with `num_frames` frames."""
    ranges = frames(20, num_frames, shape.frame_tokens, shape.frame_gap)
    prompt = ranges[-1][1] + 1 + 12
    starts = [s - shape.frame_gap for s, _ in ranges if prompt - (s - shape.frame_gap) <= shape.budget]
    context = min(starts) if starts and prompt > shape.budget else 0
    return [Req(context, prompt - context, ranges)]


def decode_step(shape: Shape, num_frames: int, gen: torch.Generator) -> list[Req]:
    per_frame = shape.frame_tokens + shape.frame_gap
    lens = torch.randint(20 + per_frame, 20 + per_frame * max(num_frames, 2), (shape.decode_reqs,), generator=gen)
    return [Req(int(n), 1) for n in lens]


def timed(fn, repeats: int) -> float:
    """Best wall time in ms after one warm-up call (which absorbs compilation).

    The minimum, not the median: on a shared CPU other processes only ever add time.
    """
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples)


def measure(batch: Batch, spec: LayerAttentionSpec, shape: Shape) -> tuple[dict, dict, dict, object]:
    """Each backend's ms per layer call; its metadata builder runs once per step, outside the timing."""
    outs, ms, first_s, metadata = {}, {}, {}, {}
    for name in BACKENDS:
        impl = create_impl(name, spec)
        metadata[name] = create_builder(name, pool_for(batch, spec, max_num_tokens=shape.budget)).build(batch.metadata)

        # Rewriting this step's K/V at the same slots is idempotent, so every call shares one cache.
        def call(impl=impl, md=metadata[name]):
            return impl.forward(batch.q, batch.k, batch.v, batch.kv_cache, md)
        start = time.perf_counter()
        outs[name] = call()  # the warm-up: flex compiles here on its first step
        first_s[name] = time.perf_counter() - start
        ms[name] = timed(call, 1 if name == "reference" else shape.repeats)
    ref = outs["reference"].float()
    errs = {n: float((o.float() - ref).abs().max() / ref.abs().max()) for n, o in outs.items() if n != "reference"}
    return ms, errs, first_s, metadata["flex"]


def work(batch: Batch, spec: LayerAttentionSpec, flex_md) -> tuple[int, dict[str, float]]:
    md = batch.metadata
    exact = kept_pairs(md, spec)
    block_mask = flex_md.block_mask
    q_block, kv_block = block_mask.BLOCK_SIZE
    listed = int(block_mask.kv_num_blocks.sum()) + int(block_mask.full_kv_num_blocks.sum())
    flex_pairs = listed * q_block * kv_block
    full_share = int(block_mask.full_kv_num_blocks.sum()) / max(listed, 1)
    ideal = varlen_tiles(md, spec, 128, 128).visited_pairs()
    with_frames = md.query_ranges is not None and spec.bidirectional   # else FA4's builtin causal/sliding tiles
    fa4 = fa4_visited_pairs(md, spec, piece_len(spec), 128) if with_frames else ideal
    return exact, {"flex_blocks": flex_pairs / exact, "flex_full_block_share": full_share,
                   "tiles_128": ideal / exact, "fa4_pieces": fa4 / exact}


def run(shape: Shape, dtype: torch.dtype) -> list[Row]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for spec in (s for s in (shape.sliding, shape.full) if s is not None):
        for n in shape.frame_counts:
            steps = (("prefill", video_chunk(shape, n)), ("decode", decode_step(shape, n, gen)))
            # One cache size for both steps: flex compiles per key length, so its decode step
            # reuses the prefill's graph (one compile per frame count, not two).
            num_blocks = max(sum(-(-r.seq_len // 16) for r in reqs) for _, reqs in steps) + 8
            for scenario, reqs in steps:
                batch = make_batch(reqs, spec, dtype=dtype, num_blocks=num_blocks, gen=gen, free_outside_window=True)
                ms, errs, first_s, flex_md = measure(batch, spec, shape)
                exact, ratios = work(batch, spec, flex_md)
                causal_ms = None
                if batch.metadata.query_ranges is not None and spec.bidirectional:
                    plain = replace(batch.metadata, query_ranges=None, query_ranges_cpu=None)
                    flex = create_impl("flex", spec)
                    plain_md = create_builder("flex", pool_for(batch, spec, max_num_tokens=shape.budget)).build(plain)
                    def causal_call(b=batch, f=flex, md=plain_md):
                        return f.forward(b.q, b.k, b.v, b.kv_cache, md)
                    causal_call()
                    causal_ms = timed(causal_call, shape.repeats)
                    ms["flex_causal"] = causal_ms
                md = batch.metadata
                rows.append(Row(spec.layer_type, scenario, n, md.num_actual_tokens, md.max_seq_len, ms, errs,
                                ms["flex"] / causal_ms if causal_ms else None, exact, ratios, first_s))
                log.info("%s %s %d frames: %s", spec.layer_type, scenario, n, {k: round(v, 2) for k, v in ms.items()})
    return rows


# --- sdpa: one padded call per group against one call per request ------------------------------

BATCH_SPECS = {   # (sliding, full) per model shape; windows as in the checkpoints
    "demo": (LayerAttentionSpec(SLIDING, 4, 2, 16, window=24, bidirectional=True),
             LayerAttentionSpec(FULL, 4, 2, 16, window=None, bidirectional=False)),
    "large": (LayerAttentionSpec(SLIDING, 8, 4, 96, window=24, bidirectional=True),
              LayerAttentionSpec(FULL, 8, 2, 192, window=None, bidirectional=False)),
    "gemma4": (FULL_SHAPE.sliding, FULL_SHAPE.full),
}


def batch_steps(gen: torch.Generator, smoke: bool) -> dict[str, list[Req]]:
    """Multi-request steps: alike decodes (identical requests), a chunk beside decodes, uneven contexts."""
    def lens(lo: int, hi: int, n: int) -> list[int]:
        return torch.randint(lo, hi, (n,), generator=gen).tolist()
    video = frames(20, 8, 22, 4)
    if smoke:
        return {"decode x4": [Req(c, 1) for c in lens(200, 260, 4)]}
    return {
        "decode x16": [Req(c, 1) for c in lens(212, 244, 16)],
        "decode x64": [Req(c, 1) for c in lens(212, 244, 64)],
        "prefill 4x212": [Req(0, 212, video) for _ in range(4)],
        "chunk+decode x15": [Req(0, 480, video)] + [Req(c, 1) for c in lens(212, 244, 15)],
        "decode uneven x16": [Req(c, 1) for c in lens(50, 4000, 16)],
    }


@dataclass
class BatchRow:
    model: str
    layer: str
    step: str
    requests: int
    tokens: int
    ms: dict[str, float]          # loop, batched, auto (per layer call); build_auto: once per step
    auto_calls: int
    max_rel_err: float


def run_batching(smoke: bool, dtype: torch.dtype, repeats: int) -> list[BatchRow]:
    rows = []
    gen = torch.Generator().manual_seed(1)
    models = {"demo": BATCH_SPECS["demo"]} if smoke else BATCH_SPECS
    for model, specs in models.items():
        for spec in specs:
            for step, reqs in batch_steps(gen, smoke).items():
                num_blocks = sum(-(-r.seq_len // 16) for r in reqs) + 8
                batch = make_batch(reqs, spec, dtype=dtype, num_blocks=num_blocks, gen=gen, free_outside_window=True)
                ms, outs = {}, {}
                impl = create_impl("sdpa", spec)
                for mode in ("loop", "batched", "auto"):
                    builder = create_builder("sdpa", pool_for(batch, spec, sdpa_batching=mode))
                    md = builder.build(batch.metadata)
                    if mode == "auto":
                        ms["build_auto"] = timed(lambda b=builder, m=batch.metadata: b.build(m), repeats)
                        calls = len(md.groups)

                    def call(md=md, impl=impl, b=batch):
                        return impl.forward(b.q, b.k, b.v, b.kv_cache, md)
                    outs[mode] = call()
                    ms[mode] = timed(call, repeats)
                want = outs["loop"].float()
                err = max(float((o.float() - want).abs().max() / want.abs().max()) for o in outs.values())
                rows.append(BatchRow(model, spec.layer_type, step, len(reqs), batch.metadata.num_actual_tokens, ms,
                                     calls, err))
                log.info("%s %s %s: %s (auto: %d calls)", model, spec.layer_type, step,
                         {k: round(v, 3) for k, v in ms.items()}, calls)
    return rows


def print_batching(rows: list[BatchRow]) -> None:
    print(f"\n{'model':<7} {'layer':<8} {'step':<18} {'reqs':>4} {'loop ms':>8} {'batched':>8} {'auto':>8} "
          f"{'calls':>5} {'plan ms':>8} {'loop/auto':>9} {'err':>8}")
    for r in rows:
        print(f"{r.model:<7} {r.layer.split('_')[0]:<8} {r.step:<18} {r.requests:>4} {r.ms['loop']:>8.3f} "
              f"{r.ms['batched']:>8.3f} {r.ms['auto']:>8.3f} {r.auto_calls:>5} {r.ms['build_auto']:>8.3f} "
              f"{r.ms['loop'] / r.ms['auto']:>9.2f} {r.max_rel_err:>8.1e}")


def print_table(rows: list[Row]) -> None:
    head = (f"{'layer':<8} {'step':<8} {'frames':>6} {'tokens':>6} {'ctx':>6} {'ref ms':>8} {'sdpa ms':>8} "
            f"{'flex ms':>8} {'causal ms':>9} {'flex/causal':>11} {'err sdpa':>9} {'err flex':>9} "
            f"{'work flex':>9} {'full blk':>8} {'tiles128':>8} {'fa4':>8}")
    print(head)
    for r in rows:
        ratio = f"{r.flex_vs_causal:.2f}" if r.flex_vs_causal else "-"
        causal = f"{r.ms['flex_causal']:.1f}" if "flex_causal" in r.ms else "-"
        print(f"{r.layer.split('_')[0]:<8} {r.scenario:<8} {r.frames:>6} {r.tokens:>6} {r.context:>6} "
              f"{r.ms['reference']:>8.1f} {r.ms['sdpa']:>8.1f} {r.ms['flex']:>8.1f} {causal:>9} {ratio:>11} "
              f"{r.max_rel_err['sdpa']:>9.1e} {r.max_rel_err['flex']:>9.1e} {r.work_ratio['flex_blocks']:>9.2f} "
              f"{r.work_ratio['flex_full_block_share']:>8.2f} "
              f"{r.work_ratio['tiles_128']:>8.2f} {r.work_ratio['fa4_pieces']:>8.2f}")


def fastest_cpu_backend(rows: list[Row], tolerance: float) -> dict[str, dict[str, float]]:
    """Per correct backend: steady-state ms summed over every step, and first-call seconds (compiles)."""
    totals = {}
    for name in ("sdpa", "flex"):
        if all(r.max_rel_err[name] < tolerance for r in rows):
            totals[name] = {"steady_ms": sum(r.ms[name] for r in rows),
                            "first_calls_s": sum(r.first_call_s[name] for r in rows)}
    return totals


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one repeat, JSON to a temp file")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    shape = SMOKE_SHAPE if args.smoke else FULL_SHAPE
    rows = run(shape, dtype)
    print_table(rows)
    batching = run_batching(args.smoke, dtype, shape.repeats)
    print_batching(batching)
    totals = fastest_cpu_backend(rows, 1e-4 if dtype == torch.float32 else 2e-2)
    for name, t in totals.items():
        print(f"{name}: steady state {t['steady_ms']:.0f} ms over all steps; first calls {t['first_calls_s']:.1f} s")
    out = args.out or (Path(tempfile.gettempdir()) / "attention_smoke.json" if args.smoke else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(), "cpu": platform.processor(),
                               "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "shape": asdict(shape),
                               "rows": [asdict(r) for r in rows], "total_ms": totals,
                               "batching": [asdict(r) for r in batching]}, indent=1, default=str))
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
