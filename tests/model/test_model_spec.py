"""ModelSpec from config.json (both head-dim spellings, any source: directory, file, dict, config
object), generation/processor files, per-layer roles (KV sharing, double-wide MLP, experts, PLE), and
the settings we refuse with a message naming them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from gemma4_fixtures import EOS, TURN_CLOSE

from mmserve.attention.backend import FULL, SLIDING
from mmserve.model.spec import (
    MoeSpec,
    PleSpec,
    UnsupportedModelError,
    load_spec,
    load_spec_without_transformers,
)


@pytest.fixture
def ckpt(checkpoints, tmp_path):
    """A private copy of the tiny checkpoint's small files (config, tokenizer, generation config)."""
    paths, _ = checkpoints
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        shutil.copy(paths["per_layer"] / name, tmp_path / name)
    return tmp_path


def edit_text_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"].update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def test_spec_describes_layer_types(checkpoints):
    paths, hf = checkpoints
    spec = load_spec(paths["per_layer"])
    text = hf.config.text_config
    assert spec.layer_types == tuple(text.layer_types)
    sliding, full = spec.attention_specs[SLIDING], spec.attention_specs[FULL]
    assert (sliding.head_dim, sliding.num_kv_heads, sliding.window, sliding.bidirectional) == (16, 2, 6, True)
    assert (full.head_dim, full.num_kv_heads, full.window, full.bidirectional) == (32, 1, None, False)
    assert sliding.clamp_bidirectional and full.scale == sliding.scale == 1.0
    assert {layer.layer_type: layer.k_eq_v for layer in spec.layers} == {SLIDING: False, FULL: True}
    assert all(not layer.shares_kv and layer.moe is None and layer.mlp_width == 96 for layer in spec.layers)
    assert spec.ple is None and spec.kv_layer_types == spec.layer_types
    assert spec.rope[FULL].rotary_dim == int(0.25 * 32) and spec.rope[SLIDING].rotary_dim == 16
    assert spec.eos_token_ids == (EOS, TURN_CLOSE)
    assert (spec.patch_size, spec.pooling_kernel_size) == (4, 2)
    assert (spec.image_max_soft_tokens, spec.video_max_soft_tokens) == (280, 70)


def test_flat_and_per_layer_forms_give_the_same_spec(checkpoints):
    paths, _ = checkpoints
    assert load_spec(paths["flat"]) == load_spec(paths["per_layer"])


def test_k_eq_v_off_keeps_sliding_kv_heads_on_full_layers(ckpt):
    # transformers applies num_global_key_value_heads only to K=V models
    raw = json.loads((ckpt / "config.json").read_text())
    text = raw["text_config"]
    text.pop("per_layer_config")
    text.update(attention_k_eq_v=False, global_head_dim=64, num_global_key_value_heads=1,
                use_bidirectional_attention=None)
    (ckpt / "config.json").write_text(json.dumps(raw))
    spec = load_spec(ckpt)
    assert spec.attention_specs[FULL].num_kv_heads == 2 and spec.attention_specs[FULL].head_dim == 64
    assert not any(layer.k_eq_v for layer in spec.layers)
    assert not any(s.bidirectional for s in spec.attention_specs.values())


def test_end_of_turn_is_added_to_eos_from_the_tokenizer(ckpt):
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    assert load_spec(ckpt).eos_token_ids == (EOS, TURN_CLOSE)
    (ckpt / "generation_config.json").unlink()
    assert load_spec(ckpt).eos_token_ids == (EOS, TURN_CLOSE)


def test_processor_settings_nested_in_processor_config(ckpt):
    (ckpt / "processor_config.json").write_text(json.dumps({
        "image_processor": {"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 140},
        "video_processor": {"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 280}}))
    spec = load_spec(ckpt)
    assert (spec.image_max_soft_tokens, spec.video_max_soft_tokens) == (140, 280)


def test_processor_settings_in_separate_files(ckpt):
    (ckpt / "preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 560, "patch_size": 4,
                                                               "pooling_kernel_size": 2}))
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 140}))
    spec = load_spec(ckpt)
    assert (spec.image_max_soft_tokens, spec.video_max_soft_tokens) == (560, 140)


def test_any_source_gives_the_same_spec(checkpoints):
    from transformers import AutoConfig

    paths, hf = checkpoints
    from_dir = load_spec(paths["per_layer"])
    raw = json.loads((paths["per_layer"] / "config.json").read_text())
    assert load_spec(paths["per_layer"] / "config.json") == from_dir
    no_files = load_spec(raw)   # no tokenizer/generation files: eos from the config alone
    assert no_files.layers == from_dir.layers and no_files.eos_token_ids == (EOS,)
    assert load_spec(AutoConfig.for_model(**raw)).layers == from_dir.layers
    text_only = load_spec(dict(raw["text_config"], model_type="gemma4_text"))
    assert text_only.layers == from_dir.layers and text_only.vision is None


def test_kv_sharing_roles_and_double_wide_mlp(ckpt):
    """E2B-like: the last 3 of 6 layers reuse the last earlier layer of their type; only they are wide."""
    edit_text_config(ckpt, num_kv_shared_layers=3, use_double_wide_mlp=True, attention_k_eq_v=False,
                     hidden_size_per_layer_input=8, vocab_size_per_layer_input=512)
    spec = load_spec(ckpt)
    types = spec.layer_types       # (S, S, F) * 2: layers 3..5 share; producers 1 (sliding) and 2 (full)
    assert [layer.kv_source for layer in spec.layers] == [0, 1, 2, 1, 1, 2]
    assert [layer.mlp_width for layer in spec.layers] == [96, 96, 96, 192, 192, 192]
    assert all(types[layer.kv_source] == layer.layer_type for layer in spec.layers)
    assert spec.kv_layer_types == types[:3]
    assert spec.ple == PleSpec(8, 512)   # may exceed vocab_size (320), not fall short


def test_experts(ckpt):
    edit_text_config(ckpt, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    assert {layer.moe for layer in load_spec(ckpt).layers} == {MoeSpec(4, 2, 32)}


@pytest.mark.parametrize("changes,feature", [
    ({"num_kv_shared_layers": 6}, "num_kv_shared_layers=6"),
    ({"enable_moe_block": True, "num_experts": 4}, "enable_moe_block"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 200},   # ids 200.. crashed the forward
     "vocab_size_per_layer_input=200 is smaller than vocab_size=320"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},   # the one-dict form: KeyError before
     "rope_parameters has no 'full_attention' entry"),
    ({"rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                             "rope_theta": 1e6}}}, "rope_parameters has no 'sliding_attention'"),
])
def test_unsupported_variants_fail_naming_the_feature(ckpt, changes, feature):
    """In the engine (load_spec) and the front end (load_spec_without_transformers) alike."""
    edit_text_config(ckpt, **changes)
    for read in (load_spec, load_spec_without_transformers):
        with pytest.raises(UnsupportedModelError, match=feature):
            read(ckpt)


def test_other_architectures_are_refused(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["model_type"] = "gemma3"
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="gemma3"):
        load_spec(ckpt)


@pytest.mark.parametrize("name,modalities", [("12b_unified", ("text", "image", "video")),
                                             ("e4b", ("text", "image", "video", "audio"))])
def test_modalities_of_published_configs(name, modalities):
    """E2B/E4B's conformer tower is served; gemma4_unified's encoder-free audio embedder is not yet,
    so its config (which has an audio_config of another kind) loads and lists no audio."""
    path = Path(__file__).resolve().parents[1] / "fixtures" / "gemma4_family" / f"{name}.json"
    assert load_spec(path).modalities == modalities
