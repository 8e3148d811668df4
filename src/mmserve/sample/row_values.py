"""Per-row host values (row indices, token ids, parameters) on the logits' device without waiting
for it: one pinned, non-blocking copy each (`to_device`). `torch.tensor(values, device=)` copies from
pageable memory and synchronises the stream, and indexing a device tensor with a host list does the
same, so in the async loop either would wait for the forward queued before it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mmserve.attention.buffers import to_device


def device_ids(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 on `device`: row indices for index_select/index_copy_, token ids, top-k."""
    return to_device(np.asarray(values, dtype=np.int64), device)


def device_floats(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """float32 on `device`: per-row parameters (temperature, top-p, penalty weights, biases)."""
    return to_device(np.asarray(values, dtype=np.float32), device)
