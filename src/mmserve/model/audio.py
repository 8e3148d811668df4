"""Audio: transformers' Gemma 4 audio tower + multimodal embedder, used as they are (E2B/E4B).

As with the vision tower we do not rewrite the conformer: the modules come from transformers and
load the checkpoint's `audio_tower.*` / `embed_audio.*` tensors. This wrapper fixes the calling
convention the engine needs: a batch of segments' log-mel features in (each only its real frames),
one [soft_tokens_i, text_hidden] tensor out per segment. Segments are padded to the longest with
masked frames; the tower masks padding in its convs and attention, so a segment's embeddings do
not depend on what it was batched with (tests/model/test_model_audio.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import Gemma4Config
from transformers.initialization import no_init_weights
from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel, Gemma4MultimodalEmbedder


def pad_features(features: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch per-segment features [frames_i, bins] -> [n, longest, bins] (zeros past each end) and
    the mask [n, longest] (True on real frames), as the feature extractor pads a batch."""
    longest = max(f.shape[0] for f in features)
    batch = features[0].new_zeros(len(features), longest, features[0].shape[1])
    mask = torch.zeros(len(features), longest, dtype=torch.bool)
    for i, f in enumerate(features):
        batch[i, : f.shape[0]] = f
        mask[i, : f.shape[0]] = True
    return batch, mask


class AudioEncoder(nn.Module):
    def __init__(self, config: Gemma4Config):
        super().__init__()
        audio_config = config.audio_config
        audio_config._attn_implementation = "eager"   # its chunked local attention exists only in eager
        with no_init_weights():   # the checkpoint overwrites every parameter
            self.audio_tower = Gemma4AudioModel(audio_config)
            self.embed_audio = Gemma4MultimodalEmbedder(audio_config, config.get_text_config())

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_audio.embedding_projection.weight.dtype

    @torch.inference_mode()
    def forward(self, features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each segment's log-mel frames [frames_i, bins] -> its embeddings [tokens_i, text_hidden]."""
        if not features or any(f.dim() != 2 or not f.shape[0] for f in features):
            raise ValueError(f"audio features {[tuple(f.shape) for f in features]}: expected non-empty [frames, bins]")
        device = self.embed_audio.embedding_projection.weight.device
        batch, mask = pad_features(features)
        batch, mask = batch.to(device=device, dtype=self.dtype), mask.to(device)
        out = self.audio_tower(batch, mask)
        embeds = self.embed_audio(inputs_embeds=out.last_hidden_state)
        valid = out.attention_mask
        return [embeds[i][valid[i]] for i in range(len(features))]
