"""Prefix-cache keys: one chained SHA-256 per full KV block.

key(j) = sha256(key(j-1) | the block's token ids | for every image/frame range overlapping the
block: the item's content hash and the range's start relative to the block's first position).
Chaining makes a key name the whole prefix up to the block's end, so equal keys mean equal K/V in
every layer; a frame's tokens see the whole frame bidirectionally, and its content hash covers all
of it. Every field has a fixed width, so no two different inputs encode alike. A block overlapping
an item without a content hash gets no key, nor does any block after it: what cannot be named is
never shared.

`mm_extra_keys` names the same inputs the way vLLM's KV events do (per block, `(identifier,
offset)` of each image/frame overlapping it), so a router can fold them into its own hashes.
"""

from __future__ import annotations

import hashlib

import numpy as np

from mmserve.request import Request

ROOT_KEY = hashlib.sha256(b"mmserve-prefix-v1").digest()


def block_hashes(request: Request, block_size: int, num_blocks: int) -> list[bytes]:
    """`request.block_hashes` extended to cover its first `num_blocks` blocks (every one of them
    full of known tokens), or as far as the items can be named. Returns that list."""
    keys = request.block_hashes
    ranges = request.mm_ranges_np
    items = [m.content_hash for m in request.mm_inputs] or [None] * len(ranges)
    i = int(np.searchsorted(ranges[:, 1], len(keys) * block_size, side="left"))
    for j in range(len(keys), num_blocks):
        first, end = j * block_size, (j + 1) * block_size
        h = hashlib.sha256(keys[-1] if keys else ROOT_KEY)
        h.update(np.asarray(request.token_ids_slice(first, end), dtype=np.int64).tobytes())
        while i < len(ranges) and ranges[i, 1] < first:
            i += 1
        k = i
        while k < len(ranges) and ranges[k, 0] < end:
            if items[k] is None:
                return keys
            h.update(items[k])
            h.update(int(ranges[k, 0] - first).to_bytes(8, "little", signed=True))
            k += 1
        keys.append(h.digest())
    return keys


def mm_extra_keys(request: Request, block_index: int, block_size: int) -> tuple[tuple[str, int], ...] | None:
    """vLLM's `extra_keys` entry for one block: `(content hash hex, range start - block start)` of each
    image/frame range overlapping it, in order (the offset is negative for a range begun in an earlier
    block); None for a block of text only."""
    ranges = request.mm_ranges_np
    first, end = block_index * block_size, (block_index + 1) * block_size
    i = int(np.searchsorted(ranges[:, 1], first, side="left"))
    keys = []
    while i < len(ranges) and ranges[i, 0] < end:
        keys.append((request.mm_inputs[i].content_hash.hex(), int(ranges[i, 0]) - first))
        i += 1
    return tuple(keys) or None
