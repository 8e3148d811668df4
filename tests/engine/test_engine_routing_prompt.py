"""A gateway's prompt (rendered from the checkpoint's chat template by transformers, as SMG renders
it: one anchor per image or video) mapped onto our expansion of it (`expand_anchors`, which also
re-tokenizes the text before a video anchor with the first timestamp): every token outside the
runs is ours one for one, each run ends where its item's last `<image|>` does, and a gateway prefix
needs exactly our tokens up to there."""

from __future__ import annotations

import random

import pytest
from prompt_cases import demo_prompt_parts, random_media

from mmserve.engine.routing_prompt import gateway_routing_prompt, media_anchors
from mmserve.model.messages import ImagePart
from mmserve.model.prompt import expand_anchors

WORDS = ["what", "is", "this", "clip?", "Describe", "the", "red", "circle", "12", "x9", "!", "moves", "up,"]


@pytest.fixture(scope="module")
def parts():
    return demo_prompt_parts()


def gateway_prompt(parts, rng: random.Random, kinds: list[str]):
    hf, tokenizer, spec = parts
    content, items = [], []
    for kind in kinds:
        if kind == "text":
            content.append({"type": "text", "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))})
        else:
            content.append({"type": kind})
            items.append(random_media(rng, kind, spec))
    rendered = hf.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=True)
    ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    return ids, items, expand_anchors(tokenizer, spec, ids, items)


@pytest.mark.parametrize("seed", range(16))
def test_a_gateway_prompt_maps_onto_our_expansion(parts, seed):
    _, _, spec = parts
    rng = random.Random(seed)
    kinds = [rng.choice(["text", "text", "image", "video"]) for _ in range(rng.randint(1, 5))] + ["video"]
    rng.shuffle(kinds)
    ids, items, ours = gateway_prompt(parts, rng, kinds)
    counts = [1 if isinstance(p, ImagePart) else len(p.timestamps_s) for p in items]
    anchors = [i for i, t in enumerate(ids) if t in (spec.image_token_id, spec.video_token_id)]
    routing = gateway_routing_prompt(ids, ours.token_ids, ours.mm_ranges, list(zip(anchors, counts, strict=True)))
    assert routing is not None and routing.maps_onto(ours.token_ids)
    assert [end - 1 for _, end, _ in routing.runs] == anchors
    needed = routing.ours_needed()
    assert needed[-1] == len(ours.token_ids) and needed == sorted(needed)
    last_range = 0
    for (_, end, _), n in zip(routing.runs, counts, strict=True):
        last_range += n
        assert needed[end] == ours.mm_ranges[last_range - 1][1] + 2   # the whole item, through its <image|>
    for j in range(len(ids) + 1):   # outside the runs, a gateway prefix is our prefix, token for token
        if not any(start < j <= end for start, end, _ in routing.runs):
            shift = sum(length - (end - start) for start, end, length in routing.runs if end < j or end == j)
            assert needed[j] == j + shift
    assert media_anchors(ids, (spec.image_token_id, spec.video_token_id), counts) == list(zip(anchors, counts, strict=True))


def test_two_videos_map_by_their_frame_counts(parts):
    """Each video's own frame count places its run's end (its last `<image|>`): swapped, the first
    video's run ends inside the other's frames."""
    _, _, spec = parts
    rng = random.Random(1)
    while True:
        ids, items, ours = gateway_prompt(parts, rng, ["video", "text", "video", "text"])
        counts = [len(p.timestamps_s) for p in items]
        if counts[0] != counts[1]:
            break
    anchors = media_anchors(ids, (spec.image_token_id, spec.video_token_id), counts)
    routing = gateway_routing_prompt(ids, ours.token_ids, ours.mm_ranges, anchors)
    assert routing is not None and len(routing.runs) == 2
    first_end = ours.mm_ranges[counts[0] - 1][1] + 2
    assert routing.ours_needed()[routing.runs[0][1]] == first_end
    swapped = media_anchors(ids, (spec.image_token_id, spec.video_token_id), counts[::-1])
    wrong = gateway_routing_prompt(ids, ours.token_ids, ours.mm_ranges, swapped)
    assert wrong is None or wrong.ours_needed()[wrong.runs[0][1]] != first_end
    assert media_anchors(ids, (spec.image_token_id, spec.video_token_id), counts[:1]) is None


def test_a_prompt_that_is_not_the_expansion_is_refused(parts):
    _, _, spec = parts
    ids, items, ours = gateway_prompt(parts, random.Random(2), ["text", "image", "text"])
    anchors = [(i, 1) for i, t in enumerate(ids) if t == spec.image_token_id]
    tampered = list(ours.token_ids)
    tampered[-2] = (tampered[-2] + 1) % spec.vocab_size   # text after the image differs
    assert gateway_routing_prompt(ids, tampered, ours.mm_ranges, anchors) is None
