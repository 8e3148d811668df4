"""torch.compile for the model's elementwise work, switched per process by the model runner.

Two granularities:
- `@layer_piece` (model/layer_pieces.py): a decoder layer's work between attention and collectives,
  compiled whole on CUDA so inductor fuses its norms, RoPE, residual adds and GELU around the GEMMs
  (bench/kernel_count.py). One graph per row regime and layer kind: the regimes are one row (decode
  at batch 1, specialised by dynamo) and any other row count (the token dim marked dynamic; the MoE
  piece splits those in two at moe.PAIRWISE_MAX), so batch composition and every CUDA-graph size
  reuse them; the kinds are the layers that reach a piece with other shapes or None arguments
  (attn_in: sliding / full, projecting K/V or sharing them; mlp_in: E2B/E4B's double-wide MLPs).
  A KV cache's block count is dynamic too, so the memory profile's small pools, the serving ones
  and a sliding pool's fewer blocks share a graph. Gemma 4's most is attn_in's 8 on E2B/E4B
  (tests/engine/test_engine_compiled.py counts an E-model engine's), within dynamo's limit per
  function, which the first piece raises to PIECE_GRAPHS (flex's module to 32). Past that limit
  dynamo refuses to compile a piece again: the piece then runs eagerly, with a warning, rather
  than fail the step.
- `@dense_kernel` (RMSNorm, norm + RoPE, gated GELU): on a CPU, compiled only with `--compile-dense`
  and only for steps of at least `MIN_TOKENS` rows, because there a compiled call costs tens of
  microseconds of wrapper and thread-team start, more than the few tiny eager ops it replaces
  (bench/offline.py). Inside a compiled piece they are traced as plain code.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit

log = logging.getLogger(__name__)

MIN_TOKENS = 128
PIECE_GRAPHS = 16   # graphs dynamo may compile per function (its recompile_limit), at least: twice Gemma 4's most
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


def layer_piece(*, token_args: int, cache_args: tuple[int, ...] = ()) -> Callable[[Callable], Callable]:
    """`fn(*args)` eager, or compiled when layer pieces are on; its first `token_args` arguments are
    per-token tensors (or None) whose first dim is the step's row count, marked dynamic; the
    arguments at `cache_args` are paged KV caches (or None), their block dim (1) dynamic."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args):
            if not _layers or call.over_limit:
                return fn(*args)
            if call.compiled is None:
                # dynamo's default is 8, attn_in's count on E2B/E4B: no room for one more kind
                torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, PIECE_GRAPHS)
                call.compiled = torch.compile(fn, fullgraph=True)
            for arg in args[:token_args]:
                if arg is not None and arg.shape[0] > 1:
                    torch._dynamo.mark_dynamic(arg, 0)
            for i in cache_args:
                if args[i] is not None:
                    torch._dynamo.maybe_mark_dynamic(args[i], 1)
            try:
                return call.compiled(*args)
            except FailOnRecompileLimitHit:   # fullgraph=True: dynamo raises where it would run it eagerly
                call.over_limit = True
                log.warning("layer piece %s: dynamo's recompile_limit (%d graphs) reached; it runs eagerly from "
                            "now on (unfused: slower). Its graphs should not outnumber row regimes x layer kinds: "
                            "TORCH_LOGS=recompiles names the guard that failed",
                            fn.__name__, torch._dynamo.config.recompile_limit)
                return fn(*args)

        call.eager = fn
        call.compiled = None
        call.over_limit = False
        return call
    return wrap
