"""Every Gemma 4 variant through a real server (gRPC, input processing, engine, paged cache): greedy
tokens for a video prompt equal transformers' greedy continuation, with prefill chunked at a small
step budget. The reference lays the prompt out independently of the server."""

from __future__ import annotations

import json

import pytest
import torch

from mmserve.clients import Client
from mmserve.model.messages import ChatMessage, VideoPart
from mmserve.model.prompt import build_prompt
from mmserve.model.spec import load_spec
from mmserve.model.tokenizer import load_tokenizer
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.preprocess import preprocess_images
from mmserve.multimodal.video import decode_video

BUDGET = 96   # tokens per step: a 64-token frame fits, a 3-frame prompt takes several chunks


def reference_greedy(model_dir, video: bytes, num_frames: int, prompt: str, max_tokens: int):
    from transformers import Gemma4ForConditionalGeneration, Gemma4UnifiedForConditionalGeneration
    from transformers.models.gemma4_unified.modeling_gemma4_unified import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    spec, tok = load_spec(model_dir), load_tokenizer(model_dir)
    decoded = decode_video(video, num_frames=num_frames, limits=MediaLimits())
    batch = preprocess_images(decoded.frames, patch_size=spec.patch_size,
                              pooling_kernel_size=spec.pooling_kernel_size, max_soft_tokens=spec.video_max_soft_tokens)
    layout = build_prompt(tok, spec, [ChatMessage("user", [
        VideoPart(batch.pixel_values, batch.position_ids, batch.num_soft_tokens, decoded.timestamps_s), prompt])])
    unified = spec.model_type == "gemma4_unified"
    cls = Gemma4UnifiedForConditionalGeneration if unified else Gemma4ForConditionalGeneration
    hf = cls.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    text = hf.config.get_text_config()
    ids = list(layout.token_ids)
    for _ in range(max_tokens):
        input_ids = torch.tensor([ids])
        mm_types = 2 * (input_ids == spec.video_token_id).long()
        extra = {}
        if unified:   # full layers stay causal (see tests/model/test_model_family.py)
            extra["attention_mask"] = create_masks_for_vision_model(
                text, torch.zeros(1, len(ids), text.hidden_size), None, None, torch.arange(len(ids))[None],
                get_block_sequence_ids_for_mask(mm_types, "cpu"))
        with torch.no_grad():
            logits = hf(input_ids=input_ids, pixel_values_videos=batch.pixel_values,
                        video_position_ids=batch.position_ids, num_frames_per_video=torch.tensor([num_frames]),
                        mm_token_type_ids=mm_types, **extra).logits[0, -1]
        ids.append(int(logits.argmax()))
    return layout, ids[len(layout.token_ids):]


@pytest.mark.parametrize("variant", ["e_model", "moe", "unified"])
def test_variant_served_greedy_matches_transformers(variant, tmp_path, start_server, make_video, gemma4_fixtures):
    fx = gemma4_fixtures
    config = {"e_model": fx.e_model_config, "moe": fx.moe_config, "unified": fx.unified_config}[variant]()
    fx.make_checkpoint(tmp_path, config=config, seed=7, unified=variant == "unified")
    # images at the video budget too, so the largest image (the start-up check) fits the small step budget
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 70}))
    server = start_server(tmp_path, max_num_batched_tokens=BUDGET, default_num_frames=3)
    video = make_video(seed=int(torch.randint(0, 10_000, ())), num_frames=6)
    layout, expected = reference_greedy(tmp_path, video, 3, "What happens?", 5)
    assert len(layout.token_ids) > 2 * BUDGET
    with Client(server.address, timeout=120) as client:
        result = client.generate(prompt="What happens?", video=video, num_frames=3, max_tokens=5, temperature=0,
                                 ignore_eos=True)
    assert list(result.token_ids) == expected
    assert result.usage.prompt_tokens == len(layout.token_ids)
