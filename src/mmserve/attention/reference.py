"""Dense float32 oracle: gathers each request's keys, masks them with mask.py, softmax in fp32.

Slow on purpose and free of tricks, so every faster backend can be compared against it. Its
builder only turns the step's offsets into Python ints and builds the dense mask, once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    LayerAttentionSpec,
    PoolConfig,
)
from mmserve.attention.mask import batch_dense_mask
from mmserve.attention.paged import gather_kv, write_kv


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


@dataclass
class ReferenceMetadata:
    common: CommonAttentionMetadata
    query_start_loc: list[int]
    seq_lens: list[int]
    mask: torch.Tensor               # bool [T, max_seq_len] (mask.batch_dense_mask)


class ReferenceMetadataBuilder:
    def __init__(self, pool: PoolConfig) -> None:
        self.spec = pool.spec

    def build(self, common: CommonAttentionMetadata) -> ReferenceMetadata:
        return ReferenceMetadata(common, common.query_start_loc_cpu[: common.num_reqs + 1].tolist(),
                                 common.seq_lens_cpu[: common.num_reqs].tolist(), batch_dense_mask(common, self.spec))


class ReferenceImpl:
    """The oracle backend (AttentionImpl)."""

    def __init__(self, spec: LayerAttentionSpec) -> None:
        self.spec = spec

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                metadata: ReferenceMetadata) -> torch.Tensor:
        md = metadata.common
        write_kv(kv_cache, k, v, md)
        qsl, seq_lens = metadata.query_start_loc, metadata.seq_lens
        out = torch.zeros_like(q)
        for r in range(md.num_reqs):
            start, end = qsl[r], qsl[r + 1]
            if end == start:
                continue
            keys, values = gather_kv(kv_cache, md.block_table[r], seq_lens[r])
            rows = dense_attention(q[start:end], keys, values, metadata.mask[start:end, : seq_lens[r]],
                                   self.spec.scale)
            out[start:end] = rows.to(q.dtype)
        return out


BACKEND = AttentionBackend("reference", ReferenceImpl, ReferenceMetadataBuilder)
