"""Attention: one mask semantics (mask.py) and interchangeable backends over a paged KV cache.

A backend bundles an implementation (`create_impl(name, spec)`, per layer type), a metadata builder
(`create_builder(name, pool)`, per KV pool, run once per step) and the KV cache shape.
`resolve_backend("auto", device)` names what a device runs (FA4 on GPUs it supports, else compiled
FlexAttention; on CPU the fastest correct CPU backend, measured in bench/attention.py), and
`selection.choose_backends` turns that into one backend per layer type (FA4 cannot run every head dim).
"""

from __future__ import annotations

import importlib
import logging

import torch

from mmserve.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    LayerAttentionSpec,
    PoolConfig,
)

log = logging.getLogger(__name__)

# name -> module holding its BACKEND bundle; imported lazily so optional dependencies stay optional.
_BACKENDS: dict[str, str] = {
    "reference": "mmserve.attention.reference",
    "sdpa": "mmserve.attention.sdpa",
    "flex": "mmserve.attention.flex",
    "fa4": "mmserve.attention.fa4",
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
    from mmserve.attention.fa4 import fa4_installed
    from mmserve.attention.selection import GPU_FALLBACK, device_arch

    if torch.device(device).type == "cuda":
        arch = device_arch(device)
        return "fa4" if fa4_installed() and arch is not None and arch // 10 in (9, 10, 11) else GPU_FALLBACK
    return CPU_AUTO_BACKEND


def get_backend(name: str) -> AttentionBackend:
    """The bundle (impl, metadata builder, KV cache shape) of backend `name` (resolved, not "auto")."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(_BACKENDS)}")
    return importlib.import_module(_BACKENDS[name]).BACKEND


def create_impl(name: str, spec: LayerAttentionSpec) -> AttentionImpl:
    """The implementation of backend `name` for one layer type (every layer of the type shares it)."""
    return get_backend(name).impl_cls(spec)


def create_builder(name: str, pool: PoolConfig) -> AttentionMetadataBuilder:
    """The metadata builder of backend `name` for one KV pool: run once per step, before the layers."""
    return get_backend(name).builder_cls(pool)


__all__ = ["AttentionBackend", "AttentionImpl", "AttentionMetadataBuilder", "CommonAttentionMetadata",
           "LayerAttentionSpec", "PoolConfig", "available_backends", "create_builder", "create_impl", "get_backend",
           "resolve_backend"]
