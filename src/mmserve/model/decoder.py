"""Our Gemma 4 text decoder over a paged KV cache, for every variant of the family.

Reads like the architecture: scaled embeddings (plus per-layer embeddings on E2B/E4B) -> layers of
(sandwich-normed attention, sandwich-normed gated-GELU MLP with routed experts beside it on 26B-A4B,
the per-layer input gate, a per-layer scalar) -> final norm -> tied head with a logit soft-cap.
Tokens are flattened ([T, hidden], no batch dim); attention goes through `mmserve.attention`
backends, which write this step's K/V into the layer's paged cache and attend over it. A
KV-sharing layer (E2B/E4B's last layers) projects only Q and attends over its producer's cache
without writing (`impl.forward(q, None, None, ...)`); since it writes nothing, rows whose logits the
step does not sample feed nothing after the last KV-writing layer, so given `SampledRows` the
KV-sharing layers run on the sampled rows alone (a prefill chunk's last row instead of all of them).
Parameter names mirror transformers' `language_model.*`; `weights.py` maps the few we group under a
submodule (`ple.*`, `moe.*`).

Tensor parallelism (Megatron, `parallel.py`'s group; identities at size 1): Q/K/V split by heads
(a KV head replicated where ranks outnumber KV heads), o_proj and the MLP's down_proj row-parallel
with one all-reduce each; the tied embedding/unembedding split along the vocab (lookups all-reduced,
logits all-gathered before the soft-cap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.attention.backend import AttentionImpl
from mmserve.model.layer_pieces import attn_in, input_norm, layer_out, mlp_in
from mmserve.model.mlp import gelu_gate
from mmserve.model.moe import MoeBlock
from mmserve.model.norm import RMSNorm
from mmserve.model.parallel import SINGLE, ParallelGroup, mark_merged, mark_shard
from mmserve.model.ple import LayerInputGate, PerLayerEmbeddings
from mmserve.model.rope import RotaryEmbedding
from mmserve.model.spec import LayerSpec, ModelSpec


@dataclass
class SampledRows:
    """The rows of a step whose hidden states the caller needs (`index` into its T tokens, in order)
    and the attention metadata of a step made of those rows alone ({layer_type: metadata}, built
    like the step's own). KV-sharing layers then run on these rows only."""

    index: torch.Tensor
    attn_metadata: dict[str, Any]


class Attention(nn.Module):
    """This rank's query heads (and the KV heads they read); o_proj's partial sums are all-reduced.

    q, k and v are one GEMM (`qkv_proj`, stacked at load time from the checkpoint's three): at
    decode's few rows a projection is a read of its weights, and one wide read streams at bandwidth
    where three thin ones do not. K=V layers stack q and k only (V is k_proj's raw output);
    KV-sharing layers project q alone."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec, impl: AttentionImpl, group: ParallelGroup = SINGLE):
        super().__init__()
        attn = spec.attention_specs[layer.layer_type]
        self.impl, self.group = impl, group
        d = self.head_dim = attn.head_dim
        q0, q1 = group.shard_range(attn.num_heads, f"{layer.layer_type} attention heads")
        k0, k1 = group.kv_heads(attn.num_kv_heads, layer.layer_type)
        self.num_heads, self.num_kv_heads = q1 - q0, k1 - k0
        self.projects_kv, self.k_eq_v = not layer.shares_kv, layer.k_eq_v
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        parts = [("q_proj", q0 * d, q1 * d, attn.num_heads * d)]
        if self.projects_kv:
            kv = ("k_proj",) if layer.k_eq_v else ("k_proj", "v_proj")
            parts += [(name, k0 * d, k1 * d, attn.num_kv_heads * d) for name in kv]
        self.split = [end - start for _, start, end, _ in parts]
        self.qkv_proj = nn.Linear(hidden, sum(self.split), bias=False)
        mark_merged(self.qkv_proj.weight, group, parts)
        self.q_norm = RMSNorm(d, eps)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=False)
        mark_shard(self.o_proj.weight, group, 1, q0 * d, q1 * d, attn.num_heads * d)
        self.k_norm = self.v_norm = None
        if self.projects_kv:
            self.k_norm = RMSNorm(d, eps)
            self.v_norm = RMSNorm(d, eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                metadata) -> torch.Tensor:
        """The layer's normed input x -> o_proj's output, all-reduced. The layer's K/V are written to
        its cache by `attn_in` (fused into the kernel that norms them), so the backend attends only."""
        kv = None
        if self.projects_kv:
            common = metadata.common
            kv = (common.slot_mapping[:common.num_actual_tokens], self.k_norm.weight, kv_cache)
        slots, k_norm, cache = kv or (None, None, None)
        q = attn_in(x, cos, sin, slots, self.qkv_proj.weight, self.q_norm.weight, k_norm, cache,
                    self.q_norm.eps, tuple(self.split), self.head_dim)
        out = self.impl.forward(q, None, None, kv_cache, metadata)
        return self.group.all_reduce(self.o_proj(out.flatten(1)))


class MLP(nn.Module):
    """gate/up column-parallel (one GEMM, `gate_up_proj`, stacked at load time), down row-parallel:
    this rank's slice of the width, one all-reduce."""

    def __init__(self, hidden: int, intermediate: int, group: ParallelGroup = SINGLE, *, what: str = "MLP width"):
        super().__init__()
        self.group = group
        i0, i1 = group.shard_range(intermediate, what)
        self.width = i1 - i0
        self.gate_up_proj = nn.Linear(hidden, 2 * self.width, bias=False)
        mark_merged(self.gate_up_proj.weight, group, [(name, i0, i1, intermediate) for name in ("gate_proj", "up_proj")])
        self.down_proj = nn.Linear(self.width, hidden, bias=False)
        mark_shard(self.down_proj.weight, group, 1, i0, i1, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.width, dim=-1)
        return self.reduce(self.down_proj(gelu_gate(gate, up)))

    def after_attention(self, h: torch.Tensor, attn: torch.Tensor, post_attn_norm: RMSNorm, pre_ff_norm: RMSNorm
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoder layer's residual after attention, and its MLP's output (all-reduced), as one piece
        (MoE layers run `MoeBlock` instead, whose piece holds the MLP's too)."""
        h, dense = mlp_in(h, attn, post_attn_norm.weight, pre_ff_norm.weight, self.gate_up_proj.weight,
                          self.down_proj.weight, pre_ff_norm.eps)
        return h, self.reduce(dense)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's share of the MLP's output -> the whole (the MLP's all-reduce)."""
        return self.group.all_reduce(partial)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: LayerSpec, impl: AttentionImpl, group: ParallelGroup = SINGLE):
        super().__init__()
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.layer_type = layer.layer_type
        self.kv_source = layer.kv_source
        self.self_attn = Attention(spec, layer, impl, group)
        self.mlp = MLP(hidden, layer.mlp_width, group, what=f"layer {layer.index} MLP width")
        self.moe = MoeBlock(hidden, layer.moe, eps, group) if layer.moe is not None else None
        self.ple = LayerInputGate(hidden, spec.ple.dim, eps) if spec.ple is not None else None
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                metadata, layer_input: torch.Tensor | None, next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, x = input_layernorm(h)) -> (the layer's output, `next_norm` of it): sandwich-normed
        attention and MLP (+ experts, + per-layer input) in the pieces of layer_pieces.py, compiled
        on CUDA, each a few fused kernels between the GEMMs."""
        attn = self.self_attn(x, cos, sin, kv_cache, metadata)
        moe, ple = self.moe, self.ple
        if moe is None:
            h, ffn = self.mlp.after_attention(h, attn, self.post_attention_layernorm, self.pre_feedforward_layernorm)
            routed = None
        else:
            h, ffn, routed = moe(h, attn, self.mlp, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        moe_norms = None if moe is None else (moe.post_feedforward_layernorm_1.weight,
                                              moe.post_feedforward_layernorm_2.weight)
        ple_w = None if ple is None else (ple.per_layer_input_gate.weight, ple.per_layer_projection.weight,
                                          ple.post_per_layer_input_norm.weight)
        return layer_out(h, ffn, routed, layer_input, self.post_feedforward_layernorm.weight, self.layer_scalar,
                         moe_norms, ple_w, next_norm.weight, self.post_feedforward_layernorm.eps)


class TextDecoder(nn.Module):
    """Gemma 4 text stack. `impls` holds one attention implementation per layer type (built for this
    rank's heads); `group` is the tensor-parallel group this rank's shard belongs to."""

    def __init__(self, spec: ModelSpec, impls: dict[str, AttentionImpl], group: ParallelGroup = SINGLE):
        super().__init__()
        self.spec = spec
        self.group = group
        v0, v1 = self.vocab_range = group.shard_range(spec.vocab_size, "vocab_size")
        self.embed_tokens = nn.Embedding(v1 - v0, spec.hidden_size)
        mark_shard(self.embed_tokens.weight, group, 0, v0, v1, spec.vocab_size)
        self.ple = PerLayerEmbeddings(spec, group) if spec.ple is not None else None
        self.layers = nn.ModuleList(DecoderLayer(spec, layer, impls[layer.layer_type], group) for layer in spec.layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, v1 - v0, bias=False)
            mark_shard(self.lm_head.weight, group, 0, v0, v1, spec.vocab_size)
        self._rope: dict[tuple[str, torch.device], RotaryEmbedding] = {}
        self._table_ids: dict[torch.device, torch.Tensor] = {}

    def _cos_sin(self, layer_type: str, positions: torch.Tensor, dtype: torch.dtype):
        key = (layer_type, positions.device)
        if key not in self._rope:
            self._rope[key] = RotaryEmbedding(self.spec.rope[layer_type], positions.device)
        return self._rope[key].cos_sin(positions, dtype)

    def _text_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Ids for the embedding tables, as transformers computes them: media placeholders (prompt or
        sampled) and out-of-vocabulary ids become the pad id. One gather through a per-device table
        (no host sync, graph-capturable)."""
        key = input_ids.device
        if key not in self._table_ids:
            spec = self.spec
            table = torch.arange(spec.vocab_size + 1, dtype=torch.int64)
            inside = [i for i in spec.placeholder_token_ids if i < spec.vocab_size]   # the rest clamp to the last row
            table[[*inside, spec.vocab_size]] = spec.pad_token_id
            self._table_ids[key] = table.to(key)
        return self._table_ids[key][input_ids.clamp(0, self.spec.vocab_size)]

    def embed(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None,
              mm_token_index: torch.Tensor | None) -> torch.Tensor:
        """Scaled token embeddings with vision embeddings written over their placeholder rows.

        The scale is rounded to the weight dtype first (sqrt(3072) is 55.5 in bf16), as the model was
        trained; vision embeddings are not scaled. Split along the vocab, each rank looks up the ids
        in its rows (zeros elsewhere) and the all-reduce sums one row per token.
        """
        weight = self.embed_tokens.weight
        scale = float(torch.tensor(math.sqrt(self.spec.hidden_size), dtype=weight.dtype))
        ids = self._text_ids(input_ids)
        if self.group.size == 1:
            h = F.embedding(ids, weight)
        else:
            local = ids - self.vocab_range[0]
            mine = (local >= 0) & (local < weight.shape[0])
            h = F.embedding(torch.where(mine, local, 0), weight) * mine[:, None].to(weight.dtype)
            h = self.group.all_reduce(h)
        h = h * scale
        if mm_embeds is not None and mm_token_index is not None and mm_token_index.numel():
            h = h.index_copy(0, mm_token_index.to(h.device), mm_embeds.to(h.dtype))
        return h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict, kv_caches: list[torch.Tensor],
                mm_embeds: torch.Tensor | None = None, mm_token_index: torch.Tensor | None = None,
                sampled: SampledRows | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states of every row, or with `sampled` of those rows only. `inputs_embeds`
        (what `embed` gives, computed by the caller) replaces the embedding step: a piecewise CUDA
        graph starts after it, where the number of vision rows varies (worker/piecewise_graphs.py)."""
        h = self.embed(input_ids, mm_embeds, mm_token_index) if inputs_embeds is None else inputs_embeds
        layer_inputs = None
        if self.ple is not None:
            layer_inputs = self.ple(self._text_ids(input_ids), h)
        rope = {t: self._cos_sin(t, positions, h.dtype) for t in attn_metadata}
        first = self.layers[0].input_layernorm
        x = input_norm(h, first.weight, first.eps)   # x: the next layer's normed input, then the final norm's
        for i, layer in enumerate(self.layers):
            if sampled is not None and layer.kv_source != i:   # the first KV-sharing layer: keep sampled rows
                if not sampled.index.numel():
                    return self.norm(h[:0])
                h, x, positions = h[sampled.index], x[sampled.index], positions[sampled.index]
                attn_metadata = sampled.attn_metadata
                layer_inputs = None if layer_inputs is None else layer_inputs[sampled.index]
                rope = {t: (cos[sampled.index], sin[sampled.index]) for t, (cos, sin) in rope.items()}
                sampled = None
            cos, sin = rope[layer.layer_type]
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, x = layer(h, x, cos, sin, kv_caches[layer.kv_source], attn_metadata[layer.layer_type],
                         None if layer_inputs is None else layer_inputs[:, i], next_norm)
        if sampled is not None:   # no KV-sharing layer: every row ran
            x = x[sampled.index]
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.group.all_gather(F.linear(hidden, weight)).float()   # the soft-cap sees every column
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
