"""A decoder layer's work between its attention call and its collectives, as functions of plain
tensors ("pieces"), so that on CUDA each compiles (inductor) into a few fused kernels around its GEMMs.

One layer, in order (its input RMSNorm comes fused in the previous layer's layer_out):
    attn_in  merged qkv GEMM -> q and k RMSNorm + RoPE, v RMSNorm, K/V written to
             the paged cache (the attention backend is then called attend-only)
    (the backend's attention)
    o_proj   the output GEMM (+ all-reduce under tensor parallelism)
    mlp_in   residual + post-attention RMSNorm, pre-FFN RMSNorm -> merged gate/up GEMM -> GELU x up
             -> down GEMM (+ all-reduce)
    (MoE layers: mlp_moe_in, in moe.py, in place of mlp_in: mlp_in's work, the router, the experts'
             pre-norm, the counting-sort dispatch and grouped GEMMs, in one piece; + two all-reduces)
    layer_out post-FFN RMSNorm (of norm_1(dense) + norm_2(routed) on MoE layers) + residual, the
             per-layer input (E2B/E4B: gate GEMM, then the projection with GELU x input folded into
             it, see ple_projection), the layer scalar, and the next layer's input RMSNorm (the
             decoder's final norm after the last layer)
A piece never spans the attention call or a collective, and each boundary falls right after a GEMM,
where a kernel ends anyway: splitting there costs no launch (bench/kernel_count.py counts them).

On CUDA the pieces run compiled (`compiled.layer_piece`: per layer kind, one graph for one row and
one for any other count, so every CUDA-graph size reuses them); on CPU they run eagerly with the
dense kernels, which bench/offline.py measured faster there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmserve.model.compiled import layer_piece
from mmserve.model.mlp import gelu_gate
from mmserve.model.norm import rms_norm
from mmserve.model.ple import gated_projection
from mmserve.model.rope import norm_rope


@layer_piece(token_args=1)
def input_norm(h: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """The first layer's input RMSNorm (every later layer's comes fused in its predecessor's layer_out)."""
    return rms_norm(h, norm_w, eps)


@layer_piece(token_args=4, cache_args=(7,))
def attn_in(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor | None,
            qkv_w: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor | None,
            kv_cache: torch.Tensor | None, eps: float, split: tuple[int, ...], head_dim: int,
            ) -> torch.Tensor:
    """x [T, H] (the layer's input, normed) -> q [T, heads, D], normed and rotated. A layer that
    projects K/V (`k_norm_w` given; `split` has 3 parts, or 2 on K=V layers whose V is k's raw
    projection) writes them into `kv_cache` ([2, blocks, block_size, Hkv, D]) at `slots` (the
    step's first len(slots) rows)."""
    t = x.shape[0]
    q_raw, *kv_raw = F.linear(x, qkv_w).split(split, dim=-1)
    q = norm_rope(q_raw.view(t, -1, head_dim), q_norm_w, eps, cos, sin)
    if k_norm_w is not None:
        k_raw = kv_raw[0].view(t, -1, head_dim)
        v_raw = k_raw if len(kv_raw) == 1 else kv_raw[1].view(t, -1, head_dim)
        n = slots.shape[0]
        k = norm_rope(k_raw, k_norm_w, eps, cos, sin)[:n]
        v = rms_norm(v_raw, None, eps)[:n]
        write_kv(kv_cache, k, v, slots)
    return q


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """K and V ([n, Hkv, D]) into the paged cache at `slots`, as ONE index_put_ on the cache tensor
    itself: compiled, that is a scatter into the cache in place (an index_copy_ into the views
    cache[0] / cache[1] compiles to a copy of the whole cache, then a scatter, then a copy back)."""
    n, block_size = slots.shape[0], kv_cache.shape[2]
    which = torch.arange(2, device=slots.device).repeat_interleave(n)
    blocks, offsets = (slots // block_size).repeat(2), (slots % block_size).repeat(2)
    kv_cache.index_put_((which, blocks, offsets), torch.cat([k, v]).to(kv_cache.dtype))


@layer_piece(token_args=2)
def mlp_in(h: torch.Tensor, attn: torch.Tensor, post_attn_w: torch.Tensor, pre_ff_w: torch.Tensor,
           gate_up_w: torch.Tensor, down_w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h (the layer's input), attn (o_proj's all-reduced output) -> (the residual after attention,
    this rank's share of the dense MLP's output)."""
    h = h + rms_norm(attn, post_attn_w, eps)
    gate, up = F.linear(rms_norm(h, pre_ff_w, eps), gate_up_w).chunk(2, dim=-1)
    return h, F.linear(gelu_gate(gate, up), down_w)


@layer_piece(token_args=4)
def layer_out(h: torch.Tensor, ffn: torch.Tensor, routed: torch.Tensor | None, layer_input: torch.Tensor | None,
              post_ff_w: torch.Tensor, scalar: torch.Tensor, moe_norm_w: tuple[torch.Tensor, torch.Tensor] | None,
              ple_w: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, next_norm_w: torch.Tensor, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output and, fused with it, the next layer's normed input (`next_norm_w`: its input
    norm, or the decoder's final norm after the last layer). The output: h + post-FFN norm of `ffn`
    (the dense MLP's, all-reduced; on MoE layers norm_1(dense) + norm_2(routed)), then the per-layer
    input's gate (E2B/E4B, `ple_w` = gate, projection, norm: h += norm(proj(gelu_tanh(gate(h)) *
    layer_input))), times the layer scalar."""
    if routed is not None:
        ffn = rms_norm(ffn, moe_norm_w[0], eps) + rms_norm(routed, moe_norm_w[1], eps)
    h = h + rms_norm(ffn, post_ff_w, eps)
    if layer_input is not None:
        gate_w, proj_w, norm_w = ple_w
        h = h + rms_norm(ple_projection(F.linear(h, gate_w), layer_input, proj_w), norm_w, eps)
    h = h * scalar
    return h, rms_norm(h, next_norm_w, eps)


def ple_projection(gate: torch.Tensor, layer_input: torch.Tensor, proj_w: torch.Tensor) -> torch.Tensor:
    """PLE's projection of gelu_tanh(gate) * layer_input, [T, D] -> [T, H], with that operand fused
    into it when compiled (the CUDA path; bench/kernel_count.py counts both cases):
    - one row (batch-1 decode): a reduction over D (256) rather than a GEMM, so inductor folds the
      GELU x input into its loads: one kernel where a GEMM and its operand's kernel are two;
    - more rows: `ple.gated_projection`, on CUDA one Triton GEMM making its operand in its prologue
      (a reduction would re-read the weight per row on CUDA cores).
    Eagerly (CPU) the elementwise op and a GEMM."""
    if torch.compiler.is_compiling():
        if gate.shape[0] > 1:
            return gated_projection(gate, layer_input, proj_w)
        gated = F.gelu(gate, approximate="tanh") * layer_input
        return (gated.unsqueeze(1).float() * proj_w.float()).sum(-1).to(gated.dtype)   # fp32 sums, as a GEMM's
    return F.linear(F.gelu(gate, approximate="tanh") * layer_input, proj_w)
