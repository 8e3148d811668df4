"""Per-layer embeddings (PLE, Gemma 4 E2B/E4B): a small extra input for every decoder layer.

Model level, once per step: a token part (a row of one packed [vocab, L*D] table, x sqrt(D)) and a
context part (the scaled, vision-merged main embeddings projected H -> L*D, x H^-0.5, RMS-normed per
layer), summed and x 2^-0.5 into [T, L, D]. Image/video placeholders look up the pad row (the
context part still sees their vision features).
Layer level, after the MLP residual: h += norm(proj(gelu_tanh(gate(h)) * input_i)).
Tensor parallel: the big token table and the projection are split along D inside every layer's
block; both parts are all-gathered once per step (the norm needs all of D), the small per-layer
gates are replicated.
On CUDA a decode step's layer projects gelu_tanh(gate) * input with `gated_projection`, one Triton
kernel that computes its GEMM operand in its prologue (model/ple_kernels.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.model.norm import RMSNorm
from mmserve.model.parallel import SINGLE, ParallelGroup, mark_shard
from mmserve.model.spec import ModelSpec


class PerLayerEmbeddings(nn.Module):
    def __init__(self, spec: ModelSpec, group: ParallelGroup = SINGLE):
        super().__init__()
        assert spec.ple is not None
        self.num_layers, self.dim, self.group = spec.num_layers, spec.ple.dim, group
        hidden, layers = spec.hidden_size, spec.num_layers
        d0, d1 = group.shard_range(self.dim, "hidden_size_per_layer_input")
        self.embed_tokens_per_layer = nn.Embedding(spec.ple.vocab_size, layers * (d1 - d0))
        self.per_layer_model_projection = nn.Linear(hidden, layers * (d1 - d0), bias=False)
        full = layers * self.dim
        mark_shard(self.embed_tokens_per_layer.weight, group, 1, d0, d1, full, blocks=layers)
        mark_shard(self.per_layer_model_projection.weight, group, 0, d0, d1, full, blocks=layers)
        self.per_layer_projection_norm = RMSNorm(self.dim, spec.rms_norm_eps)
        self.projection_scale = hidden ** -0.5

    def forward(self, token_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """token_ids [T] (placeholders already the pad id), embeds [T, H] -> per-layer inputs [T, L, D]."""
        weight = self.embed_tokens_per_layer.weight
        scale = float(torch.tensor(math.sqrt(self.dim), dtype=weight.dtype))   # rounded like the main scale
        tokens = (F.embedding(token_ids, weight) * scale).view(-1, self.num_layers, weight.shape[1] // self.num_layers)
        context = (self.per_layer_model_projection(embeds) * self.projection_scale).view(tokens.shape)
        if self.group.size > 1:
            tokens, context = self.group.all_gather(torch.stack([tokens, context]), dim=-1).unbind(0)
        context = self.per_layer_projection_norm(context)
        return (context + tokens) * 2 ** -0.5


MAX_KERNEL_ROWS = 256   # decode and verify steps; a prefill chunk's rows go to cuBLAS's tiles
BLOCK_H = 32            # output columns per program: E4B's 2560 are 80 programs, a row block's weight read spread wide


_kernel_enabled = True   # the process's choice: off after a failed start-up check (worker/backend_check.py)


def use_kernel(enabled: bool) -> None:
    """Turn the Triton kernel on or off for every model in this process (before layer pieces compile:
    a compiled piece keeps the op, and the op reads this at each call)."""
    global _kernel_enabled
    _kernel_enabled = enabled


def kernel_enabled() -> bool:
    return _kernel_enabled


@torch.library.custom_op("mmserve::ple_gated_projection", mutates_args=())
def gated_projection(gate: torch.Tensor, layer_input: torch.Tensor, proj_w: torch.Tensor) -> torch.Tensor:
    """proj(gelu_tanh(gate) * layer_input): [T, D] x2, [H, D] -> [T, H]. An opaque op, so that a
    compiled layer piece calls it as one launch: on CUDA with at most MAX_KERNEL_ROWS rows our Triton
    kernel (the operand made in its prologue) unless its start-up check turned it off; otherwise the
    elementwise op and a GEMM."""
    if gate.is_cuda and gate.shape[0] <= MAX_KERNEL_ROWS and _kernel_enabled:
        return launch_gated_projection(gate, layer_input, proj_w)
    return F.linear(F.gelu(gate, approximate="tanh") * layer_input, proj_w)


@gated_projection.register_fake
def _(gate: torch.Tensor, layer_input: torch.Tensor, proj_w: torch.Tensor) -> torch.Tensor:
    return gate.new_empty(gate.shape[0], proj_w.shape[0])


def launch_gated_projection(gate: torch.Tensor, layer_input: torch.Tensor, proj_w: torch.Tensor) -> torch.Tensor:
    """The Triton kernel itself (any device Triton runs on: its interpreter runs it on a CPU). Rows
    may be strided (a layer's slice of the [T, L, D] per-layer inputs); the last dims must be dense."""
    from mmserve.model.ple_kernels import gated_projection as kernel

    rows, dim = gate.shape
    cols = proj_w.shape[0]
    gate, layer_input, proj_w = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate, layer_input, proj_w))
    out = gate.new_empty(rows, cols)
    block_t = min(64, max(16, 1 << (rows - 1).bit_length()))   # tl.dot's tiles are 16 rows at least
    block_d = min(64, max(16, 1 << (dim - 1).bit_length()))
    grid = (-(-rows // block_t), -(-cols // BLOCK_H))
    kernel[grid](gate, layer_input, proj_w, out, rows, cols, gate.stride(0), layer_input.stride(0),
                 proj_w.stride(0), out.stride(0), DIM=dim, BLOCK_T=block_t, BLOCK_H=BLOCK_H, BLOCK_D=block_d,
                 PRECISION="ieee" if gate.dtype == torch.float32 else "tf32")
    return out


class LayerInputGate(nn.Module):
    """One layer's weights for its per-layer input, added to the residual stream by
    layer_pieces.layer_out (fused there with the layer's other elementwise work)."""

    def __init__(self, hidden: int, dim: int, eps: float):
        super().__init__()
        self.per_layer_input_gate = nn.Linear(hidden, dim, bias=False)
        self.per_layer_projection = nn.Linear(dim, hidden, bias=False)
        self.post_per_layer_input_norm = RMSNorm(hidden, eps)
