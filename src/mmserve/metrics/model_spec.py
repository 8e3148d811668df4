"""What the perf model needs to know about a model, read from a Hugging Face config.

The perf model never touches weights: FLOPs and bytes follow from shapes alone. This module turns a
config (a directory, a config.json, a dict or a `PretrainedConfig`) into plain dataclasses, one
`LayerShape` per distinct decoder layer kind with how many layers have it. Layers are grouped by
shape, not by index, because Gemma-style models differ per layer type (sliding layers: head_dim 256,
several KV heads; full layers: head_dim 512, fewer KV heads, K=V) and pipeline splits then divide each
group's count (fractions allowed) so that the stages always sum to the whole model.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class AttentionShape:
    """One layer's attention. `window` None = full attention; `has_kv_proj` False on KV-sharing layers."""

    layer_type: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None
    k_eq_v: bool = False          # V comes from the K projection (no v_proj weight), cache still holds K and V
    has_kv_proj: bool = True      # False: the layer reuses another layer's K/V (no projection, no cache write)
    bidirectional: bool = False   # frames' / images' token ranges attend both ways on this layer
    clamp_bidirectional: bool = True  # the bidirectional term also obeys q - k < window (HF semantics)

    @property
    def is_sliding(self) -> bool:
        return self.window is not None


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    top_k: int
    intermediate: int              # per expert
    shared_intermediate: int = 0   # total width of always-on shared experts (0 = none)


@dataclass(frozen=True)
class FfnShape:
    """Dense gated (3 matrices) or plain (2 matrices) MLP, optionally with routed experts beside it."""

    intermediate: int              # dense branch width; 0 when the layer is experts-only
    num_matrices: int = 3
    moe: MoeShape | None = None


@dataclass(frozen=True)
class LayerShape:
    attention: AttentionShape
    ffn: FfnShape


@dataclass(frozen=True)
class VisionShape:
    """A ViT-style encoder plus the projector into the text model, per image or video frame."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_dim: int                 # channels * patch_size**2, the patch embedding's input width
    pool_kernel: int               # soft tokens = patches / pool_kernel**2
    pool_matmul: bool              # pooling runs as a (tokens x patches) matmul (Gemma 4) rather than a reduction
    projector_out: int             # text hidden size the soft tokens are projected to
    mlp_matrices: int = 3
    default_patches: int = 0       # patches of one full-budget frame, used when a step only says "n frames"


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    hidden: int
    vocab_size: int
    layers: tuple[tuple[LayerShape, int], ...]   # (shape, number of layers with it), in first-seen order
    vision: VisionShape | None = None

    @property
    def num_layers(self) -> int:
        return sum(n for _, n in self.layers)


def load_hf_config(source: Any):
    """A transformers `PretrainedConfig` from a directory, a config.json path, a dict or a config."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            return AutoConfig.from_pretrained(str(path))
        source = json.loads(path.read_text())
    data = dict(source)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ValueError("config has no model_type; cannot tell which architecture it describes")
    return AutoConfig.for_model(model_type, **data)


def _first(cfg: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return default


def _layer_types(tc: Any, num_layers: int) -> list[str]:
    types = getattr(tc, "layer_types", None)
    if types:
        return [FULL if "sliding" not in t else SLIDING for t in types[:num_layers]]
    # Mistral-style configs: one window for every layer when set, else none.
    window = getattr(tc, "sliding_window", None) if getattr(tc, "use_sliding_window", True) else None
    return [SLIDING if window else FULL] * num_layers


def _moe_shape(tc: Any) -> MoeShape | None:
    num_experts = _first(tc, "num_experts", "num_local_experts", "n_routed_experts")
    top_k = _first(tc, "num_experts_per_tok", "top_k_experts")
    if not num_experts or not top_k:
        return None
    intermediate = _first(tc, "moe_intermediate_size", "intermediate_size")
    shared = _first(tc, "shared_expert_intermediate_size", default=0)
    if not shared and getattr(tc, "n_shared_experts", None):
        shared = tc.n_shared_experts * intermediate
    return MoeShape(int(num_experts), int(top_k), int(intermediate), int(shared))


def _is_moe_layer(tc: Any, i: int) -> bool:
    """Qwen-MoE: every `decoder_sparse_step`-th layer unless listed dense; DeepSeek: after the dense prefix."""
    if i in (getattr(tc, "mlp_only_layers", None) or []) or i < (getattr(tc, "first_k_dense_replace", None) or 0):
        return False
    if hasattr(tc, "decoder_sparse_step"):
        return (i + 1) % (tc.decoder_sparse_step or 1) == 0
    return i % (getattr(tc, "moe_layer_freq", None) or 1) == 0


def _text_layers(cfg: Any, tc: Any) -> list[LayerShape]:
    n = int(tc.num_hidden_layers)
    types = _layer_types(tc, n)
    heads = int(tc.num_attention_heads)
    # Heterogeneous configs (Gemma 4) refuse global reads of per-layer fields; ask each layer's view.
    # Configs without a head_dim field (Qwen2) mean hidden / heads.
    views = getattr(tc, "per_layer_config", None) or [tc] * n
    sharing = list(getattr(tc, "kv_sharing_modes", None) or [None] * n)
    k_eq_v_full = bool(getattr(tc, "attention_k_eq_v", False))
    window = getattr(tc, "sliding_window", None)
    model_type = str(getattr(cfg, "model_type", ""))
    # Where images attend both ways: Gemma 3 on every layer; Gemma 4 on sliding layers when "vision".
    bidi_gemma4 = getattr(tc, "use_bidirectional_attention", None) == "vision"
    moe = _moe_shape(tc)
    gemma4_moe = bool(getattr(tc, "enable_moe_block", False))
    double_wide = bool(getattr(tc, "use_double_wide_mlp", False))
    layers = []
    for i, layer_type in enumerate(types):
        hd = int(getattr(views[i], "head_dim", None) or tc.hidden_size // heads)
        kv = int(getattr(views[i], "num_key_value_heads", None) or heads)
        sliding = layer_type == SLIDING
        if model_type == "gemma3":
            bidirectional = True
        else:
            bidirectional = bidi_gemma4 and sliding
        attn = AttentionShape(
            layer_type=layer_type, num_heads=heads, num_kv_heads=kv, head_dim=hd,
            window=int(window) if sliding and window else None,
            k_eq_v=k_eq_v_full and not sliding, has_kv_proj=sharing[i] != "reuse",
            bidirectional=bidirectional,
        )
        reuse_wide = double_wide and sharing[i] == "reuse"
        if gemma4_moe:  # Gemma 4 MoE: dense MLP and routed experts side by side on every layer
            ffn = FfnShape(int(tc.intermediate_size), moe=moe)
        elif moe is not None and _is_moe_layer(tc, i):
            ffn = FfnShape(0, moe=moe)
        else:
            ffn = FfnShape(int(tc.intermediate_size) * (2 if reuse_wide else 1))
        layers.append(LayerShape(attn, ffn))
    return layers


def _vision_shape(cfg: Any, text_hidden: int) -> VisionShape | None:
    vc = getattr(cfg, "vision_config", None)
    if vc is None:
        return None
    heads = int(vc.num_attention_heads)
    patch = int(vc.patch_size)
    if vc.model_type == "gemma4_vision":
        k = int(vc.pooling_kernel_size)
        return VisionShape(
            num_layers=int(vc.num_hidden_layers), hidden=int(vc.hidden_size),
            intermediate=int(vc.intermediate_size), num_heads=heads,
            num_kv_heads=int(vc.num_key_value_heads), head_dim=int(vc.head_dim),
            patch_dim=3 * patch * patch, pool_kernel=k, pool_matmul=True, projector_out=text_hidden,
            mlp_matrices=3, default_patches=70 * k * k,  # Gemma 4 video: 70 soft tokens per frame
        )
    # SigLIP (Gemma 3): fixed image size, conv patch embedding, plain 2-matrix MLP, avg-pool then project.
    side = int(vc.image_size) // patch
    tokens = int(getattr(cfg, "mm_tokens_per_image", side * side))
    return VisionShape(
        num_layers=int(vc.num_hidden_layers), hidden=int(vc.hidden_size),
        intermediate=int(vc.intermediate_size), num_heads=heads, num_kv_heads=heads,
        head_dim=int(vc.hidden_size) // heads, patch_dim=int(getattr(vc, "num_channels", 3)) * patch * patch,
        pool_kernel=int(round((side * side / tokens) ** 0.5)), pool_matmul=False,
        projector_out=text_hidden, mlp_matrices=2, default_patches=side * side,
    )


def model_shape(source: Any) -> ModelShape:
    """Parse a HF config (text-only or a multimodal wrapper with text_config) into a ModelShape."""
    cfg = load_hf_config(source)
    tc = cfg.get_text_config()
    counts: Counter[LayerShape] = Counter(_text_layers(cfg, tc))
    return ModelShape(
        model_type=str(cfg.model_type), hidden=int(tc.hidden_size), vocab_size=int(tc.vocab_size),
        layers=tuple(counts.items()), vision=_vision_shape(cfg, int(tc.hidden_size)),
    )
