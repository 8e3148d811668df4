"""Engine time per decode step outside the model: scheduling, metadata, sampling, output handling.

    python bench/step_overhead.py            # 1..256 running requests; JSON to bench/results/step_overhead.json
    python bench/step_overhead.py --smoke    # seconds; JSON to a temp file

R requests decode together on a tiny random Gemma 4 (so the model's own time is small and the
engine's share shows). Each phase is timed by wrapping the engine's own methods; overhead = the
whole step minus model.forward and compute_logits.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mmserve.config import EngineConfig
from mmserve.engine.core import EngineCore
from mmserve.engine.sampling_params import SamplingParams
from mmserve.engine.types import EngineRequest

logger = logging.getLogger("bench.step_overhead")
RESULTS = Path(__file__).resolve().parent / "results" / "step_overhead.json"


def tiny_checkpoint(root: Path) -> Path:
    """A random text-only Gemma 4 with the real layer pattern's shape, small enough for CPU."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                attention_k_eq_v=True, sliding_window=64,
                layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 1000000.0}},
                use_bidirectional_attention="vision", hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                max_position_embeddings=4096)
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


def measure(model_dir: Path, num_reqs: int, steps: int, backend: str) -> dict:
    config = EngineConfig(model=str(model_dir), device="cpu", attention_backend=backend,
                          max_num_seqs=num_reqs, max_num_batched_tokens=max(512, num_reqs), block_size=16,
                          num_kv_blocks=num_reqs * 4 + 8)
    core = EngineCore(config)
    for i in range(num_reqs):
        core.add_request(EngineRequest(f"r{i}", [2] + [10 + (i + j) % 400 for j in range(7)],
                                       sampling=SamplingParams(max_tokens=steps + 8, ignore_eos=True)))
    core.step()   # admits everything from the inbox
    while core.scheduler.waiting or any(r.is_prefill for r in core.scheduler.running):
        core.step()
    core.step()
    timers = {name: Timer(obj, attr) for name, (obj, attr) in {
        "schedule": (core.scheduler, "schedule"), "build_metadata": (core.runner.builder, "build"),
        "forward": (core.model, "forward"), "logits": (core.model, "compute_logits"),
        "sample": (core.sampler, "sample")}.items()}
    per_step = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        per_step.append(time.perf_counter() - start)
    total = sum(per_step)
    model = timers["forward"].total + timers["logits"].total
    ms = {k: round(t.total / steps * 1e3, 3) for k, t in timers.items()}
    overhead = (total - model) / steps
    return dict(requests=num_reqs, step_ms=round(total / steps * 1e3, 3),
                step_ms_median=round(statistics.median(per_step) * 1e3, 3), model_ms=round(model / steps * 1e3, 3),
                overhead_ms=round(overhead * 1e3, 3), overhead_us_per_request=round(overhead / num_reqs * 1e6, 1),
                **{f"{k}_ms": v for k, v in ms.items() if k not in ("forward", "logits")},
                other_ms=round(overhead * 1e3 - ms["schedule"] - ms["build_metadata"] - ms["sample"], 3))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="two sizes, few steps; JSON to a temp file")
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: a tiny random one)")
    p.add_argument("--backend", default="reference")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [1, 16] if args.smoke else [1, 4, 16, 64, 128, 256]
    steps = 5 if args.smoke else 30
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or tiny_checkpoint(Path(tmp) / "tiny")
        rows = [measure(model_dir, n, steps, args.backend) for n in sizes]
    cols = ["requests", "step_ms", "model_ms", "overhead_ms", "overhead_us_per_request", "schedule_ms",
            "build_metadata_ms", "sample_ms", "other_ms"]
    print(" ".join(f"{c:>12}" for c in ["reqs", "step ms", "model ms", "overhead ms", "us/req", "schedule",
                                          "metadata", "sample", "other"]))
    for row in rows:
        print(" ".join(f"{row[c]:>12}" for c in cols))
    out = args.out or (Path(tempfile.mkdtemp()) / "step_overhead.json" if args.smoke else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"backend": args.backend, "torch": torch.__version__, "rows": rows}, indent=2))
    logger.warning("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
