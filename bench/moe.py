"""Our mixture-of-experts layer (router + grouped dispatch) against transformers' Gemma 4 router and
experts on the same weights, for 1, 16 and 256 tokens.

    python bench/moe.py            # 26B-A4B's expert shape scaled to fit this machine; JSON to bench/results/moe.json
    python bench/moe.py --smoke    # a tiny shape, a few repetitions; JSON to a temp file

Both sides compute router + experts (norms excluded) in float32 on one thread; transformers runs its
"eager" experts (a loop over hit experts, the reference) and "grouped_mm" (`torch._grouped_mm`).
Outputs are checked equal before timing. The ratio is transformers' median time / ours.
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

from mmserve.model.moe import Experts, Router
from mmserve.model.spec import MoeSpec

logger = logging.getLogger("bench.moe")
RESULTS = Path(__file__).resolve().parent / "results" / "moe.json"
TOKENS = (1, 16, 256)
# 26B-A4B routes 8 of 128 experts of width 704 at hidden 2816; keep E, top-k and the width ratio,
# shrink hidden/width 2x so the fp32 weights (~0.8 GB) fit beside the other engineers' jobs.
FULL_SHAPE = dict(hidden=1408, moe=MoeSpec(num_experts=128, top_k=8, intermediate=352))
SMOKE_SHAPE = dict(hidden=64, moe=MoeSpec(num_experts=8, top_k=2, intermediate=32))


def build(hidden: int, moe: MoeSpec):
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts, Gemma4TextRouter

    cfg = Gemma4TextConfig(hidden_size=hidden, num_experts=moe.num_experts, top_k_experts=moe.top_k,
                           moe_intermediate_size=moe.intermediate, enable_moe_block=True, num_hidden_layers=1,
                           layer_types=["full_attention"])
    cfg._experts_implementation = "eager"
    hf_router, hf_experts = Gemma4TextRouter(cfg), Gemma4TextExperts(cfg)
    router, experts = Router(hidden, moe, cfg.rms_norm_eps), Experts(hidden, moe)
    with torch.no_grad():
        for module in (hf_router, hf_experts):
            for p in module.parameters():
                p.normal_(0, hidden ** -0.5)
        router.load_state_dict(hf_router.state_dict())
        experts.load_state_dict(hf_experts.state_dict())
    return cfg, (hf_router, hf_experts), (router, experts)


def time_ms(fn, reps: int) -> float:
    fn()   # warm-up
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


@torch.inference_mode()
def bench(hidden: int, moe: MoeSpec, reps: int) -> list[dict]:
    cfg, (hf_router, hf_experts), (router, experts) = build(hidden, moe)

    def ours(x):
        weights, index = router(x)
        return experts(x, weights, index)

    def theirs(x, impl):
        cfg._experts_implementation = impl
        _, weights, index = hf_router(x)
        return hf_experts(x, index, weights)

    rows = []
    for tokens in TOKENS:
        x = torch.randn(tokens, hidden)
        ref = theirs(x, "eager")
        torch.testing.assert_close(ours(x), ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(theirs(x, "grouped_mm"), ref, rtol=1e-4, atol=1e-5)
        ours_ms = time_ms(lambda x=x: ours(x), reps)
        eager_ms = time_ms(lambda x=x: theirs(x, "eager"), reps)
        grouped_ms = time_ms(lambda x=x: theirs(x, "grouped_mm"), reps)
        rows.append(dict(tokens=tokens, experts_hit=int(experts.touched), ours_ms=round(ours_ms, 3),
                         hf_eager_ms=round(eager_ms, 3), hf_grouped_ms=round(grouped_ms, 3),
                         speedup_vs_eager=round(eager_ms / ours_ms, 2),
                         speedup_vs_grouped=round(grouped_ms / ours_ms, 2)))
    return rows


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a tiny shape, few repetitions; JSON to a temp file")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = SMOKE_SHAPE if args.smoke else FULL_SHAPE
    rows = bench(shape["hidden"], shape["moe"], reps=3 if args.smoke else 20)
    moe = shape["moe"]
    print(f"experts: hidden {shape['hidden']}, {moe.num_experts} experts of width {moe.intermediate}, top-{moe.top_k}")
    print(f"{'tokens':>6} {'hit':>4} {'ours ms':>9} {'hf eager ms':>12} {'hf grouped ms':>14} {'vs eager':>9} "
          f"{'vs grouped':>11}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['experts_hit']:>4} {r['ours_ms']:>9.3f} {r['hf_eager_ms']:>12.3f} "
              f"{r['hf_grouped_ms']:>14.3f} {r['speedup_vs_eager']:>8.2f}x {r['speedup_vs_grouped']:>10.2f}x")
    out = args.out or (Path(tempfile.mkdtemp()) / "moe.json" if args.smoke else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"hidden": shape["hidden"], "num_experts": moe.num_experts, "top_k": moe.top_k,
                               "intermediate": moe.intermediate, "dtype": "float32", "threads": 1,
                               "torch": torch.__version__, "rows": rows}, indent=2))
    logger.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
