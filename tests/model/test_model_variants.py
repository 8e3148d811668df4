"""Other dense Gemma 4 shapes against transformers: separate V projections, no bidirectional
attention (E-model setting), untied head without soft-cap, scaled proportional RoPE; and bf16/fp16."""

from __future__ import annotations

import copy

import pytest
import torch
from gemma4_fixtures import make_checkpoint, make_tokenizer, tiny_config
from test_model_parity import assert_close, hf_logits, run_ours, video_prompt

from mmserve.model import load_model
from mmserve.model.prompt import build_prompt
from mmserve.model.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    cfg = tiny_config(window=5, attention_k_eq_v=False, use_bidirectional_attention=None, final_logit_softcapping=None,
                      global_head_dim=24, num_global_key_value_heads=1, num_hidden_layers=4, tie_word_embeddings=False,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                                       "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                          "rope_theta": 20000.0, "factor": 2.0}})
    cfg["tie_word_embeddings"] = False
    path = tmp_path_factory.mktemp("gemma4_variant")
    hf = make_checkpoint(path, config=cfg, seed=3)
    return path, hf


def test_variant_video_logits_match_transformers(variant):
    path, hf = variant
    model = load_model(path)
    assert model.decoder.lm_head is not None and len(model.decoder.layers[1].self_attn.split) == 3   # q, k, v
    layout = build_prompt(TextTokenizer(make_tokenizer()), model.spec,
                          video_prompt(model.spec, torch.Generator().manual_seed(8)))
    assert_close(run_ours(model, layout, [layout.mm_ranges[1][1] + 1]), hf_logits(hf, layout.token_ids, layout))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_as_accurate_as_transformers(checkpoints, dtype):
    """The tiny random model is ill-conditioned in half precision (transformers' own bf16 logits are
    far from its fp32 ones), so the check is relative: against the fp32 reference, our half-precision
    logits are no worse than transformers' half-precision logits. Embeddings must match exactly
    (the sqrt(hidden) scale is rounded to the weight dtype first)."""
    paths, hf = checkpoints
    model = load_model(paths["flat"], dtype=dtype)
    assert model.dtype == dtype and model.vision.dtype == dtype
    layout = build_prompt(TextTokenizer(make_tokenizer()), model.spec,
                          video_prompt(model.spec, torch.Generator().manual_seed(5)))
    ours = run_ours(model, layout, [])
    ref32 = hf_logits(hf, layout.token_ids, layout)
    ids = torch.tensor(layout.token_ids)
    hf_half = copy.deepcopy(hf).to(dtype)   # the session's fp32 reference must stay untouched
    ref = hf_logits(hf_half, layout.token_ids, layout).float()
    text_ids = torch.where(torch.isin(ids, torch.tensor(model.spec.placeholder_token_ids)), model.spec.pad_token_id, ids)
    with torch.no_grad():   # placeholders embed as the pad token, as in transformers' forward
        hf_embeds = hf_half.model.language_model.embed_tokens(text_ids)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(model.decoder.embed(ids, None, None), hf_embeds, rtol=0, atol=0)

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    assert rel(ours, ref32) <= 1.25 * rel(ref, ref32) + 1e-3, (rel(ours, ref32), rel(ref, ref32))
