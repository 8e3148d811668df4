"""Reading model shapes from Hugging Face configs: both Gemma 4 config forms, KV-sharing layers,
per-architecture sliding-window layouts and where frames attend both ways."""

from __future__ import annotations

import json
import random

from mmserve.metrics.model_spec import model_shape


def gemma4_text(**extra) -> dict:
    cfg = dict(model_type="gemma4_text", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
               num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
               layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2, hidden_size_per_layer_input=0)
    return {**cfg, **extra}


def test_saved_per_layer_form_and_hub_flat_form_agree(tmp_path):
    from transformers import AutoConfig

    hub = gemma4_text()
    AutoConfig.for_model(**hub).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "per_layer_config" in saved  # transformers 5.24 writes the heterogeneous form
    from_dir, from_file, from_dict = model_shape(tmp_path), model_shape(tmp_path / "config.json"), model_shape(hub)
    assert from_dir == from_file == from_dict
    dims = {layer.attention.layer_type: (layer.attention.head_dim, layer.attention.num_kv_heads, n)
            for layer, n in from_dict.layers}
    assert dims == {"sliding_attention": (16, 2, 4), "full_attention": (32, 1, 2)}


def test_kv_sharing_layers_have_no_kv_projection():
    shape = model_shape(gemma4_text(attention_k_eq_v=False, num_kv_shared_layers=2, use_double_wide_mlp=True))
    reuse = [(layer, n) for layer, n in shape.layers if not layer.attention.has_kv_proj]
    assert sum(n for _, n in reuse) == 2
    assert all(layer.ffn.intermediate == 2 * 96 for layer, _ in reuse)
    assert shape.num_layers == 6


def test_sliding_layouts_per_architecture():
    n = random.randint(2, 8)
    mistral = model_shape(dict(model_type="mistral", num_hidden_layers=n, sliding_window=4096))
    assert [(layer.attention.window, count) for layer, count in mistral.layers] == [(4096, n)]
    llama = model_shape(dict(model_type="llama", num_hidden_layers=n))
    assert [(layer.attention.window, count) for layer, count in llama.layers] == [(None, n)]
    qwen2 = model_shape(dict(model_type="qwen2", num_hidden_layers=n + 2, use_sliding_window=True, sliding_window=64,
                             max_window_layers=2))
    assert {layer.attention.window: count for layer, count in qwen2.layers} == {None: 2, 64: n}
    gemma2 = model_shape(dict(model_type="gemma2", num_hidden_layers=2 * n))
    assert {layer.attention.window: count for layer, count in gemma2.layers} == {4096: n, None: n}


def test_where_frames_attend_both_ways():
    g4 = model_shape(dict(model_type="gemma4", text_config=gemma4_text(use_bidirectional_attention="vision")))
    assert {layer.attention.layer_type: layer.attention.bidirectional for layer, _ in g4.layers} == {
        "sliding_attention": True, "full_attention": False}
    g4_causal = model_shape(dict(model_type="gemma4", text_config=gemma4_text()))
    assert not any(layer.attention.bidirectional for layer, _ in g4_causal.layers)
    g3 = model_shape(dict(model_type="gemma3", text_config=dict(num_hidden_layers=6)))
    assert all(layer.attention.bidirectional for layer, _ in g3.layers)
