"""Per-layer embeddings (PLE, Gemma 4 E2B/E4B): a small extra input for every decoder layer.

Model level, once per step: a token part (a row of one packed [vocab, L*D] table, x sqrt(D)) and a
context part (the scaled, vision-merged main embeddings projected H -> L*D, x H^-0.5, RMS-normed per
layer), summed and x 2^-0.5 into [T, L, D]. Image/video placeholders look up the pad row (the
context part still sees their vision features).
Layer level, after the MLP residual: h += norm(proj(gelu_tanh(gate(h)) * input_i)).
Tensor parallel: the big token table and the projection are split along D inside every layer's
block; both parts are all-gathered once per step (the norm needs all of D), the small per-layer
gates are replicated.
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


class LayerInputGate(nn.Module):
    """One layer's weights for its per-layer input, added to the residual stream by
    layer_pieces.layer_out (fused there with the layer's other elementwise work)."""

    def __init__(self, hidden: int, dim: int, eps: float):
        super().__init__()
        self.per_layer_input_gate = nn.Linear(hidden, dim, bias=False)
        self.per_layer_projection = nn.Linear(dim, hidden, bias=False)
        self.post_per_layer_input_norm = RMSNorm(hidden, eps)
