"""The same model on CUDA (device-agnostic code path): fp32 logits match transformers on CPU."""

from __future__ import annotations

import pytest
import torch
from gemma4_fixtures import PagedSequence, make_tokenizer
from test_model_parity import hf_logits, video_prompt

from mmserve.model import load_model
from mmserve.model.prompt import build_prompt
from mmserve.model.tokenizer import TextTokenizer
from mmserve.model.vision import pad_patches

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, None)])
def test_cuda_model_matches_transformers(checkpoints, dtype, tol):
    paths, hf = checkpoints
    model = load_model(paths["flat"], dtype=dtype, device="cuda")
    assert model.device.type == "cuda"
    layout = build_prompt(TextTokenizer(make_tokenizer()), model.spec,
                          video_prompt(model.spec, torch.Generator().manual_seed(5)))
    seq = PagedSequence(model, ranges=layout.mm_ranges)
    pix, pos = pad_patches([(it.pixel_values, it.position_ids) for it in layout.mm_items])
    embeds = torch.cat(model.encode_vision(pix, pos))
    assert embeds.device.type == "cuda" and embeds.dtype == dtype
    ours = model.compute_logits(seq.step(layout.token_ids, embeds)).cpu()
    ref = hf_logits(hf, layout.token_ids, layout)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    if tol is not None:
        assert err < tol, err
    else:
        assert torch.isfinite(ours).all()
