"""Compiled flex must compile once per layer type, whatever the frame count or batch composition.

The sweep runs in bfloat16, which no other test compiles flex for, so the count is exact in any
test order, and it doubles as flex's bf16 parity check on chunked video, decode and text batches.
"""

from __future__ import annotations

import pytest
import torch
from attn_batches import Req, frames, make_batch, rel_err
from torch._dynamo.utils import counters

from mmserve.attention import create_builder, create_impl
from mmserve.attention.backend import FULL, SLIDING, LayerAttentionSpec
from mmserve.attention.synthetic import pool_for, run_backend

SLIDING_48 = LayerAttentionSpec(SLIDING, num_heads=4, num_kv_heads=2, head_dim=48, window=12, bidirectional=True)
FULL_80 = LayerAttentionSpec(FULL, num_heads=2, num_kv_heads=1, head_dim=80, window=None, bidirectional=False)
FRAME_COUNTS = [1, 8, 16, 32, 46, 64]


def video_batch_requests(num_frames: int) -> list[Req]:
    """A video prompt of `num_frames` 5-token frames (chunked in two once long), a decode and a text request."""
    ranges = frames(6, num_frames, 5, 1)
    prompt_len = ranges[-1][1] + 5
    context = 0 if num_frames < 32 else ranges[num_frames // 2][0]  # chunk boundary between frames
    return [Req(context, prompt_len - context, ranges), Req(40, 1), Req(0, 9)]


@pytest.mark.slow
def test_flex_compiles_once_per_layer_type_across_frame_counts():
    compiled = {}
    for spec in (SLIDING_48, FULL_80):
        impl, builder = create_impl("flex", spec), None
        before = counters["stats"]["unique_graphs"]
        for n in FRAME_COUNTS:
            batch = make_batch(video_batch_requests(n), spec, dtype=torch.bfloat16,
                               gen=torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()))), table_width=64)
            # One builder for every step, sized like the engine's (budget 512, 64-block tables).
            builder = builder or create_builder("flex", pool_for(batch, spec, max_num_tokens=512))
            got = impl.forward(batch.q, batch.k, batch.v, batch.kv_cache.clone(), builder.build(batch.metadata))
            want, _ = run_backend("reference", batch, spec)
            assert rel_err(got, want) < 2e-2, f"{spec.layer_type}, {n} frames"
        compiled[spec.layer_type] = counters["stats"]["unique_graphs"] - before
    assert compiled == {SLIDING: 1, FULL: 1}
