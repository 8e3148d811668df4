"""Gemma 4 checkpoint config -> `ModelSpec`, the plain facts the rest of mmserve plans with.

transformers' `Gemma4Config` does the parsing (it accepts both the hub's flat `global_head_dim` /
`num_global_key_value_heads` keys and the `per_layer_config` form that 5.x saves); we read its
resolved per-layer view so both spellings give the same spec. Generation and processor files beside
`config.json` add the stop ids and the vision preprocessing budget.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers import Gemma4Config, Gemma4TextConfig

from mmserve.attention.backend import FULL, SLIDING, LayerAttentionSpec
from mmserve.errors import MMServeError

logger = logging.getLogger(__name__)

DEFAULT_IMAGE_MAX_SOFT_TOKENS = 280
DEFAULT_VIDEO_MAX_SOFT_TOKENS = 70
DEFAULT_VIDEO_NUM_FRAMES = 32
END_OF_TURN = "<turn|>"


class UnsupportedModelError(MMServeError):
    """The checkpoint uses a Gemma 4 feature our decoder does not implement (yet)."""


@dataclass(frozen=True)
class RopeSpec:
    """RoPE of one layer type. `rotary_dim` dims of each head rotate; frequencies use `head_dim`
    as the denominator (Gemma 4's "proportional" RoPE keeps the full-width denominator)."""

    theta: float
    head_dim: int
    rotary_dim: int
    factor: float = 1.0


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine, scheduler and perf model need to know about the checkpoint."""

    layer_types: tuple[str, ...]
    attention_specs: dict[str, LayerAttentionSpec]
    k_eq_v: dict[str, bool]                  # per layer type: V comes from k_proj (no v_proj)
    rope: dict[str, RopeSpec]
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    hidden_activation: str
    rms_norm_eps: float
    final_logit_softcapping: float | None
    tie_word_embeddings: bool
    max_model_len: int
    pad_token_id: int
    bos_token_id: int
    boi_token_id: int
    eoi_token_id: int
    image_token_id: int
    video_token_id: int
    eos_token_ids: tuple[int, ...]
    patch_size: int
    pooling_kernel_size: int
    image_max_soft_tokens: int
    video_max_soft_tokens: int
    video_num_frames: int
    has_vision: bool
    hf_config: Gemma4Config = field(repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)


def _reject_unsupported(text: Gemma4TextConfig) -> None:
    if text.hidden_size_per_layer_input:
        raise UnsupportedModelError(
            "per-layer embeddings (PLE, hidden_size_per_layer_input="
            f"{text.hidden_size_per_layer_input}) are not supported yet (Gemma 4 E2B/E4B)")
    if text.num_kv_shared_layers:
        raise UnsupportedModelError(
            f"KV sharing (num_kv_shared_layers={text.num_kv_shared_layers}) is not supported yet (Gemma 4 E2B/E4B)")
    if text.enable_moe_block:
        raise UnsupportedModelError("mixture-of-experts (enable_moe_block) is not supported yet (Gemma 4 26B-A4B)")
    if text.use_bidirectional_attention == "all":
        raise UnsupportedModelError(
            "use_bidirectional_attention='all' (bidirectional text, an embedding-model setting) is not supported")
    if text.attention_bias:
        raise UnsupportedModelError("attention_bias=True is not supported (Gemma 4 has no attention biases)")
    if text.hidden_activation != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"hidden_activation={text.hidden_activation!r} is not supported")
    unknown = set(text.layer_types) - {SLIDING, FULL}
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")


def _rope_spec(params: dict[str, Any], head_dim: int) -> RopeSpec:
    kind = params.get("rope_type", "default")
    theta = float(params["rope_theta"])
    factor = float(params.get("factor", 1.0) or 1.0)
    if kind == "default":
        return RopeSpec(theta=theta, head_dim=head_dim, rotary_dim=head_dim)
    if kind == "proportional":
        # Only the first `partial_rotary_factor` of the frequency pairs rotate; the rest get frequency 0.
        pairs = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        return RopeSpec(theta=theta, head_dim=head_dim, rotary_dim=2 * pairs, factor=factor)
    raise UnsupportedModelError(f"rope_type={kind!r} is not supported")


def _per_type(text: Gemma4TextConfig, layer_type: str) -> tuple[int, int]:
    """(head_dim, num_kv_heads) for a layer type; every layer of one type must agree."""
    dims = {
        (text.per_layer_config[i].head_dim, text.per_layer_config[i].num_key_value_heads)
        for i, t in enumerate(text.layer_types)
        if t == layer_type
    }
    if len(dims) != 1:
        raise UnsupportedModelError(f"{layer_type} layers with differing head_dim/kv heads {sorted(dims)}")
    return dims.pop()


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _processor_settings(path: Path, key: str, filename: str) -> dict[str, Any]:
    """A sub-processor's settings: nested in processor_config.json, or its own file."""
    nested = _read_json(path / "processor_config.json").get(key)
    if isinstance(nested, dict):
        return nested
    return _read_json(path / filename)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def _end_of_turn_id(path: Path) -> int | None:
    tok = path / "tokenizer.json"
    return Tokenizer.from_file(str(tok)).token_to_id(END_OF_TURN) if tok.is_file() else None


def spec_from_hf_config(config: Gemma4Config, root: Path) -> ModelSpec:
    """Build the spec from a parsed config and the generation/processor/tokenizer files in `root`."""
    text = config.get_text_config()
    _reject_unsupported(text)
    bidirectional = text.use_bidirectional_attention == "vision"
    layer_types = tuple(text.layer_types)
    attention_specs: dict[str, LayerAttentionSpec] = {}
    rope: dict[str, RopeSpec] = {}
    k_eq_v: dict[str, bool] = {}
    for layer_type in sorted(set(layer_types)):
        head_dim, kv_heads = _per_type(text, layer_type)
        sliding = layer_type == SLIDING
        attention_specs[layer_type] = LayerAttentionSpec(
            layer_type=layer_type,
            num_heads=text.num_attention_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            window=text.sliding_window if sliding else None,
            bidirectional=bidirectional and sliding,
            clamp_bidirectional=True,
            scale=1.0,
        )
        rope[layer_type] = _rope_spec(text.rope_parameters[layer_type], head_dim)
        k_eq_v[layer_type] = bool(text.attention_k_eq_v) and not sliding

    generation = _read_json(root / "generation_config.json")
    eos = _as_ids(generation.get("eos_token_id")) or _as_ids(text.eos_token_id)
    end_of_turn = _end_of_turn_id(root)
    if end_of_turn is not None and end_of_turn not in eos:
        eos.append(end_of_turn)

    vision = config.vision_config
    image_proc = _processor_settings(root, "image_processor", "preprocessor_config.json")
    video_proc = _processor_settings(root, "video_processor", "video_preprocessor_config.json")
    patch_size = int(image_proc.get("patch_size") or (vision.patch_size if vision else 16))
    pooling = int(image_proc.get("pooling_kernel_size") or (vision.pooling_kernel_size if vision else 3))
    if vision is not None and (patch_size, pooling) != (vision.patch_size, vision.pooling_kernel_size):
        logger.warning("processor patch_size/pooling %s differ from vision_config %s",
                       (patch_size, pooling), (vision.patch_size, vision.pooling_kernel_size))

    return ModelSpec(
        layer_types=layer_types,
        attention_specs=attention_specs,
        k_eq_v=k_eq_v,
        rope=rope,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        vocab_size=text.vocab_size,
        num_attention_heads=text.num_attention_heads,
        hidden_activation=text.hidden_activation,
        rms_norm_eps=text.rms_norm_eps,
        final_logit_softcapping=text.final_logit_softcapping,
        tie_word_embeddings=bool(config.tie_word_embeddings),
        max_model_len=text.max_position_embeddings,
        pad_token_id=int(text.pad_token_id or 0),
        bos_token_id=int(generation.get("bos_token_id", text.bos_token_id)),
        boi_token_id=config.boi_token_id,
        eoi_token_id=config.eoi_token_id,
        image_token_id=config.image_token_id,
        video_token_id=config.video_token_id,
        eos_token_ids=tuple(eos),
        patch_size=patch_size,
        pooling_kernel_size=pooling,
        image_max_soft_tokens=int(image_proc.get("max_soft_tokens") or DEFAULT_IMAGE_MAX_SOFT_TOKENS),
        video_max_soft_tokens=int(video_proc.get("max_soft_tokens") or DEFAULT_VIDEO_MAX_SOFT_TOKENS),
        video_num_frames=int(video_proc.get("num_frames") or DEFAULT_VIDEO_NUM_FRAMES),
        has_vision=vision is not None,
        hf_config=config,
    )


def load_hf_config(path: str | Path) -> Gemma4Config:
    """Parse `config.json` with transformers (both head-dim spellings) and check the architecture."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise MMServeError(f"{path}: no config.json (is this a Gemma 4 checkpoint directory?)")
    raw = json.loads(cfg_path.read_text())
    if raw.get("model_type") != "gemma4":
        raise UnsupportedModelError(
            f"{cfg_path}: model_type={raw.get('model_type')!r}; mmserve serves Gemma4ForConditionalGeneration (gemma4)")
    return Gemma4Config.from_pretrained(str(path))


def load_spec(path: str | Path) -> ModelSpec:
    """The `ModelSpec` of the checkpoint directory `path`."""
    return spec_from_hf_config(load_hf_config(path), Path(path))
