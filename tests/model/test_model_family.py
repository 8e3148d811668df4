"""The Gemma 4 family against transformers: E2B-like (per-layer embeddings, KV sharing, double-wide
MLPs), 26B-A4B-like (experts beside the dense MLP, top-k > 1) and 12B-like gemma4_unified (encoder-free
vision). Fresh random video+text prompts whose frames outgrow the sliding window, prefilled in chunks
through our paged cache; fp32, max relative error 1e-4. Greedy decoding of each variant through a real
server: tests/server/test_server_family.py."""

from __future__ import annotations

import pytest
import torch
from gemma4_fixtures import (
    AUDIO,
    BOS,
    IMAGE,
    NUM_SPECIALS,
    VIDEO,
    VOCAB,
    PagedSequence,
    e_model_config,
    make_checkpoint,
    make_tokenizer,
    moe_config,
    unified_config,
)
from test_model_parity import assert_close, hf_logits, run_ours, video_prompt

from mmserve.model import load_model
from mmserve.model.prompt import build_prompt
from mmserve.model.tokenizer import TextTokenizer
from mmserve.model.vision import pad_patches

VARIANTS = {"e_model": (e_model_config, False), "moe": (moe_config, False), "unified": (unified_config, True)}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    make_config, unified = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(path, config=make_config(), seed=21, unified=unified)
    model = load_model(path)
    layers = model.decoder.layers
    if request.param == "e_model":   # the variant's parts really are in play
        assert model.decoder.ple is not None and not layers[3].self_attn.projects_kv and layers[3].kv_source == 1
        assert layers[3].mlp.width == 2 * layers[0].mlp.width
    elif request.param == "moe":
        assert all(layer.moe is not None for layer in layers)
    else:
        assert model.spec.vision.kind == "embedder" and model.spec.patch_size == 8
    return model, hf


def unified_masks(hf, layout):
    """gemma4_unified's own forward also makes full layers bidirectional over an image; we keep full
    layers causal as gemma4, vLLM and its own `create_masks_for_vision_model` do, so the reference
    gets that function's masks."""
    from transformers.models.gemma4_unified.modeling_gemma4_unified import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    ids = torch.tensor([layout.token_ids])
    types = (ids == hf.config.image_token_id).long() + 2 * (ids == hf.config.video_token_id).long()
    return create_masks_for_vision_model(
        hf.config.get_text_config(), torch.zeros(1, ids.shape[1], hf.config.get_text_config().hidden_size),
        None, None, torch.arange(ids.shape[1])[None], get_block_sequence_ids_for_mask(types, "cpu"))


def reference(hf, layout, return_cache: bool = False):
    extra = {"attention_mask": unified_masks(hf, layout)} if hf.config.model_type == "gemma4_unified" else {}
    return hf_logits(hf, layout.token_ids, layout, return_cache=return_cache, **extra)


def test_video_logits_match_transformers(variant):
    model, hf = variant
    layout = build_prompt(TextTokenizer(make_tokenizer()), model.spec,
                          video_prompt(model.spec, torch.Generator().manual_seed(31)))
    window = model.spec.attention_specs["sliding_attention"].window
    assert any(e - s + 1 > window for s, e in layout.mm_ranges)
    cuts = [layout.mm_ranges[0][1] + 2, layout.mm_ranges[2][1] + 1]
    assert_close(run_ours(model, layout, cuts), reference(hf, layout))
    copy = model.experts_touched()   # what the engine hands the perf model
    touched = None if copy is None else float(copy.result())
    assert (touched is None) == (model.decoder.layers[0].moe is None)
    if touched is not None:
        assert 1 <= touched <= model.spec.layers[0].moe.num_experts


def test_sampled_placeholder_ids_embed_as_transformers_does(variant):
    """A random model can sample a media placeholder id (<|image|>, <|video|>, <|audio|>). Fed back as
    text with no media, transformers embeds it (and its per-layer input) as the pad token: so do we."""
    model, hf = variant
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10_000, ())))
    ids = [BOS] + torch.randint(NUM_SPECIALS, VOCAB, (20,), generator=gen).tolist()
    for at, placeholder in zip(torch.randperm(20, generator=gen)[:3].tolist(), (IMAGE, VIDEO, AUDIO), strict=True):
        ids[1 + at] = placeholder
    seq = PagedSequence(model, seed=3)
    hidden = torch.cat([seq.step(ids[:9])] + [seq.step([t]) for t in ids[9:]])   # prefill, then "decode"
    assert_close(model.compute_logits(hidden), hf_logits(hf, ids))


def test_kv_sharing_layers_get_no_blocks_and_no_cache(variant):
    """The planner counts only KV-holding layers; the runner allocates their caches alone and hands
    each KV-sharing layer its producer's tensor."""
    from mmserve.config import EngineConfig
    from mmserve.core.kv_cache.planner import plan_pools
    from mmserve.worker.model_runner import ModelRunner

    model, _ = variant
    spec = model.spec
    budget = 2**20
    plans = plan_pools(spec.kv_layer_types, spec.attention_specs, block_size=4, dtype_bytes=4,
                       kv_cache_bytes=budget, max_num_seqs=2, max_step_tokens=64, max_model_len=256).pools
    holders = [layer for layer in spec.layers if not layer.shares_kv]
    for t, plan in plans.items():
        a = spec.attention_specs[t]
        assert plan.num_layers == sum(layer.layer_type == t for layer in holders)
        assert plan.bytes_per_block == plan.num_layers * 2 * 4 * a.num_kv_heads * a.head_dim * 4
    assert sum(p.num_blocks * p.bytes_per_block for p in plans.values()) <= budget
    config = EngineConfig(block_size=4, max_num_batched_tokens=64, max_num_seqs=2)
    runner = ModelRunner(model, plans, config, max_model_len=256)
    assert len({id(c) for c in runner.kv_caches}) == len(holders)
    for layer in spec.layers:
        assert runner.kv_caches[layer.index] is runner.kv_caches[layer.kv_source]
    if any(layer.shares_kv for layer in spec.layers):   # the E-model: 3 of 6 layers hold KV
        assert len(holders) == 3 and {t: p.num_layers for t, p in plans.items()} == {
            "sliding_attention": 2, "full_attention": 1}


def test_kv_sharing_layers_on_the_sampled_rows_alone(variant):
    """Running the KV-sharing layers on a chunk's last row only (what the runner does for rows it
    samples) gives that row's full-path hidden state, chunk after chunk, and the caches stay equal."""
    model, _ = variant
    layout = build_prompt(TextTokenizer(make_tokenizer()), model.spec,
                          video_prompt(model.spec, torch.Generator().manual_seed(33)))
    full, fast = (PagedSequence(model, ranges=layout.mm_ranges, seed=9) for _ in range(2))
    start = 0
    for end in (layout.mm_ranges[1][1] + 1, len(layout.token_ids)):
        items = [it for (s, _), it in zip(layout.mm_ranges, layout.mm_items, strict=True) if start <= s < end]
        pix, pos = pad_patches([(it.pixel_values, it.position_ids) for it in items])
        embeds = torch.cat(model.encode_vision(pix, pos))
        want = full.step(layout.token_ids[start:end], embeds)[-1:]
        got = fast.step(layout.token_ids[start:end], embeds, last_row_only=True)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        start = end
    for a, b in zip(full.kv_caches, fast.kv_caches, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
