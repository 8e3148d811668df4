"""The contract between the engine and attention backends (vLLM v1's split).

A backend is a bundle: an implementation (one per layer type, `forward` only computes), a metadata
builder (one per KV pool, i.e. layer type, run once per step: it prepares everything `forward`
needs, such as masks, block masks, padded gather indices) and the KV cache shape. The runner fills
one `CommonAttentionMetadata` per pool per step and hands it to that pool's builder; every layer
of the type then calls `impl.forward(q, k, v, kv_cache, metadata)` with the builder's result.
`k` and `v` None means attend only: the layer reads another layer's cache (KV sharing) and writes
nothing.

Mask semantics (one source of truth in `mask.py`), q and k absolute positions:
    keep(q, k) = (k <= q and q - k < W)
                 or (r_start(q) <= k <= r_end(q) and (not clamp or q - k < W))
W is the layer's window (None = infinite). The second term exists only on layers with
`spec.bidirectional`; `query_ranges` row i is the inclusive absolute [start, end] of the range
that query token i lies in, (-1, -1) outside, or the whole table is None when no scheduled token
is in a range (then the mask is plain causal/sliding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

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


@dataclass(frozen=True)
class PoolConfig:
    """One KV pool as its metadata builder sees it: what persistent buffers are sized by."""

    spec: LayerAttentionSpec
    num_blocks: int                 # physical blocks in the pool, null block 0 included
    block_size: int
    max_num_tokens: int             # query rows per step at most (the largest token budget)
    max_num_reqs: int
    max_blocks_per_req: int         # block table width: ceil(max_model_len / block_size)
    device: torch.device
    dtype: torch.dtype              # the model's activation dtype (masks are built in it)
    sdpa_batching: str = "auto"     # sdpa backend: one of config.SDPA_BATCHING_CHOICES
    # decode/verify steps on the split-KV kernel (attention/split_kv.py); None: selection.split_kv_decode decides
    split_kv_decode: bool | None = None
    # how far the device may move positions back after the host planned a step (async scheduling with
    # speculation: the K drafts the step in flight may reject); host-planned key bounds start that early
    position_slack: int = 0


@dataclass
class CommonAttentionMetadata:
    """One step's batch layout for one KV pool, filled by the runner. Tensors live on the model's
    device; the `*_cpu` mirrors are host tensors (the runner's staging buffers), so builders plan
    on the host without a device sync.

    Token i of the flattened batch belongs to request r with
    query_start_loc[r] <= i < query_start_loc[r + 1]; its absolute position is positions[i];
    request r has seq_lens[r] tokens in its context after this step (cached + scheduled).
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
    query_ranges: torch.Tensor | None    # int32 [num_actual_tokens, 2] or None (see the module doc)
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    positions_cpu: torch.Tensor
    block_table_cpu: torch.Tensor
    query_ranges_cpu: torch.Tensor | None


class AttentionImpl(Protocol):
    """Per-layer-type attention. q: [T, H, D]; k, v: [T, Hkv, D] or None (attend only);
    kv_cache: [2, blocks, block_size, Hkv, D]. Returns [T, H, D] (rows past the step's tokens are
    padding and left unspecified)."""

    spec: LayerAttentionSpec

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: Any) -> torch.Tensor: ...


class AttentionMetadataBuilder(Protocol):
    """Per-pool, per-step preparation; holds the persistent buffers its metadata are views of."""

    def __init__(self, pool: PoolConfig) -> None: ...

    def build(self, common: CommonAttentionMetadata) -> Any: ...


def kv_cache_shape(num_blocks: int, block_size: int, spec: LayerAttentionSpec) -> tuple[int, ...]:
    """Every backend's paged layout: K then V, each [num_blocks, block_size, Hkv, D]."""
    return (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)


@dataclass(frozen=True)
class AttentionBackend:
    """A backend as the engine sees it: which impl, which builder, which KV cache layout."""

    name: str
    impl_cls: type
    builder_cls: type
    cuda_graphs: bool = False       # every tensor its forward reads is a persistent buffer (decode graphs)
    # A step without query ranges is planned from `query_start_loc_cpu` alone: positions, seq_lens and
    # slots are read on the device, so the runner may move them there after the host built them
    # (async scheduling with speculation: the device's acceptance decides a step's first position).
    device_positions: bool = False

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, spec: LayerAttentionSpec) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, spec)
