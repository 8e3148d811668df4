"""Offline engine speed: mmserve.LLM on the main thread, step-input variants side by side, against
transformers' padded batch, on identical video requests (the engine's own cost, no gRPC, no IPC).

Variants (each its own LLM over the same loaded model, warmed up on the same requests first, so
compiles and buffer growth are excluded; runs interleaved, best of --repeats):
  loop        one SDPA call per request per layer (--sdpa-batching loop), eager dense ops, fixed budget
  batched     + one padded SDPA call per layer type and step kind where it pays (--sdpa-batching auto)
  budget      + the larger token budget while nothing decodes (--prefill-batched-tokens 2048)
  compiled    + torch.compile'd RMSNorm / norm+RoPE / gated GELU on large steps (--compile-dense)
  layers      budget's options with the decoder's layer pieces compiled at every step size, as CUDA
              runs them (model/layer_pieces.py; the engine never does this on a CPU: this decides it)
Inputs are decoded and patchified beforehand on both sides; timings cover generation only.
Greedy tokens are compared with transformers' on every variant (the same work on both sides).

    python bench/offline.py                 # demo and large, N = 16, 64 (minutes on 2 cores)
    python bench/offline.py --smoke         # seconds: demo, N = 2, 4 tokens; JSON to a temp file
    python bench/offline.py --profile       # also: where a decode and a prefill step's ms go

Prints a table and writes JSON (default bench/results/offline.json).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import gc
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch
from serving import (
    clips,
    hf_generate,
    hf_inputs,
    machine,
    make_large_checkpoint,
    pad_left,
    parameter_count,
)

from mmserve.config import DEMO_MODEL_DIR, EngineConfig
from mmserve.engine.input.processor import InputMessage, InputProcessor, TextInput, VideoInput
from mmserve.engine.llm import LLM
from mmserve.model import compiled
from mmserve.model.spec import load_spec
from mmserve.multimodal.demo_task import PROMPT
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger("bench.offline")
RESULTS = Path(__file__).resolve().parent / "results" / "offline.json"
VARIANTS = {
    "loop": dict(sdpa_batching="loop", compile_dense=False, prefill_batched_tokens=0),
    "batched": dict(sdpa_batching="auto", compile_dense=False, prefill_batched_tokens=0),
    "budget": dict(sdpa_batching="auto", compile_dense=False, prefill_batched_tokens=2048),
    "compiled": dict(sdpa_batching="auto", compile_dense=True, prefill_batched_tokens=2048),
    "layers": dict(sdpa_batching="auto", compile_dense=False, prefill_batched_tokens=2048, compile_layers=True),
}


def with_pieces(options: dict, run):
    """run() with the layer pieces compiled as `options` says (a process-wide switch the runner sets
    when an engine starts, so each interleaved variant sets it again around its own runs)."""
    compiled.set_compiled(options["compile_dense"], layers=options.get("compile_layers", False))
    try:
        return run()
    finally:
        compiled.set_compiled(False)


class Inline(concurrent.futures.Executor):
    """Runs the input processor's decode jobs on the calling thread (no second torch thread)."""

    def submit(self, fn, *args, **kwargs):
        future = concurrent.futures.Future()
        future.set_result(fn(*args, **kwargs))
        return future


def engine_requests(model_dir: Path, videos: list[bytes], num_frames: int, max_tokens: int):
    config = EngineConfig(model=str(model_dir))
    spec = load_spec(model_dir)
    processor = InputProcessor.from_checkpoint(config, Inline(), spec=spec, context_length=spec.max_model_len)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, video: bytes):
        message = InputMessage("user", (VideoInput(data=video, num_frames=num_frames), TextInput(PROMPT)))
        return await processor.process(f"req-{i}", [message], sampling)
    return [asyncio.run(one(i, v)) for i, v in enumerate(videos)]


def make_llm(model, tokenizer, requests, options: dict, n: int) -> LLM:
    engine_options = {k: v for k, v in options.items() if k != "compile_layers"}
    llm = LLM(loaded_model=model, tokenizer=tokenizer, device="cpu", attention_backend="sdpa",
              max_num_seqs=max(n, 2), kv_cache_bytes=192 * 2**20, enable_prefix_caching=False, **engine_options)
    llm.bench_options = options
    # Compiles and grows every persistent buffer outside the timings. No prefix cache: the timed runs
    # repeat the warm-up's requests, and a cache would skip the prefill transformers does.
    with_pieces(options, lambda: llm.generate([dataclasses.replace(r, request_id=f"warm-{i}")
                                               for i, r in enumerate(requests[:n])]))
    return llm


def timed_generate(llm: LLM, requests, n: int, repeat: int) -> tuple[float, int, list[tuple[int, ...]]]:
    """(wall s, steps, tokens) of one generate over the first n requests."""
    batch = [dataclasses.replace(r, request_id=f"{r.request_id}-{n}-{repeat}") for r in requests[:n]]
    first_step = llm.core.step_index
    start = time.perf_counter()
    done = with_pieces(llm.bench_options, lambda: llm.generate(batch))
    return time.perf_counter() - start, llm.core.step_index - first_step, [tuple(c.token_ids) for c in done]


def run_level(model, tokenizer, requests, hf, variants: list[str], n: int, repeats: int):
    """transformers' padded batch and every variant: best of `repeats` runs, interleaved
    (hf v1 v2 v3 hf v1 v2 v3 ...) so that load on a shared machine hits all of them alike."""
    llms = {v: make_llm(model, tokenizer, requests, VARIANTS[v], n) for v in variants}
    best: dict[str, tuple[float, int]] = {}
    tokens = {}
    for repeat in range(repeats):
        start = time.perf_counter()
        out, _ = hf_generate(hf.model, hf.batch, requests[0].sampling.max_tokens)
        wall = time.perf_counter() - start
        tokens["hf"] = [tuple(r) for r in out.tolist()]
        best["hf"] = min(best.get("hf", (wall, 0)), (wall, 0))
        for v, llm in llms.items():
            wall, steps, tokens[v] = timed_generate(llm, requests, n, repeat)
            if v not in best or wall < best[v][0]:
                best[v] = (wall, steps)
    del llms
    gc.collect()
    out_tokens = n * requests[0].sampling.max_tokens
    return {v: dict(wall_s=round(w, 3), tok_s=round(out_tokens / w, 1), steps=st) for v, (w, st) in best.items()}, tokens


@dataclasses.dataclass
class HfBatch:
    model: object
    batch: dict


def hf_batch(model_dir: Path, videos: list[bytes], num_frames: int, n: int) -> HfBatch:
    """transformers' model and the left-padded batch of the first n requests (warmed up)."""
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
    batch = pad_left(hf_inputs(model_dir, videos[:n], num_frames), load_spec(model_dir).pad_token_id)
    hf_generate(model, batch, 2)
    return HfBatch(model, batch)


def bench_model(name: str, model_dir: Path, args) -> dict:
    from mmserve.core.engine_core import load_engine_model

    videos = clips(max(args.concurrency), args.num_frames)
    requests = engine_requests(model_dir, videos, args.num_frames, args.max_tokens)
    model, tokenizer = load_engine_model(EngineConfig(model=str(model_dir), device="cpu", attention_backend="sdpa"))
    levels = []
    for n in args.concurrency:
        hf = hf_batch(model_dir, videos, args.num_frames, n)
        results, tokens = run_level(model, tokenizer, requests, hf, args.variants, n, args.repeats)
        hf_result = results.pop("hf")
        for variant, result in results.items():
            result["tokens_match_hf"] = sum(a == b for a, b in zip(tokens[variant], tokens["hf"], strict=True)) / n
            result["x_hf_batch"] = round(result["tok_s"] / hf_result["tok_s"], 2)
            logger.info("%s N=%d %s: %s", name, n, variant, result)
        levels.append(dict(n=n, hf_batch=hf_result, variants=results))
        del hf
        gc.collect()
    report = dict(name=name, parameters=parameter_count(model_dir), prompt_tokens=len(requests[0].prompt_token_ids),
                  levels=levels)
    if args.profile:
        report["profile"] = profile_steps(model, tokenizer, requests, args)
    return report


# --- where a step's time goes -----------------------------------------------------------------------

CATEGORIES = {   # aten op (self time) -> category; everything else the profiler saw is "other ops"
    "attention": ("scaled_dot_product", "index_select", "index_copy", "masked_fill", "fill_"),
    "matmuls": ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul"),
    "norms+rope+gelu": ("aten::pow", "aten::mean", "aten::mul", "aten::add", "aten::gelu", "aten::cat", "aten::neg",
                        "aten::rsqrt", "aten::tanh", "aten::to", "aten::_to_copy", "aten::copy_", "aten::sub",
                        "aten::div", "aten::cos", "aten::sin", "CompiledFunction", "Torch-Compiled Region",
                        "cpp_fused"),
}


def profile_steps(model, tokenizer, requests, args) -> dict:
    """One prefill step and one decode step of N requests, before ('loop') and after ('budget')."""
    from torch.profiler import ProfilerActivity, profile

    n = max(args.concurrency)
    out = {}
    for variant in ("loop", "budget"):
        llm = make_llm(model, tokenizer, requests, VARIANTS[variant], n)
        for r in requests[:n]:
            llm.core.add_request(dataclasses.replace(r, request_id=f"p-{r.request_id}"))
        kinds = {}
        while llm.core.has_work and len(kinds) < 2:
            prefill = any(s.is_prefill for s in llm.core.scheduler.running) or bool(llm.core.scheduler.waiting)
            kind = "prefill" if prefill else "decode"
            if kind in kinds or (kind == "decode" and len(llm.core.scheduler.running) < n):
                llm.core.step()
                continue
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                llm.core.step()
                wall = (time.perf_counter() - start) * 1e3
            kinds[kind] = breakdown(prof, wall)
        while llm.core.has_work:
            llm.core.step()
        out[variant] = kinds
        del llm
        gc.collect()
    return out


def breakdown(prof, wall_ms: float) -> dict:
    totals = dict.fromkeys([*CATEGORIES, "other ops"], 0.0)
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3
        category = next((c for c, keys in CATEGORIES.items() if any(k in event.key for k in keys)), "other ops")
        totals[category] += ms
    totals = {k: round(v, 2) for k, v in totals.items()}
    totals["python+dispatch"] = round(wall_ms - sum(totals.values()), 2)
    totals["step_ms"] = round(wall_ms, 2)
    return totals


# --- report -------------------------------------------------------------------------------------

def table(results: list[dict], variants: list[str]) -> str:
    head = f"{'model':<7}{'N':>4}{'HF batch':>10}" + "".join(f"{v + ' tok/s':>16}{'x HF':>6}" for v in variants)
    lines = [head, "-" * len(head)]
    for r in results:
        for lv in r["levels"]:
            cells = "".join(f"{lv['variants'][v]['tok_s']:>16.1f}{lv['variants'][v]['x_hf_batch']:>6.2f}"
                            for v in variants)
            lines.append(f"{r['name']:<7}{lv['n']:>4}{lv['hf_batch']['tok_s']:>10.1f}{cells}")
        match = min(v["tokens_match_hf"] for lv in r["levels"] for v in lv["variants"].values())
        lines.append(f"{r['name']:<7} {r['parameters'] / 1e6:.1f} M params, {r['prompt_tokens']} prompt tokens; "
                     f"greedy tokens equal to transformers' on at least {match:.0%} of requests")
        for variant, kinds in r.get("profile", {}).items():
            for kind, ms in kinds.items():
                parts = ", ".join(f"{k} {v:.1f}" for k, v in ms.items() if k != "step_ms")
                lines.append(f"  profile {variant:<8} {kind:<7} {ms['step_ms']:.1f} ms: {parts}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="demo model, N = 2, 4 tokens, two variants, the step profile")
    p.add_argument("--models", default="demo,large")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-frames", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per variant; the best counts")
    p.add_argument("--profile", action="store_true", help="add a per-category profile of a prefill and a decode step")
    p.add_argument("--large-dir", type=Path, default=Path(tempfile.gettempdir()) / "mmserve-bench-large")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.models, args.concurrency, args.max_tokens, args.num_frames = "demo", [2], 4, 2
        args.variants, args.repeats, args.profile = ["loop", "batched"], 1, True   # the profile cannot rot either
    torch.set_num_threads(args.threads)
    results = []
    for name in args.models.split(","):
        model_dir = DEMO_MODEL_DIR if name == "demo" else make_large_checkpoint(DEMO_MODEL_DIR, args.large_dir)
        results.append(bench_model(name, model_dir, args))
    out = args.out or (Path(tempfile.mkdtemp()) / "offline.json" if args.smoke else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(benchmark="offline", command=" ".join(["offline.py", *(argv or sys.argv[1:])]),
                                   machine=machine(), threads=args.threads, variants=VARIANTS, models=results),
                              indent=1))
    sys.stdout.write(table(results, args.variants) + f"\n\nJSON: {out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
