"""Per-row host values (row indices, token ids, parameters) on the logits' device without waiting
for it. `torch.tensor(values, device=)` copies from pageable memory and synchronises the stream, and
indexing a device tensor with a host list does the same, so in the async loop either would wait
for the forward queued before it.

A step's sampling gathers all its values by name first (`RowValues`), then sends them in one
packed, pinned, non-blocking copy and reads them as views of it on the device: one copy (one
launch on CUDA) a step, however many rows and parameters. `device_ids` is the one-off form, for
what is not per row (a prompt logprobs chunk's target ids)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mmserve.attention.buffers import to_device

_ALIGN = 8   # every array starts on an 8-byte boundary, so each view has its dtype's alignment
_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32}


def device_ids(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 on `device` in one copy of their own (a prompt logprobs chunk's target ids)."""
    return to_device(np.asarray(values, dtype=np.int64), device)


class RowValues:
    """A step's host values by name, sent together: `ids`/`floats`/`words` add arrays on the host, `to(device)`
    packs them into one byte buffer, copies it once and returns each as a view on the device."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def ids(self, name: str, values: Sequence[int] | np.ndarray) -> None:
        """int64 values (row indices, token ids, top-k, seeds' uniform bits), any shape."""
        self._arrays[name] = np.asarray(values, dtype=np.int64)

    def floats(self, name: str, values: Sequence[float] | np.ndarray) -> None:
        """float32 values (temperature, top-p, penalty weights, biases)."""
        self._arrays[name] = np.asarray(values, dtype=np.float32)

    def words(self, name: str, values: np.ndarray) -> None:
        """int32 values (a grammar's token bitmask words), any shape."""
        self._arrays[name] = np.asarray(values, dtype=np.int32)

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        """name -> the array on `device`, all from one copy (none when nothing was added)."""
        offsets, total = {}, 0
        for name, array in self._arrays.items():
            offsets[name] = total
            total += -(-array.nbytes // _ALIGN) * _ALIGN
        if not total:   # only empty arrays: nothing to copy
            return {name: torch.empty(array.shape, dtype=_DTYPES[array.dtype], device=device)
                    for name, array in self._arrays.items()}
        packed = np.zeros(total, dtype=np.uint8)
        for name, array in self._arrays.items():
            packed[offsets[name]:offsets[name] + array.nbytes] = array.reshape(-1).view(np.uint8)
        on_device = to_device(packed, device)
        out = {}
        for name, array in self._arrays.items():
            view = on_device[offsets[name]:offsets[name] + array.nbytes].view(_DTYPES[array.dtype])
            out[name] = view.view(array.shape)
        return out
