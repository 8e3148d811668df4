"""Our paged decoder + transformers' vision tower vs transformers' Gemma4ForConditionalGeneration.

Fresh random prompts on tiny random checkpoints (both config spellings); the sliding window (6) is
shorter than the prompts and than the longest frames, so sliding layers really slide and frame
ranges outgrow the window.
"""

from __future__ import annotations

import torch
from gemma4_fixtures import BOS, NUM_SPECIALS, VOCAB, PagedSequence, make_tokenizer, patchify

from mmserve.model.messages import ChatMessage, ImagePart, VideoPart
from mmserve.model.prompt import build_prompt
from mmserve.model.tokenizer import TextTokenizer
from mmserve.model.vision import pad_patches

RTOL = 1e-4


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err < RTOL, f"max relative error {err:.2e}"


def hf_logits(hf, ids: list[int], layout=None, return_cache: bool = False, **kwargs):
    """transformers' logits for a whole prompt; images/frames from `layout` in prompt order."""
    cfg = hf.config
    input_ids = torch.tensor([ids])
    if layout is not None and layout.mm_items:
        images = [it for it in layout.mm_items if it.kind == "image"]
        frames = [it for it in layout.mm_items if it.kind == "video"]
        if images:
            kwargs["pixel_values"], kwargs["image_position_ids"] = pad_patches(
                [(it.pixel_values, it.position_ids) for it in images])
        if frames:
            kwargs["pixel_values_videos"], kwargs["video_position_ids"] = pad_patches(
                [(it.pixel_values, it.position_ids) for it in frames])
            kwargs["num_frames_per_video"] = torch.tensor([len(frames)])
        kwargs["mm_token_type_ids"] = ((input_ids == cfg.image_token_id).long()
                                       + 2 * (input_ids == cfg.video_token_id).long())
    with torch.no_grad():
        out = hf(input_ids=input_ids, use_cache=return_cache, **kwargs)
    return (out.logits[0], out.past_key_values) if return_cache else out.logits[0]


def video_prompt(spec, gen: torch.Generator) -> list[ChatMessage]:
    """Text, an image (9 tokens), text, a 3-frame video with 8-token frames (> window 6)."""
    image = patchify(torch.rand(3, 24, 24, generator=gen), spec.patch_size)
    frames = [patchify(torch.rand(3, 16, 32, generator=gen), spec.patch_size) for _ in range(3)]
    video = VideoPart(torch.stack([f[0] for f in frames]), torch.stack([f[1] for f in frames]),
                      [8, 8, 8], [0.0, 2.5, 61.0])
    return [ChatMessage("user", ["Look at the cat", ImagePart(image[0], image[1], 9), " then the video ",
                                 video, "What happens?"])]


def run_ours(model, layout, chunk_ends: list[int], decode_ids: list[int] = ()) -> torch.Tensor:
    """Logits of every row: prefill in chunks ending at `chunk_ends` (never inside a range), encoding
    vision per chunk, then one decode step per id of `decode_ids`."""
    seq = PagedSequence(model, ranges=layout.mm_ranges)
    outs, start = [], 0
    for end in chunk_ends + [len(layout.token_ids)]:
        items = [it for (s, _), it in zip(layout.mm_ranges, layout.mm_items, strict=True) if start <= s < end]
        embeds = None
        if items:
            pix, pos = pad_patches([(it.pixel_values, it.position_ids) for it in items])
            embeds = torch.cat(model.encode_vision(pix, pos))
        outs.append(seq.step(layout.token_ids[start:end], embeds))
        start = end
    outs += [seq.step([t]) for t in decode_ids]
    return model.compute_logits(torch.cat(outs))


def test_text_only_logits_match_transformers(loaded):
    model, hf = loaded
    gen = torch.Generator().manual_seed(11)
    ids = [BOS] + torch.randint(NUM_SPECIALS, VOCAB, (29,), generator=gen).tolist()
    ref = hf_logits(hf, ids)
    seq = PagedSequence(model, seed=3)
    hidden = torch.cat([seq.step(ids[:13]), seq.step(ids[13:27])] + [seq.step([t]) for t in ids[27:]])
    assert_close(model.compute_logits(hidden), ref)


def test_image_and_video_logits_match_transformers(loaded):
    model, hf = loaded
    tok = TextTokenizer(make_tokenizer())
    layout = build_prompt(tok, model.spec, video_prompt(model.spec, torch.Generator().manual_seed(5)))
    assert any(e - s + 1 > model.spec.attention_specs["sliding_attention"].window for s, e in layout.mm_ranges)
    ref = hf_logits(hf, layout.token_ids, layout)
    # chunk boundaries: after the image range, and between two frames
    cuts = [layout.mm_ranges[0][1] + 2, layout.mm_ranges[2][1] + 1]
    assert_close(run_ours(model, layout, cuts), ref)


def test_sdpa_backend_matches_transformers(checkpoints):
    from mmserve.model import load_model

    paths, hf = checkpoints
    model = load_model(paths["per_layer"], attention_backend="sdpa")
    layout = build_prompt(TextTokenizer(make_tokenizer()), model.spec,
                          video_prompt(model.spec, torch.Generator().manual_seed(7)))
    assert_close(run_ours(model, layout, [layout.mm_ranges[1][1] + 1]), hf_logits(hf, layout.token_ids, layout))


def test_vision_embeddings_match_transformers(loaded):
    model, hf = loaded
    gen = torch.Generator().manual_seed(9)
    items = [patchify(torch.rand(3, h, w, generator=gen), model.spec.patch_size) for h, w in [(8, 8), (16, 24)]]
    pix, pos = pad_patches(items)
    ours = model.encode_vision(pix, pos)
    with torch.no_grad():
        ref = hf.model.get_image_features(pix, pos, return_dict=True).pooler_output
    assert [o.shape[0] for o in ours] == [1, 6]
    for o, r in zip(ours, ref, strict=True):
        assert_close(o, r)
    # a batch padded to a length the pooler cannot split (not a multiple of k^2) is padded further
    odd = model.encode_vision(torch.cat([pix, torch.zeros(2, 3, pix.shape[2])], 1),
                              torch.cat([pos, torch.full((2, 3, 2), -1)], 1))
    for o, r in zip(odd, ref, strict=True):
        assert_close(o, r)


def test_greedy_generation_is_token_identical(loaded_hub):
    """32 greedy tokens after a video prompt, ours over the paged cache, transformers' with its
    own cache (the frames' bidirectional types apply to the prefill)."""
    model, hf = loaded_hub
    tok = TextTokenizer(make_tokenizer())
    layout = build_prompt(tok, model.spec, video_prompt(model.spec, torch.Generator().manual_seed(6)))
    seq = PagedSequence(model, ranges=layout.mm_ranges, seed=4, num_blocks=48)
    items = layout.mm_items
    pix, pos = pad_patches([(it.pixel_values, it.position_ids) for it in items])
    hidden = seq.step(layout.token_ids, torch.cat(model.encode_vision(pix, pos)))
    ours = []
    for _ in range(32):
        ours.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
        hidden = seq.step([ours[-1]])
    logits, cache = hf_logits(hf, layout.token_ids, layout, return_cache=True)
    ref = []
    with torch.no_grad():
        for _ in range(32):
            ref.append(int(logits[-1].argmax()))
            out = hf(input_ids=torch.tensor([[ref[-1]]]), cache=cache, use_cache=True)
            logits, cache = out.logits[0], out.past_key_values
    assert ours == ref
    assert len(set(ours)) > 3   # a degenerate repeat would prove little
