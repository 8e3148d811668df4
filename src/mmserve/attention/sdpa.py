"""torch SDPA per request over gathered pages.

Prefill rows get the explicit bool mask from mask.py (never `is_causal`: on CPU it aligns top-left
when query and key lengths differ, which is wrong for chunked prefill). A decode row outside any
range needs no mask at all: its keys are exactly the last W positions, so we slice them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmserve.attention.backend import AttentionMetadata, LayerAttentionSpec
from mmserve.attention.mask import request_mask
from mmserve.attention.paged import gather_kv, host_offsets, write_kv


def key_span(spec: LayerAttentionSpec, first_q: int, seq_len: int, min_range_start: int | None) -> int:
    """First key position any of a request's query rows can keep (query rows start at `first_q`)."""
    lo = 0 if spec.window is None else max(0, first_q - spec.window + 1)
    if min_range_start is not None and spec.bidirectional and not spec.clamp_bidirectional:
        lo = min(lo, min_range_start)
    return min(lo, seq_len)


class SdpaImpl:
    """AttentionImpl on F.scaled_dot_product_attention."""

    def __init__(self, spec: LayerAttentionSpec) -> None:
        self.spec = spec

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata)
        qsl, seq_lens = host_offsets(metadata)
        use_ranges = metadata.mm_ranges is not None and self.spec.bidirectional
        range_starts = self._range_starts(metadata, qsl) if use_ranges else [None] * metadata.num_reqs
        out = torch.empty_like(q)
        for r in range(metadata.num_reqs):
            start, end = qsl[r], qsl[r + 1]
            if end == start:
                continue
            seq_len = seq_lens[r]
            lo = key_span(self.spec, seq_len - (end - start), seq_len, range_starts[r])
            keys, values = gather_kv(kv_cache, metadata.block_table[r], seq_len, first_key=lo)
            row_mask = None
            if end - start > 1 or range_starts[r] is not None:
                row_mask = request_mask(metadata, self.spec, r, slice(start, end), lo, seq_len)[None]
            out[start:end] = self._attend(q[start:end], keys, values, row_mask)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask, scale=self.spec.scale, enable_gqa=True)
        return o[0].transpose(0, 1)

    @staticmethod
    def _range_starts(metadata: AttentionMetadata, qsl: list[int]) -> list[int | None]:
        """Smallest range start among each request's scheduled rows, or None when none of them is in a range."""
        starts = metadata.mm_ranges[: metadata.num_actual_tokens, 0].tolist()
        result: list[int | None] = []
        for r in range(metadata.num_reqs):
            inside = [s for s in starts[qsl[r]: qsl[r + 1]] if s >= 0]
            result.append(min(inside) if inside else None)
        return result
