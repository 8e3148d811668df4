"""FA4 on one H200 (or any SM90/SM100 GPU): parity with the dense reference, then timings.

Part 1 (parity, bf16): FA4, flex and SDPA against the float32 reference on random paged steps:
varlen prefill, chunked prefill, decode, mixed and text-only, with frames longer than the window;
plus the check that FA4's mask_mod is really active (frame rows move off plain sliding exactly
where the reference's do).
Part 2 (timings, CUDA events): a Gemma-like sliding layer (8 q / 4 kv heads, head_dim 256,
window 1024) on a 2048-token chunk of a 64-frame video and on a 64-request decode step; FA4 with
the mask_mod, FA4 plain sliding (the floor), flex and SDPA. One table; under 8 minutes.

    python bench/gpu_attention_check.py                      # on the GPU machine
    python bench/gpu_attention_check.py --device cpu --smoke # plumbing only (fa4 falls back to sdpa)

Writes JSON to bench/results/gpu_attention.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from mmserve.attention import create_builder, create_impl
from mmserve.attention.backend import SLIDING, LayerAttentionSpec
from mmserve.attention.fa4 import fa4_arch, fa4_installed, fa4_supports
from mmserve.attention.synthetic import Batch, Req, frames, make_batch, pool_for, run_backend

log = logging.getLogger("bench.gpu_attention_check")
RESULTS = Path(__file__).resolve().parent / "results" / "gpu_attention.json"
METADATA_TENSORS = ("query_start_loc", "seq_lens", "positions", "block_table", "slot_mapping", "query_ranges")


def to_device(batch: Batch, device: str) -> Batch:
    md = replace(batch.metadata, **{f: getattr(batch.metadata, f).to(device) for f in METADATA_TENSORS
                                    if getattr(batch.metadata, f) is not None})
    return Batch(batch.q.to(device), batch.k.to(device), batch.v.to(device), batch.kv_cache.to(device), md, batch.reqs)


def parity_steps(window: int) -> dict[str, list[Req]]:
    w = window
    return {
        "varlen_prefill": [Req(0, 300, frames(5, 3, w + 30, 7)), Req(0, 57), Req(0, 400, frames(30, 6, 40, 9))],
        "chunked_prefill": [Req(256, 384, frames(270, 4, w + 10, 5)), Req(1000, 129, frames(600, 8, 60, 4))],
        "decode": [Req(n, 1, frames(3, 2, 50, 4)) for n in (130, 700, 1500, 33)],
        "mixed": [Req(900, 1), Req(0, 500, frames(4, 5, w + 20, 3)), Req(120, 200, frames(140, 1, 150, 0)), Req(64, 1)],
        "text_only": [Req(0, 230), Req(300, 140), Req(2000, 1)],
    }


def run_impl(name: str, spec: LayerAttentionSpec, b: Batch) -> torch.Tensor:
    return run_backend(name, b, spec, max_num_tokens=1024)[0]


def parity(device: str, specs: list[LayerAttentionSpec]) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(1234)
    for spec in specs:
        for name, reqs in parity_steps(spec.window).items():
            # One cache size and table width for every step, so flex compiles once per head dim.
            batch = to_device(make_batch(reqs, spec, dtype=torch.bfloat16, num_blocks=512, table_width=256,
                                         gen=gen, free_outside_window=True), device)
            want = run_impl("reference", spec, batch).float()
            for backend in ("fa4", "sdpa", "flex"):
                try:
                    got = run_impl(backend, spec, batch).float()
                    err = float((got - want).abs().max() / want.abs().max())
                    ok = err < 2e-2
                except Exception:  # report and carry on: one broken backend must not hide the others
                    log.exception("%s failed on %s", backend, name)
                    err, ok = float("nan"), False
                    got = None
                row = {"head_dim": spec.head_dim, "step": name, "backend": backend, "rel_err": err, "ok": ok}
                if backend == "fa4" and got is not None and batch.metadata.query_ranges is not None:
                    # The frames must change exactly the rows the reference says they change.
                    plain = Batch(batch.q, batch.k, batch.v, batch.kv_cache,
                                  replace(batch.metadata, query_ranges=None, query_ranges_cpu=None), batch.reqs)
                    in_frame = batch.metadata.query_ranges[:, 0] >= 0
                    fa4_moved = (run_impl("fa4", spec, plain).float() - got)[in_frame].abs().max() > 1e-2
                    ref_moved = (run_impl("reference", spec, plain).float() - want)[in_frame].abs().max() > 1e-2
                    row["mask_mod_active"] = bool(fa4_moved) == bool(ref_moved)
                rows.append(row)
                print(f"parity hd{spec.head_dim:<4} {name:<16} {backend:<5} rel_err={err:.2e} {'ok' if ok else 'FAIL'}"
                      + (f" mask_mod_active={row['mask_mod_active']}" if "mask_mod_active" in row else ""), flush=True)
    return rows


def cuda_ms(fn, repeats: int) -> tuple[float, float]:
    """(first call s, median ms of `repeats` later calls) with CUDA events (CPU clock off CUDA)."""
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    first = time.perf_counter() - start
    samples = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            samples.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e3)
    return first, statistics.median(samples)


def timings(device: str, spec: LayerAttentionSpec, smoke: bool) -> list[dict]:
    frame_tokens, chunk, n_frames, n_decode = (20, 128, 8, 4) if smoke else (256, 2048, 64, 64)
    ranges = frames(16, n_frames, frame_tokens, 8)
    prompt = ranges[-1][1] + 10
    prefill = [Req(prompt - chunk, chunk, ranges)]
    decode = [Req(int(n), 1) for n in torch.randint(prompt // 2, 2 * prompt, (n_decode,))]
    rows = []
    num_blocks = max(sum(-(-r.seq_len // 16) for r in reqs) for reqs in (prefill, decode)) + 64
    width = max(-(-r.seq_len // 16) for r in prefill + decode) + 1
    for step, reqs in (("prefill_chunk", prefill), ("decode", decode)):
        batch = to_device(make_batch(reqs, spec, dtype=torch.bfloat16, num_blocks=num_blocks, table_width=width),
                          device)
        variants = [("fa4", batch), ("sdpa", batch), ("flex", batch)]
        if batch.metadata.query_ranges is not None:
            plain = replace(batch.metadata, query_ranges=None, query_ranges_cpu=None)
            variants.insert(1, ("fa4 plain sliding (floor)", Batch(batch.q, batch.k, batch.v, batch.kv_cache, plain, reqs)))
        for label, b in variants:
            name = label.split()[0]
            impl = create_impl(name, spec)
            try:
                md = create_builder(name, pool_for(b, spec, max_num_tokens=max(chunk, n_decode))).build(b.metadata)
                first, ms = cuda_ms(lambda impl=impl, b=b, md=md: impl.forward(b.q, b.k, b.v, b.kv_cache, md),
                                    2 if smoke else 20)
            except Exception:
                log.exception("%s failed on %s", label, step)
                first, ms = float("nan"), float("nan")
            rows.append({"step": step, "tokens": b.metadata.num_actual_tokens, "context": b.metadata.max_seq_len,
                         "backend": label, "first_call_s": first, "ms": ms})
            print(f"timing {step:<14} {label:<26} first={first:7.2f}s  {ms:9.3f} ms", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="small shapes, few repeats")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --smoke for a plumbing check")
        return 2
    torch.manual_seed(0)
    arch = fa4_arch(args.device)
    gemma = LayerAttentionSpec(SLIDING, 8, 4, 256, window=1024, bidirectional=True)
    specs = [LayerAttentionSpec(SLIDING, 4, 2, 128, window=64, bidirectional=True),
             LayerAttentionSpec(SLIDING, 8, 4, 256, window=96, bidirectional=True)]
    info = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "arch": arch,
            "fa4_installed": fa4_installed(), "fa4_supports_gemma_sliding": fa4_supports(gemma, arch),
            "torch": torch.__version__}
    print(info, flush=True)
    start = time.perf_counter()
    result = {"info": info, "parity": parity(args.device, specs[:1] if args.smoke else specs)}
    result["timings"] = timings(args.device, gemma if not args.smoke else specs[0], args.smoke)
    result["wall_s"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{'step':<14} {'backend':<26} {'tokens':>6} {'ctx':>6} {'ms':>9}")
    for r in result["timings"]:
        print(f"{r['step']:<14} {r['backend']:<26} {r['tokens']:>6} {r['context']:>6} {r['ms']:>9.3f}")
    failed = [r for r in result["parity"] if not r["ok"] or r.get("mask_mod_active") is False]
    print(f"parity: {len(result['parity']) - len(failed)}/{len(result['parity'])} ok; wall {result['wall_s']:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
