"""Paged KV cache access shared by the backends.

Cache layout: kv_cache[0] holds K and kv_cache[1] holds V, each [num_blocks, block_size, Hkv, D];
slot = block * block_size + offset.
"""

from __future__ import annotations

import torch

from mmserve.attention.backend import CommonAttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
             metadata: CommonAttentionMetadata) -> None:
    """Store this step's K/V ([>= T, Hkv, D]; rows past num_actual_tokens are padding) at their
    slots, in place: the first thing every backend's forward does. k = v = None is a KV-sharing
    layer's attend-only call: it reads another layer's cache and writes nothing."""
    if k is None or v is None:
        return
    num_tokens = metadata.num_actual_tokens
    slots = metadata.slot_mapping[:num_tokens]
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slots, k[:num_tokens].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v[:num_tokens].to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, block_table_row: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V for key positions 0..num_keys-1 of one request, each [num_keys, Hkv, D]."""
    blocks = block_table_row[: -(-num_keys // kv_cache.shape[2])].to(torch.int64)
    k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:num_keys]
    v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:num_keys]
    return k, v
