"""CUDA graphs for decode-only steps: one captured model forward per batch size of a capture set.

Why: a decode step runs a handful of small kernels per layer, and on a GPU the Python and launch
cost of issuing them is most of its time. Replaying a graph issues the whole forward at once.

The design (vLLM v1's full graphs for uniform decode batches):
- Capture set (`capture_sizes`): 1, 2, 4, then every 8 up to max_num_seqs. A decode-only step of
  R requests (every request schedules one token, no frames) runs the graph of the smallest size
  >= R (`DecodeGraphs.size_for`), padded: rows past R are requests with no keys whose one token
  writes its K/V into the null block 0, so they change nothing. Prefill, mixed and larger steps
  run eagerly, and so does everything with `--enforce-eager`, on a CPU, or with a backend whose
  inputs change shape per step (SDPA's padded gathers).
- Inputs: a graph reads device memory at the addresses it was captured with, so every tensor the
  forward reads is a view of a persistent buffer at a fixed offset: the step-input builder's
  device buffers (ids, positions, query_start_loc, seq_lens, slot mapping) and the attention
  metadata builders' own (page tables, block masks), refilled in place each step. Python values a
  kernel launch bakes in are fixed per size: max_seqlen_q = 1, max_seqlen_k = max_model_len.
- Output: the hidden states [size, hidden] each graph wrote at capture live in the graph's
  memory pool; replay overwrites them. Logits and sampling run eagerly on the first R rows.
- Capture runs largest size first so every later (smaller) graph fits in the first one's memory
  pool, after warm-up forwards that compile kernels (FA4, torch.compile) outside the graph. If a
  capture fails (a layer that syncs with the host), the runner logs it and runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable

import torch

log = logging.getLogger(__name__)

WARMUP_RUNS = 2


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes decode graphs are captured for: 1, 2, 4, then every 8, and max_num_seqs itself."""
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs} | set(range(8, max_num_seqs + 1, 8)) | {max_num_seqs}
    return tuple(sorted(sizes))


def graphs_enabled(device_type: str, enforce_eager: bool, capturable: Iterable[bool]) -> bool:
    """Decode graphs run on CUDA, unless --enforce-eager, when every layer type's backend can be
    captured (its inputs are persistent buffers: FA4, flex; SDPA's padded gathers change shape)."""
    return device_type == "cuda" and not enforce_eager and all(capturable)


def is_decode_only(num_scheduled_tokens: list[int], has_frames: bool) -> bool:
    """A step a decode graph can run: every request schedules exactly one token and no frame is encoded."""
    return bool(num_scheduled_tokens) and not has_frames and all(n == 1 for n in num_scheduled_tokens)


class DecodeGraphs:
    """The captured decode forwards, by batch size; empty when disabled (CPU or --enforce-eager)."""

    def __init__(self, sizes: tuple[int, ...], *, enabled: bool):
        self.sizes = tuple(sorted(sizes)) if enabled else ()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool = None
        self.replays = 0   # graph steps run so far: a check that graphs ran counts these, not tokens

    @property
    def enabled(self) -> bool:
        return bool(self.sizes)

    def size_for(self, num_reqs: int) -> int | None:
        """The smallest captured size that holds `num_reqs` requests, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture_all(self, forward_for: Callable[[int], Callable[[], torch.Tensor]]) -> None:
        """Capture every size, largest first; `forward_for(size)` prepares the persistent inputs of a
        dummy decode step of that size and returns the forward to record (it returns the hidden states)."""
        for size in sorted(self.sizes, reverse=True):
            forward = forward_for(size)
            for _ in range(WARMUP_RUNS):   # compiles and autotunes outside the graph
                forward()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._outputs[size] = forward()
            self._pool = graph.pool()
            self._graphs[size] = graph
        log.info("captured decode CUDA graphs for batch sizes %s", ", ".join(map(str, self.sizes)))

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` on whatever its persistent inputs hold now; returns its hidden states."""
        self._graphs[size].replay()
        self.replays += 1
        return self._outputs[size]
