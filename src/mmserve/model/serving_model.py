"""`Gemma4ServingModel`: the object the engine's model runner drives (contract in docs/architecture.md)."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.attention.buffers import HostCopy
from mmserve.model.audio import AudioEncoder
from mmserve.model.decoder import SampledRows, TextDecoder
from mmserve.model.parallel import SINGLE, ParallelGroup
from mmserve.model.spec import ModelSpec
from mmserve.model.vision import VisionEncoder


class Gemma4ServingModel(nn.Module):
    """Our paged text decoder plus transformers' vision (and, on E2B/E4B, audio) tower, loaded from
    one checkpoint."""

    def __init__(self, spec: ModelSpec, decoder: TextDecoder, vision: VisionEncoder | None,
                 attention_backends: dict[str, str] | str = "reference", parallel: ParallelGroup = SINGLE, *,
                 audio: AudioEncoder | None = None):
        super().__init__()
        self.spec = spec   # with tensor parallelism: this rank's attention heads (parallel.local_spec)
        self.parallel = parallel
        self.bytes_read = 0   # checkpoint bytes this process read to load it (its shard)
        if isinstance(attention_backends, str):
            attention_backends = dict.fromkeys(spec.attention_specs, attention_backends)
        self.attention_backends = attention_backends   # layer type -> the backend its layers' impls belong to
        self.decoder = decoder
        self.vision = vision
        self.audio = audio
        self._touched: torch.Tensor | None = None   # see experts_touched

    @property
    def attention_backend(self) -> str:
        """The backends in use, for people: "fa4+flex" when layer types differ."""
        return "+".join(dict.fromkeys(self.attention_backends.values()))

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict, kv_caches: list[torch.Tensor],
                mm_embeds: torch.Tensor | None = None, mm_token_index: torch.Tensor | None = None,
                sampled: SampledRows | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """One step over T flattened tokens -> final-normed hidden states [T, hidden], or with
        `sampled` those rows' only [S, hidden] (KV-sharing layers then run on them alone).

        `attn_metadata[layer_type]` is what that layer type's backend builder made for this step.
        `mm_token_index` are flat indices into this step's tokens that take the rows of `mm_embeds`.
        `inputs_embeds` [T, hidden]: `embed`'s result, computed beforehand (then mm_* are unused).
        """
        hidden = self.decoder(input_ids, positions, attn_metadata, kv_caches, mm_embeds, mm_token_index, sampled,
                              inputs_embeds)
        self._copy_experts_touched()
        return hidden

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
              mm_token_index: torch.Tensor | None = None) -> torch.Tensor:
        """The step's input embeddings [T, hidden]: token embeddings, vision embeddings written over
        their placeholder rows (what `forward` starts from)."""
        return self.decoder.embed(input_ids, mm_embeds, mm_token_index)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> soft-capped float32 logits [N, vocab]."""
        return self.decoder.compute_logits(hidden)

    def _copy_experts_touched(self) -> None:
        """This forward's mean distinct experts per MoE layer into a fixed device scalar (written in
        place, so a captured graph's replay writes it too)."""
        counts = [layer.moe.experts.touched for layer in self.decoder.layers if layer.moe is not None]
        if not counts:
            return
        if self._touched is None:
            self._touched = torch.zeros((), dtype=torch.float64, device=self.device)
        self._touched.copy_(torch.stack(counts).double().mean())

    def experts_touched(self) -> HostCopy | None:
        """Distinct experts each MoE layer ran in the forward just queued (mean over layers), for the
        perf model's expert weight bytes, on its way to the host; None without experts. Taken right
        after the forward, before the next one is queued: in the async loop step N+1's forward runs
        before N's record reads N's count, so the count travels with N's step (`StepResult`), never
        through a buffer N+1 overwrites. On CUDA the copy is queued after N's forward and before
        N+1's (one stream); on a CPU `HostCopy` keeps its tensor, so it gets a copy of its own."""
        if self._touched is None:
            return None
        return HostCopy(self._touched if self._touched.is_cuda else self._touched.clone())

    def encode_vision(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
        """Patchified images/frames -> one [soft_tokens_i, hidden] embedding tensor per image."""
        if self.vision is None:
            raise ValueError("this checkpoint has no vision tower (vision_config is null)")
        return self.vision(pixel_values, position_ids)

    def encode_audio(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """Audio segments' log-mel features [frames_i, bins] -> one [soft_tokens_i, hidden] tensor each."""
        if self.audio is None:
            raise ValueError("this checkpoint has no audio tower (audio_config is null)")
        return self.audio(features)
