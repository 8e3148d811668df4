"""Attention: one mask semantics (mask.py) and interchangeable backends over a paged KV cache.

`create_impl(name, spec)` returns the per-layer-type implementation; `resolve_backend("auto", device)`
picks FA4 on GPUs it supports and otherwise the fastest correct CPU backend (measured in
bench/attention.py).
"""

from __future__ import annotations

import importlib
import logging

import torch

from mmserve.attention.backend import AttentionImpl, AttentionMetadata, LayerAttentionSpec

log = logging.getLogger(__name__)

# name -> (module, class, takes the step capacity); imported lazily so optional dependencies stay optional.
_BACKENDS: dict[str, tuple[str, str, bool]] = {
    "reference": ("mmserve.attention.reference", "ReferenceImpl", False),
    "sdpa": ("mmserve.attention.sdpa", "SdpaImpl", False),
    "flex": ("mmserve.attention.flex", "FlexImpl", True),
    "fa4": ("mmserve.attention.fa4", "Fa4Impl", False),
}

# CPU choice from bench/attention.py (bench/results/attention.json): sdpa and flex tie in steady
# state over all steps (flex wins sliding layers and decode, loses long full-layer prefill), and
# flex first spends seconds compiling per layer type, so auto takes sdpa.
CPU_AUTO_BACKEND = "sdpa"


def available_backends() -> list[str]:
    """Backends that can run here (fa4 needs the `gpu` extra; it still falls back per layer type)."""
    from mmserve.attention.fa4 import fa4_installed

    return [name for name in _BACKENDS if name != "fa4" or fa4_installed()]


def resolve_backend(name: str, device: torch.device | str) -> str:
    """Turn a --attention-backend value into a concrete backend name for `device`."""
    if name != "auto":
        if name not in _BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(_BACKENDS)}")
        return name
    from mmserve.attention.fa4 import fa4_arch, fa4_installed

    if torch.device(device).type == "cuda":
        if fa4_installed() and fa4_arch(device) in (90, 100, 110):
            return "fa4"
        return "sdpa"
    return CPU_AUTO_BACKEND


def create_impl(name: str, spec: LayerAttentionSpec, *, max_num_tokens: int = 512,
                max_num_reqs: int = 64) -> AttentionImpl:
    """The implementation of backend `name` (already resolved, not "auto") for one layer type.

    Compiled backends pad every step to `max_num_tokens` query rows and size their tables for
    `max_num_reqs` requests, so passing the engine's budget here means they compile exactly once.
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(_BACKENDS)}")
    module, cls, sized = _BACKENDS[name]
    impl_cls = getattr(importlib.import_module(module), cls)
    if sized:
        return impl_cls(spec, max_num_tokens=max_num_tokens, max_num_reqs=max_num_reqs)
    return impl_cls(spec)


__all__ = ["AttentionImpl", "AttentionMetadata", "LayerAttentionSpec", "available_backends", "create_impl",
           "resolve_backend"]
