"""The demo checkpoint's tokenizers and random image/video parts, for the tests that render a prompt
as a gateway does (transformers with the checkpoint's chat template) and compare it with ours."""

from __future__ import annotations

import random

import torch
from transformers import PreTrainedTokenizerFast

from mmserve.config import DEMO_MODEL_DIR
from mmserve.model.messages import ImagePart, VideoPart
from mmserve.model.spec import load_spec
from mmserve.model.tokenizer import load_tokenizer


def demo_prompt_parts():
    """(transformers' tokenizer with the chat template, our tokenizer, the spec) of the demo model."""
    template = (DEMO_MODEL_DIR / "chat_template.jinja").read_text()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(DEMO_MODEL_DIR / "tokenizer.json"), bos_token="<bos>",
                                 chat_template=template)
    return hf, load_tokenizer(DEMO_MODEL_DIR), load_spec(DEMO_MODEL_DIR)


def random_media(rng: random.Random, kind: str, spec) -> ImagePart | VideoPart:
    """An image of 1-6 soft tokens, or a video of 1-4 frames with 1-5 tokens each and sorted times."""
    width = 3 * spec.patch_size ** 2
    if kind == "image":
        n = rng.randint(1, 6)
        return ImagePart(torch.rand(n * 4, width), torch.zeros(n * 4, 2), n)
    frames = rng.randint(1, 4)
    tokens = [rng.randint(1, 5) for _ in range(frames)]
    times = sorted(rng.uniform(0, 130) for _ in range(frames))
    return VideoPart(torch.rand(frames, 24, width), torch.zeros(frames, 24, 2), tokens, times)
