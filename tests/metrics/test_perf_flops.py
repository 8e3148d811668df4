"""The perf model's projection, FFN, unembedding and vision FLOPs equal what torch's FlopCounterMode
counts on a real (tiny, random) transformers forward: Gemma 4 (K=V, per-layer head dims, a padded
image) and Gemma 4 MoE. Shapes and inputs are drawn fresh on each run."""

from __future__ import annotations

import random
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mmserve.metrics.perf_model import PerfModel, RequestWork, StepContext, VisionWork
from mmserve.model.spec import load_hf_config, load_spec

IMAGE_ID = 252


def gemma4_config(moe: bool = False) -> dict:
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
                use_bidirectional_attention="vision", final_logit_softcapping=30.0,
                hidden_size_per_layer_input=0, num_kv_shared_layers=0, max_position_embeddings=1024)
    if moe:
        text.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24)
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
    return random.Random()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gemma4_flops_match_flop_counter(moe: bool, rng: random.Random):
    from transformers import Gemma4ForConditionalGeneration

    cfg_dict = gemma4_config(moe)
    cfg = load_hf_config(cfg_dict)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # per-expert matmuls over the routed tokens: countable, exact
    model = Gemma4ForConditionalGeneration(cfg).eval()
    pixels, pos, patches, soft_tokens = random_image(rng, 2, 48)
    before, after = rng.randint(1, 12), rng.randint(1, 12)
    seq = before + soft_tokens + after
    ids = torch.randint(0, 200, (1, seq))
    ids[0, before:before + soft_tokens] = IMAGE_ID
    counts = counted(model, input_ids=ids, pixel_values=pixels, image_position_ids=pos,
                     mm_token_type_ids=(ids == IMAGE_ID).long(), logits_to_keep=1)

    perf = PerfModel(load_spec(cfg_dict), dtype="float32")
    ranges = ((before, before + soft_tokens - 1),)
    got = perf.step(StepContext((RequestWork(seq, seq, True, ranges),), (VisionWork(patches, soft_tokens),)))
    lm = r"language_model\.layers\.\d+\."
    assert got.flops["attn.qkv_proj"] == total(counts, lm + r"self_attn\.[qkv]_proj$")
    assert got.flops["attn.out_proj"] == total(counts, lm + r"self_attn\.o_proj$")
    ffn_pattern = lm + (r"(mlp|router|experts)$" if moe else r"mlp$")
    assert got.component("ffn").total_flops == total(counts, ffn_pattern)
    assert got.flops["unembed.unembed"] == total(counts, r"lm_head$")
    assert got.component("vision").total_flops == total(counts, r"model\.(vision_tower|embed_vision)$")
