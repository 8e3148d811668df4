"""What a KV block size costs in memory and in prefix-cache hits, on a realistic prompt mix (no GPU).

    python bench/block_size.py [--requests 4000] [--sizes 16 64 128] [--model 12b_unified] [--smoke]

A block (page) of `bs` tokens is the unit of the paged cache: a request holds whole blocks, and a
prefix hit reuses whole blocks only, and only up to a boundary that falls inside no image/frame
range (core/kv_cache/manager.py's rule, imported here). Per block size this prints, over a
seeded mix of requests:
- partial-page waste per request: the full-attention pool's last block past the request's final
  length, and the sliding pool's blocks past the `window` keys it must keep (the oldest block is
  held until all its keys leave the window), in bytes at the model's real dims (bf16);
- prefix-cache hits: the prompt tokens served from the cache out of those a 1-token block would
  serve (the shared prefix, up to the last prompt token, cut to a frame's start where it ends in
  one), and the prefill tokens lost per request to the coarser boundary.
The mix (seeded, all lengths uniform): 40% chat follow-ups (system prompt 200-2000 tokens, earlier
turns 0-3000, all cached; a new turn of 10-300), 30% new chats on a cached system prompt
(200-2000; a new turn of 10-500), 30% video follow-ups (system 20-200, a clip of 8-32 frames of 70
tokens each with a separator, an earlier question and answer of 20-300, all cached; a new question
of 10-100). Outputs are 50-500 tokens. Speed is not measured here: a GPU's kernels are the
`tiles`/`fallback` sections of bench/gpu_check.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mmserve.core.kv_cache.manager import _outside_ranges  # noqa: E402
from mmserve.model.spec import load_spec  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "gemma4_family"
RESULTS = ROOT / "bench" / "results" / "block_size.json"
FRAME_TOKENS = 70


@dataclass
class Request:
    prompt: int                 # prompt tokens
    shared: int                 # of them, a prefix already cached
    output: int
    ranges: np.ndarray          # [n, 2] frame ranges (first, last token), inclusive


def prompt_mix(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for kind in rng.choice(3, size=n, p=[0.4, 0.3, 0.3]):
        output = int(rng.integers(50, 501))
        if kind == 0:   # a chat follow-up: system + earlier turns cached
            shared = int(rng.integers(200, 2001)) + int(rng.integers(0, 3001))
            out.append(Request(shared + int(rng.integers(10, 301)), shared, output, np.zeros((0, 2), np.int64)))
        elif kind == 1:   # a new chat on a cached system prompt
            shared = int(rng.integers(200, 2001))
            out.append(Request(shared + int(rng.integers(10, 501)), shared, output, np.zeros((0, 2), np.int64)))
        else:   # a follow-up question about a video: system, frames, an earlier Q/A cached
            pos, ranges = int(rng.integers(20, 201)), []
            for _ in range(int(rng.integers(8, 33))):
                ranges.append((pos, pos + FRAME_TOKENS - 1))
                pos += FRAME_TOKENS + 1   # a separator token between frames
            shared = pos + int(rng.integers(20, 301))
            out.append(Request(shared + int(rng.integers(10, 101)), shared, output, np.asarray(ranges, np.int64)))
    return out


def hit_tokens(r: Request, bs: int) -> int:
    """Prompt tokens a prefix hit serves at block size `bs` (the manager's rule)."""
    k = min(r.shared, r.prompt - 1) // bs
    return _outside_ranges(r.ranges, k, bs) * bs


def sliding_held(length: int, window: int, bs: int) -> int:
    """Tokens of sliding-pool blocks a request of `length` tokens holds for its last `window` keys."""
    first = max(0, length - window) // bs
    return ((length - 1) // bs - first + 1) * bs


def measure(spec, requests: list[Request], bs: int) -> dict:
    specs = spec.attention_specs
    per_token = {t: 2 * a.num_kv_heads * a.head_dim * 2 * sum(1 for layer in spec.layers
                                                              if layer.layer_type == t and not layer.shares_kv)
                 for t, a in specs.items()}
    waste, hits, ideal = [], [], []
    for r in requests:
        length = r.prompt + r.output
        w = 0
        for t, a in specs.items():
            if a.window is None:
                w += (-(-length // bs) * bs - length) * per_token[t]
            else:
                keep = min(length, a.window)
                w += (sliding_held(length, a.window, bs) - keep) * per_token[t]
        waste.append(w)
        hits.append(hit_tokens(r, bs))
        ideal.append(hit_tokens(r, 1))
    waste, hits, ideal = map(np.asarray, (waste, hits, ideal))
    return {"block_size": bs, "waste_mib_mean": float(waste.mean() / 2**20), "waste_mib_p90": float(np.percentile(waste, 90) / 2**20),
            "hit_share": float(hits.sum() / ideal.sum()), "lost_prefill_tokens_mean": float((ideal - hits).mean()),
            "video_lost_tokens_mean": float(np.mean([i - h for i, h, r in zip(ideal, hits, requests, strict=True)
                                                     if len(r.ranges)]))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--model", default="12b_unified")
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--smoke", action="store_true", help="200 requests, nothing written")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.json = 200, None
    spec = load_spec(FIXTURES / f"{args.model}.json")
    requests = prompt_mix(args.requests)
    rows = [measure(spec, requests, bs) for bs in args.sizes]
    print(f"{args.model}, {args.requests} requests (mean prompt {np.mean([r.prompt for r in requests]):.0f} tokens)")
    print("| block size | partial-page waste per request, mean (p90) | prefix-hit tokens kept | "
          "prefill tokens lost per request (video follow-ups) |")
    print("|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['block_size']} | {row['waste_mib_mean']:.1f} MiB ({row['waste_mib_p90']:.1f}) | "
              f"{100 * row['hit_share']:.1f}% | {row['lost_prefill_tokens_mean']:.0f} ({row['video_lost_tokens_mean']:.0f}) |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
