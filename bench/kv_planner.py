"""How the KV planner splits a memory budget between the Gemma 4 family's pools, before and after #36.

Before (main at 9ed011c): every pool got the same number of blocks, a windowed pool capped at
`max_num_seqs x (ceil((window + step) / block) + 1)`, the rest to the full-attention pool. After
(core/kv_cache/planner.py): a windowed pool gets exactly what `max_num_seqs` requests can hold at
once (each its window, one step's tokens between them all), the full-attention pools every other
byte. Pure arithmetic over the published configs (tests/fixtures/gemma4_family), bf16, block 16: no
model is loaded, no device used.

    python bench/kv_planner.py      # 64 running with 2048-token steps (the issue's case), then the
                                    # CUDA defaults (128, 8192); JSON to bench/results/kv_planner.json
    python bench/kv_planner.py --smoke   # one model, one budget; JSON to a temp file
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

from mmserve.core.kv_cache.planner import GiB
from mmserve.metrics.cli import kv_plan
from mmserve.model.spec import load_spec

FAMILY = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gemma4_family"
RESULTS = Path(__file__).resolve().parent / "results" / "kv_planner.json"
BLOCK = 16


def equal_split(spec, gib: float, seats: int, step: int) -> dict[str, int]:
    """Blocks per pool (null block included) under the rule main used before #36."""
    counts = {t: spec.kv_layer_types.count(t) for t in spec.attention_specs if t in spec.kv_layer_types}
    cost = {t: 2 * BLOCK * a.num_kv_heads * a.head_dim * 2 * counts[t] for t, a in spec.attention_specs.items() if t in counts}
    budget = int(gib * GiB)
    equal = budget // sum(cost.values())
    blocks = dict.fromkeys(counts, equal)
    windowed = [t for t in counts if spec.attention_specs[t].window is not None]
    full = [t for t in counts if t not in windowed]
    for t in windowed:
        blocks[t] = min(equal, seats * (math.ceil((spec.attention_specs[t].window + step) / BLOCK) + 1) + 1)
    left = budget - sum(blocks[t] * cost[t] for t in windowed)
    for t in full:
        blocks[t] = left // sum(cost[f] for f in full)
    return blocks


def table(paths: list[Path], gibs: list[float], seats: int, step: int) -> list[dict]:
    """One row per (model, budget): tokens per pool and full-context requests, before and after."""
    print(f"\nKV planner, bf16, block {BLOCK}, {seats} running, {step}-token steps: tokens each pool holds and "
          "requests of the full context that fit at once (before -> after)")
    print("| model | context | KV GiB | full-attention tokens | sliding tokens | full-context requests | run at once |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for path in paths:
        spec = load_spec(path)
        need = math.ceil(spec.max_model_len / BLOCK)
        for gib in gibs:
            old = equal_split(spec, gib, seats, step)
            full = next(t for t, a in spec.attention_specs.items() if a.window is None)
            slide = next(t for t, a in spec.attention_specs.items() if a.window is not None)
            row = {"model": path.stem, "context": spec.max_model_len, "gib": gib, "max_num_seqs": seats, "step": step,
                   "before": {"full_tokens": (old[full] - 1) * BLOCK, "sliding_tokens": (old[slide] - 1) * BLOCK,
                              "full_context_requests": min(seats, (old[full] - 1) // need)}}
            try:
                new = kv_plan(spec, gib=gib, max_num_seqs=seats, max_step_tokens=step, block_size=BLOCK,
                              max_model_len=spec.max_model_len)
            except ValueError as exc:   # the planner refuses: not one full-context request fits
                row["after"] = {"refused": str(exc)}
                print(f"| {path.stem} | {spec.max_model_len} | {gib:g} | {row['before']['full_tokens']:,} -> refused: "
                      f"{str(exc).split(': it needs')[0].split(') ', 1)[1]} | | | |")
                rows.append(row)
                continue
            tokens = new.pool_tokens(BLOCK)
            row["after"] = {"full_tokens": tokens[full], "sliding_tokens": tokens[slide],
                            "full_context_requests": new.full_context_requests(BLOCK, spec.max_model_len),
                            "max_num_seqs": new.max_num_seqs}
            b, a = row["before"], row["after"]
            print(f"| {path.stem} | {spec.max_model_len} | {gib:g} | {b['full_tokens']:,} -> {a['full_tokens']:,} | "
                  f"{b['sliding_tokens']:,} -> {a['sliding_tokens']:,} | {b['full_context_requests']} -> "
                  f"{a['full_context_requests']} | {a['max_num_seqs']} |")
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the 12B at 40 GiB only; JSON to a temp file")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    paths = [FAMILY / "12b_unified.json"] if args.smoke else sorted(FAMILY.glob("*.json"))
    gibs = [40.0] if args.smoke else [24.0, 40.0, 80.0]
    rows = table(paths, gibs, 64, 2048)
    if not args.smoke:
        rows += table(paths, gibs, 128, 8192)
    out = args.out or (Path(tempfile.mkdtemp()) / "kv_planner.json" if args.smoke else RESULTS)
    out.write_text(json.dumps({"block_size": BLOCK, "dtype": "bfloat16", "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
