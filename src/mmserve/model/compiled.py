"""torch.compile for the dense elementwise kernels (RMSNorm, norm + RoPE, gated GELU), one switch per process.

A kernel decorated with `@dense_kernel` runs eagerly unless the engine turned compilation on
(`--compile-dense`, set by the model runner) and the step has at least `MIN_TOKENS` rows. Each
kernel is compiled at most once per process (dynamic token count, so batch composition never
recompiles). Small steps stay eager because on a CPU a compiled call costs tens of microseconds
of wrapper and thread-team start, more than the few tiny eager ops it replaces (bench/offline.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

MIN_TOKENS = 128
_enabled = False


def set_compiled(enabled: bool) -> None:
    """Turn the compiled kernels on or off for every model in this process."""
    global _enabled
    _enabled = enabled


def dense_kernel(fn: Callable) -> Callable:
    """`fn(x, ...)` eager, or compiled (once, lazily) when enabled and x has >= MIN_TOKENS rows."""
    @functools.wraps(fn)
    def call(x: torch.Tensor, *args):
        if not _enabled or x.shape[0] < MIN_TOKENS:
            return fn(x, *args)
        if call.compiled is None:
            call.compiled = torch.compile(fn, dynamic=True)
        return call.compiled(x, *args)

    call.eager = fn
    call.compiled = None
    return call
