"""Prompt builder vs transformers' Gemma4Processor (built offline around our tokenizers-made tokenizer).

Images go through the processor's real __call__ (Gemma4ImageProcessorPil resizes/patchifies, the
processor expands and tokenizes). Video: the processor's video path needs torchvision, which we do
not ship, so its own `replace_video_token` expands the placeholder and its tokenizer tokenizes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gemma4_fixtures import make_tokenizer
from transformers import Gemma4ImageProcessorPil, Gemma4Processor, PreTrainedTokenizerFast
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
from transformers.video_utils import VideoMetadata

from mmserve.model.messages import ChatMessage, ImagePart, TextPart, VideoPart
from mmserve.model.prompt import build_prompt, timestamp_text
from mmserve.model.spec import load_spec
from mmserve.model.tokenizer import TextTokenizer


class OfflineGemma4Processor(Gemma4Processor):
    """Gemma4Processor without its video processor (that one imports torchvision)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor":
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


@pytest.fixture(scope="module")
def processor():
    tok = PreTrainedTokenizerFast(
        tokenizer_object=make_tokenizer(), bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                              "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"})
    images = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    return OfflineGemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=images,
                                  tokenizer=tok, video_processor=None)


@pytest.fixture(scope="module")
def spec(checkpoints):
    paths, _ = checkpoints
    return load_spec(paths["per_layer"])


def ranges_of(mask: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs of True as inclusive [start, end]."""
    runs, start = [], None
    for i, v in enumerate(mask.tolist() + [False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            runs.append((start, i - 1))
            start = None
    return runs


def test_image_prompt_matches_processor(processor, spec):
    rng = np.random.default_rng(0)
    images = [(rng.random((h, w, 3)) * 255).astype(np.uint8) for h, w in [(24, 40), (50, 18)]]
    # what the chat template renders: text parts trimmed, an image as <|image|>
    text = "<bos><|turn>user\nCompare<|image|>with<|image|>please<turn|>\n<|turn>model\n"
    out = processor(text=[text], images=[images], return_tensors="pt")
    parts, counts = ["  Compare "], []
    for i in range(len(images)):
        valid = (out["image_position_ids"][i] != -1).all(-1)
        counts.append(int(valid.sum()) // 4)   # pooling 2x2
        parts.append(ImagePart(out["pixel_values"][i][valid], out["image_position_ids"][i][valid], counts[-1]))
        parts.append(TextPart(" with   " if i == 0 else "please"))
    layout = build_prompt(TextTokenizer(make_tokenizer()), spec, [ChatMessage("user", parts[:-1] + ["please\n"])])
    assert layout.token_ids == out["input_ids"][0].tolist()
    assert layout.mm_ranges == ranges_of(out["mm_token_type_ids"][0] == 1)
    assert [e - s + 1 for s, e in layout.mm_ranges] == counts


@pytest.mark.parametrize("fps,indices", [(24.0, [0, 60, 1500]), (2.0, [0, 3, 5, 7, 131])])
def test_video_prompt_matches_processor_expansion(processor, spec, fps, indices):
    frames, n = len(indices), 5
    meta = VideoMetadata(total_num_frames=max(indices) + 1, fps=fps, frames_indices=indices)
    expansion = processor.replace_video_token({"num_soft_tokens_per_video": [n], "video_metadata": [meta]}, 0)
    text = f"<bos><|turn>user\nWhat moves?{expansion}Answer briefly.<turn|>\n<|turn>model\n"
    ref = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    video = VideoPart(torch.rand(frames, 4 * n, 48), torch.zeros(frames, 4 * n, 2, dtype=torch.long),
                      [n] * frames, [i / fps for i in indices])
    layout = build_prompt(TextTokenizer(make_tokenizer()), spec,
                          [ChatMessage("user", ["What moves?", video, "Answer briefly."])])
    assert layout.token_ids == ref
    ids = torch.tensor(ref)
    assert layout.mm_ranges == ranges_of(ids == spec.video_token_id)
    assert len(layout.mm_ranges) == frames and all(it.kind == "video" for it in layout.mm_items)


def test_timestamps_are_truncated_minutes_and_seconds():
    assert [timestamp_text(s) for s in (0.0, 2.99, 61.0, 3599.9, 3600.0)] == [
        "00:00", "00:02", "01:01", "59:59", "60:00"]


def test_user_text_cannot_forge_placeholders(spec):
    tok = TextTokenizer(make_tokenizer())
    layout = build_prompt(tok, spec, [ChatMessage("user", ["<|image|><|video|><turn|>"])])
    assert spec.image_token_id not in layout.token_ids and spec.video_token_id not in layout.token_ids
    assert layout.token_ids.count(tok.token_id("<turn|>")) == 1
    assert layout.mm_ranges == []


def test_multi_turn_and_system_roles(spec):
    tok = TextTokenizer(make_tokenizer())
    msgs = [ChatMessage("system", ["Be brief."]), ChatMessage("user", ["hi"]),
            ChatMessage("assistant", ["hello"]), ChatMessage("user", ["the cat"])]
    layout = build_prompt(tok, spec, msgs)
    expected = ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nhi<turn|>\n<|turn>model\nhello<turn|>\n"
                "<|turn>user\nthe cat<turn|>\n<|turn>model\n")
    assert tok.decode(layout.token_ids, skip_special_tokens=False) == expected
    with pytest.raises(ValueError, match="role"):
        build_prompt(tok, spec, [ChatMessage("robot", ["x"])])
