"""Piecewise CUDA graphs: every step a uniform graph cannot run, as graphs of its dense parts.

Why: a step with a prefill chunk, frames, or decodes of different lengths (verify chunks beside
1-row decodes) cannot be one graph: attention's work depends on every request's lengths. Run
eagerly, such a step costs 70-120 ms of launches at 12B dims on an H200 (the first GPU run), 5x a
graph step, and under video traffic most steps carry a prefill chunk. Everything but attention,
though, is per token: embeddings, norms, projections, RoPE, the MLP and experts, all-reduces.

The design (vLLM v1's piecewise compile, which splits the model at attention):
- Buckets (`piecewise_sizes`): token counts 1, 2, 4, then four per doubling (8, 10, 12, 14, 16,
  20, ...) up to the largest step (`max_step_tokens`; 36 buckets for 2048). A step of T
  tokens runs the smallest bucket B >= T: its ids and positions padded to B rows (id 0,
  position 0) in the step-input buffers.
- Pieces: at capture the forward over B rows is recorded as one graph per stretch between two
  attention calls (`SplitAttention`, wrapped around each layer's attention impl, ends the current
  graph and begins the next): layers + 1 graphs per bucket, in one memory pool, replayed in
  the order captured. Between two pieces the layer's attention runs eagerly, on the step's own
  metadata (any backend: sdpa and reference too) and on the real rows only: the piece before
  ends by copying its q into a persistent buffer, whose [:T] rows attention reads, and the
  result is copied into another persistent buffer the piece after reads, its padding rows zeroed.
  Nothing a piece allocated outlives its bucket's capture (the forward's output too is copied
  into a persistent buffer), so the pool holds one bucket's working set, not every bucket's:
  holding each layer's q at its output address kept ~448 KB per token at 12B dims alive, 22.7 GiB
  over the 53,211 tokens of the buckets to 8192, where the graphs have 1 - utilization of the
  card (memory_profile.py). The copy costs one kernel per layer (~0.6 ms of HBM traffic in a
  2048-token step at 12B, under 1% of it). No real row attends to a
  padding row, and the dense pieces treat each row alone. The pieces write every row's K/V (the
  model's `attn_in` does, before attention): a padding row's goes to the null block's slot 0, and
  since every padding row starts from id 0 at position 0 and gets zeros from attention, all of
  them write the same finite values there, whatever any buffer held before.
- The embedding runs eagerly before the first piece, into a persistent [B, hidden] buffer: the
  number of vision rows it writes changes every step (`Gemma4ServingModel.forward(inputs_embeds=)`).
- KV-sharing layers (E2B/E4B) run every row on a piecewise step: the sampled-rows pruning changes
  the row count mid-forward, so it stays on eager steps.

Emulation (`--emulate-cuda-graphs`, a CPU): the same buckets, padding and persistent buffers, with
the forward re-run over the B padded rows at replay and each attention call doing exactly what
the replay does between pieces (real rows in, copied into the persistent buffer, padding rows of
it left as they were); the output is copied into the same static buffer a CUDA replay writes.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from mmserve.worker.cuda_graphs import EMULATED, WARMUP_RUNS

log = logging.getLogger(__name__)


def piecewise_sizes(max_tokens: int) -> tuple[int, ...]:
    """Token buckets: 1, 2, 4, then four per doubling (8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ...),
    and `max_tokens` itself: past 8 tokens a step's bucket is less than a fifth padding."""
    sizes, p = {1, 2, 4, max_tokens}, 8
    while p <= max_tokens:
        sizes.update(p + p * i // 4 for i in range(4))
        p *= 2
    return tuple(sorted(s for s in sizes if s <= max_tokens))


@dataclass
class AttentionCall:
    """One layer's attention between two pieces, as captured: the impl, the tensors the piece before
    left (q in the persistent buffer it copied it to; k, v at their output addresses, None on the
    decoder's path, whose `attn_in` writes K/V into the cache itself), the layer's cache, and the
    buffer the piece after reads."""

    impl: object
    layer_type: str
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    kv_cache: torch.Tensor
    out: torch.Tensor


@dataclass
class DenseStep:
    """What a piecewise forward's dense pieces read of a layer type's attention metadata (`attn_in`
    writes every row's K/V at its slot, inside the piece): all of the bucket's rows, the padding
    rows' slots in the null block (`StepInputBuilder.build(pad_tokens_to=)`). The attention between
    the pieces gets the step's own metadata."""

    slot_mapping: torch.Tensor
    num_actual_tokens: int

    @property
    def common(self) -> DenseStep:   # read as a backend's metadata is: metadata.common.slot_mapping
        return self


# The piecewise forward running on this thread, if any: what a SplitAttention call belongs to. (Not
# an attribute of the wrapper: several runners may drive one model, one after another.)
_RUNNING: ContextVar[PiecewiseGraphs | None] = ContextVar("piecewise_forward", default=None)


class SplitAttention:
    """A layer's attention impl inside a piecewise forward: where one piece ends and the next begins.
    Outside one (eager and uniform-graph steps) it is `inner`."""

    def __init__(self, inner, layer_type: str):
        self.inner = inner
        self.spec = inner.spec
        self.layer_type = layer_type

    def forward(self, q, k, v, kv_cache, metadata):
        graphs = _RUNNING.get()
        if graphs is None:
            return self.inner.forward(q, k, v, kv_cache, metadata)
        return graphs._split(self, q, k, v, kv_cache, metadata)


class PiecewiseGraphs:
    """The piecewise forwards by bucket; empty when `mode` is None (eager). `attn_width`: the widest
    attention output (heads x head dim) of any layer type, which sizes the buffer attention results
    cross between pieces in."""

    def __init__(self, sizes: tuple[int, ...], *, mode: str | None, attn_width: int, dtype: torch.dtype,
                 device: torch.device, hidden_size: int):
        self.mode = mode
        self.sizes = tuple(sorted(sizes)) if mode else ()
        rows = self.sizes[-1] if self.sizes else 0
        # Inference tensors, as an eager step's activations are: a compiled layer piece (model/compiled.py)
        # fed a normal tensor where it was traced with an inference one fails its guards and compiles again.
        with torch.inference_mode():
            self.embeds = torch.zeros(rows, hidden_size, dtype=dtype, device=device)   # the first piece's input
            self._attn_in = torch.zeros(rows * attn_width, dtype=dtype, device=device)    # q, for attention
            self._attn_out = torch.zeros(rows * attn_width, dtype=dtype, device=device)   # its result, for the next piece
            self._static = torch.zeros(rows, hidden_size, dtype=dtype, device=device)     # the output every replay overwrites
        self._pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._calls: dict[int, list[AttentionCall]] = {}
        self._closures: dict[int, Callable[[], torch.Tensor]] = {}   # emulated
        self._running: str | None = None   # "capture" | "warmup" | "run": what a SplitAttention call does
        self._num_tokens = 0               # the real rows of the step running
        self._metadata: dict = {}          # emulated: the running step's attention metadata
        self._capture: list | None = None  # while capturing: [pieces, calls, the open graph]
        self._pool = None
        self.replays = 0
        self.capture_s = 0.0   # what capture_all took: warm-ups (and their compiles) and captures

    @property
    def enabled(self) -> bool:
        return bool(self.sizes)

    def wrap(self, model) -> None:
        """Put every decoder layer's attention impl behind a SplitAttention (after the self-check has
        settled which impls serve)."""
        for layer in model.decoder.layers:
            attn = layer.self_attn
            if not isinstance(attn.impl, SplitAttention):
                attn.impl = SplitAttention(attn.impl, layer.layer_type)

    def size_for(self, num_tokens: int) -> int | None:
        """The smallest bucket holding `num_tokens`, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture_all(self, forward_for: Callable[[int], Callable[[], torch.Tensor]]) -> None:
        """Capture every bucket, largest first (one memory pool); `forward_for(size)` returns the
        forward over the persistent inputs' first `size` rows (`embeds` among them). An exception
        mid-capture ends the open capture before it propagates (as `torch.cuda.graph` does), so the
        eager fallback can run on the stream."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            forward = forward_for(size)
            if self.mode == EMULATED:
                self._closures[size] = forward
                continue
            self._running = "warmup"   # attention skipped: its inputs are whatever the buffers hold
            token = _RUNNING.set(self)
            try:
                for _ in range(WARMUP_RUNS):
                    forward()
                torch.cuda.synchronize()
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                self._running = "capture"
                with torch.cuda.stream(stream):
                    graph = torch.cuda.CUDAGraph()
                    self._capture = [[], [], graph]
                    graph.capture_begin(pool=self._pool)
                    try:
                        self._static[:size].copy_(forward())   # in the last piece: its output dies here
                    except BaseException:
                        with contextlib.suppress(Exception):   # an invalidated capture's end raises too
                            self._capture[2].capture_end()
                        raise
                    graph = self._capture[2]
                    graph.capture_end()
                torch.cuda.current_stream().wait_stream(stream)
                self._pieces[size], self._calls[size] = self._capture[0] + [graph], self._capture[1]
            finally:
                _RUNNING.reset(token)
                self._running, self._capture = None, None
        self.capture_s = time.perf_counter() - start
        log.info("%s piecewise CUDA graphs for %d token buckets up to %d in %.1f s",
                 "emulated" if self.mode == EMULATED else "captured", len(self.sizes), self.sizes[-1] if self.sizes else 0,
                 self.capture_s)

    def fill_attention_buffers(self, value: float) -> None:
        """Fill the buffers between pieces (q for attention, its result for the next piece) with
        `value`: the start-up check's garbage, so a padding row that reaches a real one shows."""
        for buffer in (self._attn_in, self._attn_out):
            buffer.fill_(value)

    def run(self, size: int, num_tokens: int, metadata: dict) -> torch.Tensor:
        """The forward of a step of `num_tokens` real rows in bucket `size`, its inputs (ids,
        positions, `embeds`) in the persistent buffers and `metadata` its attention's: replay each
        piece, attention in between. Returns the hidden states [size, hidden], valid until the next run."""
        self._num_tokens = num_tokens
        self.replays += 1
        if self.mode == EMULATED:
            self._running, self._metadata = "run", metadata
            token = _RUNNING.set(self)
            try:
                self._static[:size].copy_(self._closures[size]())
            finally:
                _RUNNING.reset(token)
                self._running = None
            return self._static[:size]
        pieces, calls = self._pieces[size], self._calls[size]
        for i, graph in enumerate(pieces):
            graph.replay()
            if i < len(calls):
                self._attend(calls[i], metadata[calls[i].layer_type])
        return self._static[:size]

    def _attend(self, call: AttentionCall, metadata) -> torch.Tensor:
        """One layer's attention on the real rows, into the buffer the next piece reads."""
        n = self._num_tokens
        k = None if call.k is None else call.k[:n]
        v = None if call.v is None else call.v[:n]
        result = call.impl.forward(call.q[:n], k, v, call.kv_cache, metadata)
        call.out[:n].copy_(result[:n])
        call.out[n:].zero_()   # padding rows: the same finite values in every row and step, whatever came before
        return call.out

    def _split(self, split: SplitAttention, q, k, v, kv_cache, metadata) -> torch.Tensor:
        """What a layer's attention call does inside a piecewise forward (`_running`): q into its
        persistent buffer (captured, the piece's last kernel: q's own memory goes back to the pool),
        then attention (emulated replay) or the end of this piece and the start of the next (capture)."""
        q_in = self._attn_in[:q.numel()].view(q.shape)
        q_in.copy_(q)
        out = self._attn_out[:q.numel()].view(q.shape)
        call = AttentionCall(split.inner, split.layer_type, q_in, k, v, kv_cache, out)
        if self._running == "run":    # emulated: the replay's eager attention, between two "pieces"
            return self._attend(call, self._metadata[split.layer_type])
        if self._running == "capture":
            pieces, calls, graph = self._capture
            graph.capture_end()
            pieces.append(graph)
            calls.append(call)
            graph = torch.cuda.CUDAGraph()
            self._capture[2] = graph
            graph.capture_begin(pool=self._pool)
        return out
