"""The GPU path's one check (issues 19, 28): run it on one H100, H200 or B200, section by section.

1. parity    FA4 (sliding layers, head dim 256) and the batched fallback (full layers, head dim 512)
             against the dense float32 reference on random paged steps with frames shorter and
             longer than the window: varlen prefill, chunked prefill, decode, mixed, text only
             (bf16, max error relative to the output's largest value < 2e-2); FA4's mask_mod must
             change exactly the rows the reference says the frames change; on CUDA `auto` must
             have chosen FA4 and flex (without FA4 both would be flex, and parity vacuous for FA4).
             Beside them the MoE router (26B-A4B's 128 experts, top 8, bf16): our top k of the scores
             must choose transformers' experts (top k of the fp32 softmax) where ties at the k-th place
             are forced, and on random weights, with weights within 2e-2 where they agree.
2. tokens    the demo checkpoint end to end on video requests, greedy: FA4 and SDPA in bf16, each
             compared with an fp32 SDPA run (FA4 must agree at least as well as SDPA, within 10
             points), and CUDA graphs against --enforce-eager (identical tokens, and graphs must
             have been enabled and replayed: a failed capture runs eagerly and would pass vacuously).
2b. speculation  the same requests with the demo assistant drafting K = 3: verify-step and drafter
             graphs against eager verify steps and drafting, identical tokens; drafts must have been
             verified and some accepted (the accept path ran), and verify and drafter graphs replayed.
3. compiles  FA4 kernels compiled over steps of 1/8/16/32/46/64 frames and decode steps (target: no
             new kernel after the first step of each kind); caches sized from each step.
4. tiles     key tiles FA4 visits (windowed page tables) against the kept pairs and the minimum tile
             work, at 1..64 frames (target: <= 1.3x the minimum at 64 frames); FA4 time with frames
             against its plain sliding path on the same step.
4b. sampler  top-p at a 262k vocabulary: the Triton kernel CUDA runs against torch's bisection (its
             fallback) at 1/16/64 rows, and the engine's start-up check of the kernel on this GPU.
5. fallback  head dim 512: the split-KV kernel (CUDA's decode path), flex and gather + SDPA on one
             decode at 32k, 64 decodes and one prefill chunk: K/V bytes, pairs and busy programs
             counted from the plans the builders make, metadata build time, kernel ms, GB/s.
6. decode    one decode step's wall time with CUDA graphs and with --enforce-eager at batch 1/16/64,
             at the serving model's dimensions, against the floor (the bytes the perf model says
             the step moves / the device's measured copy bandwidth); beside it the forward alone
             (`forward_ms`: the replay of that batch's captured graph); every timed graph step must
             have replayed a graph.
6b. profile  three decode steps under torch.profiler with CUDA activities at the serving model's
             dimensions, batch 1 and 64: kernels per step and per layer (target <= 12), the top 15
             kernels by time, GEMM time against the rest.
7. serving   output tokens/s of mmserve.LLM against transformers' batched generate on N identical
             prompts, random weights at Gemma 4 12B (default), E4B, 26B-A4B or 31B dimensions
             (transformers' audio tower, E2B/E4B, runs eager attention: it refuses SDPA); graphs
             must replay.
7b. capacity the serving model with no memory flag (issue 36): the KV cache sized by
             --gpu-memory-utilization 0.9's profiling step with the CUDA defaults; what start-up
             reported (tokens per pool, full-context requests that fit), then 64 concurrent requests of
             8192 prompt tokens, none of which may be preempted; the allocator's peak against the budget.
8. collectives  tensor parallelism's per-layer collective (issue 26): the all-reduce of [rows, hidden]
             bf16 over a single-rank NCCL group (TP on one lent GPU is 1) at decode and prefill row
             counts for each family member's width, per call and per layer / per step; beside it the
             ring all-reduce's NVLink wire time at TP 2/4/8, a model (bytes / datasheet bandwidth).
             One rank moves no bytes (and the engine calls no collective at TP 1): this is NCCL's
             fixed cost and whether it captures into a graph, not what TP costs.
9. video_prefill  (#35) 32-frame videos at the serving model's dimensions (random weights, the vision
             tower included) prefilled through the engine: frames/s and the FLOP floor's share of the
             wall time (perf model FLOPs / the measured GEMM rate; target >= 0.6), every step a
             graph; and 16 decoding requests' step time while such a video prefills beside them
             against alone (target <= 1.5x).
10. mixed    (#35) one 2048-token prefill chunk beside 63 decodes: the step against its own floor,
             max(bytes / copy bandwidth, FLOPs / GEMM rate) (target <= 1.4x), as piecewise graphs.

Every floor divides by the device the run is on, measured once at its start (lease_device.py: a
1 GiB device-to-device copy and an 8192^3 bf16 GEMM, as this workplace read its H100s and H200s);
each section's JSON carries those readings, the device's name, SMs and memory, and the datasheet's
dense peaks, beside which every floor is computed too (`datasheet_floor_ms`). The sections that load
the serving model size their KV cache from the device's free memory beside the checkpoint.

Kernel times come from CUDA-graph replays of 20 calls (or 20 back-to-back calls between two events
when a call cannot be captured), median of repeats; one call's own event time minus that is
reported as its host overhead (`*_host_ms`). The report is rewritten after every section, so a run
killed at its time limit keeps the sections it finished; `--only` runs some sections alone, in
its order (scripts/gpu_lease/ runs them in the lease's calls, each call's slowest last).

    python bench/gpu_check.py                       # on the GPU machine: bench/results/gpu_check.json
    python bench/gpu_check.py --only parity tiles --out /tmp/a.json
    python bench/gpu_check.py --smoke               # CPU: the same plumbing on tiny shapes, JSON to a temp file

Without CUDA the full run prints that it needs a GPU and exits 0, writing nothing. On the CPU smoke
run the sections that compare or time graphs run over emulated ones (`cpu_engine`), so their replay
checks can fail there as on a GPU; video_prefill and mixed check their replays there too, their
device targets only on CUDA.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import gc
import json
import logging
import platform
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from lease_device import Ceilings, kv_cache_bytes, measure

from mmserve.attention.backend import FULL, SLIDING, LayerAttentionSpec
from mmserve.attention.selection import choose_backends, device_arch
from mmserve.config import DEMO_ASSISTANT_DIR, DEMO_MODEL_DIR, DEVICE_DEFAULTS

log = logging.getLogger("bench.gpu_check")
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gpu_check.json"
FAMILY = ROOT / "tests" / "fixtures" / "gemma4_family"
FRAME_COUNTS = (1, 8, 16, 32, 46, 64)
BF16_TOL = 2e-2


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the GPU run and the CPU smoke run, and the run's device."""

    sliding: LayerAttentionSpec
    full: LayerAttentionSpec
    frame_tokens: int            # soft tokens per frame
    chunk: int                   # the prefill chunk (token budget) of the tile and timing steps
    frame_counts: tuple[int, ...]
    token_requests: int          # video requests in the tokens section
    token_frames: int
    max_tokens: int
    serving_model: str | None    # a tests/fixtures/gemma4_family config, or None: the demo-sized one
    serving_prompt: int
    serving_batch: int
    serving_tokens: int
    decode_batches: tuple[int, ...]   # the decode section's batch sizes
    decode_steps: int                 # timed decode steps per batch size
    repeats: int
    video_frames: int = 32            # video_prefill: frames per video
    video_requests: int = 4           # video_prefill: videos prefilled together
    itl_decodes: int = 16             # video_prefill: requests decoding while a video prefills
    mixed_chunk: int = 2048           # mixed: the prefill chunk beside the decodes
    mixed_decodes: int = 63
    capacity_batch: int = 64          # capacity: concurrent requests
    capacity_prompt: int = 8192       # capacity: their prompt tokens
    moe_router: tuple[int, int, int] = (2816, 128, 8)   # parity's router rows: hidden, experts, top k (26B-A4B)
    moe_rows: int = 4096              # parity's router rows: tokens routed
    ceilings: Ceilings | None = None  # the run's device as measured at its start (what floors divide by)


GPU = Sizes(sliding=LayerAttentionSpec(SLIDING, 16, 8, 256, window=1024, bidirectional=True),
            full=LayerAttentionSpec(FULL, 16, 1, 512, window=None, bidirectional=False),
            frame_tokens=70, chunk=2048, frame_counts=FRAME_COUNTS, token_requests=8, token_frames=8,
            max_tokens=24, serving_model="12b_unified", serving_prompt=1024, serving_batch=16, serving_tokens=64,
            decode_batches=(1, 16, 64), decode_steps=16, repeats=20)
SMOKE = Sizes(sliding=LayerAttentionSpec(SLIDING, 4, 2, 32, window=24, bidirectional=True),
              full=LayerAttentionSpec(FULL, 4, 1, 64, window=None, bidirectional=False),
              frame_tokens=10, chunk=64, frame_counts=(1, 4), token_requests=2, token_frames=2, max_tokens=4,
              serving_model=None, serving_prompt=24, serving_batch=2, serving_tokens=4,
              decode_batches=(2,), decode_steps=2, repeats=1, video_frames=2, video_requests=2, itl_decodes=2,
              mixed_chunk=32, mixed_decodes=3, capacity_batch=4, capacity_prompt=48, moe_router=(64, 16, 4),
              moe_rows=256)


# --- shared helpers -----------------------------------------------------------------------------

def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


GRAPH_CALLS = 20   # calls captured into one graph (or issued back to back) per timed sample


def device_time(fn: Callable[[], object], device: str, repeats: int) -> dict:
    """Per-call time of `fn` without its host cost, and that host cost apart (median of `repeats`).

    One call between two events also times its Python and launch work (FA4 b36's wrapper alone is
    ~90 us, more than a decode kernel), so on a GPU the kernel time comes from replays of a CUDA
    graph of GRAPH_CALLS calls, or, when `fn` cannot be captured, from GRAPH_CALLS back-to-back
    calls between two events (host-bound if each call's host work outlasts its kernels: `method`
    says which). `host_ms`: one call's event time minus the kernel time. On a CPU: the host clock."""
    fn()
    synchronize(device)
    if device != "cuda":
        samples = []
        for _ in range(repeats):
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
        return {"ms": _median(samples), "method": "host clock"}

    def events(run: Callable[[], object], calls: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    one_call = _median([events(fn, 1) for _ in range(repeats)])
    method, run = "graph", None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
        graph.replay()
        run = graph.replay
    except Exception as exc:   # a host sync or a per-call allocation inside fn
        log.info("not capturable (%s): timing back-to-back calls", exc)
        torch.cuda.synchronize()
        method = "back_to_back"

        def run():
            for _ in range(GRAPH_CALLS):
                fn()
    synchronize(device)
    kernel = _median([events(run, GRAPH_CALLS) for _ in range(repeats)])
    return {"ms": kernel, "method": method, "one_call_ms": one_call, "host_ms": max(0.0, one_call - kernel)}


def _median(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6))


def layer_backends(sizes: Sizes, device: str) -> dict[str, str]:
    """What `--attention-backend auto` runs for each of the two layer types on this machine."""
    from mmserve.attention.fa4 import fa4_installed

    specs = {SLIDING: sizes.sliding, FULL: sizes.full}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return choose_backends(specs, device_type=device, arch=device_arch(device), dtype=dtype,
                           fa4_installed=fa4_installed())


# --- 1. parity: each layer type's GPU kernel against the dense float32 reference -----------------------

def to_device(batch, device: str):
    """The batch with its tensors (host mirrors stay on the host) on `device`."""
    from mmserve.attention.synthetic import Batch

    md = batch.metadata
    moved = {f: getattr(md, f).to(device) for f in ("query_start_loc", "seq_lens", "positions", "block_table",
                                                     "slot_mapping", "query_ranges") if getattr(md, f) is not None}
    return Batch(*(t.to(device) for t in (batch.q, batch.k, batch.v, batch.kv_cache)), replace(md, **moved),
                 batch.reqs)


def without_frames(batch):
    """The same step with no range table: the layer's plain causal / sliding mask."""
    from mmserve.attention.synthetic import Batch

    md = replace(batch.metadata, query_ranges=None, query_ranges_cpu=None)
    return Batch(batch.q, batch.k, batch.v, batch.kv_cache, md, batch.reqs)


def parity_steps(window: int, frame: int):
    """Steps of every kind; frames longer than the window (w + 30) and shorter ones."""
    from mmserve.attention.synthetic import Req, frames

    w = window
    return {
        "varlen_prefill": [Req(0, 300, frames(5, 3, w + 30, 7)), Req(0, 57), Req(0, 400, frames(30, 6, frame, 9))],
        "chunked_prefill": [Req(256, 384, frames(270, 4, w + 10, 5)), Req(1000, 129, frames(600, 8, frame, 4))],
        "decode": [Req(n, 1, frames(3, 2, frame, 4)) for n in (130, 700, 1500, 33)],
        "mixed": [Req(900, 1), Req(0, 500, frames(4, 5, w + 20, 3)), Req(120, 200, frames(140, 1, 150, 0)),
                  Req(64, 1)],
        "text_only": [Req(0, 230), Req(300, 140), Req(2000, 1)],
    }


def parity(sizes: Sizes, device: str) -> dict:
    from mmserve.attention.synthetic import make_batch, run_backend

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    chosen = layer_backends(sizes, device)
    gen = torch.Generator().manual_seed(1234)
    rows = []
    for spec in (sizes.sliding, sizes.full):
        window = spec.window or sizes.sliding.window
        for step, reqs in parity_steps(window, sizes.frame_tokens).items():
            if device == "cpu":   # the smoke run: the same steps, scaled to the tiny window
                reqs = [replace(r, context=r.context // 20, query=max(1, r.query // 20),
                                ranges=[(s // 20, e // 20) for s, e in r.ranges if e // 20 > s // 20]) for r in reqs]
            batch = to_device(make_batch(reqs, spec, dtype=dtype, num_blocks=512, table_width=256, gen=gen,
                                         free_outside_window=True), device)
            want, _ = run_backend("reference", batch, spec)
            for backend in dict.fromkeys((chosen[spec.layer_type], "sdpa")):
                row = {"layer": spec.layer_type, "step": step, "backend": backend}
                got, _ = run_backend(backend, batch, spec)
                row["rel_err"] = rel_err(got, want)
                row["ok"] = row["rel_err"] < BF16_TOL
                if backend == "fa4" and batch.metadata.query_ranges is not None and spec.bidirectional:
                    # The frames must change exactly the rows the reference says they change.
                    plain = without_frames(batch)
                    in_frame = batch.metadata.query_ranges[:, 0] >= 0
                    moved = (run_backend(backend, plain, spec)[0].float() - got.float())[in_frame].abs().max()
                    ref_moved = (run_backend("reference", plain, spec)[0].float() - want.float())[in_frame].abs().max()
                    row["mask_mod_active"] = bool(moved > 1e-2) == bool(ref_moved > 1e-2)
                    row["ok"] = row["ok"] and row["mask_mod_active"]
                rows.append(row)
    rows += moe_routing(sizes, device)
    as_planned = backends_as_planned(chosen, device)
    return {"backends": chosen, "backends_as_planned": as_planned, "tolerance": BF16_TOL, "rows": rows,
            "ok": as_planned and all(r["ok"] for r in rows)}


def moe_routing(sizes: Sizes, device: str) -> list[dict]:
    """Our MoE router's expert choice against transformers' Gemma4TextRouter on the same bf16 weights
    (26B-A4B's shape): ours takes the top k of the bf16 scores, transformers' the top k of their fp32
    softmax. Equal scores give equal probabilities, so the two can differ only where a tie at the k-th
    place is broken differently by topk on the two dtypes: the CPU's topk breaks them alike (the smoke
    run), CUDA's is another kernel. `forced_ties`: every expert's router row three times, so most
    tokens tie at the k-th place (k not a multiple of 3; `tied_at_k` counts them: 3,836 of 4,096 at
    the GPU's shape on a CPU); `random`: random rows, whose bf16 scores tie there in a few % of tokens
    (228 of 4,096). Where the chosen experts agree their weights must match too."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter

    from mmserve.model.moe import route

    hidden, experts, top_k = sizes.moe_router
    cfg = Gemma4TextConfig(hidden_size=hidden, num_experts=experts, top_k_experts=top_k, moe_intermediate_size=8,
                           enable_moe_block=True, num_hidden_layers=1, layer_types=["full_attention"])
    gen = torch.Generator().manual_seed(99)
    rows = []
    for step in ("forced_ties", "random"):
        theirs = Gemma4TextRouter(cfg).eval()
        with torch.no_grad():
            proj = torch.randn(experts, hidden, generator=gen) * hidden ** -0.5
            if step == "forced_ties":
                proj = proj[torch.arange(experts) // 3]
            theirs.proj.weight.copy_(proj)
            theirs.scale.copy_(1 + 0.1 * torch.randn(hidden, generator=gen))
            theirs.per_expert_scale.copy_(1 + 0.1 * torch.randn(experts, generator=gen))
            theirs = theirs.to(device=device, dtype=torch.bfloat16)
            x = torch.randn(sizes.moe_rows, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
            probs, their_weights, their_experts = theirs(x)
            weights, chosen = route(x, theirs.eps, theirs.scale, theirs.proj.weight, theirs.per_expert_scale, top_k)
        edge = torch.topk(probs, top_k + 1, dim=-1).values
        ties = edge[:, top_k - 1] == edge[:, top_k]
        same = (chosen.sort(-1).values == their_experts.sort(-1).values).all(-1)
        dense = [torch.zeros(x.shape[0], experts, device=device).scatter(1, i, w.float())
                 for i, w in ((chosen, weights), (their_experts, their_weights))]
        row = {"layer": "moe_router", "step": step, "backend": f"top{top_k}_of_{experts}",
               "tokens": x.shape[0], "tied_at_k": int(ties.sum()), "differing": int((~same).sum()),
               "rel_err": rel_err(dense[0][same], dense[1][same]) if bool(same.any()) else 0.0}
        row["ok"] = row["differing"] == 0 and row["rel_err"] < BF16_TOL
        rows.append(row)
    return rows


GPU_BACKENDS = {SLIDING: "fa4", FULL: "flex"}   # what a GPU run must check: FA4, and flex for head dim 512


def backends_as_planned(chosen: dict[str, str], device: str) -> bool:
    """On CUDA `auto` must pick FA4 for the sliding layers and flex for the full ones: without FA4
    (not installed, or not runnable here) both would run flex and parity would pass without FA4."""
    return device != "cuda" or chosen == GPU_BACKENDS


# --- 3. compiles: one FA4 kernel per kind of step ----------------------------------------------------

def blocks_for(reqs, slack: int = 8) -> int:
    """Cache blocks a step needs: each request's ceil(seq / 16), the null block and some slack."""
    return sum(-(-r.seq_len // 16) for r in reqs) + 1 + slack


def fa4_kernels() -> int:
    from flash_attn.cute.interface import _flash_attn_fwd

    return len(_flash_attn_fwd.compile_cache.cache)


def compiles(sizes: Sizes, device: str) -> dict:
    from mmserve.attention.synthetic import Req, make_batch, run_backend

    if device != "cuda":
        return {"skipped": "FA4 runs on CUDA only; tests/attention/test_attn_fa4_compile.py checks the same "
                           "under FakeTensorMode on CPU"}
    spec = sizes.sliding
    gen = torch.Generator().manual_seed(7)
    counts, earlier = [], fa4_kernels()   # kernels an earlier section of the call (parity) compiled
    for n in sizes.frame_counts:
        for kind, reqs in (("prefill", video_chunk(sizes, n)),
                           ("decode", [Req(300 * n + 7 * i, 1) for i in range(1 + n % 5)])):
            before = fa4_kernels()
            batch = to_device(make_batch(reqs, spec, dtype=torch.bfloat16, num_blocks=blocks_for(reqs),
                                         table_width=2048, gen=gen, cache_device=device), device)
            run_backend("fa4", batch, spec)
            counts.append({"frames": n, "step": kind, "new_kernels": fa4_kernels() - before})
    later = [c["new_kernels"] for c in counts[2:]]   # the first prefill and decode steps compile
    return {"rows": counts, "kernels_before": earlier, "total_kernels": fa4_kernels(), "ok": sum(later) == 0}


def _top_p_kernel(work, probs, index, top_p) -> None:
    from mmserve.sample.nucleus import launch_nucleus_filter

    work.copy_(probs)
    launch_nucleus_filter(work, index, top_p)


def _top_p_bisection(work, probs, top_p) -> None:
    from mmserve.sample.nucleus import nucleus

    work.copy_(probs)
    work.mul_(nucleus(work, top_p))


def sampler(sizes: Sizes, device: str) -> dict:
    """Top-p at Gemma 4's 262k vocabulary: the Triton kernel CUDA runs (sample/nucleus_kernels.py)
    against torch's bisection (its fallback) at 1, 16 and 64 rows, and the start-up check's verdict
    on this GPU (worker/backend_check.nucleus_kernel_mismatch)."""
    from mmserve.worker.backend_check import nucleus_kernel_mismatch

    if device != "cuda":
        return {"skipped": "the kernel runs on CUDA; tests/engine/test_sampler_nucleus.py runs it in Triton's "
                           "interpreter and compiles it for sm_90a"}
    vocab = 262_144
    reason = nucleus_kernel_mismatch(vocab, torch.device(device))
    rows = []
    for n in (1, 16, 64):
        gen = torch.Generator(device=device).manual_seed(n)
        probs = torch.softmax(torch.randn(n, vocab, generator=gen, device=device) * 4, dim=-1)
        index, top_p, work = torch.arange(n, device=device), torch.full((n,), 0.9, device=device), probs.clone()
        kernel = functools.partial(_top_p_kernel, work, probs, index, top_p)
        bisection = functools.partial(_top_p_bisection, work, probs, top_p)
        row = {"rows": n}
        add_timing(row, "kernel", device_time(kernel, device, sizes.repeats))
        add_timing(row, "bisection", device_time(bisection, device, sizes.repeats))
        rows.append(row)
    return {"vocab": vocab, "check": reason or "passed", "rows": rows,
            "ok": reason is None and all(r["kernel_ms"] < r["bisection_ms"] for r in rows)}


# --- 4. tiles: FA4's visited key tiles with windowed page tables ------------------------------------

def video_chunk(sizes: Sizes, num_frames: int):
    """The last prefill chunk (<= sizes.chunk tokens) of a prompt of `num_frames` frames, 8 text tokens apart."""
    from mmserve.attention.synthetic import Req, frames

    ranges = frames(16, num_frames, sizes.frame_tokens, 8)
    prompt = ranges[-1][1] + 1 + 12
    context = max(0, prompt - sizes.chunk)
    return [Req(context, prompt - context, ranges)]


def fa4_tile(spec: LayerAttentionSpec, arch: int) -> tuple[int, int]:
    """(queries, keys) per FA4 b36 tile with the mask_mod (never causal/local): 128 packed rows
    (128 / g queries); 80 keys at head dim > 192 on SM90 (`_tile_size_fwd_sm90`), else 128."""
    keys = 80 if arch // 10 == 9 and spec.head_dim > 192 else 128
    return max(1, 128 // (spec.num_heads // spec.num_kv_heads)), keys


def prepared(name: str, batch, spec: LayerAttentionSpec):
    """Backend `name`'s forward on `batch` with its metadata built once (what a layer costs)."""
    from mmserve.attention import create_builder, create_impl
    from mmserve.attention.synthetic import pool_for

    metadata = create_builder(name, pool_for(batch, spec)).build(batch.metadata)
    impl = create_impl(name, spec)
    return lambda: impl.forward(batch.q, batch.k, batch.v, batch.kv_cache, metadata)


def add_timing(row: dict, name: str, timing: dict) -> None:
    """row[name_ms] = the kernel time; the method and host overhead beside it."""
    row[f"{name}_ms"] = timing.pop("ms")
    row.update({f"{name}_{k}": v for k, v in timing.items()})


def tiles(sizes: Sizes, device: str) -> dict:
    """Visited tile work / minimum tile work / kept pairs, FA4's tiles on each architecture; plus
    on a GPU the time of the step with frames against the same step without (FA4's plain path)."""
    from tile_analysis import fa4_visited_pairs, kept_pairs, varlen_tiles

    from mmserve.attention.synthetic import make_batch

    spec = sizes.sliding
    rows = []
    for n in sizes.frame_counts:
        reqs = video_chunk(sizes, n)
        batch = make_batch(reqs, spec, num_blocks=sum(-(-r.seq_len // 16) for r in reqs) + 8,
                           free_outside_window=True)
        md = batch.metadata
        kept = kept_pairs(md, spec)
        row = {"frames": n, "tokens": md.num_actual_tokens, "context": md.max_seq_len}
        for arch in (90, 100):
            tile_q, tile_k = fa4_tile(spec, arch)
            minimum = varlen_tiles(md, spec, tile_q, tile_k).visited_pairs()
            row[f"sm{arch}_min_over_kept"] = minimum / kept
            row[f"sm{arch}_visited_over_min"] = fa4_visited_pairs(md, spec, tile_q, tile_k) / minimum
        if device == "cuda":
            step = to_device(make_batch(reqs, spec, dtype=torch.bfloat16, num_blocks=blocks_for(reqs),
                                        free_outside_window=True, cache_device=device), device)
            add_timing(row, "fa4", device_time(prepared("fa4", step, spec), device, sizes.repeats))
            add_timing(row, "fa4_plain", device_time(prepared("fa4", without_frames(step), spec), device,
                                                     sizes.repeats))
        rows.append(row)
    worst = max(r["sm90_visited_over_min"] for r in rows if r["frames"] == max(sizes.frame_counts))
    return {"rows": rows, "target": "visited <= 1.3x the minimum tile work at 64 frames",
            "ok": worst <= 1.3}


# --- head dim 512: split-KV decode, flex, SDPA over a padded gather ------------------------------

# The head-dim-512 full layer's kernels the section compares: (backend, split_kv_decode). split_kv
# is what CUDA runs on decode steps (attention/selection.py); flex forced onto them is what ran before.
FALLBACK_VARIANTS = {"split_kv": ("flex", True), "flex": ("flex", False), "sdpa": ("sdpa", None)}


def fallback_steps(context: int, chunk: int, decodes: int) -> dict:
    from mmserve.attention.synthetic import Req

    return {"decode_1": [Req(8 * context - 1, 1)], "decode_64": [Req(context // 2 + 37 * i, 1) for i in range(decodes)],
            "prefill_chunk": [Req(context, chunk)]}


def fallback_variants(step: str) -> tuple[str, ...]:
    return ("split_kv", "flex", "sdpa") if step.startswith("decode") else ("flex", "sdpa")


def fallback_metadata(variant: str, batch, spec: LayerAttentionSpec):
    from mmserve.attention import create_builder
    from mmserve.attention.synthetic import pool_for

    backend, split = FALLBACK_VARIANTS[variant]
    builder = create_builder(backend, replace(pool_for(batch, spec), split_kv_decode=split))
    return builder, builder.build(batch.metadata)


def fallback(sizes: Sizes, device: str) -> dict:
    """Full-layer (head dim 512) decode and prefill steps: the split-KV kernel (decode steps on
    CUDA), flex, and SDPA over a padded gather: the K/V bytes each kernel asks for (L2 hits
    included: a prefill chunk's K/V may fit the 60 MB L2, a 64-request decode's does not) and the
    (query row, key) pairs it computes, counted from the plans the builders really make for the step
    (split-KV: each request's keys from its first kept key, plus the splits' float32 partials
    written and read; flex: every (query block, KV head) program reads each block its block mask
    lists; SDPA: each group's gathered blocks, read from the cache and written as a copy, then read
    once per query tile), the programs that share one KV head's keys at batch 1 (split-KV spreads
    them over the GPU, flex runs one), the per-step metadata build (outside any graph), and on a
    GPU the kernel times, GB/s and its share of the device's measured copy bandwidth (`_of_copy`)."""
    from mmserve.attention import create_impl
    from mmserve.attention.synthetic import make_batch

    spec = sizes.full
    elem = 2 if device == "cuda" else 4
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    block_bytes = 2 * 16 * spec.num_kv_heads * spec.head_dim * elem   # K and V of one 16-token block, all KV heads
    context = 4096 if device == "cuda" else 96
    rows = []
    for name, reqs in fallback_steps(context, sizes.chunk, 64 if device == "cuda" else 4).items():
        batch = to_device(make_batch(reqs, spec, dtype=dtype, num_blocks=blocks_for(reqs), cache_device=device),
                          device)
        needed = sum(-(-r.seq_len // 16) for r in reqs) * block_bytes
        row = {"step": name, "requests": len(reqs), "max_context": max(r.seq_len for r in reqs),
               "needed_kv_bytes": needed, "kept_pairs": causal_pairs(reqs) * spec.num_heads}
        for variant in fallback_variants(name):
            builder, md = fallback_metadata(variant, batch, spec)
            kv_bytes, pairs, programs = FALLBACK_WORK[variant](md, spec, block_bytes)
            row[f"{variant}_kv_bytes"], row[f"{variant}_pairs"] = kv_bytes, pairs
            row[f"{variant}_programs"] = programs
            row[f"{variant}_build_ms"] = host_time(lambda b=builder, c=batch.metadata: b.build(c), device,
                                                   sizes.repeats)
            if device == "cuda":
                impl, b = create_impl(FALLBACK_VARIANTS[variant][0], spec), batch
                timing = device_time(lambda i=impl, m=md, b=b: i.forward(b.q, b.k, b.v, b.kv_cache, m), device,
                                     sizes.repeats)
                add_timing(row, variant, timing)
                row[f"{variant}_GBps"] = kv_bytes / (row[f"{variant}_ms"] * 1e6)
                row[f"{variant}_of_copy"] = row[f"{variant}_GBps"] * 1e9 / sizes.ceilings.copy_bytes_per_s
            row[f"{variant}_bytes_over_needed"] = kv_bytes / needed
        rows.append(row)
    return {"rows": rows}


LENT_SMS = 132   # multiprocessors of both lent kinds (H100 SXM, H200): fallback_plans' default off a GPU


def fallback_plans(sms: int) -> list[dict]:
    """The fallback section's K/V byte counts at GPU shapes from the builders' plans alone (no
    kernel runs, so any machine can print them): 12B's and E2B's full layers, bf16; split-KV
    planned for `sms` multiprocessors (split_kv.default_programs: two programs each)."""
    from mmserve.attention.split_kv import SplitKvPlanner
    from mmserve.attention.synthetic import make_batch, pool_for

    rows = []
    for model, heads in (("12b", 16), ("e2b", 8)):
        spec = replace(GPU.full, num_heads=heads, num_kv_heads=1)
        block_bytes = 2 * 16 * spec.num_kv_heads * spec.head_dim * 2
        for name, reqs in fallback_steps(4096, GPU.chunk, 64).items():
            batch = make_batch(reqs, spec, dtype=torch.bfloat16, num_blocks=blocks_for(reqs))
            row = {"model": model, "step": name, "needed_kv_bytes": sum(-(-r.seq_len // 16) for r in reqs) * block_bytes}
            for variant in fallback_variants(name):
                builder, md = fallback_metadata(variant, batch, spec)
                if variant == "split_kv":
                    md = SplitKvPlanner(pool_for(batch, spec), programs=2 * sms).plan(batch.metadata)
                kv_bytes, _, programs = FALLBACK_WORK[variant](md, spec, block_bytes)
                row[f"{variant}_kv_bytes"], row[f"{variant}_programs"] = kv_bytes, programs
                row[f"{variant}_over_needed"] = kv_bytes / row["needed_kv_bytes"]
            rows.append(row)
    return rows


def causal_pairs(reqs) -> int:
    """(query, key) pairs a full layer keeps: each query sees the keys up to its own position."""
    return sum(r.query * (r.context + 1) + r.query * (r.query - 1) // 2 for r in reqs)


def flex_work(md, spec: LayerAttentionSpec, block_bytes: int) -> tuple[int, int, int]:
    """(K/V bytes, pairs, programs with keys) of flex's kernel: one program per (query block, q_pad
    head); each reads the blocks of its KV head that its block mask lists (partial and full),
    block_bytes / Hkv apiece."""
    from mmserve.attention.flex import Q_BLOCK

    mask = md.block_mask
    listed = int(mask.kv_num_blocks.sum()) + int(mask.full_kv_num_blocks.sum())
    busy = int(((mask.kv_num_blocks + mask.full_kv_num_blocks) > 0).sum())
    heads = md.q_pad.shape[1]
    per_head_block = block_bytes // spec.num_kv_heads
    return heads * listed * per_head_block, heads * listed * Q_BLOCK * 16, heads * busy


def split_kv_work(md, spec: LayerAttentionSpec, block_bytes: int) -> tuple[int, int, int]:
    """(bytes, pairs, programs with keys) of the split-KV kernel: each request's keys from its first
    kept key, once per KV head (block_bytes / 16 per key), each query tile once (a decode token's
    g rows are one tile); with more than one split in the grid, every split's float32 partial rows
    (head dim + its log-sum-exp) written and read back by the merge."""
    c = md.common
    q_lens = torch.diff(c.query_start_loc_cpu[: c.num_reqs + 1]).long()
    keys = c.seq_lens_cpu[: c.num_reqs].long() - md.key_lo.cpu().long()
    splits = md.num_splits.cpu().long()
    g = spec.num_heads // spec.num_kv_heads
    kv_bytes = int(keys.sum()) * md.tiles_per_req * block_bytes // 16
    partials = 0 if md.max_splits == 1 else int((splits * q_lens).sum()) * spec.num_heads * (spec.head_dim + 1) * 4 * 2
    pairs = int((keys * q_lens).sum()) * g * spec.num_kv_heads
    return kv_bytes + partials, pairs, int(splits.sum()) * md.tiles_per_req * spec.num_kv_heads


SDPA_QUERY_TILE = 64   # query rows per program of SDPA's memory-efficient kernel (assumed; head dim 512)


def sdpa_work(md, spec: LayerAttentionSpec, block_bytes: int) -> tuple[int, int, int]:
    """(K/V bytes, pairs, programs) of gather + SDPA: each group gathers R x num_blocks blocks (read
    from the cache, written as a padded copy), and the kernel reads a request's copy once per tile
    of SDPA_QUERY_TILE packed query rows (g rows per query, one program per tile and KV head);
    every padded pair is computed."""
    g = spec.num_heads // spec.num_kv_heads
    gathered = sum(grp.num_reqs * grp.num_blocks for grp in md.groups) * block_bytes
    kernel = sum(grp.num_reqs * grp.num_blocks * -(-grp.q_len * g // SDPA_QUERY_TILE) for grp in md.groups)
    pairs = sum(grp.num_reqs * grp.q_len * g * grp.num_blocks * 16 for grp in md.groups) * spec.num_kv_heads
    programs = sum(grp.num_reqs * -(-grp.q_len * g // SDPA_QUERY_TILE) for grp in md.groups) * spec.num_kv_heads
    return 2 * gathered + kernel * block_bytes, pairs, programs


FALLBACK_WORK = {"split_kv": split_kv_work, "flex": flex_work, "sdpa": sdpa_work}


def host_time(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Median ms of `fn` to completion (host work plus the device work it queues)."""
    fn()
    samples = []
    for _ in range(repeats):
        synchronize(device)
        begin = time.perf_counter()
        fn()
        synchronize(device)
        samples.append((time.perf_counter() - begin) * 1e3)
    return _median(samples)


# --- 2. tokens: the demo checkpoint end to end ----------------------------------------------------

def video_requests(sizes: Sizes, device: str) -> list:
    """Video + text prompts for the demo checkpoint, built by the server's own input processor."""
    from mmserve.config import EngineConfig
    from mmserve.engine.input.processor import InputMessage, InputProcessor, TextInput, VideoInput
    from mmserve.model.spec import load_spec_without_transformers
    from mmserve.multimodal.synthetic import make_clip
    from mmserve.sampling_params import SamplingParams

    sampling = SamplingParams(max_tokens=sizes.max_tokens, ignore_eos=True)
    with ThreadPoolExecutor(2) as pool:
        config = EngineConfig(device=device)
        processor = InputProcessor.from_checkpoint(config, pool, spec=load_spec_without_transformers(config.model), context_length=1024)

        async def build():
            return [await processor.process(f"video-{i}", [InputMessage("user", (
                VideoInput(make_clip(i, num_frames=sizes.token_frames).data, num_frames=sizes.token_frames),
                TextInput("Describe the video.")))], sampling) for i in range(sizes.token_requests)]
        return asyncio.run(build())


# The CPU smoke run's stand-in for FA4 where graphs run: a backend whose every input is a persistent
# buffer, which a graph (on a CPU an emulated one) can hold; SDPA's padded gathers cannot be.
CPU_GRAPH_BACKEND = "flex"
CPU_STEP_TOKENS = 64   # every engine of the graph sections on a CPU (cpu_engine): the smoke's steps fit
CPU_KV_BLOCKS = 128    # per pool, likewise: one full 1024-token context and then some


def cpu_engine(device: str) -> dict:
    """On a CPU, the options every engine of the sections that compare or time graphs (tokens,
    speculation, decode, profile, serving) starts with, in place of their CUDA step budgets: graphs
    emulated (`emulate_cuda_graphs`: the same capture sizes, padding, replays and replay counts as on
    CUDA, so the smoke run exercises that bookkeeping), and one small step size and KV size for all:
    flex compiles its graph again for each other size of either (~15 s cold here), and on a CPU it
    computes over every row and key those sizes give it. Nothing on CUDA."""
    return {} if device == "cuda" else {"emulate_cuda_graphs": True, "max_num_batched_tokens": CPU_STEP_TOKENS,
                                        "prefill_batched_tokens": 0, "num_kv_blocks": CPU_KV_BLOCKS}


def graph_options(device: str, budget: dict) -> dict:
    """A graph section's engine options: its step `budget` (engine_budgets) on CUDA; `cpu_engine`'s
    over CPU_GRAPH_BACKEND on a CPU."""
    return budget if device == "cuda" else {"attention_backend": CPU_GRAPH_BACKEND, **cpu_engine(device)}


def greedy_tokens(requests: list, device: str, **options) -> tuple[list[list[int]], dict]:
    """Each request's greedy tokens, and whether decode graphs were on and how many steps replayed one
    (on a CPU graphs are emulated: a backend that graphs can hold replays them, as on CUDA)."""
    from mmserve.engine.llm import LLM

    # strict: a kernel failing the start-up self-check must fail the section, not be measured as its fallback
    llm = LLM(model=str(DEMO_MODEL_DIR), device=device, max_num_seqs=len(requests), strict_backends=True,
              **cpu_engine(device), **options)
    tokens = [c.token_ids for c in llm.generate(requests)]
    graphs = graph_use(llm)
    del llm
    release_device_memory()
    return tokens, graphs


def graph_use(llm) -> dict:
    """Whether decode graphs were on, how many steps replayed one (verify steps apart), how many
    drafting rounds replayed the drafter's graph or ran eagerly, and how many drafts the target
    verified and accepted (0 without speculation)."""
    graphs, speculator = llm.core.runner.graphs, llm.core.speculator
    return {"graphs_enabled": graphs.enabled, "graph_replays": graphs.replays,
            "verify_replays": sum(n for q, n in graphs.replays_by_query_len.items() if q > 1),
            "draft_replays": speculator.graphs.replays if speculator is not None else 0,
            "draft_eager_rounds": speculator.graphs.eager_rounds if speculator is not None else 0,
            "drafts_verified": sum(speculator.verified) if speculator is not None else 0,
            "drafts_accepted": sum(speculator.accepted) if speculator is not None else 0}


def graphs_ran(use: dict) -> bool:
    """A graph run must have replayed graphs: a failed capture runs eagerly and would otherwise pass
    every comparison with no graph replayed (on a CPU the graphs are emulated: `cpu_engine`)."""
    return use["graphs_enabled"] and use["graph_replays"] > 0


def prefix_agreement(runs: list[list[int]], reference: list[list[int]]) -> float:
    """Mean share of each request's tokens before its first difference from the reference."""
    shares = []
    for got, want in zip(runs, reference, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        shares.append(same / max(len(want), 1))
    return sum(shares) / len(shares)


def tokens(sizes: Sizes, device: str) -> dict:
    requests = video_requests(sizes, device)
    # On the CPU the same comparisons run with CPU stand-ins (reference for fp32, flex for fa4).
    fast = "fa4" if device == "cuda" else CPU_GRAPH_BACKEND
    low = "bfloat16" if device == "cuda" else "float32"
    # The reference is the plainest path: fp32, eager, frames encoded in their own step (no side stream).
    runs = {"reference": dict(dtype="float32", attention_backend="sdpa" if device == "cuda" else "reference",
                              enforce_eager=True, encode_ahead=False),
            "sdpa": dict(dtype=low, attention_backend="sdpa"),
            fast + " graphs": dict(dtype=low, attention_backend=fast),
            fast + " eager": dict(dtype=low, attention_backend=fast, enforce_eager=True)}
    out, use = {}, {}
    for name, opts in runs.items():
        out[name], use[name] = greedy_tokens(requests, device, **opts)
    agree = {name: prefix_agreement(out[name], out["reference"]) for name in runs if name != "reference"}
    graphs_equal = out[fast + " graphs"] == out[fast + " eager"]
    replayed = graphs_ran(use[fast + " graphs"])
    return {"requests": len(requests), "frames": sizes.token_frames, "max_tokens": sizes.max_tokens,
            "agreement_with_fp32": agree, "graphs_equal_eager": graphs_equal, "graphs": use[fast + " graphs"],
            "graphs_replayed": replayed,
            "ok": replayed and graphs_equal and agree[fast + " graphs"] >= agree["sdpa"] - 0.10}


def speculation(sizes: Sizes, device: str) -> dict:
    """The tokens section's video requests with the demo assistant drafting K = 3: verify steps
    (K + 1 rows per request) and drafting rounds as CUDA graphs against eager ones. Identical tokens
    count only if drafts were verified and some accepted (else speculation, or its accept path,
    never ran) and verify and drafter graphs replayed (on a CPU emulated ones)."""
    requests = video_requests(sizes, device)
    fast, low = ("fa4", "bfloat16") if device == "cuda" else (CPU_GRAPH_BACKEND, "float32")
    out, use = {}, {}
    for name, eager in (("graphs", False), ("eager", True)):
        out[name], use[name] = greedy_tokens(requests, device, dtype=low, attention_backend=fast, enforce_eager=eager,
                                             speculative_model=str(DEMO_ASSISTANT_DIR), num_speculative_tokens=3)
    equal = out["graphs"] == out["eager"]
    accepted = all(u["drafts_verified"] > 0 and u["drafts_accepted"] > 0 for u in use.values())
    verify_replayed = use["graphs"]["verify_replays"] > 0
    draft_replayed = use["graphs"]["draft_replays"] > 0
    return {"requests": len(requests), "backend": fast, "graphs_equal_eager": equal, "graphs": use["graphs"],
            "eager": use["eager"], "drafts_accepted": accepted, "verify_graphs_replayed": verify_replayed,
            "draft_graphs_replayed": draft_replayed, "ok": equal and accepted and verify_replayed and draft_replayed}


# --- 5. serving: mmserve.LLM against transformers' batched generate ----------------------------------

def serving_checkpoint(sizes: Sizes, device: str) -> tuple[Path, float]:
    """(checkpoint, seconds spent building it): the demo model on the smoke run, else random weights
    at the family member's dimensions, written once per machine and shared by decode and serving."""
    if sizes.serving_model is None:
        return DEMO_MODEL_DIR, 0.0
    out_dir = Path(tempfile.gettempdir()) / f"gpu_check_{sizes.serving_model}"
    if (out_dir / "complete").exists():
        return out_dir, 0.0
    start = time.perf_counter()
    shutil.rmtree(out_dir, ignore_errors=True)
    random_checkpoint(sizes.serving_model, out_dir, device)
    (out_dir / "complete").touch()
    return out_dir, time.perf_counter() - start


def release_device_memory() -> None:
    """Free what engines and models no longer referenced still hold: a dropped engine's tensors live
    until the garbage collector breaks its cycles (`llm = None` is not enough), and only then can the
    caching allocator return their memory for the next section's load."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


MIN_KV_CACHE = 2**30   # below this an engine of a section is not worth starting: the device is too small


def engine_kv_cache(model_dir: Path, wanted_gib: float) -> int:
    """A CUDA engine's --kv-cache-bytes: `wanted_gib`, or what the device's free memory holds beside
    the checkpoint's weights (its safetensors files) and the engine's headroom, whichever is less
    (an H100 holds ~60 GiB less than an H200). Fails the section before anything loads where less
    than MIN_KV_CACHE is left: the serving model needs a larger kind."""
    release_device_memory()
    free, _ = torch.cuda.mem_get_info()
    checkpoint = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    kv = kv_cache_bytes(int(wanted_gib * 2**30), checkpoint, free)
    if kv < MIN_KV_CACHE:
        raise RuntimeError(f"{model_dir.name}'s weights ({checkpoint / 2**30:.1f} GiB) and the engine's headroom "
                           f"leave {kv / 2**30:.1f} GiB of the {free / 2**30:.1f} GiB free for a KV cache: this "
                           f"serving model needs a device with more memory (nvidia-h200: ~139 GiB)")
    return kv


def kv_record(llm) -> dict:
    """The KV cache an engine of a section started with: its size, and the requests it seats at once."""
    kv = llm.core.kv_capacity
    return {"gib": kv.num_bytes / 2**30, "max_num_seqs": kv.max_num_seqs, "sized_by": kv.sized_by}


def engine_budgets(sizes: Sizes, device: str) -> dict[str, list[dict]]:
    """The step budgets (EngineConfig options; those left out take the device's default) of the
    engines each section starts with graphs, in order. Every such engine captures a piecewise graph
    per token bucket up to its largest step (`piecewise_sizes`: 44 buckets to CUDA's default 8192,
    each layers + 1 graphs after two warm-up forwards), so each gets the budget its steps need and no
    more: the decode steps' sections (decode, profile) and serving chunk their prefills at the CUDA
    default 2048 rather than 8192 (36 buckets, a quarter of the rows forwarded in capture); mixed's
    one step is its chunk beside its decodes; capacity starts as a user would (the defaults: what it
    checks). Sections without graphs (decode's eager engine) are not listed."""
    chunk = 2048 if device == "cuda" else 32   # decode_beside_video: the server's CUDA budget
    return {
        "decode": [dict(prefill_batched_tokens=0)],
        "profile": [dict(prefill_batched_tokens=0)],
        "serving": [dict(max_num_batched_tokens=min(2048, sizes.serving_batch * sizes.serving_prompt),
                         prefill_batched_tokens=0)],
        "mixed": [dict(max_num_batched_tokens=sizes.mixed_chunk + sizes.mixed_decodes, prefill_batched_tokens=0,
                       max_step_slowdown=0)],   # (the step the issue names: the whole chunk beside the decodes)
        "video_prefill": [dict(max_num_batched_tokens=sizes.chunk, prefill_batched_tokens=sizes.chunk),
                          dict(max_num_batched_tokens=chunk, prefill_batched_tokens=0, max_step_slowdown=ITL_SLOWDOWN)],
        "capacity": [{}],
    }


def capture_record(llm) -> dict:
    """What an engine of a section captured at start-up, and how long it took."""
    runner = llm.core.runner
    return {"max_step_tokens": llm.config.max_step_tokens, "piecewise_buckets": len(runner.piecewise.sizes),
            "piecewise_capture_s": runner.piecewise.capture_s, "uniform_graphs": len(runner.graphs.keys),
            "uniform_capture_s": runner.graphs.capture_s}


def capture_plan(sections: list[str], sizes: Sizes) -> list[str]:
    """One line per graph engine of `sections` as a CUDA run starts it (`engine_budgets`): its
    largest step, token buckets, piecewise graphs and the rows its capture forwards (two warm-ups
    and the capture per bucket), at the serving model's layers."""
    from mmserve.config import EngineConfig
    from mmserve.worker.cuda_graphs import WARMUP_RUNS
    from mmserve.worker.piecewise_graphs import piecewise_sizes

    layers = json.loads((FAMILY / f"{sizes.serving_model}.json").read_text())["text_config"]["num_hidden_layers"]
    lines = []
    for section in sections:
        for i, budget in enumerate(engine_budgets(sizes, "cuda").get(section, [])):
            buckets = piecewise_sizes(EngineConfig(device="cuda", **budget).max_step_tokens)
            lines.append(f"{section}[{i}]: steps to {buckets[-1]} tokens, {len(buckets)} buckets, "
                         f"{len(buckets) * (layers + 1)} piecewise graphs ({layers} layers), "
                         f"{(WARMUP_RUNS + 1) * sum(buckets)} rows forwarded to capture them")
    return lines


def random_checkpoint(name: str, out_dir: Path, device: str) -> Path:
    """Random bf16 weights at a family member's published dimensions (tests/fixtures/gemma4_family)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(**json.loads((FAMILY / f"{name}.json").read_text()))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(out_dir), max_shard_size="4GB")
    del model
    return out_dir


def hf_attention(model_dir: Path) -> dict[str, str]:
    """transformers' attention per sub-model: SDPA, but eager for the audio tower (E2B/E4B), which
    refuses SDPA (and never runs here: the prompts are text)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    present = [k for k in ("text_config", "vision_config", "audio_config") if getattr(config, k, None) is not None]
    return {k: "eager" if k == "audio_config" else "sdpa" for k in present}


def hf_batch_generate(model_dir: Path, prompts: torch.Tensor, max_tokens: int, device: str) -> tuple[float, list]:
    """transformers' generate over the whole batch (identical prompts need no padding): (seconds, tokens)."""
    from transformers import AutoModelForImageTextToText

    release_device_memory()   # the engine a section ran before this (profile's, serving's own) must not hold the card
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype,
                                                        attn_implementation=hf_attention(model_dir))
    model = model.to(device).eval()
    config = copy.deepcopy(model.generation_config)
    # Exactly max_tokens new tokens, like ignore_eos: an EOS id past the vocabulary is never chosen.
    config.eos_token_id = model.config.get_text_config().vocab_size
    config.max_new_tokens, config.do_sample = max_tokens, False
    ids = prompts.to(device)
    with torch.inference_mode():
        warm = copy.deepcopy(config)
        warm.max_new_tokens = 2
        model.generate(input_ids=ids[:1], attention_mask=torch.ones_like(ids[:1]), generation_config=warm)
        synchronize(device)
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        synchronize(device)
        seconds = time.perf_counter() - start
    tokens = out[:, ids.shape[1]:].tolist()
    del model
    release_device_memory()
    return seconds, tokens


def mmserve_generate(model_dir: Path, prompts: torch.Tensor, max_tokens: int, device: str, budget: dict
                     ) -> tuple[float, list, dict]:
    """(seconds, tokens, graph use, the KV cache and the captures it ran with) of mmserve.LLM on the batch."""
    from mmserve.engine.llm import LLM
    from mmserve.sampling_params import SamplingParams

    batch, prompt = prompts.shape
    options = dict(device=device, max_num_seqs=batch, max_model_len=prompt + max_tokens + 16, strict_backends=True,
                   **graph_options(device, budget))
    if device == "cuda":
        options["kv_cache_bytes"] = engine_kv_cache(model_dir, 16)
    llm = LLM(model=str(model_dir), **options)
    kv, captures = kv_record(llm), capture_record(llm)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompts[0].tolist()], SamplingParams(max_tokens=2, ignore_eos=True))   # warm-up
    synchronize(device)
    start = time.perf_counter()
    done = llm.generate([p.tolist() for p in prompts], sampling)
    synchronize(device)
    seconds = time.perf_counter() - start
    graphs = graph_use(llm)
    del llm
    release_device_memory()
    return seconds, [c.token_ids for c in done], {**graphs, "kv_cache": kv, "captures": captures}


def serving(sizes: Sizes, device: str) -> dict:
    model_dir, build_s = serving_checkpoint(sizes, device)
    from mmserve.model.spec import load_spec

    spec = load_spec(model_dir)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(min(1000, spec.vocab_size // 2), spec.vocab_size, (sizes.serving_prompt,), generator=gen)
    prompt[0] = spec.bos_token_id
    prompts = prompt.expand(sizes.serving_batch, -1).contiguous()
    hf_s, hf_tokens = hf_batch_generate(model_dir, prompts, sizes.serving_tokens, device)
    ours_s, our_tokens, graphs = mmserve_generate(model_dir, prompts, sizes.serving_tokens, device,
                                                  engine_budgets(sizes, device)["serving"][0])
    total = sizes.serving_batch * sizes.serving_tokens
    agree = sum(a == b for x, y in zip(hf_tokens, our_tokens, strict=True) for a, b in zip(x, y, strict=False))
    return {"model": sizes.serving_model or "demo-sized", "batch": sizes.serving_batch,
            "prompt_tokens": sizes.serving_prompt, "output_tokens": sizes.serving_tokens,
            "checkpoint_build_s": build_s, "hf_tok_s": total / hf_s, "mmserve_tok_s": total / ours_s,
            "speedup": hf_s / ours_s, "greedy_agreement": agree / total, "graphs": graphs,
            "ok": graphs_ran(graphs)}


# --- 5a. capacity: the KV cache sized from the device, many long requests at once -------------------

CAPACITY_OUTPUT = 8   # tokens each capacity request generates


def capacity_requests(kv, wanted: int, prompt: int, block_size: int) -> int:
    """How many requests of `prompt` + CAPACITY_OUTPUT tokens the cache start-up sized holds at once:
    `wanted`, or fewer where its seats or its full-attention pool (every token of every request) hold
    fewer. Issue 36's 64 x 8k is an H200's: an H100's KV cache, ~43 GiB by estimate, holds ~270k
    full-attention tokens of the 12B (`mmserve perf --kv-cache-gib 43`: its 128 seats' sliding windows
    take the rest), about 33 such requests."""
    per_request = -(-(prompt + CAPACITY_OUTPUT) // block_size) * block_size
    return min(wanted, kv.max_num_seqs, kv.pool_tokens.get(FULL, wanted * per_request) // per_request)


def capacity(sizes: Sizes, device: str) -> dict:
    """Start the serving model as a user would, with no memory flag, and load it with as many of
    `capacity_batch` requests of `capacity_prompt` tokens as the cache it sized holds at once
    (`capacity_requests`): none may be preempted; `meets_target` says whether all of them fit."""
    from mmserve.engine.llm import LLM
    from mmserve.sampling_params import SamplingParams

    model_dir, build_s = serving_checkpoint(sizes, device)
    release_device_memory()   # a dropped engine of the section before must not shrink the cache this one sizes
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    llm = LLM(model=str(model_dir), device=device, strict_backends=True, **engine_budgets(sizes, device)["capacity"][0])
    start_s = time.perf_counter() - started
    captures = capture_record(llm)
    kv = llm.core.kv_capacity
    preempted = []
    schedule = llm.core.scheduler.schedule

    def counting():
        out = schedule()
        preempted.extend(out.preempted_ids)
        return out

    llm.core.scheduler.schedule = counting
    spec = llm.core.model.spec
    batch = max(1, capacity_requests(kv, sizes.capacity_batch, sizes.capacity_prompt, llm.config.block_size))
    gen = torch.Generator().manual_seed(2)
    prompts = [[spec.bos_token_id] + torch.randint(min(1000, spec.vocab_size // 2), spec.vocab_size,
                                                   (sizes.capacity_prompt - 1,), generator=gen).tolist()
               for _ in range(batch)]
    synchronize(device)
    started = time.perf_counter()
    done = llm.generate(prompts, SamplingParams(max_tokens=CAPACITY_OUTPUT, ignore_eos=True))
    synchronize(device)
    seconds = time.perf_counter() - started
    config = llm.config
    result = {"model": sizes.serving_model or "demo-sized", "checkpoint_build_s": build_s, "start_s": start_s,
              "kv_cache": {"pool_tokens": kv.pool_tokens, "full_context_requests": kv.full_context_requests,
                           "num_bytes": kv.num_bytes, "max_num_seqs": kv.max_num_seqs, "sized_by": kv.sized_by},
              "max_num_batched_tokens": config.max_num_batched_tokens,
              "prefill_batched_tokens": config.prefill_batched_tokens, "requests": len(done),
              "target_requests": sizes.capacity_batch, "meets_target": batch >= sizes.capacity_batch,
              "prompt_tokens": sizes.capacity_prompt, "generate_s": seconds, "preempted": len(preempted),
              "captures": captures}
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        result.update(peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30, device_gib=total / 2**30,
                      budget_gib=config.gpu_memory_utilization * total / 2**30)
    del llm
    release_device_memory()
    result["ok"] = not preempted and kv.full_context_requests >= 1 and len(done) == batch
    return result


# --- 5b. decode: one decode step, graphs against eager, against the bytes it must move ------------

SERVING_MODELS = ("12b_unified", "e4b", "26b_a4b", "31b")   # tests/fixtures/gemma4_family


def decode(sizes: Sizes, device: str) -> dict:
    """Decode step time at each batch size with CUDA graphs (the default) and with --enforce-eager,
    at the serving model's dimensions, against the floor no version beats: the bytes the step moves
    by the engine's perf model (each decoder weight once, the K/V it attends to, the rows it gathers
    of the per-layer embedding table: not the whole table, nor the vision tower, which
    `weight_bytes` counts) over the device's measured copy bandwidth (and its datasheet's beside)."""
    from mmserve.engine.llm import LLM
    from mmserve.metrics.perf_model import PerfModel, RequestWork, StepContext

    model_dir, build_s = serving_checkpoint(sizes, device)
    prompt_len = 128 if device == "cuda" else 16
    rows, weight_bytes, use, kv, captures = [], 0, {}, {}, {}
    for eager in (False, True):
        options = dict(device=device, max_num_seqs=max(sizes.decode_batches), enforce_eager=eager,
                       max_model_len=prompt_len + sizes.decode_steps + 16, strict_backends=True,
                       **graph_options(device, engine_budgets(sizes, device)["decode"][0]))
        if device == "cuda":
            options["kv_cache_bytes"] = engine_kv_cache(model_dir, 8)
        llm = LLM(model=str(model_dir), **options)
        kv["eager" if eager else "graphs"] = kv_record(llm)
        captures["eager" if eager else "graphs"] = capture_record(llm)
        weight_bytes = sum(p.numel() * p.element_size() for p in llm.core.model.parameters())
        perf = PerfModel(llm.core.model.spec, dtype=llm.config.dtype)
        for batch in sizes.decode_batches:
            step_ms, replays, forward_ms = decode_step_ms(llm, batch, prompt_len, sizes.decode_steps, device,
                                                          sizes.repeats)
            context = prompt_len + 3 + sizes.decode_steps // 2   # the timed steps' middle one
            moved = perf.step(StepContext(tuple(RequestWork(1, context, False) for _ in range(batch)))).total_bytes
            floors = sizes.ceilings.against_floors(step_ms / 1e3, nbytes=moved)
            rows.append({"batch": batch, "graphs": not eager, "step_ms": step_ms, "graph_replays": replays,
                         "forward_ms": forward_ms, "step_bytes": moved, **floors,
                         "forward_over_floor": None if forward_ms is None else forward_ms / floors["floor_ms"]})
        use["eager" if eager else "graphs"] = graph_use(llm)
        del llm
        release_device_memory()
    # every timed step of a graph row must have replayed one (a batch past the captured sizes runs eagerly)
    replayed = all(r["graph_replays"] >= sizes.decode_steps for r in rows if r["graphs"])
    return {"model": sizes.serving_model or "demo-sized", "weight_bytes": weight_bytes, "checkpoint_build_s": build_s,
            "kv_cache": kv, "captures": captures, "graph_use": use, "rows": rows, "every_batch_replayed": replayed,
            "ok": graphs_ran(use["graphs"]) and replayed}


def decode_step_ms(llm, batch: int, prompt_len: int, steps: int, device: str, repeats: int
                   ) -> tuple[float, int, float | None]:
    """Median wall ms of one decode step of `batch` requests (each step ends with the sampled tokens
    on the host, so its wall time is its latency), after their prefill and two warm steps; how many
    of the timed steps replayed a graph; and the forward alone: the replay of that batch's graph
    (device time on CUDA, `replay_ms`; the host clock over an emulated one on a CPU), None where no
    graph holds it (eager)."""
    step = start_decoding(llm, batch, prompt_len, steps)
    samples, replays = [], llm.core.runner.graphs.replays
    for _ in range(steps):
        synchronize(device)
        begin = time.perf_counter()
        step()
        samples.append((time.perf_counter() - begin) * 1e3)
    replays = llm.core.runner.graphs.replays - replays
    graphs, forward_ms = llm.core.runner.graphs, None
    size = graphs.size_for(batch) if graphs.enabled else None
    if size is not None:   # the inputs of the last step are still in its buffers: replaying recomputes it
        replay = functools.partial(graphs.replay, size)
        with torch.inference_mode():   # an emulated replay runs the forward's ops, as the engine's step does
            forward_ms = replay_ms(replay, repeats) if device == "cuda" else host_time(replay, device, repeats)
    while llm.has_work:   # let them finish, so the next batch size starts on an empty engine
        step()
    return _median(samples), replays, forward_ms


def replay_ms(replay: Callable[[], object], repeats: int) -> float:
    """Device ms of one replay of a captured graph: GRAPH_CALLS back-to-back replays between two
    events (a replay's host cost, one launch, is far below its kernels'), median of `repeats`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(GRAPH_CALLS):
            replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / GRAPH_CALLS)
    return _median(samples)


def start_decoding(llm, batch: int, prompt_len: int, steps: int) -> Callable[[], None]:
    """Add `batch` random prompts, run their prefill and two decode steps (warm-up); returns one
    engine step (which raises a request's error)."""
    from mmserve.engine.types import EngineRequest
    from mmserve.sampling_params import SamplingParams

    vocab = llm.core.model.spec.vocab_size
    sampling = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    ids = [f"decode-{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    gen = torch.Generator().manual_seed(batch)
    for rid in ids:
        prompt = torch.randint(min(1000, vocab // 2), vocab, (prompt_len,), generator=gen).tolist()
        llm.add_request(EngineRequest(rid, prompt, sampling=sampling))
    produced: dict[str, int] = dict.fromkeys(ids, 0)

    def step() -> None:
        for rid, item in llm.step():
            if isinstance(item, BaseException):
                raise item
            produced[rid] += len(item.new_token_ids)
    while min(produced.values()) < 3:   # prefill done, and two decode steps to warm up
        step()
    return step


# --- 6b. profile: the kernels of a decode step -------------------------------------------------------

PROFILE_STEPS = 3
TOP_KERNELS = 15
MAX_KERNELS_PER_DENSE_LAYER = 12   # issue 34's target (bench/kernel_count.py counts it on a CPU)
_NO_KERNEL = {"view", "as_strided", "empty", "empty_strided", "result_type", "to", "_reshape_alias", "detach",
              "slice", "select", "unsqueeze", "squeeze", "t", "transpose", "expand", "reshape", "split", "chunk",
              "lift_fresh", "resolve_conj", "resolve_neg", "is_nonzero", "item", "_local_scalar_dense"}
_GEMM = re.compile(r"gemm|gemv|cutlass|cublas|xmma|nvjet|splitk|aten::(?:mm|addmm|bmm|_grouped_mm)", re.I)


def profile(sizes: Sizes, device: str) -> dict:
    """PROFILE_STEPS decode steps under torch.profiler (with CUDA activities on a GPU: the kernels of
    the replayed graphs) at the serving model's dimensions, at the smallest and largest decode batch:
    kernels per step and per decoder layer (all of a step's kernels over its layers: the head and
    sampler's few included), the TOP_KERNELS by time, GEMM time against everything else. On the
    smoke run the CPU's leaf ATen ops stand in for kernels (the plumbing, not the numbers)."""
    from torch.profiler import ProfilerActivity

    from mmserve.engine.llm import LLM

    model_dir, build_s = serving_checkpoint(sizes, device)
    prompt_len = 128 if device == "cuda" else 16
    batches = sorted({sizes.decode_batches[0], sizes.decode_batches[-1]})
    options = dict(device=device, max_num_seqs=batches[-1], strict_backends=True,
                   max_model_len=prompt_len + 3 + PROFILE_STEPS + 16,
                   **graph_options(device, engine_budgets(sizes, device)["profile"][0]))
    if device == "cuda":
        options["kv_cache_bytes"] = engine_kv_cache(model_dir, 8)
    llm = LLM(model=str(model_dir), **options)
    kv, captures = kv_record(llm), capture_record(llm)
    layers = llm.core.model.spec.num_layers
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    rows = []
    for batch in batches:
        step = start_decoding(llm, batch, prompt_len, PROFILE_STEPS)
        replays = llm.core.runner.graphs.replays
        synchronize(device)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(PROFILE_STEPS):
                step()
            synchronize(device)
        replays = llm.core.runner.graphs.replays - replays
        while llm.has_work:
            step()
        rows.append({"batch": batch, "graph_replays": replays, **kernel_table(kernel_events(prof, device), layers)})
    use = graph_use(llm)
    del llm
    release_device_memory()
    per_layer = max(r["kernels_per_layer"] for r in rows)
    replayed = all(r["graph_replays"] >= PROFILE_STEPS for r in rows)
    return {"model": sizes.serving_model or "demo-sized", "layers": layers, "steps": PROFILE_STEPS,
            "checkpoint_build_s": build_s, "kv_cache": kv, "captures": captures, "rows": rows,
            "max_kernels_per_layer": per_layer,
            "target_kernels_per_layer": MAX_KERNELS_PER_DENSE_LAYER,
            "target_met": per_layer <= MAX_KERNELS_PER_DENSE_LAYER, "graph_use": use,
            "ok": graphs_ran(use) and replayed}


def kernel_events(prof, device: str) -> list[tuple[str, float]]:
    """(name, device ms) of every kernel the profile saw; on a CPU, every ATen op with no ATen op
    inside it (host ms)."""
    from torch.autograd import DeviceType

    events = prof.events()
    if device == "cuda":
        return [(e.name, e.device_time_total / 1e3) for e in events if e.device_type == DeviceType.CUDA]
    return [(e.name, e.cpu_time_total / 1e3) for e in events if e.name.startswith("aten::")
            and e.name.removeprefix("aten::") not in _NO_KERNEL
            and not any(child.name.startswith("aten::") for child in e.cpu_children)]


def kernel_table(kernels: list[tuple[str, float]], layers: int) -> dict:
    """Per step: kernels, per layer, GEMM ms against the rest, and the TOP_KERNELS names by time."""
    by_name: dict[str, list[float]] = {}
    for name, ms in kernels:
        by_name.setdefault(name, []).append(ms)
    gemm = sum(ms for name, ms in kernels if _GEMM.search(name))
    total = sum(ms for _, ms in kernels)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:TOP_KERNELS]
    per_step = len(kernels) / PROFILE_STEPS
    return {"kernels_per_step": per_step, "kernels_per_layer": per_step / layers,
            "kernel_ms_per_step": total / PROFILE_STEPS, "gemm_ms_per_step": gemm / PROFILE_STEPS,
            "other_ms_per_step": (total - gemm) / PROFILE_STEPS, "gemm_share": gemm / total if total else 0.0,
            "top": [{"name": name[:120], "calls_per_step": len(times) / PROFILE_STEPS,
                     "ms_per_step": sum(times) / PROFILE_STEPS} for name, times in top]}


# --- 8. collectives: tensor parallelism's all-reduce per layer, on a single-rank NCCL group -----------

TP_MEMBERS = ("e4b", "12b_unified", "26b_a4b", "31b")   # widths and layer counts: tests/fixtures/gemma4_family
NVLINK_BYTES_PER_S = 450e9   # H100/H200 NVLink 4: 900 GB/s per GPU, both directions together
TP_SIZES = (2, 4, 8)


def tp_layout(name: str) -> dict:
    """A member's hidden width, layers and all-reduces per layer: after o_proj and the MLP, and the
    routed experts' on the MoE model (model/decoder.py, model/moe.py)."""
    text = json.loads((FAMILY / f"{name}.json").read_text())["text_config"]
    return {"hidden": text["hidden_size"], "layers": text["num_hidden_layers"],
            "per_layer": 3 if text.get("enable_moe_block") else 2}


@contextlib.contextmanager
def single_rank_group(device: str):
    """The default process group of one rank: NCCL on CUDA (what the layers' all-reduce calls there),
    gloo on the smoke run; torn down afterwards so no other section sees it."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as rendezvous:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{rendezvous}/file",
                                rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def ring_wire_us(nbytes: int, ranks: int) -> float:
    """A ring all-reduce's time on the wire alone: each GPU sends and receives 2 (N - 1) / N of the
    tensor (reduce-scatter, then all-gather) at the link's one-direction bandwidth; no latency."""
    return 2 * (ranks - 1) / ranks * nbytes / NVLINK_BYTES_PER_S * 1e6


def collectives(sizes: Sizes, device: str) -> dict:
    """Per call: the all-reduce of a decode step's (batch rows) or a prefill chunk's rows of hidden
    states, timed as the other kernels are (graph replays, or back-to-back calls between events);
    per layer and per step: times the layer's all-reduces (per step: every layer and the embedding's).
    With one rank NCCL moves nothing over a link: this is the floor a collective adds (launch, the
    kernel's fixed cost), and it tells whether the layers' collectives can be captured into the
    decode graphs; the NVLink columns model the bytes a real group would add."""
    import torch.distributed as dist

    dtype = torch.bfloat16 if device == "cuda" else torch.float32   # gloo's CPU all-reduce: no bf16
    rows_list = (*sizes.decode_batches, sizes.chunk)
    out = []
    with single_rank_group(device) as group:
        for name in TP_MEMBERS:
            layout = tp_layout(name)
            for rows in rows_list:
                x = torch.randn(rows, layout["hidden"], dtype=dtype, device=device)
                timing = device_time(lambda x=x: dist.all_reduce(x, group=group), device, sizes.repeats)
                row = {"model": name, "rows": rows, "phase": "prefill" if rows == sizes.chunk else "decode",
                       "bytes": x.numel() * x.element_size()}
                ms = timing["ms"]
                add_timing(row, "all_reduce", timing)
                row.update(per_layer_us=layout["per_layer"] * ms * 1e3,
                           per_step_ms=(layout["layers"] * layout["per_layer"] + 1) * ms)
                for n in TP_SIZES:
                    row[f"nvlink_tp{n}_per_layer_us"] = layout["per_layer"] * ring_wire_us(row["bytes"], n)
                out.append(row)
    methods = {r["all_reduce_method"] for r in out}
    return {"ok": True, "backend": "nccl" if device == "cuda" else "gloo", "dtype": str(dtype), "world_size": 1,
            "measures": "one rank: NCCL's fixed cost per call and whether it captures into a graph, not TP's "
                        "cost (the engine issues no collective at TP 1; nvlink_* columns are a bytes model)",
            "captured": methods == {"graph"}, "methods": sorted(methods), "rows": out}


# --- 9. video_prefill and mixed: every step a graph (#35) ------------------------------------------

def graph_engine(model_dir: Path, device: str, **options):
    """An LLM as served (graphs on CUDA, strict backends: a failed capture must fail the section);
    on the CPU smoke run the graphs are emulated, so the piecewise plumbing runs too."""
    from mmserve.engine.llm import LLM

    if device == "cuda":   # 32 GiB seat mixed's 64 requests at 12B (24 seat 60: `mmserve perf --kv-cache-gib`)
        if "kv_cache_bytes" not in options:
            options["kv_cache_bytes"] = engine_kv_cache(model_dir, 32)
    return LLM(model=str(model_dir), device=device, strict_backends=True, emulate_cuda_graphs=device != "cuda",
               **options)


def video_request(spec, rid: str, num_frames: int, max_tokens: int, seed: int):
    """A prompt of `num_frames` random 360x640 frames through the server's preprocessing (the model's
    video soft-token budget per frame), a text token before each and a question after."""
    import numpy as np

    from mmserve.engine.types import EngineRequest
    from mmserve.multimodal.preprocess import preprocess_images
    from mmserve.request import MultiModalInput
    from mmserve.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    frames = preprocess_images([rng.integers(0, 256, (360, 640, 3), dtype=np.uint8) for _ in range(num_frames)],
                               patch_size=spec.patch_size, pooling_kernel_size=spec.pooling_kernel_size,
                               max_soft_tokens=spec.video_max_soft_tokens)
    text = lambda n: rng.integers(min(1000, spec.vocab_size // 2), spec.vocab_size, n).tolist()   # noqa: E731
    ids, ranges = [spec.bos_token_id], []
    for n in frames.num_soft_tokens:
        ids += text(1) + [spec.boi_token_id]
        ranges.append((len(ids), len(ids) + n - 1))
        ids += [spec.video_token_id] * n + [spec.eoi_token_id]
    ids += text(8)
    inputs = [MultiModalInput(frames.pixel_values[i], frames.position_ids[i]) for i in range(num_frames)]
    return EngineRequest(rid, ids, ranges, inputs, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         num_frames=num_frames, num_mm_tokens=sum(frames.num_soft_tokens))


def prefill_flops(perf, request) -> float:
    """The perf model's FLOPs of prefilling a whole prompt (its frames through the vision tower too)."""
    from mmserve.metrics.perf_model import RequestWork, StepContext, VisionWork

    n = len(request.prompt_token_ids)
    images = tuple(VisionWork(int((m.position_ids[:, 0] >= 0).sum()), e - s + 1)
                   for m, (s, e) in zip(request.mm_inputs, request.mm_ranges, strict=True))
    return perf.step(StepContext((RequestWork(n, n, True, tuple(request.mm_ranges)),), images)).total_flops


def graph_steps(llm) -> tuple[int, int]:
    runner = llm.core.runner
    return runner.graphs.replays, runner.piecewise.replays


def video_prefill(sizes: Sizes, device: str) -> dict:
    """(a) `video_requests` videos of `video_frames` frames prefilled together through the engine:
    frames per second and the FLOP floor's share of the wall time (the perf model's FLOPs, vision
    tower included, / the device's measured GEMM rate; target >= 0.6; the datasheet's beside); every
    step replays a graph (piecewise).
    (b) the inter-token latency of `itl_decodes` decoding requests while one such video prefills
    beside them, against their latency alone (target <= 1.5x)."""
    from mmserve.metrics.perf_model import PerfModel

    model_dir, build_s = serving_checkpoint(sizes, device)
    llm = graph_engine(model_dir, device, max_num_seqs=max(sizes.video_requests, sizes.itl_decodes + 1),
                       **engine_budgets(sizes, device)["video_prefill"][0])
    spec, kv, captures = llm.core.model.spec, kv_record(llm), capture_record(llm)
    perf = PerfModel(spec, dtype=llm.config.dtype if llm.config.dtype != "auto" else
                     ("bfloat16" if device == "cuda" else "float32"))
    llm.generate([video_request(spec, "warm", 2, 1, seed=99)])   # encoder, pieces and sampler warm
    videos = [video_request(spec, f"video-{i}", sizes.video_frames, 1, seed=i) for i in range(sizes.video_requests)]
    before = graph_steps(llm)
    steps = llm.core.step_index
    synchronize(device)
    start = time.perf_counter()
    llm.generate(videos)
    synchronize(device)
    seconds = time.perf_counter() - start
    replayed = sum(graph_steps(llm)) - sum(before)
    ran = llm.core.step_index - steps
    flops = sum(prefill_flops(perf, v) for v in videos)
    floor_s, sheet_s = sizes.ceilings.floor_s(flops=flops), sizes.ceilings.floor_s(flops=flops, datasheet=True)
    frames = sizes.video_frames * sizes.video_requests
    prefill = {"videos": sizes.video_requests, "frames_each": sizes.video_frames,
               "tokens_each": len(videos[0].prompt_token_ids), "seconds": seconds, "frames_per_s": frames / seconds,
               "flops": flops, "flop_floor_s": floor_s, "of_floor": floor_s / seconds,
               "datasheet_of_floor": None if sheet_s is None else sheet_s / seconds, "kv_cache": kv,
               "captures": captures, "steps": ran, "graph_steps": replayed}
    del llm
    release_device_memory()
    itl = decode_beside_video(model_dir, device, sizes)
    # every step a graph (emulated on a CPU) anywhere; the targets on CUDA only: a CPU step is mostly overhead
    targets_met = prefill["of_floor"] >= 0.6 and itl["ratio"] <= 1.5
    ok = prefill["graph_steps"] == prefill["steps"] and (targets_met or device != "cuda")
    return {"model": sizes.serving_model or "demo-sized", "checkpoint_build_s": build_s, "prefill": prefill,
            "itl": itl, "ok": ok}


# the server's CUDA default, named on a CPU too so that the dry run schedules through the cap
ITL_SLOWDOWN = DEVICE_DEFAULTS["cuda"]["max_step_slowdown"]


def decode_beside_video(model_dir: Path, device: str, sizes: Sizes) -> dict:
    """Median step time of `itl_decodes` decoding requests alone, then of the steps that also carry
    a chunk of one video's prompt, as the server schedules them on CUDA: its 2048-token budget, and its
    prefill cap beside decodes (`max_step_slowdown` 1.4: the step's roofline by the perf model over the
    engine's peaks within 1.4x its decode rows'); each such step's prompt tokens are recorded. Then
    the same for another video with the cap off (`uncapped`), in the same engine."""
    from mmserve.engine.types import EngineRequest
    from mmserve.sampling_params import SamplingParams

    options = engine_budgets(sizes, device)["video_prefill"][1]
    llm = graph_engine(model_dir, device, max_num_seqs=sizes.itl_decodes + 1, **options)
    spec, captures = llm.core.model.spec, capture_record(llm)
    vocab = spec.vocab_size
    sampling = SamplingParams(max_tokens=100_000 if device == "cuda" else 400, ignore_eos=True)
    gen = torch.Generator().manual_seed(7)
    for i in range(sizes.itl_decodes):
        prompt = torch.randint(min(1000, vocab // 2), vocab, (64,), generator=gen).tolist()
        llm.add_request(EngineRequest(f"decode-{i}", prompt, sampling=sampling))

    def timed_step() -> float:
        synchronize(device)
        begin = time.perf_counter()
        for _, item in llm.step():
            if isinstance(item, BaseException):
                raise item
        synchronize(device)
        return (time.perf_counter() - begin) * 1e3

    while any(r.is_prefill for r in llm.core.scheduler.running) or llm.core.scheduler.waiting:
        llm.step()
    alone = [timed_step() for _ in range(8 if device == "cuda" else 2)]

    def beside_a_video(rid: str, seed: int) -> dict:
        """The steps that carry a chunk of a new video's prompt: their median time, each one's chunk."""
        llm.add_request(video_request(spec, rid, sizes.video_frames, 1, seed=seed))
        video, beside, chunks = llm.core.requests[rid], [], []
        while video.num_computed_tokens < video.num_prompt_tokens and rid in llm.core.requests:
            computed = video.num_computed_tokens
            ms = timed_step()
            if video.num_computed_tokens > computed:   # the step carried one of its chunks
                beside.append(ms)
                chunks.append(video.num_computed_tokens - computed)
        median = _median(beside) if beside else None
        return {"chunk_tokens": chunks, "beside_video_ms": median, "video_steps": len(beside),
                "ratio": median / _median(alone) if beside else float("inf")}

    peaks = llm.core.peaks
    result = {"decodes": sizes.itl_decodes, "budget": options["max_num_batched_tokens"], "captures": captures,
              "max_step_slowdown": ITL_SLOWDOWN,
              "cap_peaks": {"flops": peaks.flops, "bandwidth": peaks.bandwidth, "source": peaks.source},
              "alone_ms": _median(alone), **beside_a_video("video", seed=5)}
    llm.core.scheduler.step_time = None   # the cap off, in the same engine: what it bought (another video)
    result["uncapped"] = beside_a_video("video-uncapped", seed=6)
    llm = None   # (not del: timed_step closes over it) frees its caches before the next section
    release_device_memory()
    return result


def mixed(sizes: Sizes, device: str) -> dict:
    """One `mixed_chunk`-token prefill chunk beside `mixed_decodes` decodes at the serving model's
    dimensions: the step's wall time against its own floor, max(bytes / copy bandwidth, FLOPs / GEMM
    rate) by the perf model, the device's measured ceilings (target <= 1.4x; its datasheet's beside),
    and whether it replayed a piecewise graph."""
    from mmserve.engine.types import EngineRequest
    from mmserve.metrics.perf_model import PerfModel, RequestWork, StepContext
    from mmserve.sampling_params import SamplingParams

    model_dir, build_s = serving_checkpoint(sizes, device)
    decode_prompt = 128 if device == "cuda" else 8
    llm = graph_engine(model_dir, device, max_num_seqs=sizes.mixed_decodes + 1, **engine_budgets(sizes, device)["mixed"][0])
    spec, kv, captures = llm.core.model.spec, kv_record(llm), capture_record(llm)
    perf = PerfModel(spec, dtype="bfloat16" if device == "cuda" else "float32")
    vocab = spec.vocab_size
    gen = torch.Generator().manual_seed(3)
    text = lambda n: torch.randint(min(1000, vocab // 2), vocab, (n,), generator=gen).tolist()   # noqa: E731
    long_sampling = SamplingParams(max_tokens=100_000 if device == "cuda" else 400, ignore_eos=True)
    for i in range(sizes.mixed_decodes):
        llm.add_request(EngineRequest(f"decode-{i}", [spec.bos_token_id] + text(decode_prompt - 1),
                                      sampling=long_sampling))
    while any(r.is_prefill for r in llm.core.scheduler.running) or llm.core.scheduler.waiting:
        llm.step()
    rows = []
    for k in range(3 if device == "cuda" else 1):
        rid = f"chunk-{k}"
        llm.add_request(EngineRequest(rid, [spec.bos_token_id] + text(sizes.mixed_chunk - 1),
                                      sampling=SamplingParams(max_tokens=1, ignore_eos=True)))
        before = graph_steps(llm)[1]
        contexts = [r.num_computed_tokens + 1 for r in llm.core.scheduler.running]
        synchronize(device)
        begin = time.perf_counter()
        llm.step()
        synchronize(device)
        ms = (time.perf_counter() - begin) * 1e3
        work = tuple(RequestWork(1, c, False) for c in contexts) + (RequestWork(sizes.mixed_chunk, sizes.mixed_chunk, True),)
        breakdown = perf.step(StepContext(work))
        rows.append({"step_ms": ms, "decodes": len(contexts),
                     **sizes.ceilings.against_floors(ms / 1e3, breakdown.total_bytes, breakdown.total_flops),
                     "bytes": breakdown.total_bytes, "flops": breakdown.total_flops,
                     "piecewise_replayed": graph_steps(llm)[1] > before})
        while any(r.request_id == rid for r in llm.core.scheduler.running + llm.core.scheduler.waiting):
            llm.step()   # its sampled token; the decodes go on
    del llm
    release_device_memory()
    best = min(r["over_floor"] for r in rows)
    # every step piecewise (emulated on a CPU) anywhere; the target on CUDA only: a CPU step is mostly overhead
    ok = all(r["piecewise_replayed"] for r in rows) and (best <= 1.4 or device != "cuda")
    return {"model": sizes.serving_model or "demo-sized", "chunk": sizes.mixed_chunk, "decodes": sizes.mixed_decodes,
            "checkpoint_build_s": build_s, "kv_cache": kv, "captures": captures, "best_over_floor": best, "rows": rows,
            "ok": ok}


# --- driver ------------------------------------------------------------------------------------

SECTIONS: dict[str, Callable[[Sizes, str], dict]] = {
    "parity": parity, "tokens": tokens, "speculation": speculation, "compiles": compiles, "tiles": tiles,
    "sampler": sampler,
    "fallback": fallback, "decode": decode, "profile": profile, "serving": serving, "collectives": collectives,
    "video_prefill": video_prefill, "mixed": mixed, "capacity": capacity}


def machine(device: str) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": device}
    if device == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), arch=device_arch("cuda"),
                    memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        info["flash_attn_4"] = version("flash-attn-4")
    return info


def run_sections(sizes: Sizes, device: str, only: list[str] | None, report: dict, out: Path) -> dict:
    """Run the sections (`only`'s, in its order: a lease call puts its slowest last), writing the
    whole report after each one: a run killed at its time limit still leaves the sections it finished."""
    if sizes.ceilings is None:
        raise ValueError("sizes.ceilings is unset: measure the device first (lease_device.measure), every floor divides by it")
    results = report["sections"]
    for name in dict.fromkeys(only) if only else SECTIONS:
        start = time.perf_counter()
        try:
            results[name] = SECTIONS[name](sizes, device)
        except Exception as exc:   # one broken section must not hide the others' numbers
            log.exception("section %s failed", name)
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
        results[name]["seconds"] = time.perf_counter() - start
        results[name]["device"] = sizes.ceilings.record()
        release_device_memory()   # the section's engines are gone with its frame; their memory with them
        log.info("%s done in %.1f s", name, results[name]["seconds"])
        write_report(report, out)
    return results


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(json.dumps(report, indent=1, default=str))
    partial.replace(out)


def print_summary(results: dict) -> None:
    for name, r in results.items():
        keys = [k for k in r if k not in ("rows", "traceback", "seconds", "device")]
        print(f"{name:<9} {r['seconds']:6.1f}s  " + ", ".join(f"{k}={_fmt(r[k])}" for k in keys))
        for row in r.get("rows", []):
            print("    " + "  ".join(f"{k}={_fmt(v)}" for k, v in row.items()))


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU plumbing on tiny shapes; JSON to a temp file")
    p.add_argument("--only", nargs="*", choices=list(SECTIONS), help="run just these sections")
    p.add_argument("--serving-model", default=GPU.serving_model, choices=list(SERVING_MODELS),
                   help="family member whose dimensions the serving section's random checkpoint has")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--fallback-plans", action="store_true",
                   help="print the fallback section's K/V byte counts at GPU shapes (plans only, any machine)")
    p.add_argument("--sms", type=int, default=None,
                   help=f"--fallback-plans: the GPU's multiprocessors (default: this GPU's, else {LENT_SMS})")
    args = p.parse_args(argv)
    if args.fallback_plans:
        sms = args.sms or (torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available()
                           else LENT_SMS)
        for row in fallback_plans(sms):
            print("  ".join(f"{k}={_fmt(v)}" for k, v in row.items()))
        return 0
    if not args.smoke and not torch.cuda.is_available():
        print("bench/gpu_check.py measures the GPU path and needs a CUDA GPU (H100/H200/B200); none here, "
              "so nothing was run or written. Use --smoke for the CPU plumbing check.")
        return 0
    device = "cpu" if args.smoke else "cuda"
    for line in capture_plan(args.only or list(SECTIONS), replace(GPU, serving_model=args.serving_model)):
        print(f"CUDA captures: {line}")   # what each graph engine captures on the device (the dry run: will)
    start = time.perf_counter()
    ceilings = measure(device)
    log.info("ceilings: %s", ceilings.record())
    sizes = replace(SMOKE if args.smoke else replace(GPU, serving_model=args.serving_model), ceilings=ceilings)
    torch.manual_seed(0)
    out = args.out or (Path(tempfile.gettempdir()) / "gpu_check_smoke.json" if args.smoke else RESULTS)
    report = {"machine": {**machine(device), "ceilings": ceilings.record()}, "smoke": args.smoke,
              "command": " ".join(["python bench/gpu_check.py",
              *(argv if argv is not None else sys.argv[1:])]), "sections": {}}
    results = run_sections(sizes, device, args.only, report, out)
    report["wall_s"] = time.perf_counter() - start
    write_report(report, out)
    print(f"{ceilings.device}: copy {ceilings.copy_bytes_per_s / 1e12:.3g} TB/s, GEMM "
          f"{ceilings.gemm_flops / 1e12:.3g} TFLOP/s measured (spread {ceilings.spread:.0%}); datasheet "
          f"{_fmt(ceilings.datasheet_bytes_per_s)} B/s, {_fmt(ceilings.datasheet_flops)} FLOP/s")
    print_summary(results)
    failed = [n for n, r in results.items() if "error" in r or r.get("ok") is False]
    print(f"wall {report['wall_s']:.0f}s; " + (f"FAILED: {', '.join(failed)}" if failed else "all sections ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
