"""LivePrompt's token counts against `build_prompt`, the one-shot path's layout (the reference).

A session sizes its context from `history_tokens` (the most a full history can take) and decides a
roll-over from `frames_tokens`; both must count exactly what build_prompt renders for a user turn
holding those frames as a video, or a session either refuses a history that fits (bench/live_video.py
could not open 64 frames on the demo model) or overflows its context.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.config import DEMO_MODEL_DIR
from mmserve.engine.live_session import TIMESTAMP_MINUTES, LivePrompt
from mmserve.model.messages import ChatMessage, TextPart, VideoPart
from mmserve.model.prompt import build_prompt
from mmserve.model.spec import load_spec
from mmserve.model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def model():
    return load_tokenizer(DEMO_MODEL_DIR), load_spec(DEMO_MODEL_DIR)


def video(soft_tokens: list[int], timestamps: list[float]) -> VideoPart:
    n = len(soft_tokens)
    return VideoPart(torch.zeros(n, 1, 1), torch.zeros(n, 1, 2), soft_tokens, timestamps)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_frames_render_and_count_as_build_prompt(model, seed):
    tok, spec = model
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 70))
    soft = [int(x) for x in rng.integers(1, spec.video_max_soft_tokens + 1, n)]
    times = sorted(float(t) for t in rng.uniform(0, 60 * TIMESTAMP_MINUTES, n))
    system = "Watch closely." if seed % 2 else ""
    messages = ([ChatMessage("system", [TextPart(system)])] if system else []) + [
        ChatMessage("user", [video(soft, times), TextPart("What moves?")])]
    reference = build_prompt(tok, spec, messages)

    prompt = LivePrompt(tok, spec, system)
    counted = prompt.frames_tokens(list(zip(times, soft, strict=True)))
    ids, ranges = list(prompt.header), []
    for t, k in zip(times, soft, strict=True):
        piece, (a, b) = prompt.frame(t, k)
        ranges.append((len(ids) + a, len(ids) + b))
        ids += piece
    assert counted == len(ids) - len(prompt.header)
    ids += prompt.question("What moves?", prompt.pending)
    assert ids == reference.token_ids
    assert ranges == [tuple(r) for r in reference.mm_ranges]
    # a full history: these frames at the per-frame budget take what history_tokens says (exactly, as
    # this tokenizer writes each digit as a token, so every timestamp below 100 minutes is as long)
    widest = prompt.history_tokens(n, spec.video_max_soft_tokens)
    full = build_prompt(tok, spec, [ChatMessage("user", [video([spec.video_max_soft_tokens] * n, times)])])
    bare = LivePrompt(tok, spec)
    assert len(full.token_ids) - len(bare.header) - len(bare.question("", "")) == widest >= counted
