"""Paged KV cache access shared by the Python-level backends (reference, sdpa).

Cache layout: kv_cache[0] holds K and kv_cache[1] holds V, each [num_blocks, block_size, Hkv, D];
slot = block * block_size + offset.
"""

from __future__ import annotations

import torch

from mmserve.attention.backend import AttentionMetadata


def host_offsets(metadata: AttentionMetadata) -> tuple[list[int], list[int]]:
    """query_start_loc and seq_lens as Python lists, from the host copies when the runner made them
    (so a GPU step pays no device sync for the per-request loop)."""
    qsl = metadata.query_start_loc_cpu if metadata.query_start_loc_cpu is not None else metadata.query_start_loc
    seq_lens = metadata.seq_lens_cpu if metadata.seq_lens_cpu is not None else metadata.seq_lens
    return qsl.tolist(), seq_lens.tolist()


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
             metadata: AttentionMetadata) -> None:
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


def gather_kv(kv_cache: torch.Tensor, block_table_row: torch.Tensor, num_keys: int,
              first_key: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V for key positions first_key..num_keys-1 of one request, each [num_keys - first_key, Hkv, D].

    Only the blocks holding those keys are read (a decode row of a sliding layer reads its window).
    """
    block_size = kv_cache.shape[2]
    first_block = first_key // block_size
    blocks = block_table_row[first_block: -(-num_keys // block_size)].to(torch.int64)
    offset = first_key - first_block * block_size
    count = num_keys - first_key
    k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[offset: offset + count]
    v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[offset: offset + count]
    return k, v
