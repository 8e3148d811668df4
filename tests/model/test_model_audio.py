"""The audio path against transformers on a random tiny E-model: our AudioEncoder (loaded by our
loader) gives the embeddings `Gemma4Model.get_audio_features` gives, whatever a segment is batched
with; the spec counts soft tokens as transformers' processor does; the perf model's audio FLOPs
agree with torch's FLOP counter run over the real tower."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gemma4_fixtures import e_model_config, make_checkpoint
from torch.utils.flop_counter import FlopCounterMode

from mmserve.metrics.perf_model import AudioWork, PerfModel, StepContext
from mmserve.model import load_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("e_audio")
    hf = make_checkpoint(path, config=e_model_config(), seed=int(np.random.randint(1000)))
    return hf, load_model(path)


def _clips(*seconds: float) -> list[np.ndarray]:
    rng = np.random.default_rng(np.random.randint(2**31))
    return [(0.3 * rng.standard_normal(int(s * 16000))).astype(np.float32) for s in seconds]


def test_audio_embeddings_match_transformers_whatever_the_batch(models):
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    hf, ours = models
    batch = Gemma4AudioFeatureExtractor()(_clips(1.37, 0.61, 2.2), return_tensors="pt")
    feats, mask = batch["input_features"], batch["input_features_mask"]
    with torch.no_grad():
        ref = hf.model.get_audio_features(feats, mask, return_dict=True)
    expected = [ref.pooler_output[i][ref.attention_mask[i]] for i in range(3)]
    segments = [feats[i][mask[i]] for i in range(3)]
    for got, want in zip(ours.encode_audio(segments), expected, strict=True):   # batched together
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for segment, want in zip(segments, expected, strict=True):                  # each alone
        torch.testing.assert_close(ours.encode_audio([segment])[0], want, atol=1e-5, rtol=1e-5)


def test_soft_token_count_is_the_processors(models):
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    _, ours = models
    spec = ours.spec.audio
    fake = type("P", (), {"feature_extractor": type("F", (), {"frame_length": spec.frame_length,
                                                             "hop_length": spec.hop_length})(),
                          "audio_seq_length": spec.max_soft_tokens})()
    for n in [0, 160, 161, 321, 481, 16000, 16321, 479_999, 480_000, 480_001, 2_000_000]:
        assert spec.num_soft_tokens(n) == Gemma4Processor._compute_audio_num_tokens(fake, np.zeros(n), 16000), n
    assert spec.segment_samples == 480_000


def test_perf_model_audio_flops_match_torchs_count(models):
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    _, ours = models
    batch = Gemma4AudioFeatureExtractor()(_clips(3.0), return_tensors="pt")
    segment = batch["input_features"][0][batch["input_features_mask"][0]]
    with FlopCounterMode(display=False) as counter:
        (embeds,) = ours.encode_audio([segment])
    counted = counter.get_total_flops()
    billed = PerfModel(ours.spec).step(StepContext(audio=(AudioWork(segment.shape[0], embeds.shape[0]),))).total_flops
    assert 0.8 < billed / counted < 1.25, (billed, counted)
