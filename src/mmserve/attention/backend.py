"""The contract between the engine and attention backends.

The engine's metadata builder fills one `AttentionMetadata` per KV pool (layer type) per step;
each decoder layer calls `impl.forward(q, k, v, kv_cache, metadata)`. Backends write this step's
K/V into the paged cache at `slot_mapping` and attend over the cache through `block_table`.

Mask semantics (one source of truth in `mask.py`), q and k absolute positions:
    keep(q, k) = (k <= q and q - k < W)
                 or (r_start(q) <= k <= r_end(q) and (not clamp or q - k < W))
W is the layer's window (None = infinite). The second term exists only on layers with
`spec.bidirectional`; `mm_ranges` row i is the inclusive absolute [start, end] of the range that
query token i lies in, (-1, -1) outside, or the whole table is None when no scheduled token is in
a range (then the mask is plain causal/sliding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class LayerAttentionSpec:
    """What one layer type needs from attention; shared by every layer of that type."""

    layer_type: str                 # SLIDING or FULL
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None              # None on full layers
    bidirectional: bool             # frames' ranges apply on this layer type
    clamp_bidirectional: bool = True  # the bidirectional term also obeys q - k < W (HF semantics)
    scale: float = 1.0              # Gemma 4 uses 1.0 (q/k are RMS-normed)


@dataclass
class AttentionMetadata:
    """One step's batch layout for one KV pool. Tensors live on the model's device.

    Token i of the flattened batch belongs to request r with
    query_start_loc[r] <= i < query_start_loc[r + 1]; its absolute position is positions[i];
    request r's context after this step is seq_lens[r] tokens (cached + scheduled).
    """

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor        # int32 [num_reqs + 1]
    seq_lens: torch.Tensor               # int32 [num_reqs]
    positions: torch.Tensor              # int64 [num_actual_tokens]
    block_table: torch.Tensor            # int32 [num_reqs, max_blocks_per_req]; unused entries 0
    slot_mapping: torch.Tensor           # int64 [num_actual_tokens]; slot = block * block_size + offset
    block_size: int
    mm_ranges: torch.Tensor | None = None  # int32 [num_actual_tokens, 2] or None
    # CPU mirrors for backends that loop over requests in Python (reference, sdpa).
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None


class AttentionImpl(Protocol):
    """Per-layer-type attention. q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, blocks, block_size, Hkv, D]."""

    spec: LayerAttentionSpec

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor: ...


def kv_cache_shape(num_blocks: int, block_size: int, spec: LayerAttentionSpec) -> tuple[int, ...]:
    return (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
