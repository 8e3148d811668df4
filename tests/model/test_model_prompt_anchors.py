"""A gateway-rendered prompt (one anchor per image/video) expanded by `expand_anchors` equals what
`build_prompt` lays out for the same messages: same ids, same ranges, same pixels in order.

The gateway side is rendered as SMG renders it: the checkpoint's chat_template.jinja through a
Jinja renderer and the Hugging Face tokenizer, special tokens parsed (transformers here)."""

from __future__ import annotations

import random

import pytest
from prompt_cases import demo_prompt_parts, random_media

from mmserve.model.messages import ChatMessage, TextPart
from mmserve.model.prompt import build_prompt, expand_anchors

WORDS = ["what", "is", "this", "video?", "Describe", "the", "red", "circle", "12", "x9", "!", "moves", "up,"]


@pytest.fixture(scope="module")
def parts():
    return demo_prompt_parts()


@pytest.mark.parametrize("seed", range(12))
def test_expanded_gateway_prompt_equals_our_layout(parts, seed):
    hf, tokenizer, spec = parts
    rng = random.Random(seed)
    openai_messages, ours, media = [], [], []
    for role in (["system"] if rng.random() < 0.3 else []) + ["user"] * rng.randint(1, 2):
        content, ours_parts = [], []
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice(["text", "text", "image", "video"]) if role == "user" else "text"
            if kind == "text":
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))
                content.append({"type": "text", "text": text})
                ours_parts.append(TextPart(text))
            else:
                part = random_media(rng, kind, spec)
                content.append({"type": kind})
                ours_parts.append(part)
                media.append(part)
        openai_messages.append({"role": role, "content": content})
        ours.append(ChatMessage(role, ours_parts))
    rendered = hf.apply_chat_template(openai_messages, add_generation_prompt=True, tokenize=True)
    ids = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
    want = build_prompt(tokenizer, spec, ours)
    got = expand_anchors(tokenizer, spec, list(ids), media)
    assert got.token_ids == want.token_ids
    assert got.mm_ranges == want.mm_ranges
    assert [m.pixel_values.data_ptr() for m in got.mm_items] == [m.pixel_values.data_ptr() for m in want.mm_items]


def test_anchor_count_or_kind_mismatch_is_refused(parts):
    _, tokenizer, spec = parts
    image = random_media(random.Random(0), "image", spec)
    with pytest.raises(ValueError, match="anchors"):
        expand_anchors(tokenizer, spec, [2, spec.image_token_id, spec.image_token_id], [image])
    with pytest.raises(ValueError, match="does not match"):
        expand_anchors(tokenizer, spec, [2, spec.video_token_id], [image])
