"""Which torch calls would make the host wait for the device on CUDA, counted on a CPU.

`bench/async_overlap.py` runs the sampler's work under it over a simulated device (each read waits
for the simulated stream), and a test runs every row kind under it (tests/engine/test_engine_async.py:
the async loop's sampling reads nothing).
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode


class DeviceReads(TorchFunctionMode):
    """The torch calls that make the host wait for the device's stream on CUDA, each calling `wait`
    first: a device tensor read on the host (`.tolist()`, `.item()`, `bool()`/`int()`/`float()`,
    `.cpu()`, `.numpy()`, `nonzero`, `masked_select`), a host value copied to the device from
    pageable memory (`torch.tensor`/`as_tensor` with a device, a host tensor's `.to(device)` without
    `non_blocking`: PyTorch synchronises the stream after such a copy), and a device tensor indexed
    with what must first become a device index that way (a Python list) or be counted on the host
    (a boolean mask). On a CPU every tensor lives on the host, so which ones stand for device tensors
    is tracked: those `mark`ed (the logits, the hidden states) and every tensor made from one or by a
    factory given a device; the rest (numpy views, the grammar's bitmask) are the host's. `sites`
    counts each read by the innermost mmserve line that made it."""

    _READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
              torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select}
    _INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
                 torch.Tensor.index_put, torch.index_put}

    def __init__(self, wait: Callable[[], None] = lambda: None):
        super().__init__()
        self.wait = wait
        self.sites: Counter[str] = Counter()
        self._device: dict[int, weakref.ref] = {}   # id -> the tensor (a tensor's == is elementwise: no set)

    def mark(self, *tensors) -> None:
        """These tensors stand for device ones."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                key = id(t)
                self._device[key] = weakref.ref(t, lambda _, key=key: self._device.pop(key, None))

    def around(self, fn: Callable, marked: int) -> Callable:
        """`fn` run under this mode, its positional argument `marked` (the logits, the hidden
        states: device results) marked as a device tensor first."""
        def run(*args, **kwargs):
            self.mark(args[marked])
            with self:
                return fn(*args, **kwargs)
        return run

    def on_device(self, x) -> bool:
        ref = self._device.get(id(x))
        return ref is not None and ref() is x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_device = any(self.on_device(x) for x in _tensors((args, kwargs)))
        if self._waits(func, args, kwargs, on_device):
            self.sites[_caller()] += 1
            self.wait()
        out = func(*args, **kwargs)
        if func is torch.Tensor.cpu and out is args[0]:   # a host copy, as on CUDA (a CPU tensor's .cpu() is itself)
            out = out.clone()
        if func not in self._READS and (on_device or kwargs.get("device") is not None):
            self.mark(*_tensors(out))
        return out

    def _waits(self, func, args, kwargs, on_device: bool) -> bool:
        first = args[0] if args else None
        if func in self._READS:
            return self.on_device(first)
        if func in (torch.tensor, torch.as_tensor):
            return kwargs.get("device") is not None
        if func is torch.Tensor.to:
            moves = any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs
            return moves and not self.on_device(first) and not kwargs.get("non_blocking", False)
        if func in self._INDEXING and self.on_device(first):
            parts = args[1] if isinstance(args[1], tuple) else (args[1],)
            return any(isinstance(p, list) or (isinstance(p, torch.Tensor) and p.dtype == torch.bool) for p in parts)
        return False


def _tensors(obj) -> list[torch.Tensor]:
    """The tensors in `obj` and its nested tuples, lists and dicts (what torch calls take and return;
    cheaper than pytree's flatten, which this hook would otherwise pay on every torch call)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    found = []
    for x in obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ():
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (tuple, list, dict)):
            found += _tensors(x)
    return found


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and "/mmserve/" not in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    return f"{path[path.rindex('/mmserve/') + 1:]}:{frame.f_lineno}"
