"""Vision embeddings shared across requests, keyed by the image/frame's content hash, LRU in bytes.

A frame whose embeddings are still here is not encoded again, even when the K/V blocks of the
prompt it sat in were evicted or another request shows the same video at another position. An
entry larger than the whole budget is never kept; the caller holds this step's embeddings itself,
so an eviction can never take one that is about to be used. Entries are copies: a view would pin
the whole batch it was cut from and make the byte count a lie.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()   # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:   # (no use: the LRU order stays)
        return key in self._entries

    def get(self, key: bytes) -> torch.Tensor | None:
        embeds = self._entries.get(key)
        if embeds is not None:
            self._entries.move_to_end(key)
        return embeds

    def put(self, key: bytes, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if size > self.max_bytes or key in self._entries:
            return
        while self.num_bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()
        self._entries[key] = embeds.clone()
        self.num_bytes += size


def default_encoder_cache_bytes(spec, dtype: torch.dtype, frames: int = 256) -> int:
    """Room for `frames` video frames of the served model (soft tokens x hidden size x dtype)."""
    return frames * spec.video_max_soft_tokens * spec.hidden_size * torch.empty((), dtype=dtype).element_size()
