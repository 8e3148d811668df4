"""The perf model's projection, FFN, per-layer-embedding, unembedding and vision FLOPs equal what
torch's FlopCounterMode counts on a real (tiny, random) transformers forward of every Gemma 4 variant:
dense (K=V, per-layer head dims, a padded image), MoE, E-model (per-layer embeddings, KV-sharing
layers without K/V projections, double-wide MLPs) and gemma4_unified (encoder-free vision).
Shapes and inputs are drawn fresh on each run."""

from __future__ import annotations

import random
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mmserve.metrics.perf_model import PerfModel, RequestWork, StepContext, VisionWork
from mmserve.model.spec import load_hf_config, load_spec

IMAGE_ID = 252


def gemma4_config(variant: str = "dense") -> dict:
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
                use_bidirectional_attention="vision", final_logit_softcapping=30.0,
                hidden_size_per_layer_input=0, num_kv_shared_layers=0, max_position_embeddings=1024)
    if variant == "moe":
        text.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24)
    if variant == "e_model":
        text.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, num_kv_shared_layers=3,
                    use_double_wide_mlp=True, attention_k_eq_v=False)
    if variant == "unified":
        del text["hidden_size_per_layer_input"]
        return dict(model_type="gemma4_unified", text_config=text,
                    vision_config=dict(patch_size=4, pooling_kernel_size=2, mm_embed_dim=40, mm_posemb_size=16,
                                       output_proj_dims=40),
                    audio_config=None, boi_token_id=250, eoi_token_id=251, image_token_id=IMAGE_ID,
                    video_token_id=253, audio_token_id=254, boa_token_id=248, eoa_token_index=249)
    return dict(model_type="gemma4", text_config=text,
                vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                                   position_embedding_size=64, standardize=True),
                audio_config=None, boi_token_id=250, eoi_token_id=251, image_token_id=IMAGE_ID, video_token_id=253,
                audio_token_id=254, boa_token_id=248, eoa_token_index=249)


def counted(model, **inputs) -> dict[str, int]:
    """FLOPs per module path from a real forward."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(**inputs)
    return {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}


def total(counts: dict[str, int], pattern: str) -> int:
    found = [v for k, v in counts.items() if re.search(pattern, k)]
    assert found, f"no module matches {pattern}"
    return sum(found)


def random_image(rng: random.Random, k: int, patch_dim: int):
    """A grid of (k*a) x (k*b) patches, padded with (-1, -1) patches to a multiple of k*k."""
    cols, rows = k * rng.randint(1, 3), k * rng.randint(1, 3)
    valid = cols * rows
    padded = valid + k * k * rng.randint(0, 2)
    pos = torch.full((1, padded, 2), -1, dtype=torch.long)
    pos[0, :valid] = torch.stack(torch.meshgrid(torch.arange(cols), torch.arange(rows), indexing="xy"), -1).reshape(-1, 2)
    pixels = torch.rand(1, padded, patch_dim)
    pixels[0, valid:] = 0
    return pixels, pos, padded, valid // (k * k)


@pytest.fixture(scope="module")
def rng() -> random.Random:
    return random.Random(random.getrandbits(64))


@pytest.mark.parametrize("variant", ["dense", "moe", "e_model", "unified"])
def test_gemma4_flops_match_flop_counter(variant: str, rng: random.Random):
    from transformers import Gemma4ForConditionalGeneration, Gemma4UnifiedForConditionalGeneration

    cfg_dict = gemma4_config(variant)
    cfg = load_hf_config(cfg_dict)
    cfg._attn_implementation = "eager"
    cfg.get_text_config()._experts_implementation = "eager"  # per-expert matmuls over the routed tokens: exact
    unified = variant == "unified"
    model = (Gemma4UnifiedForConditionalGeneration if unified else Gemma4ForConditionalGeneration)(cfg).eval()
    k = 1 if unified else 2   # unified: one soft token per 8-px model patch
    pixels, pos, patches, soft_tokens = random_image(rng, k, 192 if unified else 48)
    before, after = rng.randint(1, 12), rng.randint(1, 12)
    seq = before + soft_tokens + after
    ids = torch.randint(0, 200, (1, seq))
    ids[0, before:before + soft_tokens] = IMAGE_ID
    # with logits_to_keep=1 transformers runs the KV-sharing layers on the sampled row only, as we do
    counts = counted(model, input_ids=ids, pixel_values=pixels, image_position_ids=pos,
                     mm_token_type_ids=(ids == IMAGE_ID).long(), logits_to_keep=1)

    perf = PerfModel(load_spec(cfg_dict), dtype="float32")
    ranges = ((before, before + soft_tokens - 1),)
    # transformers' unified embedder also runs (and projects) the padding patches
    image = VisionWork(patches, patches if unified else soft_tokens)
    got = perf.step(StepContext((RequestWork(seq, seq, True, ranges),), (image,)))
    lm = r"language_model\.layers\.\d+\."
    assert got.flops["attn.qkv_proj"] == total(counts, lm + r"self_attn\.[qkv]_proj$")
    assert got.flops["attn.out_proj"] == total(counts, lm + r"self_attn\.o_proj$")
    ffn_pattern = lm + (r"(mlp|router|experts)$" if variant == "moe" else r"mlp$")
    assert got.component("ffn").total_flops == total(counts, ffn_pattern)
    assert got.flops["unembed.unembed"] == total(counts, r"lm_head$")
    assert got.component("vision").total_flops == total(counts, r"model\.(vision_tower|embed_vision)$")
    if variant == "e_model":
        ple = r"language_model\.(per_layer_model_projection|layers\.\d+\.(per_layer_input_gate|per_layer_projection))$"
        assert got.component("ple").total_flops == total(counts, ple)
        assert got.write_bytes["attn.kv_cache"] == seq * 2 * 4 * (2 * 2 * 16 + 1 * 2 * 32)  # 3 layers hold KV
