"""Engine time per decode step outside the model, and the step as the server runs it.

    python bench/step_overhead.py            # tiny: 1..256 requests, larger: 1..64; JSON to bench/results/
    python bench/step_overhead.py --smoke    # seconds; JSON to a temp file

R requests decode together on a random Gemma 4: "tiny" (the model's own time is small, so the
engine's share shows) and "larger" (real head dims, compute dominates). Each phase is timed by
wrapping the engine core's own methods on the main thread (offline, as mmserve.LLM runs it);
overhead = the whole step minus model.forward and compute_logits, and its share is reported.

Then the same requests run through AsyncEngine as the server runs it, with the same torch threads:
the core in its own process (the default) and on a thread of this process (--no-engine-process).
From the step records: the step's own time inside the engine, and the cycle the front end sees
(step + IPC + output processing, record to record). A threading regression (torch work on a thread
that is not its process's first OpenMP user) shows as "thread" steps slower than "offline" ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mmserve.config import EngineConfig
from mmserve.core.engine_core import EngineCore
from mmserve.engine.async_engine import AsyncEngine
from mmserve.engine.observer import NullObserver
from mmserve.engine.types import EngineRequest
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger("bench.step_overhead")
RESULTS = Path(__file__).resolve().parent / "results" / "step_overhead.json"


SIZES = {
    # tiny: the model's own time is small, so the engine's share shows
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 global_head_dim=32, vocab_size=512),
    # larger: Gemma 4's real head dims (256 sliding / 512 full), so compute dominates Python overhead
    "larger": dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, global_head_dim=512, vocab_size=8192),
}


def random_checkpoint(root: Path, size: str) -> Path:
    """A random text-only Gemma 4 (6 layers, sliding/full pattern, K=V full layers)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(num_hidden_layers=6, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=64,
                layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 1000000.0}},
                use_bidirectional_attention="vision", hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                max_position_embeddings=4096, **SIZES[size])
    cfg = Gemma4Config(text_config=text, vision_config=None, audio_config=None)
    Gemma4ForConditionalGeneration(cfg).save_pretrained(str(root))
    return root


class Timer:
    """Wraps `obj.name` so every call adds its wall time to `total`."""

    def __init__(self, obj, name: str):
        self.total = 0.0
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start

        setattr(obj, name, timed)


def engine_config(model_dir: Path, num_reqs: int, backend: str, threads: int, **overrides) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", attention_backend=backend,
                        max_num_seqs=num_reqs, max_num_batched_tokens=max(512, num_reqs), block_size=16,
                        num_kv_blocks=num_reqs * 4 + 8, engine_threads=threads, **overrides)


def requests(num_reqs: int, max_tokens: int) -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", [2] + [10 + (i + j) % 400 for j in range(7)],
                          sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i in range(num_reqs)]


def measure(model_dir: Path, num_reqs: int, steps: int, backend: str, size: str, threads: int) -> dict:
    core = EngineCore(engine_config(model_dir, num_reqs, backend, threads))
    for req in requests(num_reqs, steps + 8):
        core.add_request(req)
    while core.scheduler.waiting or any(r.is_prefill for r in core.scheduler.running):
        core.step()
    core.step()
    timers = {name: Timer(obj, attr) for name, (obj, attr) in {
        "schedule": (core.scheduler, "schedule"), "build_metadata": (core.runner.inputs, "build"),
        "forward": (core.model, "forward"), "logits": (core.model, "compute_logits"),
        "sample": (core.sampler, "sample"), "accept": (core.rejection, "accept"), "outputs": (core, "_emit")}.items()}
    per_step = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        per_step.append(time.perf_counter() - start)
    total = sum(per_step)
    model = timers["forward"].total + timers["logits"].total
    ms = {k: round(t.total / steps * 1e3, 3) for k, t in timers.items()}
    ms["outputs"] = round(ms["outputs"] + ms.pop("accept"), 3)   # the sampled tokens kept, then sent out
    overhead = (total - model) / steps
    return dict(size=size, requests=num_reqs, step_ms=round(total / steps * 1e3, 3),
                overhead_share=round((total - model) / total, 3),
                step_ms_median=round(statistics.median(per_step) * 1e3, 3), model_ms=round(model / steps * 1e3, 3),
                overhead_ms=round(overhead * 1e3, 3), overhead_us_per_request=round(overhead / num_reqs * 1e6, 1),
                **{f"{k}_ms": v for k, v in ms.items() if k not in ("forward", "logits")},
                other_ms=round(overhead * 1e3 - ms["schedule"] - ms["build_metadata"] - ms["sample"] - ms["outputs"], 3))


class StepClock(NullObserver):
    """Keeps each decode step's time in the engine and when the front end got its record."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []   # (duration in the engine, front-end arrival)

    def on_step(self, record) -> None:
        if record.items and not any(item.is_prefill for item in record.items):
            self.steps.append((record.duration_s, time.perf_counter()))


def measure_served(model_dir: Path, num_reqs: int, steps: int, backend: str, size: str, threads: int,
                   engine_process: bool) -> dict:
    """The same decode through AsyncEngine: the core in its own process, or on a thread of this one."""
    clock = StepClock()
    config = engine_config(model_dir, num_reqs, backend, threads, engine_process=engine_process)

    async def run() -> None:
        engine = AsyncEngine(config, observer=clock)
        await engine.start()
        try:
            async def drain(req):
                async for _ in engine.generate(req):
                    pass

            await asyncio.gather(*(drain(r) for r in requests(num_reqs, steps + 8)))
        finally:
            await engine.shutdown()

    asyncio.run(run())
    last = clock.steps[-steps:]
    cycles = [b[1] - a[1] for a, b in zip(last, last[1:], strict=False)]
    return dict(size=size, requests=num_reqs, mode="process" if engine_process else "thread",
                step_ms=round(statistics.median(d for d, _ in last) * 1e3, 3),
                cycle_ms=round(statistics.median(cycles) * 1e3, 3) if cycles else None)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model at 1 and 16 requests, few steps; JSON to a temp file")
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: random tiny and larger ones)")
    p.add_argument("--backend", default="reference")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--threads", type=int, default=2, help="torch threads, the same in every mode")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = 5 if args.smoke else 20
    plan = {"tiny": [1, 16]} if args.smoke else {"tiny": [1, 4, 16, 64, 128, 256], "larger": [1, 16, 64]}
    if args.model is not None:
        plan = {"given": plan["tiny"]}
    served_plan = {"tiny": [16]} if args.smoke else {"tiny": [1, 16, 64], "larger": [16]}
    rows, served = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for size, counts in plan.items():
            model_dir = args.model or random_checkpoint(Path(tmp) / size, size)
            rows += [measure(model_dir, n, steps, args.backend, size, args.threads) for n in counts]
            for n in served_plan.get(size, counts[:1]):
                offline = next(r for r in rows if r["size"] == size and r["requests"] == n)
                served.append(dict(size=size, requests=n, mode="offline", step_ms=offline["step_ms_median"],
                                   cycle_ms=None))
                served += [measure_served(model_dir, n, steps, args.backend, size, args.threads, proc)
                           for proc in (True, False)]
    cols = ["size", "requests", "step_ms", "model_ms", "overhead_ms", "overhead_share", "overhead_us_per_request",
            "schedule_ms", "build_metadata_ms", "sample_ms", "outputs_ms", "other_ms"]
    print(" ".join(f"{c:>10}" for c in ["size", "reqs", "step ms", "model ms", "ovh ms", "ovh share", "us/req",
                                         "schedule", "metadata", "sample", "outputs", "other"]))
    for row in rows:
        print(" ".join(f"{row[c]:>10}" for c in cols))
    print()
    print(" ".join(f"{c:>10}" for c in ["size", "reqs", "mode", "step ms", "cycle ms"]))
    for row in served:
        print(" ".join(f"{row[c] if row[c] is not None else '-':>10}" for c in ["size", "requests", "mode", "step_ms",
                                                                                  "cycle_ms"]))
    out = args.out or (Path(tempfile.mkdtemp()) / "step_overhead.json" if args.smoke else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"backend": args.backend, "torch": torch.__version__, "threads": args.threads,
                               "rows": rows, "served": served}, indent=2))
    logger.warning("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
