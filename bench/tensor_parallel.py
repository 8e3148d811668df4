"""TP=1 vs TP=2 on this machine: the same prefill and decode steps through the engine's runners (rank
0's TensorParallelRunner broadcasting each step to a spawned gloo rank, against one ModelRunner), and
the share of rank 0's step spent in collectives, from a torch.profiler profile of the steps.

    python bench/tensor_parallel.py          # a random 8-layer, hidden-1024 Gemma 4; JSON to bench/results/tensor_parallel.json
    python bench/tensor_parallel.py --smoke  # the demo model, a few steps; JSON to a temp file

Both layouts get the same two cores: TP=1 one process on 2 torch threads (and on 1, since a 2-thread
OpenMP team stalls whenever another process takes a core), TP=2 two ranks on 1 each.
Two CPU cores cannot show a real TP speed-up: each rank does half the matmuls but the ranks share the
cores TP=1 can already use, and every layer adds collectives (a GPU rank brings its own memory
bandwidth; a CPU rank brings nothing). What this measures is the overhead: the collectives' share
of rank 0's step (time in gloo's broadcast/all-reduce/all-gather, which includes waiting for rank 1
to reach them), and the step times side by side. The GPU side (TP on one lent GPU is 1: the per-layer
all-reduce over a single-rank NCCL group, at decode and prefill row counts) is bench/gpu_check.py's
`collectives` section.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mmserve.config import DEMO_MODEL_DIR, EngineConfig
from mmserve.core.kv_cache.planner import plan_pools
from mmserve.core.sched.output import BlockUpdate, ScheduledRequest, SchedulerOutput
from mmserve.request import Request
from mmserve.sampling_params import SamplingParams
from mmserve.worker.model_runner import ModelRunner

logger = logging.getLogger("bench.tensor_parallel")
RESULTS = Path(__file__).resolve().parent / "results" / "tensor_parallel.json"
CORES = 2
BLOCK = 16
# (ranks, torch threads per rank): TP=1 on both cores and on one (no OpenMP team to stall when
# another process takes a core), TP=2 one thread per rank.
LAYOUTS = ((1, 2), (1, 1), (2, 1))
# The full run's random checkpoint: the demo model's config with a wider, deeper text stack.
FULL_TEXT = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=128, global_head_dim=128, num_global_key_value_heads=4,
                 layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3
                 + ["full_attention"])


def random_checkpoint(root: Path) -> Path:
    """The demo model's config and tokenizer with FULL_TEXT's shape, randomly initialised."""
    import shutil

    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    raw = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    raw["text_config"].update(FULL_TEXT)
    raw["text_config"].pop("per_layer_config", None)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(Gemma4Config(**{k: v for k, v in raw.items() if k != "architectures"}))
    model.save_pretrained(str(root))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (DEMO_MODEL_DIR / name).exists():
            shutil.copy(DEMO_MODEL_DIR / name, root / name)
    return root


def steps(spec, plans, batch: int, prompt: int, decodes: int) -> tuple[list[SchedulerOutput], list[Request]]:
    """One prefill step of `batch` prompts of `prompt` tokens, then `decodes` decode steps, and the
    requests; every request's blocks are given in the first step."""
    gen = torch.Generator().manual_seed(1)
    blocks = -(-(prompt + decodes) // BLOCK)
    requests = [Request(f"r{i}", torch.randint(20, spec.vocab_size, (prompt,), generator=gen).tolist(),
                        SamplingParams(max_tokens=decodes + 1)) for i in range(batch)]
    first = SchedulerOutput([ScheduledRequest(r, prompt, 0, True, block_updates={
        pool: BlockUpdate(0, list(range(1 + i * blocks, 1 + (i + 1) * blocks)), 0) for pool in plans})
        for i, r in enumerate(requests)])
    outs = [first]
    for k in range(decodes):
        outs.append(SchedulerOutput([ScheduledRequest(r, 1, prompt + k, False) for r in requests]))
    return outs, requests


def run(runner, spec, plans, batch: int, prompt: int, decodes: int, *, profile: bool) -> list[float]:
    """Each step's time in ms, or with `profile` the share of it spent in collectives."""
    outs, requests = steps(spec, plans, batch, prompt, decodes)
    values = []
    for i, out in enumerate(outs):
        if i:
            for r in requests:
                r.output_token_ids.append(21)   # the token "sampled" by the step before
        if not profile:
            start = time.perf_counter()
            runner.execute(out)
            values.append((time.perf_counter() - start) * 1e3)
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            runner.execute(out)
            ms = (time.perf_counter() - start) * 1e3
        # gloo's own events ("gloo:all_reduce", ...) span each collective from start to completion
        comm_ms = sum(e.cpu_time_total for e in prof.key_averages() if e.key.startswith("gloo:")) / 1e3
        values.append(min(1.0, comm_ms / ms))
    runner.release(SchedulerOutput([], finished_ids=[r.request_id for r in requests]))   # on every rank
    return values


def measure(path: Path, size: int, threads: int, batch: int, prompt: int, decodes: int, reps: int) -> dict:
    """Median prefill and decode step times (ms, unprofiled runs) and collectives' shares (profiled runs)."""
    from mmserve.executor.ranks import load_rank_model
    from mmserve.executor.tensor_parallel import TensorParallelGroup
    from mmserve.model.parallel import SINGLE
    from mmserve.model.spec import load_spec

    config = EngineConfig(model=str(path), device="cpu", dtype="float32", max_num_seqs=batch,
                          max_num_batched_tokens=batch * prompt, prefill_batched_tokens=0, block_size=BLOCK,
                          engine_threads=CORES, tensor_parallel_size=size, enable_prefix_caching=False)
    torch.set_num_threads(threads)
    spec = load_spec(path)
    tp = TensorParallelGroup(config) if size > 1 else None
    model = load_rank_model(config, tp.group if tp else SINGLE)   # both layouts load the same way
    local = model.spec
    blocks = batch * -(-(prompt + decodes) // BLOCK) + 1
    plans = plan_pools(local.kv_layer_types, local.attention_specs, block_size=BLOCK, dtype_bytes=4,
                       num_kv_blocks=blocks).pools
    max_len = prompt + decodes + 1
    try:
        runner = (tp.runner_factory if tp else ModelRunner)(model, plans, config, max_model_len=max_len)
        run(runner, spec, plans, batch, prompt, decodes, profile=False)   # warm-up
        times = [run(runner, spec, plans, batch, prompt, decodes, profile=False) for _ in range(reps)]
        shares = [run(runner, spec, plans, batch, prompt, decodes, profile=True) for _ in range(reps)] if tp else []
    finally:
        if tp is not None:
            tp.close()
    return dict(prefill_ms=round(statistics.median(t[0] for t in times), 2),
                decode_ms=round(statistics.median(x for t in times for x in t[1:]), 2),
                comm_share_prefill=round(statistics.median(s[0] for s in shares), 3) if shares else 0.0,
                comm_share_decode=round(statistics.median(x for s in shares for x in s[1:]), 3) if shares else 0.0)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="the demo model, few steps; JSON to a temp file")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(CORES))
    batch, prompt, decodes, reps = (2, 32, 3, 1) if args.smoke else (4, 256, 16, 2)
    with tempfile.TemporaryDirectory() as tmp:
        path = DEMO_MODEL_DIR if args.smoke else random_checkpoint(Path(tmp) / "model")
        rows = {layout: measure(path, *layout, batch, prompt, decodes, reps) for layout in LAYOUTS}
    print(f"model: {'demo' if args.smoke else FULL_TEXT}; {batch} requests, prefill {prompt} tokens each, "
          f"{decodes} decode steps; {CORES} cores")
    print(f"{'tp':>3} {'threads/rank':>13} {'prefill ms':>11} {'decode ms':>10} {'comm % prefill':>15} "
          f"{'comm % decode':>14}")
    for (size, threads), r in rows.items():
        print(f"{size:>3} {threads:>13} {r['prefill_ms']:>11.1f} {r['decode_ms']:>10.2f} "
              f"{100 * r['comm_share_prefill']:>14.1f}% {100 * r['comm_share_decode']:>13.1f}%")
    tp2 = rows[(2, 1)]
    for size, threads in ((1, 2), (1, 1)):
        r = rows[(size, threads)]
        print(f"step time TP=1 on {threads} thread(s) / TP=2: prefill {r['prefill_ms'] / tp2['prefill_ms']:.2f}x, "
              f"decode {r['decode_ms'] / tp2['decode_ms']:.2f}x")
    print("the same two cores do the work in every layout: what TP=2 gains here is TP=1's 2-thread team stalling "
          "on a shared machine, not a TP speed-up (on GPUs each rank adds its own memory bandwidth)")
    out = args.out or (Path(tempfile.mkdtemp()) / "tensor_parallel.json" if args.smoke else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "demo" if args.smoke else FULL_TEXT, "batch": batch, "prompt": prompt,
                               "decodes": decodes, "cores": CORES, "dtype": "float32", "torch": torch.__version__,
                               "rows": [dict(tp=size, threads_per_rank=threads, **r)
                                        for (size, threads), r in rows.items()]}, indent=2))
    logger.warning("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
