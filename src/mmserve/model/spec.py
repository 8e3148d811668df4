"""The model spec: one parse of a Gemma 4 family config into the plain facts mmserve plans with.

The decoder, the KV planner, the scheduler, the input processor and the perf model all read this
`ModelSpec`; it is built from the config alone (no weights), so the front-end process can load it.
In the engine (`load_spec`) transformers' config classes do the parsing (they accept the hub's flat
`global_head_dim` / `num_global_key_value_heads` keys and the `per_layer_config` form that 5.x
saves, and derive the KV-sharing roles); we read their resolved per-layer view. The front end
(`load_spec_without_transformers`) reads the same view from config.json without importing
transformers (model/config_json.py). Generation, processor and tokenizer files beside `config.json` add the stop
ids and the vision preprocessing budget.

Served: `gemma4` (dense 31B, E2B/E4B with per-layer embeddings and KV sharing, 26B-A4B with
experts), `gemma4_unified` (12B, encoder-free vision) and their text-only models (`gemma4_text`,
`gemma4_unified_text`, tied or untied as their text config says; weights as `Gemma4ForCausalLM`
saves them). Settings we do not implement fail here, naming the setting.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmserve.attention.backend import FULL, SLIDING, LayerAttentionSpec
from mmserve.errors import MMServeError
from mmserve.model import config_json

logger = logging.getLogger(__name__)

DEFAULT_IMAGE_MAX_SOFT_TOKENS = 280
DEFAULT_VIDEO_MAX_SOFT_TOKENS = 70
DEFAULT_AUDIO_SEQ_LENGTH = 750      # the processor's cap on one audio segment's soft tokens
DEFAULT_AUDIO_MS_PER_TOKEN = 40     # 10 ms mel frames, subsampled 4x by the tower's two stride-2 convs
END_OF_TURN = "<turn|>"
SERVED_MODEL_TYPES = ("gemma4", "gemma4_unified", "gemma4_text", "gemma4_unified_text")


class UnsupportedModelError(MMServeError):
    """The checkpoint uses a setting our decoder does not implement."""


@dataclass(frozen=True)
class RopeSpec:
    """RoPE of one layer type. `rotary_dim` dims of each head rotate; frequencies use `head_dim`
    as the denominator (Gemma 4's "proportional" RoPE keeps the full-width denominator)."""

    theta: float
    head_dim: int
    rotary_dim: int
    factor: float = 1.0


@dataclass(frozen=True)
class MoeSpec:
    """Routed experts (Gemma 4 26B-A4B): each token's `top_k` of `num_experts` gated MLPs of width
    `intermediate`, beside the layer's dense MLP."""

    num_experts: int
    top_k: int
    intermediate: int


@dataclass(frozen=True)
class PleSpec:
    """Per-layer embeddings (E2B/E4B): a `dim`-wide input per layer from a [vocab_size, layers*dim]
    token table plus a projection of the main embeddings."""

    dim: int
    vocab_size: int


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer. `kv_source` is the layer whose KV cache it attends over: itself, or for a
    KV-sharing consumer the last earlier non-consumer layer of its type (it then has no K/V
    projections and writes no cache)."""

    index: int
    layer_type: str
    k_eq_v: bool          # V comes from k_proj's raw output (no v_proj)
    kv_source: int
    mlp_width: int        # dense MLP width (double on KV-sharing layers with use_double_wide_mlp)
    moe: MoeSpec | None = None

    @property
    def shares_kv(self) -> bool:
        return self.kv_source != self.index


@dataclass(frozen=True)
class VisionSpec:
    """The vision path's shape, for the perf model. `tower`: Gemma 4's ViT (`num_layers` layers of
    width `hidden`) pooled k x k, then projected to the text width; `embedder`: gemma4_unified's
    encoder-free path (one Linear patch embedding of width `hidden`, no layers, one soft token per
    `patch_dim`-valued patch)."""

    kind: str                 # "tower" | "embedder"
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_dim: int            # input values of one patch as the encoder sees it
    pool_kernel: int          # soft tokens = patches / pool_kernel**2
    projector_out: int        # the text model's hidden size
    default_patches: int      # patches of one full-budget video frame
    position_table: int       # patch positions the encoder's table holds along each side


@dataclass(frozen=True)
class AudioSpec:
    """The audio path (E2B/E4B): transformers' conformer tower (two stride-2 convs over log-mel
    frames, then `num_layers` blocks of width `hidden` with chunked local attention), projected to
    the text width; and the feature extractor's settings, which fix how many soft tokens a clip
    costs (one per `ms_per_token` ms, at most `max_soft_tokens` per segment)."""

    num_layers: int
    hidden: int
    num_heads: int
    conv_channels: tuple[int, int]
    conv_kernel: int          # the depthwise conv of each block
    context: int
    output_dim: int           # the tower's output, before the embedder's projection
    projector_out: int        # the text model's hidden size
    sampling_rate: int
    feature_size: int         # mel bins
    frame_length: int         # samples per mel frame's window
    hop_length: int           # samples between mel frames
    ms_per_token: int
    max_soft_tokens: int
    feature_extractor: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def segment_samples(self) -> int:
        """The longest audio one segment holds (30 s at the defaults)."""
        return self.max_soft_tokens * self.ms_per_token * self.sampling_rate // 1000

    def num_soft_tokens(self, num_samples: int) -> int:
        """Soft tokens of `num_samples` samples (<= segment_samples), as the processor counts them:
        mel frames whose window holds only real samples, then two stride-2 convs."""
        frames = (num_samples + self.frame_length // 2 - (self.frame_length + 1)) // self.hop_length + 1
        if frames <= 0:
            return 0
        return min(((frames + 1) // 2 + 1) // 2, self.max_soft_tokens)


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine, scheduler and perf model need to know about the checkpoint."""

    model_type: str
    layers: tuple[LayerSpec, ...]
    attention_specs: dict[str, LayerAttentionSpec]   # per layer type, shared by its layers
    rope: dict[str, RopeSpec]
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    hidden_activation: str
    rms_norm_eps: float
    final_logit_softcapping: float | None
    tie_word_embeddings: bool
    max_model_len: int
    ple: PleSpec | None
    vision: VisionSpec | None
    audio: AudioSpec | None      # E2B/E4B's audio tower and its feature extractor; None: audio is refused
    pad_token_id: int
    bos_token_id: int
    boi_token_id: int
    eoi_token_id: int
    image_token_id: int
    video_token_id: int
    audio_token_id: int | None   # a model without an audio tower may still sample this id
    boa_token_id: int | None     # `<|audio>` and `<audio|>`: around each audio segment's soft tokens
    eoa_token_id: int | None
    eos_token_ids: tuple[int, ...]
    patch_size: int              # pixels per side of one patch as preprocessing cuts it
    pooling_kernel_size: int
    image_max_soft_tokens: int
    video_max_soft_tokens: int
    hf_config: Any = field(repr=False, compare=False)

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(layer.layer_type for layer in self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def has_vision(self) -> bool:
        return self.vision is not None

    @property
    def has_audio(self) -> bool:
        return self.audio is not None

    @property
    def modalities(self) -> tuple[str, ...]:
        """The inputs this model takes, as GetModelInfo lists them."""
        return ("text",) + (("image", "video") if self.has_vision else ()) + (("audio",) if self.has_audio else ())

    @property
    def placeholder_token_ids(self) -> tuple[int, ...]:
        """Media placeholder ids: the model embeds them as the pad token wherever they stand, even
        sampled ones (transformers masks by id; a prompt's placeholders are overwritten anyway)."""
        ids = (self.image_token_id, self.video_token_id, self.audio_token_id)
        return tuple(i for i in ids if i is not None)

    @property
    def kv_layer_types(self) -> tuple[str, ...]:
        """The layer type of every layer that holds a KV cache (KV-sharing consumers hold none)."""
        return tuple(layer.layer_type for layer in self.layers if not layer.shares_kv)


def _optional_id(value: Any) -> int | None:
    return None if value is None else int(value)


def _reject_unsupported(text: Any) -> None:
    if getattr(text, "use_bidirectional_attention", None) == "all":
        raise UnsupportedModelError(
            "use_bidirectional_attention='all' (bidirectional text, an embedding-model setting) is not supported")
    if text.attention_bias:
        raise UnsupportedModelError("attention_bias=True is not supported (Gemma 4 has no attention biases)")
    if text.hidden_activation != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"hidden_activation={text.hidden_activation!r} is not supported")
    unknown = set(text.layer_types) - {SLIDING, FULL}
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    if shared >= text.num_hidden_layers:
        raise UnsupportedModelError(
            f"num_kv_shared_layers={shared} leaves no layer to produce the shared KV cache")
    ple_vocab = getattr(text, "vocab_size_per_layer_input", 0) or 0
    if getattr(text, "hidden_size_per_layer_input", 0) and ple_vocab < text.vocab_size:
        raise UnsupportedModelError(
            f"vocab_size_per_layer_input={ple_vocab} is smaller than vocab_size={text.vocab_size} (with "
            f"hidden_size_per_layer_input set): ids from {ple_vocab} on have no per-layer embedding")
    if getattr(text, "enable_moe_block", False) and not (
            text.num_experts and text.top_k_experts and text.moe_intermediate_size):
        raise UnsupportedModelError(
            "enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")


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


def _per_type(text: Any, layer_type: str) -> tuple[int, int]:
    """(head_dim, num_kv_heads) for a layer type; every layer of one type must agree."""
    dims = {
        (text.per_layer_config[i].head_dim, text.per_layer_config[i].num_key_value_heads)
        for i, t in enumerate(text.layer_types)
        if t == layer_type
    }
    if len(dims) != 1:
        raise UnsupportedModelError(f"{layer_type} layers with differing head_dim/kv heads {sorted(dims)}")
    return dims.pop()


def _layers(text: Any) -> tuple[LayerSpec, ...]:
    """Per-layer roles: KV sharing from transformers' `kv_sharing_modes` (consumers read the last
    earlier non-consumer of their type), MLP widths, experts."""
    types = list(text.layer_types)
    modes = list(getattr(text, "kv_sharing_modes", None) or [None] * len(types))
    moe = None
    if getattr(text, "enable_moe_block", False):
        moe = MoeSpec(int(text.num_experts), int(text.top_k_experts), int(text.moe_intermediate_size))
    double_wide = bool(getattr(text, "use_double_wide_mlp", False))
    layers = []
    for i, layer_type in enumerate(types):
        source = i
        if modes[i] == "reuse":
            source = max(j for j in range(i) if types[j] == layer_type and modes[j] != "reuse")
        wide = 2 if double_wide and modes[i] == "reuse" else 1
        layers.append(LayerSpec(index=i, layer_type=layer_type,
                                k_eq_v=bool(text.attention_k_eq_v) and layer_type != SLIDING,
                                kv_source=source, mlp_width=int(text.intermediate_size) * wide, moe=moe))
    return tuple(layers)


def _vision(config: Any, text_hidden: int, video_budget: int) -> VisionSpec | None:
    vc = getattr(config, "vision_config", None)
    if vc is None:
        return None
    if vc.model_type == "gemma4_unified_vision":
        side = vc.patch_size * vc.pooling_kernel_size
        return VisionSpec(kind="embedder", num_layers=0, hidden=int(vc.mm_embed_dim), intermediate=0, num_heads=0,
                          num_kv_heads=0, head_dim=0, patch_dim=3 * side * side, pool_kernel=1,
                          projector_out=text_hidden, default_patches=video_budget,
                          position_table=int(vc.mm_posemb_size))
    k = int(vc.pooling_kernel_size)
    return VisionSpec(kind="tower", num_layers=int(vc.num_hidden_layers), hidden=int(vc.hidden_size),
                      intermediate=int(vc.intermediate_size), num_heads=int(vc.num_attention_heads),
                      num_kv_heads=int(vc.num_key_value_heads), head_dim=int(vc.head_dim),
                      patch_dim=3 * vc.patch_size ** 2, pool_kernel=k, projector_out=text_hidden,
                      default_patches=video_budget * k * k, position_table=int(vc.position_embedding_size))


def _audio(config: Any, root: Path | None, text_hidden: int) -> AudioSpec | None:
    """The audio tower's shape and the feature extractor's settings (processor_config.json's nested
    `feature_extractor`, or a Gemma 4 feature extractor's own preprocessor_config.json; else
    transformers' defaults, which are the released models')."""
    ac = getattr(config, "audio_config", None)
    # Only E2B/E4B's conformer tower is served; gemma4_unified's encoder-free audio embedder
    # (`gemma4_unified_audio`) is not yet, so such a model refuses audio like one without a tower.
    if ac is None or getattr(ac, "model_type", "gemma4_audio") != "gemma4_audio":
        return None
    settings = _processor_settings(root, "feature_extractor", "preprocessor_config.json")
    if settings.get("feature_extractor_type", "Gemma4AudioFeatureExtractor") != "Gemma4AudioFeatureExtractor":
        settings = {}
    settings = {k: v for k, v in settings.items() if k not in ("feature_extractor_type", "processor_class")}
    if not isinstance(config, config_json.Gemma4JsonConfig):
        from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

        fe = Gemma4AudioFeatureExtractor(**settings)
    else:
        fe = config_json.feature_extractor(settings)
    processor = _read_json(root / "processor_config.json" if root else None)
    if fe.feature_size != ac.subsampling_conv_channels[0]:
        raise UnsupportedModelError(f"the feature extractor's {fe.feature_size} mel bins do not match the audio "
                                    f"tower's first conv ({ac.subsampling_conv_channels[0]} channels)")
    return AudioSpec(
        num_layers=int(ac.num_hidden_layers), hidden=int(ac.hidden_size), num_heads=int(ac.num_attention_heads),
        conv_channels=(int(ac.subsampling_conv_channels[0]), int(ac.subsampling_conv_channels[1])),
        conv_kernel=int(ac.conv_kernel_size),
        context=int(ac.attention_chunk_size + ac.attention_context_left - 1 + ac.attention_context_right),
        output_dim=int(ac.output_proj_dims), projector_out=text_hidden, sampling_rate=int(fe.sampling_rate),
        feature_size=int(fe.feature_size), frame_length=int(fe.frame_length), hop_length=int(fe.hop_length),
        ms_per_token=int(processor.get("audio_ms_per_token") or DEFAULT_AUDIO_MS_PER_TOKEN),
        max_soft_tokens=int(processor.get("audio_seq_length") or DEFAULT_AUDIO_SEQ_LENGTH),
        feature_extractor=settings)


def _read_json(path: Path | None) -> dict[str, Any]:
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def _processor_settings(root: Path | None, key: str, filename: str) -> dict[str, Any]:
    """A sub-processor's settings: nested in processor_config.json, or its own file."""
    if root is None:
        return {}
    nested = _read_json(root / "processor_config.json").get(key)
    if isinstance(nested, dict):
        return nested
    return _read_json(root / filename)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def _end_of_turn_id(root: Path | None) -> int | None:
    tok = root / "tokenizer.json" if root is not None else None
    if tok is None or not tok.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok)).token_to_id(END_OF_TURN)


def _preprocessing(config: Any, root: Path | None) -> tuple[int, int, dict[str, Any], dict[str, Any]]:
    """(patch_size, pooling_kernel_size, image settings, video settings) as preprocessing applies them.
    gemma4_unified cuts 48-px "model patches" directly (its processor merges 3x3 16-px patches in the
    same raster order), so its preprocessing runs with patch 48 and no pooling."""
    vision = getattr(config, "vision_config", None)
    image_proc = _processor_settings(root, "image_processor", "preprocessor_config.json")
    video_proc = _processor_settings(root, "video_processor", "video_preprocessor_config.json")
    patch_size = int(image_proc.get("patch_size") or (vision.patch_size if vision else 16))
    pooling = int(image_proc.get("pooling_kernel_size") or (vision.pooling_kernel_size if vision else 3))
    if vision is not None and (patch_size, pooling) != (vision.patch_size, vision.pooling_kernel_size):
        logger.warning("processor patch_size/pooling %s differ from vision_config %s",
                       (patch_size, pooling), (vision.patch_size, vision.pooling_kernel_size))
    if vision is not None and vision.model_type == "gemma4_unified_vision":
        patch_size, pooling = patch_size * pooling, 1
    return patch_size, pooling, image_proc, video_proc


def spec_from_hf_config(config: Any, root: Path | None = None) -> ModelSpec:
    """Build the spec from a parsed transformers config and (when given) the generation, processor
    and tokenizer files in the checkpoint directory `root`."""
    text = config.get_text_config()
    _reject_unsupported(text)
    bidirectional = getattr(text, "use_bidirectional_attention", None) == "vision"
    attention_specs: dict[str, LayerAttentionSpec] = {}
    rope: dict[str, RopeSpec] = {}
    for layer_type in sorted(set(text.layer_types)):
        head_dim, kv_heads = _per_type(text, layer_type)
        sliding = layer_type == SLIDING
        attention_specs[layer_type] = LayerAttentionSpec(
            layer_type=layer_type, num_heads=text.num_attention_heads, num_kv_heads=kv_heads, head_dim=head_dim,
            window=text.sliding_window if sliding else None, bidirectional=bidirectional and sliding,
            clamp_bidirectional=True, scale=1.0)
        if layer_type not in text.rope_parameters:   # e.g. the flat one-dict form of other models
            raise UnsupportedModelError(f"rope_parameters has no {layer_type!r} entry (Gemma 4 gives each layer "
                                        f"type its own: {{{SLIDING!r}: {{...}}, {FULL!r}: {{...}}}})")
        rope[layer_type] = _rope_spec(text.rope_parameters[layer_type], head_dim)

    generation = _read_json(root / "generation_config.json" if root else None)
    eos = _as_ids(generation.get("eos_token_id")) or _as_ids(text.eos_token_id)
    end_of_turn = _end_of_turn_id(root)
    if end_of_turn is not None and end_of_turn not in eos:
        eos.append(end_of_turn)
    patch_size, pooling, image_proc, video_proc = _preprocessing(config, root)
    video_budget = int(video_proc.get("max_soft_tokens") or DEFAULT_VIDEO_MAX_SOFT_TOKENS)
    ple_dim = int(getattr(text, "hidden_size_per_layer_input", 0) or 0)

    return ModelSpec(
        model_type=str(config.model_type),
        layers=_layers(text),
        attention_specs=attention_specs,
        rope=rope,
        hidden_size=text.hidden_size,
        vocab_size=text.vocab_size,
        num_attention_heads=text.num_attention_heads,
        hidden_activation=text.hidden_activation,
        rms_norm_eps=text.rms_norm_eps,
        final_logit_softcapping=text.final_logit_softcapping,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings)),
        max_model_len=text.max_position_embeddings,
        ple=PleSpec(ple_dim, int(text.vocab_size_per_layer_input)) if ple_dim else None,
        vision=_vision(config, text.hidden_size, video_budget),
        audio=_audio(config, root, text.hidden_size),
        pad_token_id=int(text.pad_token_id or 0),
        bos_token_id=int(generation.get("bos_token_id", text.bos_token_id)),
        boi_token_id=int(config.boi_token_id),
        eoi_token_id=int(config.eoi_token_id),
        image_token_id=int(config.image_token_id),
        video_token_id=int(config.video_token_id),
        audio_token_id=_optional_id(getattr(config, "audio_token_id", None)),
        boa_token_id=_optional_id(getattr(config, "boa_token_id", None)),
        eoa_token_id=_optional_id(getattr(config, "eoa_token_index", getattr(config, "eoa_token_id", None))),
        eos_token_ids=tuple(eos),
        patch_size=patch_size,
        pooling_kernel_size=pooling,
        image_max_soft_tokens=int(image_proc.get("max_soft_tokens") or DEFAULT_IMAGE_MAX_SOFT_TOKENS),
        video_max_soft_tokens=video_budget,
        hf_config=config,
    )


def _wrap_text_config(model_type: str, data: dict[str, Any]):
    """A text-only config inside its multimodal wrapper (without vision), so both read alike. The
    wrapper's `tie_word_embeddings` is the one the model ties by: the text config's (a text-only
    model's own), not the wrapper's default."""
    from transformers import Gemma4Config, Gemma4UnifiedConfig

    wrapper = Gemma4UnifiedConfig if model_type.startswith("gemma4_unified") else Gemma4Config
    return wrapper(text_config=data, vision_config=None, audio_config=None,
                   tie_word_embeddings=data.get("tie_word_embeddings", True))


def load_hf_config(source: Any):
    """A transformers config from a checkpoint directory, a config.json path, a dict or a config
    object; refuses model types mmserve does not serve, naming them."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        model_type = source.model_type
        if model_type in ("gemma4_text", "gemma4_unified_text"):
            return _wrap_text_config(model_type, source.to_dict())
        if model_type not in SERVED_MODEL_TYPES:
            raise UnsupportedModelError(f"model_type={model_type!r}: mmserve serves {', '.join(SERVED_MODEL_TYPES)}")
        return source
    if isinstance(source, str | Path):
        source = _config_json(source)
    data = dict(source)
    model_type = data.pop("model_type", None)
    if model_type not in SERVED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type={model_type!r}: mmserve serves the Gemma 4 family ({', '.join(SERVED_MODEL_TYPES)})")
    if model_type.endswith("_text"):
        return _wrap_text_config(model_type, data)
    return AutoConfig.for_model(model_type, **data)


def _config_json(source: str | Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint directory or of a config.json path."""
    path = Path(source)
    cfg_path = path / "config.json" if path.is_dir() else path
    if not cfg_path.is_file():
        raise MMServeError(f"{path}: no config.json (is this a Gemma 4 checkpoint directory?)")
    return json.loads(cfg_path.read_text())


def _root(source: Any) -> Path | None:
    """The checkpoint directory of a source given as a path (its other files are read from there)."""
    root = Path(source) if isinstance(source, str | Path) else None
    if root is not None and not root.is_dir():
        root = root.parent if root.name == "config.json" else None
    return root


def load_spec(source: Any) -> ModelSpec:
    """The `ModelSpec` of a checkpoint directory, a config.json, a config dict or a config object
    (generation, processor and tokenizer files beside config.json are read when given a path),
    parsed by transformers: its `hf_config` builds the vision and audio towers."""
    return spec_from_hf_config(load_hf_config(source), _root(source))


def load_spec_without_transformers(source: Any) -> ModelSpec:
    """The same `ModelSpec` as `load_spec`, without importing transformers when config.json allows
    (model/config_json.py): the front end's, which builds no tower. A config that needs transformers'
    parsing, or that transformers refuses, goes to transformers (config.json as read here, not again)
    and fails with its message."""
    if isinstance(source, str | Path):
        data = _config_json(source)
    elif isinstance(source, dict):
        data = source
    else:
        return load_spec(source)   # a transformers config object
    root = _root(source)
    if isinstance(data, dict) and data.get("model_type") in SERVED_MODEL_TYPES:
        try:
            return spec_from_hf_config(config_json.resolve(data), root)
        except MMServeError:
            raise
        except Exception as exc:   # NotResolvable, or what a malformed config breaks: transformers decides
            logger.debug("config.json read through transformers: %s", exc)
    return spec_from_hf_config(load_hf_config(data), root)   # refused (naming the model type), or parsed
