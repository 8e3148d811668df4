"""The embedded demo checkpoint (built by scripts/train_demo_model.py) loads with our loader and
matches transformers on a video prompt."""

from __future__ import annotations

import pytest
import torch
from gemma4_fixtures import patchify
from test_model_parity import assert_close, hf_logits, run_ours

from mmserve.config import DEMO_MODEL_DIR
from mmserve.model import load_model
from mmserve.model.messages import ChatMessage, VideoPart
from mmserve.model.prompt import build_prompt
from mmserve.model.tokenizer import load_tokenizer

pytestmark = pytest.mark.skipif(not (DEMO_MODEL_DIR / "config.json").is_file(),
                                reason="demo model not built yet (scripts/train_demo_model.py)")


def test_demo_model_spec_and_logits():
    from transformers import Gemma4ForConditionalGeneration

    model = load_model(DEMO_MODEL_DIR)
    spec = model.spec
    tok = load_tokenizer(DEMO_MODEL_DIR)
    assert tok.token_id("<turn|>") in spec.eos_token_ids
    side = spec.patch_size * spec.pooling_kernel_size * 2
    gen = torch.Generator().manual_seed(0)
    frames = [patchify(torch.rand(3, side, side, generator=gen), spec.patch_size) for _ in range(3)]
    video = VideoPart(torch.stack([f[0] for f in frames]), torch.stack([f[1] for f in frames]),
                      [4, 4, 4], [0.0, 0.5, 1.0])
    layout = build_prompt(tok, spec, [ChatMessage("user", [video, "Describe the clip."])])
    hf = Gemma4ForConditionalGeneration.from_pretrained(str(DEMO_MODEL_DIR), dtype=torch.float32).eval()
    assert_close(run_ours(model, layout, []), hf_logits(hf, layout.token_ids, layout))


def test_demo_chat_template_renders_our_layout():
    """For text, the checkpoint's own Jinja chat template and our builder give the same ids."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast.from_pretrained(str(DEMO_MODEL_DIR))
    tok = load_tokenizer(DEMO_MODEL_DIR)
    spec = load_model(DEMO_MODEL_DIR).spec
    chat = [("system", "Be brief."), ("user", "  what moves? "), ("assistant", "a red circle"), ("user", "and then")]
    ref = hf_tok.apply_chat_template([{"role": r, "content": [{"type": "text", "text": t}]} for r, t in chat],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    ours = build_prompt(tok, spec, [ChatMessage(r, [t]) for r, t in chat])
    assert ours.token_ids == list(ref)
