"""Owns the model and its paged KV caches; turns one SchedulerOutput into logits.

Vision: the frames whose tokens enter a step are encoded in that step (one batched call, padded to
the largest frame) into a per-request encoder cache. An entry lives until its frame's range is in
the KV cache (the end of that step, since chunks never split a frame), and never past the prompt;
a preempted, finished or aborted request's entries are dropped at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from mmserve.attention.backend import kv_cache_shape
from mmserve.engine.logprobs import TokenLogprobs, prompt_logprobs
from mmserve.model.vision import pad_patches
from mmserve.scheduler.kv_cache_manager import KVCacheManager, PoolPlan
from mmserve.scheduler.metadata import MetadataBuilder
from mmserve.scheduler.output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    logits: torch.Tensor            # float32 [S, vocab]
    sampled: list[ScheduledRequest]  # row i of logits belongs to sampled[i]
    # request id -> logprobs of the prompt tokens after this step's chunk start (prompt_logprobs requests)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model, plans: dict[str, PoolPlan], *, block_size: int, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int):
        self.model = model
        spec = model.spec
        device, dtype = model.device, model.dtype
        # One cache per layer that holds KV; a KV-sharing consumer's entry is its producer's tensor.
        self.kv_caches: list[torch.Tensor] = []
        for layer in spec.layers:
            t = layer.layer_type
            self.kv_caches.append(self.kv_caches[layer.kv_source] if layer.shares_kv else torch.zeros(
                kv_cache_shape(plans[t].num_blocks, block_size, spec.attention_specs[t]), dtype=dtype, device=device))
        self.builder = MetadataBuilder(spec.attention_specs, max_num_batched_tokens=max_num_batched_tokens,
                                       max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                       block_size=block_size, device=device)
        self.encoder_cache: dict[str, dict[int, torch.Tensor]] = {}

    def free(self, request_id: str) -> None:
        self.encoder_cache.pop(request_id, None)

    def _encode(self, scheduled: list[ScheduledRequest]) -> torch.Tensor | None:
        """Embeddings of this step's frames in (request, frame) order, encoding those not cached."""
        todo = [(s.request, f) for s in scheduled for f in s.frames
                if f not in self.encoder_cache.get(s.request.request_id, {})]
        if todo:
            pix, pos = pad_patches([(r.mm_inputs[f].pixel_values, r.mm_inputs[f].position_ids) for r, f in todo])
            embeds = self.model.encode_vision(pix, pos)
            for (r, f), e in zip(todo, embeds, strict=True):
                start, end = r.mm_ranges[f]
                if e.shape[0] != end - start + 1:
                    raise ValueError(f"request {r.request_id}: range {f} has {end - start + 1} placeholder tokens "
                                     f"but its pixels give {e.shape[0]} embeddings")
                self.encoder_cache.setdefault(r.request_id, {})[f] = e
        parts = [self.encoder_cache[s.request.request_id][f] for s in scheduled for f in s.frames]
        return torch.cat(parts) if parts else None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> StepResult:
        for rid in out.preempted_ids + out.finished_ids:
            self.free(rid)
        inputs = self.builder.build(out.scheduled, kv)
        mm_embeds = self._encode(out.scheduled)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata, self.kv_caches,
                                    mm_embeds, inputs.mm_token_index)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        prompt_lp = prompt_logprobs(self.model, hidden, out.scheduled, self.builder.query_start_loc.np)
        for s in out.scheduled:
            # A frame's embeddings are needed until its whole range is in the KV cache, which (chunks
            # never split a frame) is the end of the step that encoded it.
            cache = self.encoder_cache.get(s.request.request_id)
            if cache is not None:
                for f in s.frames:
                    cache.pop(f, None)
                if not cache or s.context_len + s.num_tokens >= s.request.num_prompt_tokens:
                    self.free(s.request.request_id)
        return StepResult(logits, [out.scheduled[i] for i in inputs.sampled], prompt_lp)
