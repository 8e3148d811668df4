"""Random paged batches for the attention tests: varlen, chunked prefill, decode, frames, shuffled blocks."""

from __future__ import annotations

import random

import torch

from mmserve.attention.backend import FULL, SLIDING, LayerAttentionSpec
from mmserve.attention.synthetic import Batch, Req, frames, make_batch, query_ranges

SLIDING_SPEC = LayerAttentionSpec(SLIDING, num_heads=4, num_kv_heads=2, head_dim=32, window=8,
                                  bidirectional=True, clamp_bidirectional=True, scale=1.0)
SLIDING_UNCLAMPED = LayerAttentionSpec(SLIDING, num_heads=4, num_kv_heads=2, head_dim=32, window=8,
                                       bidirectional=True, clamp_bidirectional=False, scale=1.0)
FULL_SPEC = LayerAttentionSpec(FULL, num_heads=4, num_kv_heads=1, head_dim=64, window=None,
                               bidirectional=False, scale=0.125)
FULL_BIDI = LayerAttentionSpec(FULL, num_heads=4, num_kv_heads=1, head_dim=64, window=None,
                               bidirectional=True, scale=0.125)
SPECS = [SLIDING_SPEC, SLIDING_UNCLAMPED, FULL_SPEC, FULL_BIDI]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute error relative to the reference's largest magnitude (fp32: 1e-5, bf16: 2e-2)."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def standard_batches(window: int = 8) -> dict[str, list[Req]]:
    """Named request mixes every backend is checked on; frames longer than `window` included."""
    w = window
    return {
        "varlen_prefill": [Req(0, 37, frames(5, 2, 6, 3)), Req(0, 9), Req(0, 50, frames(2, 3, w + 4, 2))],
        "chunked_prefill": [Req(20, 30, frames(22, 2, w + 3, 1)), Req(48, 17, frames(30, 3, 5, 2)), Req(5, 1)],
        "decode": [Req(40, 1, frames(3, 2, 6, 2)), Req(7, 1), Req(63, 1), Req(16, 1)],
        "mixed": [Req(33, 1), Req(0, 45, frames(4, 3, w + 2, 3)), Req(12, 20, frames(14, 1, 10, 0)), Req(70, 1)],
        "text_only": [Req(0, 23), Req(10, 14), Req(30, 1)],
        # A chunk starting inside a frame older than the window (our scheduler avoids it; the mask must not care).
        "split_frame": [Req(30, 20, [(20, 20 + 3 * w)]), Req(3, 4)],
    }


def random_step(rng: random.Random, window: int) -> list[Req]:
    """Decodes, chunked prefills and whole prompts, with frames shorter and longer than the window."""
    reqs = []
    for _ in range(rng.randint(2, 9)):
        ranges = frames(rng.randint(0, 6), rng.randint(0, 5), rng.choice([3, 6, window + rng.randint(1, 9)]),
                        rng.randint(1, 4))
        prompt = (ranges[-1][1] if ranges else 10) + rng.randint(1, 12)
        kind = rng.random()
        if kind < 0.4:       # decode past the prompt
            context, query = prompt + rng.randint(0, 30), 1
        elif kind < 0.7:     # a chunk starting between frames
            starts = [0] + [e + 1 for _, e in ranges if e + 1 < prompt]
            context = rng.choice(starts)
            query = prompt - context
        else:                # a whole prompt
            context, query = 0, prompt
        reqs.append(Req(context, query, ranges))
    return reqs


__all__ = ["Batch", "Req", "SPECS", "frames", "make_batch", "query_ranges", "random_step", "rel_err", "standard_batches"]
