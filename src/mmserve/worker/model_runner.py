"""Owns the model, its paged KV caches and every per-step input; turns one SchedulerOutput into logits.

Per step: apply the scheduler's block-table changes (block_table.py), fill the step inputs once
(step_inputs.py: ids, positions, slots, one CommonAttentionMetadata per KV pool), let each pool's
attention metadata builder prepare its backend's state once, then run the model: on CUDA a uniform
step (one token per request, or with speculation K + 1: a verify step) replays the captured graph
of its padded size (cuda_graphs.py), every other step its dense pieces per token bucket with
attention between them (piecewise_graphs.py); eagerly with --enforce-eager, on a CPU unless
emulated, or past the largest bucket. With async scheduling a step's last input may be a token the
step before is still sampling: it is copied into the inputs on the device (`SampledTokens`), with
the drafts made after it (speculation), and the request's positions, context length and slots move
back there by what that step's acceptance rejected (the host built them as if it kept every
draft); where a backend plans from host positions (sdpa, reference, or FA4 on a step with frames)
the rejected count is read to the host first instead (free on a CPU, a wait on CUDA). Nothing
here waits for the device otherwise (prompt logprobs aside); the host staging buffers are rewritten only once
the previous step's copies out of them have run (a CUDA event, not a device-wide sync). With the
self-check on, the graphs are replayed at start-up against the eager forward (backend_check.py).

Vision and audio: the frames and audio segments whose tokens enter a step are encoded one step
ahead where the scheduler foresaw them (`SchedulerOutput.encode_ahead`, worker/encode_ahead.py):
batched across requests after the step's forward is queued, on CUDA on a side stream that overlaps
it, the consuming step waiting on its event. What was not foreseen is encoded in its own step (one
batched call per tower, padded to the largest item), except what the cross-request encoder cache
still holds; new embeddings go into that cache (LRU in bytes, keyed by content hash), so a video or
a clip heard before costs no encoder work even when its K/V blocks were evicted. A request's frame
counts as encoded (`frames_encoded`) in the step that consumes it, whichever step ran the tower.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from mmserve.attention import PoolConfig, get_backend
from mmserve.attention.buffers import HostCopy
from mmserve.config import EngineConfig
from mmserve.core.kv_cache.planner import PoolPlan
from mmserve.core.sched.output import ScheduledRequest, SchedulerOutput
from mmserve.model.compiled import set_compiled
from mmserve.model.vision import pad_patches
from mmserve.request import AudioFeatures
from mmserve.sample.logprobs import PromptLogprobs, prompt_logprobs
from mmserve.worker.backend_check import (
    BackendCheck,
    CheckStep,
    check_attention,
    check_cache,
    check_nucleus_kernel,
    check_ple_kernel,
    fallen_back,
    graph_check_step,
    graphs_mismatch,
    should_check,
)
from mmserve.worker.block_table import BlockTables
from mmserve.worker.cuda_graphs import (
    UniformStepGraphs,
    capture_sizes,
    graph_mode,
    graph_query_lens,
    uniform_query_len,
)
from mmserve.worker.encode_ahead import EncodedAhead
from mmserve.worker.encoder_cache import EncoderCache, default_encoder_cache_bytes
from mmserve.worker.piecewise_graphs import DenseStep, PiecewiseGraphs, piecewise_sizes
from mmserve.worker.sampled_rows import SampledRowsBuilder
from mmserve.worker.step_inputs import PrevStep, StepInputBuilder, StepInputs

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    logits: torch.Tensor            # float32 [L, vocab]
    # the requests that sample, in row order: 1 + len(draft_token_ids) consecutive rows each (one
    # without drafts; a verify chunk's rows score its last token and each draft)
    sampling: list[ScheduledRequest]
    # request id -> logprobs of the prompt tokens after this step's chunk start (prompt_logprobs requests),
    # on their way to the host
    prompt_logprobs: PromptLogprobs = field(default_factory=PromptLogprobs)
    frames_encoded: dict[str, int] = field(default_factory=dict)   # per request id, cache hits excluded
    # ... the same per request id and modality ("image", "video", "audio")
    encoded_by_modality: dict[str, dict[str, int]] = field(default_factory=dict)
    # when the towers ran for this step's frames (perf_counter): its own call, and those a step before
    # made for it ahead; None if neither ran
    encode_perf: tuple[float, float] | None = None
    hidden: torch.Tensor | None = None   # [L, hidden] final-normed states of the logits rows (the drafter's input)
    # request id -> why its media failed to encode: its rows ran on zero embeddings, the core ends it
    media_failed: dict[str, str] = field(default_factory=dict)
    # MoE: this step's distinct experts per layer (mean) on its way to the host, for its record; None without experts
    experts: HostCopy | None = None

    def experts_touched(self) -> float | None:
        """The step's own expert count (read after its tokens reached the host: no wait of its own)."""
        return None if self.experts is None else float(self.experts.result())


@dataclass
class SampledTokens:
    """A step's outcome still on the device (async scheduling), for the next step's inputs
    (`ModelRunner.execute`): per sampled request (its row: `rows`), the token after what it kept
    and, with speculation, the drafts made after that token (`tokens` [S, 1 + K]); and the
    positions the host counted as kept that the step's acceptance rolled back (`shift` [S]; None
    without speculation)."""

    tokens: torch.Tensor
    rows: dict[str, int]
    shift: torch.Tensor | None = None


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
        self.block_tables = BlockTables(plans, max_blocks, device=device)
        self.inputs = StepInputBuilder(spec.attention_specs, max_num_tokens=max_tokens,
                                       max_num_seqs=config.max_num_seqs, max_blocks_per_req=max_blocks,
                                       block_size=config.block_size, device=device)
        pools = {t: PoolConfig(spec.attention_specs[t], num_blocks=plans[t].num_blocks, block_size=config.block_size,
                               max_num_tokens=max_tokens, max_num_reqs=config.max_num_seqs,
                               max_blocks_per_req=max_blocks, device=device, dtype=dtype,
                               sdpa_batching=config.sdpa_batching,
                               # needed by the async loop; the synchronous one pays at most a tile more per request
                               position_slack=config.num_speculative_tokens if config.speculative_model else 0)
                 for t in spec.attention_specs if t in plans}
        self.pools = pools
        self.strict_backends = config.strict_backends
        self.self_check = should_check(config.backend_self_check, device)
        self.backend_checks: list[BackendCheck] = (
            check_attention(model, pools, self.kv_caches, strict=config.strict_backends) if self.self_check else [])
        if self.self_check and device.type == "cuda":   # the kernel runs on CUDA only
            self.backend_checks += check_ple_kernel(model, strict=config.strict_backends)
            self.backend_checks += check_nucleus_kernel(spec.vocab_size, device, strict=config.strict_backends)
        backends = {t: get_backend(name) for t, name in model.attention_backends.items()}   # after fallbacks
        self.attn_builders = {t: backends[t].builder_cls(pool) for t, pool in pools.items()}
        self._host_positions = [b.name for b in backends.values() if not b.device_positions]   # plan from the host
        # KV-sharing layers run only the rows that sample (worker/sampled_rows.py)
        self.sampled_rows = None
        if any(layer.shares_kv for layer in spec.layers):
            self.sampled_rows = SampledRowsBuilder(spec, backends, pools, max_num_seqs=config.max_num_seqs,
                                                   max_blocks=max_blocks, block_size=config.block_size, device=device)
        # Prefix caching off means no reuse across requests at all: no vision embeddings kept either.
        self.encoder_cache = EncoderCache(0 if not config.enable_prefix_caching
                                          else config.encoder_cache_bytes or default_encoder_cache_bytes(spec, dtype))
        # Embeddings encoded a step early (prefix caching or not): at most one full step's worth.
        self.encoded_ahead = EncodedAhead(config.max_step_tokens * spec.hidden_size
                                          * torch.empty((), dtype=dtype).element_size())
        self._encode_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._inputs_copied = torch.cuda.Event() if device.type == "cuda" else None
        self._warned_host_shift = False
        self.max_model_len = max_model_len
        self.graphs = UniformStepGraphs(capture_sizes(config.max_num_seqs), mode=graph_mode(
            device.type, config.enforce_eager, config.emulate_cuda_graphs, [b.cuda_graphs for b in backends.values()]),
            query_lens=graph_query_lens(config.num_speculative_tokens if config.speculative_model else 0,
                                        config.block_size),
            max_tokens=max_tokens)
        if self.graphs.enabled:
            self._capture_graphs()
        # Every other step (prefill chunks, frames, mixed lengths) replays its dense pieces
        # (piecewise_graphs.py); attention runs eagerly between them, so any backend serves.
        self.piecewise = PiecewiseGraphs(
            piecewise_sizes(max_tokens), mode=graph_mode(device.type, config.enforce_eager, config.emulate_cuda_graphs, ()),
            attn_width=max(a.num_heads * a.head_dim for a in spec.attention_specs.values()), dtype=dtype,
            device=device, hidden_size=spec.hidden_size)
        if self.piecewise.enabled:
            self.piecewise.wrap(model)
            self._capture_piecewise()

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """One graph per (capture size, query length) over an all-padding step (its contents do not
        matter); with the self-check on, each query length's graph must run a step of real-looking
        requests as the eager forward does (`_check_graphs`)."""
        def forward_for(size: int, query_len: int):
            inputs = self.inputs.build([], self.block_tables.rows, np.empty(0, dtype=np.int64), pad_to=size,
                                       query_len=query_len)
            metadata = self._metadata(inputs)
            return lambda: self.model.forward(inputs.input_ids, inputs.positions, metadata, self.kv_caches)
        def capture_and_check() -> str | None:
            self.graphs.capture_all(forward_for)
            if not self.self_check:
                return None
            reason = self._check_graphs()
            self.graphs.replays = 0
            self.graphs.replays_by_query_len.clear()
            return reason
        if not self._capture_checked("cuda_graphs", capture_and_check):
            self.graphs = UniformStepGraphs((), mode=None)

    def _capture_checked(self, component: str, capture_and_check) -> bool:
        """Capture one kind of graphs and, with the self-check on, check them (`capture_and_check`
        returns why they are unfit to serve, or None); the outcome goes into `backend_checks`.
        False when they failed (logged, or raised under --strict-backends): the caller drops them,
        and the steps they would have run run eagerly."""
        try:
            reason = capture_and_check()
        except Exception as exc:   # e.g. a host sync in some layer: such a model simply runs eagerly
            logger.debug("%s capture failed", component, exc_info=True)
            reason = f"capture failed: {type(exc).__name__}: {str(exc)[:300]}"
        if reason is not None:
            self.backend_checks.append(fallen_back(component, component, "eager", reason, self.strict_backends))
            return False
        if self.self_check:
            self.backend_checks.append(BackendCheck(component, component, component))
        return True

    def _check_graphs(self) -> str | None:
        """Why the graphs are not fit to serve, or None: per query length, requests of their own
        context (private blocks), one fewer than the graph's size so padding runs beside them, replayed
        and run eagerly unpadded; their rows must agree and the padding rows be finite."""
        for q, sizes in self.graphs.by_query_len.items():
            if not sizes:
                continue
            size = self.graphs.size_for(min(4, sizes[-1]), q)
            step = self._check_step([q] * max(1, size - 1))
            if step is not None and (reason := self._graph_check(step, size, q)) is not None:
                return f"{q} row(s) per request: {reason}"
        return None

    def _check_step(self, query_lens: list[int]) -> CheckStep | None:
        return graph_check_step(query_lens, pools=self.pools, vocab_size=self.model.spec.vocab_size,
                                max_model_len=self.max_model_len)

    def _graph_check(self, step: CheckStep, size: int, query_len: int) -> str | None:
        with check_cache(self.kv_caches, step) as garbage:
            eager = self._eager_rows(step)
            replays = []
            for again in (False, True):
                garbage(again)
                _, hidden = self._replay(step.scheduled, step.tables, step.rows, size, query_len)
                replays.append(hidden[:size * query_len].clone())
        n = eager.shape[0]
        return graphs_mismatch(replays[0][:n], eager, replays[0][n:], replays[1][n:])

    @torch.inference_mode()
    def _capture_piecewise(self) -> None:
        """Capture every token bucket's pieces; with the self-check on, a step of mixed lengths (a
        chunk beside decodes) replayed over garbage in every padding row must give the eager rows."""
        def forward_for(size: int):
            ids, positions = self.inputs.input_ids.dev[:size], self.inputs.positions.dev[:size]
            dense = {t: DenseStep(self.inputs.slot_mapping[t].dev[:size], size) for t in self.attn_builders}
            return lambda: self.model.forward(ids, positions, dense, self.kv_caches,
                                              inputs_embeds=self.piecewise.embeds[:size])
        for buffer in self.inputs.slot_mapping.values():   # capture's K/V writes: all to the null block
            buffer.np[:] = 0
            buffer.push(buffer.np.shape[0])
        def capture_and_check() -> str | None:
            self.piecewise.capture_all(forward_for)
            reason = None
            if self.self_check and (step := self._check_step([5, 1, 1])) is not None:
                with check_cache(self.kv_caches, step) as garbage:
                    eager = self._eager_rows(step)
                    garbage(True)
                    self.piecewise.fill_attention_buffers(float("nan"))   # what padding rows carry: anything
                    inputs, hidden = self._run_pieces(step.scheduled, step.tables, step.rows)
                    empty = hidden[:0]
                    reason = graphs_mismatch(hidden[:inputs.num_tokens].clone(), eager, empty, empty)
                self.piecewise.replays = 0
            return reason
        if not self._capture_checked("piecewise_graphs", capture_and_check):
            self.piecewise = PiecewiseGraphs((), mode=None, attn_width=0, dtype=self.model.dtype,
                                             device=self.model.device, hidden_size=0)

    def _eager_rows(self, step: CheckStep) -> torch.Tensor:
        """The check step's rows, eagerly and unpadded (the context restored after)."""
        inputs = self.inputs.build(step.scheduled, step.tables, step.rows)
        return self.model.forward(inputs.input_ids, inputs.positions, self._metadata(inputs),
                                  self.kv_caches)[:inputs.num_tokens].clone()

    def _metadata(self, inputs) -> dict:
        """Each pool's backend metadata for the step (refilling the builders' persistent buffers)."""
        return {t: builder.build(inputs.common[t]) for t, builder in self.attn_builders.items()}

    def _build(self, scheduled: list[ScheduledRequest], tables: dict[str, np.ndarray], rows: np.ndarray,
               prev: SampledTokens | None = None, **padding) -> StepInputs:
        """The step's inputs in the persistent buffers; a last input that the step in flight samples
        (async scheduling), and the drafts made after it, are copied there on the device from `prev`,
        and the rows of those requests moved back by what its acceptance rejected (on the device, or
        on the host first where a backend plans from host positions)."""
        in_flight = None
        if prev is not None:
            host_shift = None
            if prev.shift is not None and (self._host_positions or any(s.frames for s in scheduled)):
                if prev.shift.is_cuda and not self._warned_host_shift:
                    self._warned_host_shift = True
                    logger.warning("async scheduling with speculation: %s plans attention from host positions, "
                                   "so a step waits for the acceptance of the step before it",
                                   "+".join(self._host_positions) or "a step with frames")
                host_shift = prev.shift.cpu().numpy()   # waits for that acceptance on CUDA; there already on a CPU
            in_flight = PrevStep(prev.rows, prev.tokens.shape[1], host_shift)
        inputs = self.inputs.build(scheduled, tables, rows, prev=in_flight,
                                   gather_from=self.block_tables if tables is self.block_tables.rows else None,
                                   **padding)
        if inputs.prev_token is not None:
            dst, src = inputs.prev_token
            self.inputs.input_ids.dev.index_copy_(0, dst, prev.tokens.view(-1).index_select(0, src))
        if inputs.shifted is not None:
            self.inputs.shift_on_device(inputs.shifted, prev.shift)
        return inputs

    def _replay(self, scheduled: list[ScheduledRequest], tables: dict[str, np.ndarray], rows: np.ndarray,
                size: int, query_len: int, prev: SampledTokens | None = None):
        """Fill the persistent inputs of a padded uniform step and replay its graph: (inputs, hidden)."""
        inputs = self._build(scheduled, tables, rows, prev, pad_to=size, query_len=query_len)
        self._metadata(inputs)
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        return inputs, self.graphs.replay(size, query_len)   # reads the buffers just refilled, at their addresses

    def _run_pieces(self, scheduled: list[ScheduledRequest], tables: dict[str, np.ndarray], rows: np.ndarray,
                    mm=None, prev: SampledTokens | None = None):
        """A step as piecewise graphs: its inputs padded to the bucket's rows, the embeddings eagerly
        into the first piece's buffer, then the pieces with attention between. (inputs, hidden)."""
        num_tokens = sum(s.num_tokens for s in scheduled)
        size = self.piecewise.size_for(num_tokens)
        inputs = self._build(scheduled, tables, rows, prev, pad_tokens_to=size)
        metadata = self._metadata(inputs)
        mm_embeds = mm() if mm is not None else None
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        embeds = self.piecewise.embeds[:size]
        embeds.copy_(self.model.embed(inputs.input_ids, mm_embeds, inputs.mm_token_index))
        return inputs, self.piecewise.run(size, num_tokens, metadata)

    @property
    def verify_graph_rows(self) -> int:
        """1 + K when verify steps have graphs (the scheduler then pads every speculating request's
        chunk to those rows, so a speculating batch replays one graph), else 0."""
        return max((q for q, sizes in self.graphs.by_query_len.items() if q > 1 and sizes), default=0)

    def free(self, request_id: str) -> None:
        self.block_tables.free(request_id)
        self.encoded_ahead.free(request_id)

    def encoded_ahead_bytes(self) -> int:
        """The embeddings held for the next steps (every rank's, under tensor parallelism)."""
        return self.encoded_ahead.num_bytes

    @torch.inference_mode()   # the block tables' device rows are inference tensors, as in `execute`
    def release(self, out: SchedulerOutput) -> None:
        """A step that schedules nothing runs nothing: free here what the runner holds for the
        requests that ended or were preempted since (a step that runs frees them in `execute`)."""
        for rid in out.preempted_ids + out.finished_ids:
            self.free(rid)

    def confirm_drafts(self) -> None:
        """Tensor parallelism's check of the last step's drafts on the other ranks when no step
        follows (executor/tensor_parallel.py); one rank verified its own drafts: nothing to check."""

    def _encode(self, scheduled: list[ScheduledRequest]
                ) -> tuple[torch.Tensor | None, dict[str, int], dict[str, dict[str, int]], tuple[float, float] | None,
                       dict[str, str]]:
        """Embeddings of this step's frames and audio segments in (request, range) order, encoding only
        those whose content is neither encoded ahead, cached nor repeated in this step (an audio segment split between
        chunks is encoded whole once; each chunk takes its rows); how many items each request encoded,
        in all and by modality; when the towers ran for them (perf_counter start, end: from the first
        call that encoded one ahead, in a step before, to the end of this step's own), if any; and the
        requests whose media failed to encode (id -> why): their ranges get zero embeddings so the
        step's other rows go on, and the core ends those requests alone."""
        step: dict[bytes, torch.Tensor | None] = {}   # this step's embeddings, safe from eviction
        todo: dict[bool, list] = {False: [], True: []}   # is audio -> [(request id, input, key)]
        encoded, by_modality, encode_perf = {}, {}, None
        ahead = []   # keys encoded by the step before, offered to the cache after every lookup
        for s in scheduled:
            for f in s.frames:
                item = s.request.mm_inputs[f]
                key = item.content_hash
                if key in step:
                    continue
                audio = isinstance(item, AudioFeatures)
                taken = self.encoded_ahead.take(key)   # encoded by a step before: counted here, with its call's time
                if taken is not None:
                    step[key], when = taken
                    encode_perf = (min(when[0], encode_perf[0]), max(when[1], encode_perf[1])) if encode_perf else when
                    ahead.append(key)
                else:
                    step[key] = self.encoder_cache.get(key)
                    if step[key] is not None:
                        continue
                    todo[audio].append((s.request.request_id, item, key))
                rid = s.request.request_id
                encoded[rid] = encoded.get(rid, 0) + 1
                modality = "audio" if audio else "video" if s.request.prompt_token_ids[
                    s.request.mm_ranges[f][0]] == self.model.spec.video_token_id else "image"
                counts = by_modality.setdefault(rid, {})
                counts[modality] = counts.get(modality, 0) + 1
        for key in ahead:
            self.encoder_cache.put(key, step[key])
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
            encode_perf = (min(began, encode_perf[0]) if encode_perf else began, time.perf_counter())
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

    def _encode_ahead(self, ahead: list) -> None:
        """Encode the media the next step will likely consume (`SchedulerOutput.encode_ahead`: (request,
        range indices)), one batched call per tower, into `encoded_ahead`, skipping what is held there
        or in the encoder cache already and what would pass its byte bound. On CUDA the towers run on
        the side stream, so they overlap the forward queued before them. An item whose encode fails
        is not held: its own step encodes it again and ends its request alone, as it would have.
        The step that consumes them reports their frames and this call's time."""
        if not ahead:
            return
        row_bytes = self.model.spec.hidden_size * self.model.dtype.itemsize
        room = self.encoded_ahead.max_bytes - self.encoded_ahead.num_bytes
        todo: dict[bool, list] = {False: [], True: []}   # is audio -> [(request id, input, key)]
        owners: dict[bytes, list[str]] = {}
        for request, frames in ahead:
            rid = request.request_id
            for f in frames:
                item = request.mm_inputs[f]
                key = item.content_hash
                if key in owners:
                    owners[key].append(rid)
                    continue
                if self.encoded_ahead.claim(key, rid) or key in self.encoder_cache:
                    continue
                start, end = request.mm_ranges[f]
                if (end - start + 1) * row_bytes > room:
                    continue
                room -= (end - start + 1) * row_bytes
                owners[key] = [rid]
                todo[isinstance(item, AudioFeatures)].append((rid, item, key))
        if not owners:
            return
        began = time.perf_counter()
        embeds, ready = [], None
        with torch.cuda.stream(self._encode_stream) if self._encode_stream is not None else nullcontext():
            for audio, items in todo.items():
                if items:
                    embeds += zip(items, self._run_tower("audio" if audio else "vision", items, {}), strict=True)
            if self._encode_stream is not None:
                ready = torch.cuda.Event()
                ready.record(self._encode_stream)
        when = (began, time.perf_counter())
        for (rid, _, key), e in embeds:
            if e is not None and self.encoded_ahead.fits(e.numel() * e.element_size()):
                self.encoded_ahead.put(key, rid, e, ready, when)
                for other in owners[key][1:]:
                    self.encoded_ahead.claim(key, other)

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
        if not copies:   # most steps (model.device walks the parameters)
            return
        device = self.model.device
        for t, pairs in copies.items():
            index = torch.tensor(pairs, dtype=torch.long)   # [n, 2]: source, destination
            if device.type == "cuda":   # from pinned memory: the copy waits for no step in flight
                index = index.pin_memory().to(device, non_blocking=True)
            for cache in self.pool_caches[t]:   # (2, blocks, block_size, heads, dim)
                cache[:, index[:, 1]] = cache[:, index[:, 0]]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, prev: SampledTokens | None = None) -> StepResult:
        """Queue the step's forward and logits (nothing here waits for the device, but prompt
        logprobs); `prev` (async scheduling): the tokens the step before samples, still on the device."""
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()   # the last step's copies out of the staging buffers have run
        self._copy_blocks(out.block_copies)
        for rid in out.preempted_ids + out.finished_ids:
            self.free(rid)
        rows = self.block_tables.apply(out.scheduled)
        num_tokens, has_frames, has_prefill, has_verify = [], False, False, False   # one pass over the step
        for s in out.scheduled:
            num_tokens.append(s.num_tokens)
            has_frames = has_frames or bool(s.frames)
            has_prefill = has_prefill or s.is_prefill
            has_verify = has_verify or s.is_verify
        query_len = uniform_query_len(num_tokens, has_frames, has_prefill)
        graph_size = self.graphs.size_for(len(out.scheduled), query_len) if query_len else None
        pieces = graph_size is None and self.piecewise.size_for(sum(num_tokens)) is not None
        encoded, by_modality, encode_perf, failed = {}, {}, None, {}
        sampled = None   # graph steps run every row: KV-sharing layers too
        if graph_size is not None:
            inputs, hidden = self._replay(out.scheduled, self.block_tables.rows, rows, graph_size, query_len, prev)
        elif pieces:
            def encode():
                nonlocal encoded, by_modality, encode_perf, failed
                mm_embeds, encoded, by_modality, encode_perf, failed = self._encode(out.scheduled)
                return mm_embeds
            inputs, hidden = self._run_pieces(out.scheduled, self.block_tables.rows, rows, encode, prev)
        else:
            inputs = self._build(out.scheduled, self.block_tables.rows, rows, prev)
            attn_metadata = self._metadata(inputs)
            mm_embeds, encoded, by_modality, encode_perf, failed = self._encode(out.scheduled)
            # (a verify chunk samples several rows, and positions the device moves back are not the
            # host's: KV-sharing layers then run every row)
            if self.sampled_rows is not None and not has_verify and (prev is None or prev.shift is None):
                sampled = self.sampled_rows.build(out.scheduled, inputs, self.block_tables.rows, rows,
                                                  PrevStep(prev.rows) if prev is not None else None)
            if self._inputs_copied is not None:
                self._inputs_copied.record()
            hidden = self.model.forward(inputs.input_ids, inputs.positions, attn_metadata, self.kv_caches,
                                        mm_embeds, inputs.mm_token_index, sampled)
        prompt_lp = PromptLogprobs()   # a step with prompt-logprobs requests always takes the full path (sampled is None)
        if sampled is None:   # every row's hidden state came back; keep the sampled ones
            prompt_lp = prompt_logprobs(self.model, hidden, out.scheduled, self.inputs.query_start_loc.np)
            hidden = hidden[inputs.logits_indices]
        logits = self.model.compute_logits(hidden)
        experts = self.model.experts_touched()   # before the next forward overwrites the count
        if out.encode_ahead:
            self._encode_ahead(out.encode_ahead)
        return StepResult(logits, [out.scheduled[i] for i in inputs.sampling_index.tolist()], prompt_lp, encoded, by_modality,
                          encode_perf, hidden, failed, experts)
