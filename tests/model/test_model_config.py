"""ModelSpec from config.json (both head-dim spellings), generation/processor files, and the
variants we refuse with a message naming the feature."""

from __future__ import annotations

import json
import shutil

import pytest
from gemma4_fixtures import EOS, TURN_CLOSE

from mmserve.attention.backend import FULL, SLIDING
from mmserve.model.config import UnsupportedModelError, load_spec


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
    assert spec.k_eq_v == {SLIDING: False, FULL: True}
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
    assert spec.k_eq_v[FULL] is False
    assert not any(s.bidirectional for s in spec.attention_specs.values())


def test_end_of_turn_is_added_to_eos_from_the_tokenizer(ckpt):
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    assert load_spec(ckpt).eos_token_ids == (EOS, TURN_CLOSE)
    (ckpt / "generation_config.json").unlink()
    assert load_spec(ckpt).eos_token_ids == (EOS, TURN_CLOSE)


def test_processor_settings_nested_in_processor_config(ckpt):
    (ckpt / "processor_config.json").write_text(json.dumps({
        "image_processor": {"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 140},
        "video_processor": {"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 280, "num_frames": 8}}))
    spec = load_spec(ckpt)
    assert (spec.image_max_soft_tokens, spec.video_max_soft_tokens, spec.video_num_frames) == (140, 280, 8)


def test_processor_settings_in_separate_files(ckpt):
    (ckpt / "preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 560, "patch_size": 4,
                                                               "pooling_kernel_size": 2}))
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 140, "num_frames": 16}))
    spec = load_spec(ckpt)
    assert (spec.image_max_soft_tokens, spec.video_max_soft_tokens, spec.video_num_frames) == (560, 140, 16)


@pytest.mark.parametrize("changes,feature", [
    ({"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 64}, "PLE"),
    ({"num_kv_shared_layers": 2}, "KV sharing"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
     "mixture-of-experts"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
])
def test_unsupported_variants_fail_naming_the_feature(ckpt, changes, feature):
    edit_text_config(ckpt, **changes)
    with pytest.raises(UnsupportedModelError, match=feature):
        load_spec(ckpt)


def test_other_architectures_are_refused(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["model_type"] = "gemma3"
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="gemma3"):
        load_spec(ckpt)
