"""A Gemma 4 config.json resolved as transformers' config classes resolve it, without transformers.

The front end needs the `ModelSpec` (the perf model, the input processor) but no model code, and
importing transformers for its config classes costs ~1.5 s of CPU in every server start. This
module reads config.json with the defaults those classes fill in (`save_pretrained` writes only
the fields that differ from them) and the derivations the spec reads (default layer types, the
last layer full, default RoPE, per-layer head dims from `global_head_dim` or `per_layer_config`,
KV-sharing roles), for the served families: `gemma4`, `gemma4_unified`, their text-only configs
and their assistants (the drafters of speculative decoding).

It is deliberately partial: where a config needs more than the spec's fields (a type transformers
would refuse, per-layer overrides of other fields, legacy layer names, sub-configs of another
family), it raises `NotResolvable` and the caller parses with transformers, whose message is then
the one a bad config gets. The engine process always parses with transformers (it loads the vision
tower from that config), so every start is still validated there.
tests/model/test_model_config_json.py compares these defaults, and the specs built both ways, with
transformers'.
"""

from __future__ import annotations

import logging
from typing import Any

from mmserve.attention.backend import FULL, SLIDING

logger = logging.getLogger(__name__)

SLIDING_PATTERN = 6        # transformers' default layer types: 5 sliding, then 1 full
DEFAULT_GLOBAL_HEAD_DIM = 512
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
PER_LAYER_FIELDS = ("head_dim", "num_key_value_heads")   # the per-layer overrides resolved here

_TEXT = dict(
    vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    rope_parameters=None, attention_bias=False, sliding_window=512, layer_types=None, final_logit_softcapping=None,
    use_bidirectional_attention=None, attention_k_eq_v=False, num_kv_shared_layers=0, use_double_wide_mlp=False)
# The defaults of transformers' config classes for the fields the spec reads, by model_type.
TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma4_text": dict(_TEXT, vocab_size_per_layer_input=262_144, hidden_size_per_layer_input=256,
                        enable_moe_block=False, num_experts=None, top_k_experts=None, moe_intermediate_size=None),
    "gemma4_unified_text": dict(_TEXT, max_position_embeddings=262_144, sliding_window=1024,
                                use_bidirectional_attention="vision"),
}
VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma4_vision": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                          num_key_value_heads=12, head_dim=64, pooling_kernel_size=3, patch_size=16,
                          position_embedding_size=10 * 1024),
    "gemma4_unified_vision": dict(patch_size=16, pooling_kernel_size=3, mm_embed_dim=3840, mm_posemb_size=1120),
}
AUDIO_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma4_audio": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8,
                         subsampling_conv_channels=[128, 32], conv_kernel_size=5, attention_chunk_size=12,
                         attention_context_left=13, attention_context_right=0, output_proj_dims=1536),
    "gemma4_unified_audio": dict(audio_embed_dim=640),
}
_TOP = dict(boi_token_id=255_999, eoi_token_id=258_882, image_token_id=258_880, video_token_id=258_884,
            boa_token_id=256_000, eoa_token_index=258_883, audio_token_id=258_881, tie_word_embeddings=True)
# model_type -> (its text config's model_type, its vision's, its audio's, its own defaults)
FAMILIES = {
    "gemma4": ("gemma4_text", "gemma4_vision", "gemma4_audio", _TOP),
    "gemma4_unified": ("gemma4_unified_text", "gemma4_unified_vision", "gemma4_unified_audio", _TOP),
}
TEXT_ONLY = {"gemma4_text": "gemma4", "gemma4_unified_text": "gemma4_unified"}
# A drafter's config: its text config's default model_type and its own defaults.
ASSISTANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma4_assistant": ("gemma4_text", dict(backbone_hidden_size=1536, use_ordered_embeddings=False,
                                             num_centroids=2048, centroid_intermediate_top_k=32,
                                             tie_word_embeddings=True)),
    "gemma4_unified_assistant": ("gemma4_unified_text", dict(backbone_hidden_size=3840, use_ordered_embeddings=False,
                                                             num_centroids=2048, centroid_intermediate_top_k=32,
                                                             tie_word_embeddings=True)),
}
# What Gemma4AssistantConfig refuses of its text config (validate_architecture), as it must hold.
ASSISTANT_TEXT = dict(hidden_size_per_layer_input=0, enable_moe_block=False, use_double_wide_mlp=False,
                      vocab_size_per_layer_input=0)
# Fields whose JSON null transformers accepts (typed `X | None`) though their default is not None.
NULLABLE = frozenset({"pad_token_id", "eos_token_id", "bos_token_id", "rope_parameters", "layer_types",
                      *_TOP.keys() - {"tie_word_embeddings"}})
# Gemma4AudioFeatureExtractor's defaults for what the spec reads (frame and hop lengths from ms).
FEATURE_EXTRACTOR_DEFAULTS = dict(feature_size=128, sampling_rate=16_000, frame_length_ms=20.0, hop_length_ms=10.0)


class NotResolvable(Exception):
    """This config needs transformers' own parsing (its validation, or what is not resolved here)."""


class ConfigView:
    """A resolved config read by attribute, as the spec reads transformers' configs."""

    def __init__(self, values: dict[str, Any]):
        self.__dict__.update(values)

    def __repr__(self) -> str:
        return f"ConfigView({self.__dict__!r})"


class Gemma4JsonConfig(ConfigView):
    """The composite (text + optional vision and audio) config."""

    def get_text_config(self) -> ConfigView:
        return self.text_config


def _checked(values: dict[str, Any], defaults: dict[str, Any], where: str) -> dict[str, Any]:
    """Refuse (to transformers) a value of another type than its default's: transformers' strict
    configs refuse it, naming the field; read on as-is it would give the spec a wrong type."""
    for key, default in defaults.items():
        value = values[key]
        if value is None:
            if default is not None and key not in NULLABLE:
                raise NotResolvable(f"{where}.{key} is null")
            continue
        if default is None:
            continue   # `int | None` fields: the spec converts what it reads
        if key == "eos_token_id":
            ok = isinstance(value, int | list) and not isinstance(value, bool)
        elif isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        elif isinstance(default, list):
            ok = isinstance(value, list | tuple)
        else:
            ok = isinstance(value, type(default)) and not isinstance(value, bool)
        if not ok:
            raise NotResolvable(f"{where}.{key}: {type(value).__name__} where transformers expects "
                                f"{type(default).__name__}")
    return values


def _kv_sharing_modes(layer_types: list[str], num_shared: int) -> list[str | None]:
    """transformers' `kv_sharing_modes` as the spec reads it: the last `num_shared` layers "reuse"
    the cache of an earlier layer of their type (transformers also marks those producers "store")."""
    first_shared = len(layer_types) - num_shared
    if 0 < first_shared and set(layer_types[:first_shared]) != set(layer_types):
        raise NotResolvable("a shared layer type has no earlier layer producing its cache")
    return [None if i < first_shared else "reuse" for i in range(len(layer_types))]


def _per_layer(values: dict[str, Any], overrides: dict[Any, Any]) -> list[ConfigView]:
    """Each layer's head_dim and KV heads: its `per_layer_config` override, else the global value."""
    n = values["num_hidden_layers"]
    by_index: dict[int, dict[str, Any]] = {}
    for key, layer in overrides.items():
        index = int(key)
        if not 0 <= index < n or not isinstance(layer, dict) or set(layer) - set(PER_LAYER_FIELDS):
            raise NotResolvable(f"per_layer_config[{key!r}] = {layer!r}")
        by_index[index] = layer
    for layer in by_index.values():
        _checked({**{f: values[f] for f in PER_LAYER_FIELDS}, **layer},
                 {f: values[f] for f in PER_LAYER_FIELDS}, "per_layer_config")
    return [ConfigView({f: by_index.get(i, {}).get(f, values[f]) for f in PER_LAYER_FIELDS}) for i in range(n)]


def _text(model_type: str, data: dict[str, Any]) -> ConfigView:
    data = dict(data)
    if data.pop("model_type", model_type) != model_type:
        raise NotResolvable("text_config of another model type")
    global_head_dim = data.pop("global_head_dim", DEFAULT_GLOBAL_HEAD_DIM)
    global_kv_heads = data.pop("num_global_key_value_heads", None)
    overrides = data.pop("per_layer_config", None)
    if data.get("attention_chunk_size") is not None:
        raise NotResolvable("attention_chunk_size")   # transformers refuses it beside sliding_window
    defaults = TEXT_DEFAULTS[model_type]
    values = _checked({**defaults, **data}, defaults, "text_config")
    n = values["num_hidden_layers"]
    layer_types = values["layer_types"]
    if layer_types is None:
        layer_types = [SLIDING if (i + 1) % SLIDING_PATTERN else FULL for i in range(n)]
    layer_types = list(layer_types)
    if not set(layer_types) <= {SLIDING, FULL} or len(layer_types) != n:
        raise NotResolvable(f"layer_types {layer_types}")   # legacy names, or a count transformers refuses
    if layer_types and layer_types[-1] != FULL:
        logger.warning("the last layer must be full attention, got %s: it is made full attention (as "
                       "transformers does)", layer_types[-1])
        layer_types[-1] = FULL
    if overrides is None:
        layer = {"head_dim": global_head_dim}
        if values["attention_k_eq_v"] and global_kv_heads is not None:
            layer["num_key_value_heads"] = global_kv_heads
        overrides = {i: layer for i, t in enumerate(layer_types) if t == FULL}
    if not isinstance(overrides, dict):
        raise NotResolvable("per_layer_config is not a mapping")
    values.update(layer_types=layer_types, rope_parameters=values["rope_parameters"] or DEFAULT_ROPE,
                  per_layer_config=_per_layer(values, overrides),
                  kv_sharing_modes=_kv_sharing_modes(layer_types, values["num_kv_shared_layers"]))
    return ConfigView(values)


def _sub_config(key: str, data: Any, model_type: str, table: dict[str, dict[str, Any]]) -> ConfigView | None:
    if data is None:
        return None
    if not isinstance(data, dict) or data.get("model_type", model_type) != model_type:
        raise NotResolvable(f"{key} of another model type")
    defaults = table[model_type]
    return ConfigView(_checked({**defaults, **data, "model_type": model_type}, defaults, key))


def resolve(data: dict[str, Any]) -> Gemma4JsonConfig:
    """The config of a parsed config.json (`model_type` included) with transformers' defaults; a
    text-only config sits in its family's wrapper without vision or audio, tied as the text config
    says, as load_hf_config wraps it."""
    data = dict(data)
    model_type = data.pop("model_type", None)
    if model_type in TEXT_ONLY:
        tied = data.get("tie_word_embeddings", TEXT_DEFAULTS[model_type]["tie_word_embeddings"])
        data = {"text_config": dict(data, model_type=model_type), "vision_config": None, "audio_config": None,
                "tie_word_embeddings": tied}
        model_type = TEXT_ONLY[model_type]
    if model_type not in FAMILIES:
        raise NotResolvable(f"model_type={model_type!r}")
    text_type, vision_type, audio_type, defaults = FAMILIES[model_type]
    text = _text(text_type, data.pop("text_config", None) or {})
    vision = _sub_config("vision_config", data.pop("vision_config", None), vision_type, VISION_DEFAULTS)
    audio = _sub_config("audio_config", data.pop("audio_config", None), audio_type, AUDIO_DEFAULTS)
    values = _checked({**defaults, **data}, defaults, model_type)
    return Gemma4JsonConfig(dict(values, model_type=model_type, text_config=text, vision_config=vision,
                                 audio_config=audio))


def resolve_assistant(data: dict[str, Any]) -> Gemma4JsonConfig:
    """A drafter's config.json with transformers' defaults: its text config (every layer KV-sharing
    when it names no count, as the assistant config makes it) and the centroid head's settings. What
    Gemma4AssistantConfig refuses (per-layer embeddings, experts, ...) is left to it, to name."""
    data = dict(data)
    model_type = data.pop("model_type", None)
    if model_type not in ASSISTANTS:
        raise NotResolvable(f"model_type={model_type!r}")
    text_type, defaults = ASSISTANTS[model_type]
    text_data = dict(data.pop("text_config", None) or {})
    text_type = text_data.get("model_type", text_type)
    if text_type not in TEXT_DEFAULTS or (model_type == "gemma4_assistant" and text_type != "gemma4_text"):
        raise NotResolvable(f"an assistant's text_config of type {text_type!r}")
    text_defaults = TEXT_DEFAULTS[text_type]
    if not text_data.get("num_kv_shared_layers", text_defaults["num_kv_shared_layers"]):
        text_data["num_kv_shared_layers"] = text_data.get("num_hidden_layers", text_defaults["num_hidden_layers"])
    text = _text(text_type, text_data)
    if model_type == "gemma4_assistant" and (
            any(getattr(text, k) != v for k, v in ASSISTANT_TEXT.items())
            or text.num_kv_shared_layers != text.num_hidden_layers):
        raise NotResolvable("not an assistant's architecture")
    values = _checked({**defaults, **data}, defaults, model_type)
    return Gemma4JsonConfig(dict(values, model_type=model_type, text_config=text))


def feature_extractor(settings: dict[str, Any]) -> ConfigView:
    """What the spec reads of Gemma4AudioFeatureExtractor(**settings): its rate, mel bins and the
    frame and hop lengths in samples (from their milliseconds, as the extractor rounds them)."""
    given = {k: settings[k] for k in FEATURE_EXTRACTOR_DEFAULTS if k in settings}
    values = _checked({**FEATURE_EXTRACTOR_DEFAULTS, **given}, FEATURE_EXTRACTOR_DEFAULTS, "feature_extractor")
    rate = values["sampling_rate"]
    return ConfigView(dict(sampling_rate=rate, feature_size=values["feature_size"],
                           frame_length=int(round(rate * values["frame_length_ms"] / 1000.0)),
                           hop_length=int(round(rate * values["hop_length_ms"] / 1000.0))))
