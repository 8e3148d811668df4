"""Owns the model, its paged KV caches and every per-step input; turns one SchedulerOutput into logits.

Per step: apply the scheduler's block-table changes (block_table.py), fill the step inputs once
(step_inputs.py: ids, positions, slots, one CommonAttentionMetadata per KV pool), let each pool's
attention metadata builder prepare its backend's state once, then run the model: eagerly, or on
CUDA as the captured graph of a uniform decode step's padded size (one token per request, or with
speculation K + 1 per request: a verify step; cuda_graphs.py; --enforce-eager turns graphs off). The host staging buffers are rewritten only once the previous step's copies
out of them have run (a CUDA event, not a device-wide sync).

Vision and audio: the frames and audio segments whose tokens enter a step are encoded in that step
(one batched call per tower, padded to the largest item), except those whose content the
cross-request encoder cache still holds; new embeddings go into that cache (LRU in bytes, keyed by
content hash), so a video or a clip heard before costs no encoder work even when its K/V blocks
were evicted.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from mmserve.attention import PoolConfig, get_backend
from mmserve.config import EngineConfig
from mmserve.core.kv_cache.planner import PoolPlan
from mmserve.core.sched.output import ScheduledRequest, SchedulerOutput
from mmserve.ipc.protocol import TokenLogprobs
from mmserve.model.compiled import set_compiled
from mmserve.model.vision import pad_patches
from mmserve.request import AudioFeatures
from mmserve.sample.logprobs import prompt_logprobs
from mmserve.worker.backend_check import (
    BackendCheck,
    check_attention,
    fallen_back,
    graphs_mismatch,
    should_check,
)
from mmserve.worker.block_table import BlockTables
from mmserve.worker.cuda_graphs import (
    UniformStepGraphs,
    capture_sizes,
    graph_query_lens,
    graphs_enabled,
    uniform_query_len,
)
from mmserve.worker.encoder_cache import EncoderCache, default_encoder_cache_bytes
from mmserve.worker.sampled_rows import SampledRowsBuilder
from mmserve.worker.step_inputs import StepInputBuilder

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    logits: torch.Tensor            # float32 [L, vocab]
    # the requests that sample, in row order: 1 + len(draft_token_ids) consecutive rows each (one
    # without drafts; a verify chunk's rows score its last token and each draft)
    sampling: list[ScheduledRequest]
    # request id -> logprobs of the prompt tokens after this step's chunk start (prompt_logprobs requests)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    frames_encoded: dict[str, int] = field(default_factory=dict)   # per request id, cache hits excluded
    # ... the same per request id and modality ("image", "video", "audio")
    encoded_by_modality: dict[str, dict[str, int]] = field(default_factory=dict)
    encode_perf: tuple[float, float] | None = None   # the vision encoder call (perf_counter), if any
    hidden: torch.Tensor | None = None   # [L, hidden] final-normed states of the logits rows (the drafter's input)
    # request id -> why its media failed to encode: its rows ran on zero embeddings, the core ends it
    media_failed: dict[str, str] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model, plans: dict[str, PoolPlan], config: EngineConfig, *, max_model_len: int):
        self.model = model
        spec = model.spec
        device, dtype = model.device, model.dtype
        backends = {t: get_backend(name) for t, name in model.attention_backends.items()}
        # One cache per layer that holds KV; a KV-sharing consumer's entry is its producer's tensor.
        # (Every backend shares one paged layout, so a backend the self-check swaps in uses it too.)
        self.kv_caches: list[torch.Tensor] = []
        for layer in spec.layers:
            t = layer.layer_type
            self.kv_caches.append(self.kv_caches[layer.kv_source] if layer.shares_kv else torch.zeros(
                backends[t].kv_cache_shape(plans[t].num_blocks, config.block_size, spec.attention_specs[t]),
                dtype=dtype, device=device))
        # each pool's caches, one per layer holding KV (block copies go through every one)
        self.pool_caches = {t: [self.kv_caches[layer.index] for layer in spec.layers
                                if layer.layer_type == t and not layer.shares_kv] for t in plans}
        set_compiled(config.compile_dense, layers=device.type == "cuda")   # fused layer pieces: CUDA always
        max_tokens = config.max_step_tokens
        max_blocks = math.ceil(max_model_len / config.block_size)
        self.block_tables = BlockTables(plans, max_blocks)
        self.inputs = StepInputBuilder(spec.attention_specs, max_num_tokens=max_tokens,
                                       max_num_seqs=config.max_num_seqs, max_blocks_per_req=max_blocks,
                                       block_size=config.block_size, device=device)
        pools = {t: PoolConfig(spec.attention_specs[t], num_blocks=plans[t].num_blocks, block_size=config.block_size,
                               max_num_tokens=max_tokens, max_num_reqs=config.max_num_seqs,
                               max_blocks_per_req=max_blocks, device=device, dtype=dtype,
                               sdpa_batching=config.sdpa_batching)
                 for t in spec.attention_specs if t in plans}
        self.pools = pools
        self.strict_backends = config.strict_backends
        self.self_check = should_check(config.backend_self_check, device)
        self.backend_checks: list[BackendCheck] = (
            check_attention(model, pools, self.kv_caches, strict=config.strict_backends) if self.self_check else [])
        backends = {t: get_backend(name) for t, name in model.attention_backends.items()}   # after fallbacks
        self.attn_builders = {t: backends[t].builder_cls(pool) for t, pool in pools.items()}
        # KV-sharing layers run only the rows that sample (worker/sampled_rows.py)
        self.sampled_rows = None
        if any(layer.shares_kv for layer in spec.layers):
            self.sampled_rows = SampledRowsBuilder(spec, backends, pools, max_num_seqs=config.max_num_seqs,
                                                   max_blocks=max_blocks, block_size=config.block_size, device=device)
        # Prefix caching off means no reuse across requests at all: no vision embeddings kept either.
        self.encoder_cache = EncoderCache(0 if not config.enable_prefix_caching
                                          else config.encoder_cache_bytes or default_encoder_cache_bytes(spec, dtype))
        self._inputs_copied = torch.cuda.Event() if device.type == "cuda" else None
        self.graphs = UniformStepGraphs(capture_sizes(config.max_num_seqs), enabled=graphs_enabled(
            device.type, config.enforce_eager, [b.cuda_graphs for b in backends.values()]),
            query_lens=graph_query_lens(config.num_speculative_tokens if config.speculative_model else 0),
            max_tokens=max_tokens)
        if self.graphs.enabled:
            self._capture_graphs()

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """One graph per (capture size, query length) over an all-padding step (its contents do not
        matter); with the self-check on, each query length's smallest graph must replay the eager forward."""
        def forward_for(size: int, query_len: int):
            inputs = self.inputs.build([], self.block_tables.rows, np.empty(0, dtype=np.int64), pad_to=size,
                                       query_len=query_len)
            metadata = {t: builder.build(inputs.common[t]) for t, builder in self.attn_builders.items()}
            return lambda: self.model.forward(inputs.input_ids, inputs.positions, metadata, self.kv_caches)
        reason = None
        try:
            self.graphs.capture_all(forward_for)
            if self.self_check:
                for q, sizes in self.graphs.by_query_len.items():
                    if sizes and reason is None:
                        eager = forward_for(sizes[0], q)().clone()
                        reason = graphs_mismatch(self.graphs.replay(sizes[0], q).clone(), eager)
                self.graphs.replays = 0
                self.graphs.replays_by_query_len.clear()
        except Exception as exc:   # e.g. a host sync in some layer: such a model simply runs eagerly
            logger.debug("CUDA graph capture failed", exc_info=True)
            reason = f"capture failed: {type(exc).__name__}: {str(exc)[:300]}"
        if reason is not None:
            self.graphs = UniformStepGraphs((), enabled=False)
            self.backend_checks.append(fallen_back("cuda_graphs", "cuda_graphs", "eager", reason,
                                                   self.strict_backends))
        elif self.self_check:
            self.backend_checks.append(BackendCheck("cuda_graphs", "cuda_graphs", "cuda_graphs"))

    def free(self, request_id: str) -> None:
        self.block_tables.free(request_id)

    def _encode(self, scheduled: list[ScheduledRequest]
                ) -> tuple[torch.Tensor | None, dict[str, int], dict[str, dict[str, int]], tuple[float, float] | None,
                       dict[str, str]]:
        """Embeddings of this step's frames and audio segments in (request, range) order, encoding only
        those whose content is neither cached nor repeated in this step (an audio segment split between
        chunks is encoded whole once; each chunk takes its rows); how many items each request encoded,
        in all and by modality; when the towers ran (perf_counter start, end), if they did; and the
        requests whose media failed to encode (id -> why): their ranges get zero embeddings so the
        step's other rows go on, and the core ends those requests alone."""
        step: dict[bytes, torch.Tensor | None] = {}   # this step's embeddings, safe from eviction
        todo: dict[bool, list] = {False: [], True: []}   # is audio -> [(request id, input, key)]
        encoded, by_modality, encode_perf = {}, {}, None
        for s in scheduled:
            for f in s.frames:
                item = s.request.mm_inputs[f]
                key = item.content_hash
                if key not in step:
                    step[key] = self.encoder_cache.get(key)
                    if step[key] is None:
                        audio = isinstance(item, AudioFeatures)
                        rid = s.request.request_id
                        todo[audio].append((rid, item, key))
                        encoded[rid] = encoded.get(rid, 0) + 1
                        modality = "audio" if audio else "video" if s.request.prompt_token_ids[
                            s.request.mm_ranges[f][0]] == self.model.spec.video_token_id else "image"
                        counts = by_modality.setdefault(rid, {})
                        counts[modality] = counts.get(modality, 0) + 1
        failed: dict[str, str] = {}
        if todo[False] or todo[True]:
            began = time.perf_counter()
            embeds = []
            if todo[False]:
                embeds += zip(todo[False], self._run_tower("vision", todo[False], failed), strict=True)
            if todo[True]:
                embeds += zip(todo[True], self._run_tower("audio", todo[True], failed), strict=True)
            for (_, _, key), e in embeds:
                step[key] = e
                if e is not None:
                    self.encoder_cache.put(key, e)
            encode_perf = (began, time.perf_counter())
        parts = []
        for s in scheduled:
            for f in s.frames:
                e = step[s.request.mm_inputs[f].content_hash]
                start, end = s.request.mm_ranges[f]
                if e is None or e.shape[0] != end - start + 1:
                    rid = s.request.request_id
                    if e is not None:
                        logger.error("request %s: range %d has %d placeholder tokens but its input gives %d "
                                     "embeddings", rid, f, end - start + 1, e.shape[0])
                    failed.setdefault(rid, "its media gave other embeddings than their placeholders")
                    e = torch.zeros(end - start + 1, self.model.spec.hidden_size, dtype=self.model.dtype,
                                    device=self.model.device)
                parts.append(e[max(start, s.num_computed_tokens) - start:min(end, s.seq_len - 1) - start + 1])
        return (torch.cat(parts) if parts else None), encoded, by_modality, encode_perf, failed

    def _run_tower(self, kind: str, todo: list, failed: dict[str, str]) -> list[torch.Tensor | None]:
        """The vision or audio tower over `todo`'s (request id, input, key) in one batched call; if that
        raises, request by request, so a failure is that request's alone (None for its inputs, its id
        and the exception's type into `failed`; the message, which may quote the batch, goes to the log)."""
        def run(items: list) -> list[torch.Tensor]:
            if kind == "audio":
                return self.model.encode_audio([m.features for _, m, _ in items])
            return self.model.encode_vision(*pad_patches([(m.pixel_values, m.position_ids) for _, m, _ in items]))
        try:
            return run(todo)
        except Exception:
            logger.warning("the %s encoder failed on a batch of %d inputs; encoding request by request", kind,
                           len(todo), exc_info=True)
        what = "audio" if kind == "audio" else "images/frames"
        out: list[torch.Tensor | None] = []
        for rid, group in itertools.groupby(todo, key=lambda item: item[0]):
            items = list(group)
            try:
                out += run(items)
            except Exception as exc:
                logger.error("request %s: the %s encoder failed on its media", rid, kind, exc_info=exc)
                failed[rid] = f"the {kind} encoder failed on its {what} ({type(exc).__name__})"
                out += [None] * len(items)
        return out

    def _copy_blocks(self, copies: dict[str, list[tuple[int, int]]]) -> None:
        """Copy whole KV blocks in every layer of their pool (a parallel sample's own copy of its
        parent's partial last prompt block), before the step writes to either."""
        for t, pairs in copies.items():
            src = torch.tensor([p[0] for p in pairs], device=self.model.device)
            dst = torch.tensor([p[1] for p in pairs], device=self.model.device)
            for cache in self.pool_caches[t]:   # (2, blocks, block_size, heads, dim)
                cache[:, dst] = cache[:, src]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        self._copy_blocks(out.block_copies)
        for rid in out.preempted_ids + out.finished_ids:
            self.free(rid)
        rows = self.block_tables.apply(out.scheduled)
        query_len = uniform_query_len([s.num_tokens for s in out.scheduled], any(s.frames for s in out.scheduled),
                                      any(s.is_prefill for s in out.scheduled))
        graph_size = self.graphs.size_for(len(out.scheduled), query_len) if query_len else None
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()   # the last step's copies out of the staging buffers have run
        inputs = self.inputs.build(out.scheduled, self.block_tables.rows, rows, pad_to=graph_size,
                                   query_len=query_len or 1)
        attn_metadata = {t: builder.build(inputs.common[t]) for t, builder in self.attn_builders.items()}
        mm_embeds, encoded, by_modality, encode_perf, failed = self._encode(out.scheduled)   # decode steps encode nothing
        sampled = None   # graph steps are uniform decode steps: the full path
        # (a verify chunk samples several rows: KV-sharing layers then run every row)
        if self.sampled_rows is not None and graph_size is None and not any(s.draft_token_ids for s in out.scheduled):
            sampled = self.sampled_rows.build(out.scheduled, inputs, self.block_tables.rows, rows)
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        if graph_size is not None:
            hidden = self.graphs.replay(graph_size, query_len)   # reads the buffers just refilled, at their addresses
        else:
            hidden = self.model.forward(inputs.input_ids, inputs.positions, attn_metadata, self.kv_caches,
                                        mm_embeds, inputs.mm_token_index, sampled)
        prompt_lp = {}   # a step with prompt-logprobs requests always takes the full path (sampled is None)
        if sampled is None:   # every row's hidden state came back; keep the sampled ones
            prompt_lp = prompt_logprobs(self.model, hidden, out.scheduled, self.inputs.query_start_loc.np)
            hidden = hidden[inputs.logits_indices]
        logits = self.model.compute_logits(hidden)
        return StepResult(logits, [out.scheduled[i] for i in inputs.sampling_index], prompt_lp, encoded, by_modality,
                          encode_perf, hidden, failed)
