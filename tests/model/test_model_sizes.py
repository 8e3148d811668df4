"""The family at its published dimensions (tests/fixtures/gemma4_family, configs only): our modules,
built on the meta device, have the published parameter counts (within 2%), the 26B-A4B's active
parameters match, and the KV planner's pool pages follow from the spec (KV-sharing layers cost
nothing). No weights are allocated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmserve.attention import create_impl
from mmserve.core.kv_cache.planner import plan_pools
from mmserve.model.decoder import TextDecoder
from mmserve.model.spec import load_spec

FIXTURES = Path(__file__).parents[1] / "fixtures" / "gemma4_family"
# published total, whether it covers the vision/audio encoders, KV bytes per token in bf16
# (2 (K and V) * kv_heads * head_dim * 2 bytes, summed over the layers that hold KV)
PUBLISHED = {
    "e2b": (5.1e9, True, 12 * 2 * 1 * 256 * 2 + 3 * 2 * 1 * 512 * 2),
    "e4b": (8.0e9, True, 20 * 2 * 2 * 256 * 2 + 4 * 2 * 2 * 512 * 2),
    "26b_a4b": (25.2e9, False, 25 * 2 * 8 * 256 * 2 + 5 * 2 * 2 * 512 * 2),
    "31b": (30.7e9, False, 50 * 2 * 16 * 256 * 2 + 10 * 2 * 4 * 512 * 2),
    "12b_unified": (12.0e9, True, 40 * 2 * 8 * 256 * 2 + 8 * 2 * 1 * 512 * 2),
}


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def meta_modules(spec):
    """Our decoder and vision path, and transformers' audio tower (which we never load), on meta."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel

    from mmserve.model.vision import VisionEncoder
    from mmserve.model.vision_embedder import UnifiedVisionEncoder

    impls = {t: create_impl("reference", s) for t, s in spec.attention_specs.items()}
    with torch.device("meta"):
        decoder = TextDecoder(spec, impls)
        vision = (UnifiedVisionEncoder if spec.vision.kind == "embedder" else VisionEncoder)(spec.hf_config)
        audio_config = spec.hf_config.audio_config
        audio = Gemma4AudioModel(audio_config) if spec.model_type == "gemma4" and audio_config else None
    return decoder, vision, audio


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_counts_and_kv_pages(name):
    spec = load_spec(FIXTURES / f"{name}.json")
    published, with_encoders, kv_bytes_per_token = PUBLISHED[name]
    decoder, vision, audio = meta_modules(spec)
    total = count(decoder) + (count(vision) + (count(audio) if audio else 0) if with_encoders else 0)
    assert abs(total / published - 1) < 0.02, f"{name}: {total / 1e9:.3f}B vs published {published / 1e9}B"
    if name == "26b_a4b":   # active: everything but the 120 unselected experts of every layer
        moe = spec.layers[0].moe
        idle = spec.num_layers * (moe.num_experts - moe.top_k) * 3 * spec.hidden_size * moe.intermediate
        assert abs((count(decoder) - idle) / 3.8e9 - 1) < 0.02
    plans = plan_pools(spec.kv_layer_types, spec.attention_specs, block_size=16, dtype_bytes=2,
                       kv_cache_bytes=8 * 2**30, max_num_seqs=4, max_step_tokens=2048, max_model_len=8192).pools
    assert sum(p.bytes_per_block for p in plans.values()) == 16 * kv_bytes_per_token
    assert sum(p.num_blocks * p.bytes_per_block for p in plans.values()) <= 8 * 2**30
