"""A Gemma 4 assistant's configuration (the drafter), parsed without its weights or the model code.

The perf model and the front end read it (drafter FLOPs and bytes, model info) with
`read_assistant_spec`, without transformers; the engine core loads the assistant itself
(model/assistant.py) from `load_assistant_spec`, which transformers parses and validates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mmserve.attention.backend import SLIDING
from mmserve.errors import MMServeError
from mmserve.model import config_json
from mmserve.model.spec import ModelSpec, RopeSpec, UnsupportedModelError, _per_type, _rope_spec

ASSISTANT_MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")


@dataclass(frozen=True)
class DraftAttention:
    """One assistant layer type: its query heads over the target's K/V heads of that type."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None     # sliding layers: keys within window + 1 of the last one (None: all)


@dataclass(frozen=True)
class AssistantSpec:
    model_type: str
    layer_types: tuple[str, ...]
    attention: dict[str, DraftAttention]
    rope: dict[str, RopeSpec]
    hidden_size: int
    backbone_hidden_size: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_top_k: int


def _config_data(path: str | Path) -> tuple[str, dict]:
    """(model_type, config.json's contents) of an assistant checkpoint; refuses another model type."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise UnsupportedModelError(f"{path}: no config.json (is this a Gemma 4 assistant checkpoint directory?)")
    data = json.loads(cfg_path.read_text())
    model_type = data.get("model_type")
    if model_type not in ASSISTANT_MODEL_TYPES:
        raise UnsupportedModelError(
            f"--speculative-model {path}: model_type={model_type!r}, expected one of {', '.join(ASSISTANT_MODEL_TYPES)}")
    return model_type, data


def _hf_config(path: str | Path, model_type: str, data: dict):
    from transformers import AutoConfig

    data = {k: v for k, v in data.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **data)
    except Exception as exc:   # transformers' validate_architecture names the setting
        raise UnsupportedModelError(f"--speculative-model {path}: {exc}") from exc


def load_assistant_spec(path: str | Path) -> AssistantSpec:
    """Parse an assistant's config.json through transformers (which refuses what an assistant may not
    be: per-layer embeddings, experts, double-wide MLPs, a layer that is not KV-sharing)."""
    model_type, data = _config_data(path)
    return _assistant_spec(model_type, _hf_config(path, model_type, data))


def read_assistant_spec(path: str | Path) -> AssistantSpec:
    """The same spec without importing transformers when config.json allows (model/config_json.py),
    for the front end and the check before ranks are spawned; what it cannot resolve goes through
    transformers (config.json as read here, not again), which names what it refuses. The engine loads
    the drafter with `load_assistant_spec`."""
    model_type, data = _config_data(path)
    try:
        return _assistant_spec(model_type, config_json.resolve_assistant(data))
    except MMServeError:
        raise
    except Exception:              # NotResolvable, or what a malformed config breaks: transformers decides
        return _assistant_spec(model_type, _hf_config(path, model_type, data))


def _assistant_spec(model_type: str, config) -> AssistantSpec:
    text = config.get_text_config()
    attention, rope = {}, {}
    for t in sorted(set(text.layer_types)):
        head_dim, kv_heads = _per_type(text, t)
        attention[t] = DraftAttention(text.num_attention_heads, kv_heads, head_dim,
                                      text.sliding_window if t == SLIDING else None)
        rope[t] = _rope_spec(text.rope_parameters[t], head_dim)
    return AssistantSpec(
        model_type=model_type, layer_types=tuple(text.layer_types), attention=attention, rope=rope,
        hidden_size=text.hidden_size, backbone_hidden_size=int(config.backbone_hidden_size),
        intermediate_size=text.intermediate_size, vocab_size=text.vocab_size, rms_norm_eps=text.rms_norm_eps,
        tie_word_embeddings=bool(config.tie_word_embeddings), use_ordered_embeddings=bool(config.use_ordered_embeddings),
        num_centroids=int(config.num_centroids), centroid_top_k=int(config.centroid_intermediate_top_k))


def storing_layers(target: ModelSpec) -> dict[str, int]:
    """The target layer whose K/V the assistant reads, per layer type: the last that holds a cache."""
    return {layer.layer_type: layer.index for layer in target.layers if not layer.shares_kv}


def check_compatible(assistant: AssistantSpec, target: ModelSpec) -> None:
    """Refuse, naming the mismatch, an assistant that cannot read this target's states."""
    problems = []
    if assistant.backbone_hidden_size != target.hidden_size:
        problems.append(f"backbone_hidden_size {assistant.backbone_hidden_size} != the target's hidden_size "
                        f"{target.hidden_size}")
    if assistant.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {assistant.vocab_size} != the target's {target.vocab_size}")
    stores = storing_layers(target)
    for t, attn in assistant.attention.items():
        if t not in stores:
            problems.append(f"it has {t} layers but the target has no {t} layer holding K/V")
            continue
        theirs = target.attention_specs[t]
        if (attn.head_dim, attn.num_kv_heads) != (theirs.head_dim, theirs.num_kv_heads):
            problems.append(f"{t}: head_dim/kv heads {attn.head_dim}/{attn.num_kv_heads} != the target layer "
                            f"{stores[t]}'s {theirs.head_dim}/{theirs.num_kv_heads}")
    if assistant.use_ordered_embeddings and assistant.vocab_size % assistant.num_centroids:
        problems.append(f"vocab_size {assistant.vocab_size} is not a multiple of num_centroids {assistant.num_centroids}")
    if problems:
        raise UnsupportedModelError("the speculative model does not fit the target: " + "; ".join(problems))
