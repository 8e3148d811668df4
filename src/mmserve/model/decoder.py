"""Our Gemma 4 text decoder (dense variants) over a paged KV cache.

Reads like the architecture: scaled embeddings -> layers of (sandwich-normed attention, sandwich-
normed gated-GELU MLP, per-layer scalar) -> final norm -> tied head with a logit soft-cap. Tokens
are flattened ([T, hidden], no batch dim); attention goes through `mmserve.attention` backends,
which write this step's K/V into the layer's paged cache and attend over it.
Parameter names mirror transformers' `language_model.*` so checkpoints map one to one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.attention.backend import AttentionImpl, AttentionMetadata
from mmserve.model.norm import RMSNorm
from mmserve.model.rope import RotaryEmbedding, apply_rope
from mmserve.model.spec import LayerSpec, ModelSpec


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: LayerSpec, impl: AttentionImpl):
        super().__init__()
        attn = spec.attention_specs[layer.layer_type]
        self.impl = impl
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        # K=V layers (full layers of the big models) take V from k_proj's raw output.
        self.v_proj = None if layer.k_eq_v else nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)
        self.v_norm = RMSNorm(self.head_dim, eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim)), cos, sin)
        k_raw = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v_raw = k_raw if self.v_proj is None else self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        k = apply_rope(self.k_norm(k_raw), cos, sin)
        v = self.v_norm(v_raw)
        out = self.impl.forward(q, k, v, kv_cache, metadata)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: LayerSpec, impl: AttentionImpl):
        super().__init__()
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.layer_type = layer.layer_type
        self.self_attn = Attention(spec, layer, impl)
        self.mlp = MLP(hidden, layer.mlp_width)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, metadata))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


class TextDecoder(nn.Module):
    """Gemma 4 text stack. `impls` holds one attention implementation per layer type."""

    def __init__(self, spec: ModelSpec, impls: dict[str, AttentionImpl]):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, layer, impls[layer.layer_type]) for layer in spec.layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self._rope: dict[tuple[str, torch.device], RotaryEmbedding] = {}

    def _cos_sin(self, layer_type: str, positions: torch.Tensor, dtype: torch.dtype):
        key = (layer_type, positions.device)
        if key not in self._rope:
            self._rope[key] = RotaryEmbedding(self.spec.rope[layer_type], positions.device)
        return self._rope[key].cos_sin(positions, dtype)

    def embed(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None,
              mm_token_index: torch.Tensor | None) -> torch.Tensor:
        """Scaled token embeddings with vision embeddings written over their placeholder rows.

        The scale is rounded to the weight dtype first (sqrt(3072) is 55.5 in bf16), as the model was
        trained; vision embeddings are not scaled.
        """
        weight = self.embed_tokens.weight
        scale = float(torch.tensor(math.sqrt(self.spec.hidden_size), dtype=weight.dtype))
        ids = torch.where(input_ids < self.spec.vocab_size, input_ids, self.spec.pad_token_id)
        h = F.embedding(ids, weight) * scale
        if mm_embeds is not None and mm_token_index is not None and mm_token_index.numel():
            h = h.index_copy(0, mm_token_index.to(h.device), mm_embeds.to(h.dtype))
        return h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict[str, AttentionMetadata], kv_caches: list[torch.Tensor],
                mm_embeds: torch.Tensor | None = None, mm_token_index: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids, mm_embeds, mm_token_index)
        rope = {t: self._cos_sin(t, positions, h.dtype) for t in attn_metadata}
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            cos, sin = rope[layer.layer_type]
            h = layer(h, cos, sin, kv_cache, attn_metadata[layer.layer_type])
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight).float()
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
