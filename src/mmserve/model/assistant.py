"""Gemma 4's assistant drafter (`gemma4_assistant` / `gemma4_unified_assistant`) over the target's K/V.

The assistant has no KV cache of its own: every layer projects only Q and attends over the K/V
the target wrote in its last non-consumer layer of that layer type (its "storing" layer), read in
place from the target's paged pools through the target's attention backend: the attend-only call
KV-sharing layers make (`impl.forward(q, None, None, cache, metadata)`, `TargetKV`; the drafting
round's decode-shaped metadata comes from spec_decode/speculator.py). One draft step takes
`pre_projection(concat(target embedding of the last token, last hidden state))` at a constant
position (that of the token being drafted from), runs the layers (sandwich-normed attention and
gated-GELU MLP, as the target's), final-norms, and gives
- logits: the tied `lm_head`, or with `use_ordered_embeddings` the centroid head (the top-k
  centroids of `centroids(h)` select `top_k * vocab / num_centroids` vocabulary rows through
  `token_ordering`; every other token gets the smallest selected logit - 1), no soft-cap;
- the next step's hidden state, `post_projection(h)` (back to the target's width).
Masks are transformers': a full layer sees every key it is given; a sliding layer the last
`sliding_window + 1` of them (its bidirectional window read from the past side). The smallest
selected logit is taken per row (transformers takes it over the batch; it drafts at batch 1).
Parameter names are the checkpoint's, so loading is a strict state-dict match.

Tensor parallelism (`parallel.py`'s group; identities at size 1), sharded like the target so each
rank's layers read that rank's shard of the storing layers' K/V: query heads split by the target's
head split (a rank's query heads are exactly those whose KV heads it holds), o_proj row-parallel
and the MLP column/row-parallel (one all-reduce each), the head split along the vocab (plain:
logits all-gathered; centroid head: each rank scores the selected rows in its vocab shard and one
all-reduce of those scores gives every rank the full row). The projections, norms, centroids and
`token_ordering` are replicated. Each rank reads only its shard of the checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.attention.backend import AttentionImpl
from mmserve.model.assistant_spec import (
    AssistantSpec,
    DraftAttention,
    check_compatible,
    load_assistant_spec,
)
from mmserve.model.decoder import MLP
from mmserve.model.norm import RMSNorm
from mmserve.model.parallel import SINGLE, ParallelGroup, mark_shard, merged_of, shards_of
from mmserve.model.rope import RotaryEmbedding, norm_rope
from mmserve.model.spec import ModelSpec
from mmserve.model.weights import WeightLoadError, check_floating, checkpoint_files, copy_merged, iter_tensors

logger = logging.getLogger(__name__)

@dataclass
class TargetKV:
    """What one assistant layer type attends over in a drafting round: its storing layer's paged
    cache, an attention implementation for this rank's assistant heads over it, and the round's
    metadata from that backend's builder (one query row per request; its window the assistant's)."""

    impl: AttentionImpl
    kv_cache: torch.Tensor
    metadata: Any


class DraftLayerAttention(nn.Module):
    """This rank's query heads (those over the target's KV heads it holds); o_proj all-reduced."""

    def __init__(self, hidden: int, attn: DraftAttention, eps: float, layer_type: str, group: ParallelGroup = SINGLE):
        super().__init__()
        self.group = group
        d = self.head_dim = attn.head_dim
        q0, q1 = group.shard_range(attn.num_heads, f"assistant {layer_type} attention heads")
        group.kv_heads(attn.num_kv_heads, f"assistant {layer_type}")   # the target's split
        self.num_heads = q1 - q0
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=False)
        mark_shard(self.q_proj.weight, group, 0, q0 * d, q1 * d, attn.num_heads * d)
        self.q_norm = RMSNorm(d, eps)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=False)
        mark_shard(self.o_proj.weight, group, 1, q0 * d, q1 * d, attn.num_heads * d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: TargetKV) -> torch.Tensor:
        r = x.shape[0]
        q = norm_rope(self.q_proj(x).view(r, self.num_heads, self.head_dim), self.q_norm.weight, self.q_norm.eps,
                      cos, sin)
        out = kv.impl.forward(q, None, None, kv.kv_cache, kv.metadata)[:r]
        return self.group.all_reduce(self.o_proj(out.reshape(r, self.num_heads * self.head_dim)))


class DraftLayer(nn.Module):
    def __init__(self, spec: AssistantSpec, layer_type: str, group: ParallelGroup = SINGLE):
        super().__init__()
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.layer_type = layer_type
        self.self_attn = DraftLayerAttention(hidden, spec.attention[layer_type], eps, layer_type, group)
        self.mlp = MLP(hidden, spec.intermediate_size, group, what="assistant MLP width")
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, h, cos, sin, kv: TargetKV) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, kv))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


class CentroidHead(nn.Module):
    """`use_ordered_embeddings`: logits only for the vocabulary rows of the top-k centroids. Split
    along the vocab, a rank scores the selected rows it holds (zero elsewhere): one all-reduce of
    those [R, selected] scores, and every rank builds the same full row."""

    def __init__(self, spec: AssistantSpec, group: ParallelGroup = SINGLE):
        super().__init__()
        self.top_k = spec.centroid_top_k
        self.num_centroids = spec.num_centroids
        self.group = group
        self.vocab_size = spec.vocab_size
        self.centroids = nn.Linear(spec.hidden_size, spec.num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(spec.vocab_size, dtype=torch.int64))

    def forward(self, h: torch.Tensor, head: torch.Tensor, first_row: int) -> torch.Tensor:
        """`head`: this rank's rows [first_row, first_row + len) of the vocabulary's embeddings."""
        top = torch.topk(self.centroids(h), k=self.top_k, dim=-1).indices              # [R, top_k]
        per_centroid = self.token_ordering.long().view(self.num_centroids, -1)
        rows = per_centroid[top].flatten(1)                                             # [R, top_k * V / C]
        if self.group.size == 1:   # every row is this rank's: no masking (a draft step's hot path)
            selected = torch.einsum("rd,rkd->rk", h, head[rows])
        else:
            local = rows - first_row
            mine = (local >= 0) & (local < head.shape[0])
            selected = torch.einsum("rd,rkd->rk", h, head[local.where(mine, 0)]) * mine.to(h.dtype)
            selected = self.group.all_reduce(selected)
        out = (selected.min(dim=-1, keepdim=True).values - 1.0).expand(-1, self.vocab_size).clone()
        return out.scatter_(1, rows, selected)


class Assistant(nn.Module):
    """The drafter. `step(token_embeds, hidden, rope, target_kv)` is one draft step for R requests.
    `group`: the tensor-parallel group whose shard this is (its target's)."""

    def __init__(self, spec: AssistantSpec, group: ParallelGroup = SINGLE):
        super().__init__()
        self.spec = spec
        self.group = group
        v0, v1 = self.vocab_range = group.shard_range(spec.vocab_size, "assistant vocab_size")
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(v1 - v0, spec.hidden_size)   # the tied head's weight
        mark_shard(self.model.embed_tokens.weight, group, 0, v0, v1, spec.vocab_size)
        self.model.layers = nn.ModuleList(DraftLayer(spec, t, group) for t in spec.layer_types)
        self.model.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, v1 - v0, bias=False)
            mark_shard(self.lm_head.weight, group, 0, v0, v1, spec.vocab_size)
        self.pre_projection = nn.Linear(2 * spec.backbone_hidden_size, spec.hidden_size, bias=False)
        self.post_projection = nn.Linear(spec.hidden_size, spec.backbone_hidden_size, bias=False)
        self.masked_embedding = CentroidHead(spec, group) if spec.use_ordered_embeddings else None
        self._rope: dict[tuple[str, torch.device], RotaryEmbedding] = {}
        self.bytes_read = 0   # checkpoint bytes this process read to load it (its shard)

    @property
    def head_weight(self) -> torch.Tensor:
        """This rank's rows of the head (`vocab_range`)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin per layer type at the (constant) draft positions: computed once per drafting round."""
        out = {}
        for t in self.spec.attention:
            key = (t, positions.device)
            if key not in self._rope:
                self._rope[key] = RotaryEmbedding(self.spec.rope[t], positions.device)
            out[t] = self._rope[key].cos_sin(positions, dtype)
        return out

    @torch.inference_mode()
    def step(self, token_embeds: torch.Tensor, hidden: torch.Tensor, rope: dict, target_kv: dict[str, TargetKV]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """token_embeds, hidden [R, backbone_hidden] -> float32 logits [R, vocab] (the whole vocabulary,
        the same on every rank) and the next hidden state [R, backbone_hidden]."""
        h = self.pre_projection(torch.cat([token_embeds, hidden], dim=-1).to(self.pre_projection.weight.dtype))
        for layer in self.model.layers:
            cos, sin = rope[layer.layer_type]
            h = layer(h, cos, sin, target_kv[layer.layer_type])
        h = self.model.norm(h)
        if self.masked_embedding is not None:
            logits = self.masked_embedding(h, self.head_weight, self.vocab_range[0])
        else:
            logits = self.group.all_gather(F.linear(h, self.head_weight))
        return logits.float(), self.post_projection(h)


def load_assistant(path: str | Path, target: ModelSpec, *, dtype: torch.dtype, device: torch.device,
                   parallel: ParallelGroup = SINGLE) -> Assistant:
    """The assistant at `path`, checked against `target` (the whole model's spec, not a rank's) first,
    its tensors loaded strictly; with a `parallel` group, this rank's shard only."""
    start = time.perf_counter()
    spec = load_assistant_spec(path)
    check_compatible(spec, target)
    with torch.device("meta"):
        model = Assistant(spec, parallel)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    floating = {name for name, t in model.state_dict().items() if t.is_floating_point()}
    merged = merged_of(model)   # the MLP's gate_up_proj, stacked from the checkpoint's gate_proj and up_proj
    expected = (set(shapes) - {into for into, _ in merged.values()}) | set(merged)
    names = {n for n in checkpoint_files(path) if not (spec.tie_word_embeddings and n == "lm_head.weight")}
    missing, unexpected = sorted(expected - names), sorted(names - expected)
    if missing or unexpected:
        raise WeightLoadError(f"{path}: assistant checkpoint does not match its config: missing {missing[:8]}, "
                              f"unexpected {unexpected[:8]}")
    shards = shards_of(model) | {name: part.shard for name, (_, part) in merged.items() if part.shard is not None}
    state = {}
    for name, _, tensor in iter_tensors(path, {n: n for n in expected}, shards):
        model.bytes_read += tensor.numel() * tensor.element_size()
        if (merged[name][0] if name in merged else name) in floating:
            check_floating(path, name, tensor)
        if name in merged:
            copy_merged(state, shapes, name, *merged[name], tensor, dtype, device)
            continue
        if tensor.shape != shapes[name]:
            raise WeightLoadError(f"{path}: {name} has shape {tuple(tensor.shape)}, expected {tuple(shapes[name])}")
        state[name] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    logger.info("loaded assistant %s (%s)%s: %d layers, hidden %d, %s head, in %.1fs", path, spec.model_type,
                f", tensor-parallel rank {parallel.rank} of {parallel.size}" if parallel.size > 1 else "",
                len(spec.layer_types), spec.hidden_size,
                "centroid" if spec.use_ordered_embeddings else "lm", time.perf_counter() - start)
    return model
