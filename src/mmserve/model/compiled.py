"""torch.compile for the model's elementwise work, switched per process by the model runner.

Two granularities:
- `@layer_piece` (model/layer_pieces.py): a decoder layer's work between attention and collectives,
  compiled whole on CUDA so inductor fuses its norms, RoPE, residual adds and GELU around the GEMMs
  (bench/kernel_count.py). Compiled at most twice per piece and layer kind: for one row (decode at
  batch 1, specialised by dynamo) and for any other row count (the token dim marked dynamic), so
  batch composition and every CUDA-graph size reuse them.
- `@dense_kernel` (RMSNorm, norm + RoPE, gated GELU): on a CPU, compiled only with `--compile-dense`
  and only for steps of at least `MIN_TOKENS` rows, because there a compiled call costs tens of
  microseconds of wrapper and thread-team start, more than the few tiny eager ops it replaces
  (bench/offline.py). Inside a compiled piece they are traced as plain code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

MIN_TOKENS = 128
PIECE_GRAPHS = 16   # see layer_piece
_dense = False
_layers = False


def set_compiled(dense: bool, *, layers: bool = False) -> None:
    """Turn the compiled dense kernels (`dense`) and layer pieces (`layers`) on or off for every model
    in this process."""
    global _dense, _layers
    _dense, _layers = dense, layers


def layers_compiled() -> bool:
    return _layers


def dense_kernel(fn: Callable) -> Callable:
    """`fn(x, ...)` eager, or compiled (once, lazily) when enabled and x has >= MIN_TOKENS rows."""
    @functools.wraps(fn)
    def call(x: torch.Tensor, *args):
        if not _dense or x.shape[0] < MIN_TOKENS:
            return fn(x, *args)
        if call.compiled is None:
            call.compiled = torch.compile(fn, dynamic=True)
        return call.compiled(x, *args)

    call.eager = fn
    call.compiled = None
    return call


def layer_piece(*, token_args: int) -> Callable[[Callable], Callable]:
    """`fn(*args)` eager, or compiled when layer pieces are on; its first `token_args` arguments are
    per-token tensors (or None) whose first dim is the step's row count, marked dynamic."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args):
            if not _layers:
                return fn(*args)
            if call.compiled is None:
                # Graphs per piece: two row regimes (three for the MoE piece: moe.PAIRWISE_MAX splits
                # the many rows) x the layer kinds that reach it (sliding / full, projecting K/V or
                # sharing them): up to 8, dynamo's default limit, past which it would run the piece
                # eagerly without a word.
                torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, PIECE_GRAPHS)
                call.compiled = torch.compile(fn, fullgraph=True)
            for arg in args[:token_args]:
                if arg is not None and arg.shape[0] > 1:
                    torch._dynamo.mark_dynamic(arg, 0)
            return call.compiled(*args)

        call.eager = fn
        call.compiled = None
        return call
    return wrap
