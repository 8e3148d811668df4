"""Dense float32 oracle: gathers each request's keys, builds the mask from mask.py, softmax in fp32.

Slow on purpose and free of tricks, so every faster backend can be compared against it.
"""

from __future__ import annotations

import torch

from mmserve.attention.backend import AttentionMetadata, LayerAttentionSpec
from mmserve.attention.mask import batch_dense_mask
from mmserve.attention.paged import gather_kv, host_offsets, write_kv


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, H, D], k/v [Lk, Hkv, D], mask [Lq, Lk] -> [Lq, H, D] in float32; fully masked rows give zeros."""
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)                                   # [H, Lq, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)   # [H, Lk, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (probs @ vf).transpose(0, 1)


class ReferenceImpl:
    """The oracle backend (AttentionImpl)."""

    def __init__(self, spec: LayerAttentionSpec) -> None:
        self.spec = spec

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata)
        mask = batch_dense_mask(metadata, self.spec)
        qsl, seq_lens = host_offsets(metadata)
        out = torch.zeros_like(q)
        for r in range(metadata.num_reqs):
            start, end = qsl[r], qsl[r + 1]
            if end == start:
                continue
            keys, values = gather_kv(kv_cache, metadata.block_table[r], seq_lens[r])
            rows = dense_attention(q[start:end], keys, values, mask[start:end, : seq_lens[r]], self.spec.scale)
            out[start:end] = rows.to(q.dtype)
        return out
