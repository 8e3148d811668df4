"""Persistent per-step buffers: the zero-allocation hot path of step inputs and metadata builders;
and the host <-> device transfers the engine loop makes without waiting for the device.

`StagedBuffer`: a host staging tensor (pinned on CUDA) written through its numpy view, and the
device tensor it is copied to once per step (non-blocking). On a CPU device both are the same
tensor, so nothing is copied. `Workspace`: named grow-only scratch for step-dependent shapes
(padded masks, gather indices); after the largest step has been seen, nothing is allocated.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on `device` without waiting for the device: on CUDA one non-blocking copy
    from pinned memory (a plain `torch.tensor(..., device=)` copies from pageable memory and waits
    for the stream, i.e. for every step queued before it); the caching host allocator keeps the
    pinned block until the copy has run. On a CPU the array's own memory."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


class HostCopy:
    """`tensor` on its way to the host: on CUDA one non-blocking copy into pinned memory and an event
    after it, so `result()` waits for that copy alone, not for what the device queued after it."""

    def __init__(self, tensor: torch.Tensor):
        self._host, self._copied = tensor, None
        if tensor.is_cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()
        return self._host


class StagedBuffer:
    """A staging tensor (pinned on CUDA), its numpy view, and the device tensor it is copied to."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str):
        device = torch.device(device)
        pin = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.dev = self.cpu if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)

    def push(self, n: int) -> torch.Tensor:
        """Copy the first n rows to the device; return the device view."""
        if self.dev is not self.cpu:
            self.dev[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.dev[:n]


class Workspace:
    """Grow-only scratch tensors by name: `get(name, shape, dtype)` returns a view of a persistent
    buffer at least that large, reallocating only when a step needs more than ever before."""

    def __init__(self, device: torch.device | str, *, pin: bool = False):
        self.device = torch.device(device)
        self.pin = pin
        self._flat: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.numel() < numel or flat.dtype != dtype:
            flat = torch.empty(max(numel, 1), dtype=dtype, device=self.device, pin_memory=self.pin)
            self._flat[name] = flat
        return flat[:numel].view(shape)

    def storages(self) -> set[int]:
        """Data pointers of every buffer (tests check no step allocates outside them)."""
        return {t.untyped_storage().data_ptr() for t in self._flat.values()}


class StagedWorkspace:
    """Named grow-only host buffers (pinned on CUDA), written through numpy, each with a device twin
    that `push` fills with one non-blocking copy (on a CPU device the twin is the host buffer)."""

    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        self.host = Workspace("cpu", pin=device.type == "cuda")
        self.dev = self.host if device.type == "cpu" else Workspace(device)

    def array(self, name: str, shape: tuple[int, ...], dtype: torch.dtype):
        """The host buffer `name` as a numpy array of `shape`."""
        return self.host.get(name, shape, dtype).numpy()

    def push(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The device twin of host buffer `name`, holding what was written into `array(name, ...)`."""
        host = self.host.get(name, shape, dtype)
        if self.dev is self.host:
            return host
        dev = self.dev.get(name, shape, dtype)
        dev.copy_(host, non_blocking=True)
        return dev

    def storages(self) -> set[int]:
        return self.host.storages() | self.dev.storages()
