"""CUDA graphs for uniform steps: one captured model forward per (batch size, rows per request).

Why: a decode step runs a handful of small kernels per layer, and on a GPU the Python and launch
cost of issuing them is most of its time. Replaying a graph issues the whole forward at once.

The design (vLLM v1's full graphs for uniform decode batches, speculative ones included):
- Capture set (`capture_sizes`): 1, 2, 4, then every 8 up to max_num_seqs, for each query length
  of `query_lens`: 1 (plain decode) and, with speculation, K + 1 (a verify step: every request
  scores its last token and K drafts), a size taken only while size x query length fits the
  step's token buffers. A uniform step of R requests (every request schedules the same q tokens,
  no frames: `uniform_query_len`) runs the graph of the smallest size >= R captured for q
  (`UniformStepGraphs.size_for`), padded with requests that live in the null block alone
  (`StepInputBuilder._pad`: each padding token at the slot its position names, so padding reads
  only what it has just written and real rows never read padding). A step that mixes query
  lengths (plain decodes beside verify chunks, a verify chunk cut short by the budget), prefill,
  frames and larger steps run eagerly, and so does everything with `--enforce-eager`, on a CPU
  unless emulated, or with a backend whose inputs change shape per step (SDPA's padded gathers).
- Inputs: a graph reads device memory at the addresses it was captured with, so every tensor the
  forward reads is a view of a persistent buffer at a fixed offset: the step-input builder's
  device buffers (ids, positions, query_start_loc, seq_lens, slot mapping) and the attention
  metadata builders' own (page tables, block masks), refilled in place each step. Python values a
  kernel launch bakes in are fixed per graph: max_seqlen_q = its query length (FA4 bounds the keys
  by its page table's full width). The metadata's max_seq_len is not fixed: it is each step's
  longest context (a drafting round's in `TargetKVReader.prepare`), which a graph would bake in as
  its capture step's, so a capturable backend must not read it (only the dense reference's mask does).
- Output: the hidden states [size x q, hidden] each graph wrote at capture live in the graph's
  memory pool, which every graph shares: a replay's output is valid until the next replay (of any
  graph). Logits and sampling run eagerly on the real rows.
- Capture runs the most token rows first so every later (smaller) graph fits in the first one's
  memory pool, after warm-up forwards that compile kernels (FA4, torch.compile) outside the graph.
  If a capture fails (a layer that syncs with the host), the runner logs it and runs eagerly.

Emulation (`--emulate-cuda-graphs`, a CPU): the same capture set, bucketing, padding and
persistent buffers, with each "graph" being the forward closure built over its capture step (it
reads what a CUDA graph reads: the capture's input views and metadata objects, refilled in place
by every later step) run again at replay, its output copied into one static buffer that every
replay overwrites, as the shared memory pool would. It checks a graph path's tokens, coverage and
buffer discipline without a GPU; it cannot check capture itself (a host sync inside the forward),
graph memory or kernel numerics: the start-up self-check and bench/gpu_check.py do that on a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable

import torch

log = logging.getLogger(__name__)

WARMUP_RUNS = 2
CUDA, EMULATED = "cuda", "emulated"


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes decode graphs are captured for: 1, 2, 4, then every 8, and max_num_seqs itself."""
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs} | set(range(8, max_num_seqs + 1, 8)) | {max_num_seqs}
    return tuple(sorted(sizes))


def graph_mode(device_type: str, enforce_eager: bool, emulate: bool, capturable: Iterable[bool]) -> str | None:
    """How uniform steps run: as CUDA graphs (on CUDA), emulated ones (`--emulate-cuda-graphs` on a
    CPU), or None (eagerly): never with --enforce-eager, and only when every layer type's backend can
    be captured (its inputs are persistent buffers: FA4, flex; SDPA's padded gathers change shape)."""
    if enforce_eager or not all(capturable):
        return None
    if device_type == "cuda":
        return CUDA
    return EMULATED if emulate else None


def uniform_query_len(num_scheduled_tokens: list[int], has_frames: bool, has_prefill: bool) -> int | None:
    """The tokens every request of a step schedules, when a graph of that query length can run it:
    all schedule the same, no frame is encoded, and above one token no request is prefilling (a
    graph of several rows per request is a verify step's; a prompt chunk may hold media tokens,
    whose mask path a graph cannot switch to). Else None."""
    if not num_scheduled_tokens or has_frames or min(num_scheduled_tokens) != max(num_scheduled_tokens):
        return None
    q = num_scheduled_tokens[0]
    return None if q > 1 and has_prefill else q


def graph_query_lens(num_speculative_tokens: int, block_size: int) -> tuple[int, ...]:
    """Query lengths graphs are captured for: decode, and with speculation a full verify chunk, while
    a padding request's K + 1 tokens fit the null block (one slot per position)."""
    q = 1 + num_speculative_tokens
    return (1, q) if num_speculative_tokens and q <= block_size else (1,)


class UniformStepGraphs:
    """The captured forwards of uniform steps (every request the same number of rows: 1 for decode,
    K + 1 for a verify chunk), by (batch size, query length); empty when `mode` is None (eager).
    A size is captured for a query length while size x length <= max_tokens."""

    def __init__(self, sizes: tuple[int, ...], *, mode: str | None, query_lens: tuple[int, ...] = (1,),
                 max_tokens: int | None = None):
        self.mode = mode
        self.sizes = tuple(sorted(sizes)) if mode else ()
        self.by_query_len = {q: tuple(s for s in self.sizes if max_tokens is None or s * q <= max_tokens)
                             for q in query_lens} if mode else {}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._closures: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}   # emulated
        self._static: torch.Tensor | None = None   # emulated: the shared output every replay overwrites
        self._pool = None
        self.replays = 0   # graph steps run so far: a check that graphs ran counts these, not tokens
        self.replays_by_query_len: dict[int, int] = {}
        self.capture_s = 0.0   # what capture_all took: warm-ups (and their compiles) and captures

    @property
    def enabled(self) -> bool:
        return bool(self.sizes)

    @property
    def keys(self) -> list[tuple[int, int]]:
        """(size, query length) of every graph, most token rows first: the capture order."""
        return sorted(((s, q) for q, sizes in self.by_query_len.items() for s in sizes),
                      key=lambda k: (k[0] * k[1], k[1]), reverse=True)

    def size_for(self, num_reqs: int, query_len: int = 1) -> int | None:
        """The smallest size captured for `query_len` that holds `num_reqs` requests, or None (run eagerly)."""
        sizes = self.by_query_len.get(query_len, ())
        i = bisect.bisect_left(sizes, num_reqs)
        return sizes[i] if i < len(sizes) else None

    def capture_all(self, forward_for: Callable[[int, int], Callable[[], torch.Tensor]]) -> None:
        """Capture every graph, most token rows first; `forward_for(size, query_len)` prepares the
        persistent inputs of a dummy step of that shape and returns the forward to record (it returns
        the hidden states)."""
        start = time.perf_counter()
        for key in self.keys:
            forward = forward_for(*key)
            if self.mode == EMULATED:
                self._closures[key] = forward
                continue
            for _ in range(WARMUP_RUNS):   # compiles and autotunes outside the graph
                forward()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._outputs[key] = forward()
            self._pool = graph.pool()
            self._graphs[key] = graph
        self.capture_s = time.perf_counter() - start
        log.info("%s CUDA graphs for batch sizes %s in %.1f s", "emulated" if self.mode == EMULATED else "captured", "; ".join(
            f"{', '.join(map(str, sizes))} at {q} row(s) per request" for q, sizes in self.by_query_len.items()),
            self.capture_s)

    def replay(self, size: int, query_len: int = 1) -> torch.Tensor:
        """Run the graph of (`size`, `query_len`) on whatever its persistent inputs hold now; returns
        its hidden states, valid until the next replay."""
        key = (size, query_len)
        if self.mode == EMULATED:
            out = self._closures[key]()
            rows = max(s * q for s, q in self.keys)
            if self._static is None or self._static.shape[1:] != out.shape[1:] or self._static.dtype != out.dtype:
                self._static = torch.empty((rows, *out.shape[1:]), dtype=out.dtype, device=out.device)
            static = self._static[:out.shape[0]]
            static.copy_(out)
        else:
            self._graphs[key].replay()
            static = self._outputs[key]
        self.replays += 1
        self.replays_by_query_len[query_len] = self.replays_by_query_len.get(query_len, 0) + 1
        return static
