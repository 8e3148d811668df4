"""The drafter's K draft steps as one captured graph per batch-size bucket.

Why: a drafting round is K tiny forwards of the assistant (a few layers at one row per request),
each a few dozen kernels; run eagerly, their launch cost is most of the round's time on a GPU.
Captured once per bucket, a round is one replay.

The design follows the target's decode graphs (worker/cuda_graphs.py, whose `UniformStepGraphs`
captures and replays these too):
- Buckets: the target's capture sizes (1, 2, 4, then every 8 up to max_num_seqs). A round of R
  requests replays the smallest bucket >= R, padded with requests that read one key of the null
  block (their rows are never read back; no drafter row reads another's).
- Inputs: every tensor the K steps read is a persistent buffer at a fixed address: the round's
  tokens and hidden-state rows (copied in here), and TargetKVReader's positions, key counts and
  block tables (gathered from the runner's by row) with the backends' own metadata buffers,
  refilled in place by `prepare` before each replay (its new metadata objects are dropped: the
  graph reads the buffers the capture's objects view, as a CUDA graph reads addresses).
- Output: the [bucket, K] drafts, valid until the next replay; a round copies its rows out.
- Capture: every bucket at the first round that replays (the pools' shapes and the block size are
  known from then), most rows first, so later buckets fit the first one's memory pool.
Tensor parallelism: every rank captures and replays its own graphs over its shards, their
collectives inside (NCCL's are captured on CUDA; the emulation re-runs gloo's); every rank decides
a round's bucket and whether it replays from the same plain data, so the collectives pair up.
Rounds that run eagerly (`eager_reason`): rounds whose drafts a grammar masks (a host sync per
step), without graphs (--enforce-eager, a backend that cannot be captured, a CPU unless emulated),
and after a failed capture; each reason is logged once and counted (`eager_rounds`).

Emulated (`--emulate-cuda-graphs`, a CPU): each bucket's "graph" is the K-step closure built at
capture over the capture round's buffers and metadata objects, run again at replay: the same
captured-buffer discipline, checked without a GPU (tests/engine/test_engine_speculative.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from mmserve.worker.cuda_graphs import UniformStepGraphs, capture_sizes

logger = logging.getLogger(__name__)


class DraftGraphs:
    """One captured K-step draft loop per bucket. `loop(tokens, hidden, rope, target_kv)` runs the K
    steps and returns the drafts [R, K]."""

    def __init__(self, reader, assistant, loop: Callable, *, mode: str | None,
                 max_num_seqs: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.reader, self.assistant, self.loop = reader, assistant, loop
        self.dtype = dtype
        self.graphs = UniformStepGraphs(capture_sizes(max_num_seqs), mode=mode)
        self.tokens = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(max_num_seqs, hidden_size, dtype=dtype, device=device)
        self._captured = False
        self.failed: str | None = None
        self.eager_rounds = 0
        self._logged: set[str] = set()

    @property
    def replays(self) -> int:
        return self.graphs.replays

    def eager_reason(self, num_reqs: int, *, masked: bool) -> str | None:
        """Why a round of `num_reqs` requests runs eagerly, or None (it replays a graph)."""
        if not self.graphs.enabled:
            return "no graphs (enforce-eager, an uncapturable backend, or a CPU without emulation)"
        if self.failed is not None:
            return f"capture failed: {self.failed}"
        if masked:
            return "a grammar masks its drafts"
        if self.graphs.size_for(num_reqs) is None:
            return f"{num_reqs} requests: no bucket holds them (largest {self.graphs.sizes[-1]})"
        return None

    def count_eager(self, reason: str) -> None:
        """Note an eager round (visible: each reason is logged once)."""
        self.eager_rounds += 1
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("drafting rounds run eagerly: %s", reason)

    def _pad(self, size: int, num_keys, shift):
        """Padding requests read one key (the reader gives them the null block's table row)."""
        n = len(num_keys)
        num_keys = np.concatenate([np.asarray(num_keys, dtype=np.int64), np.ones(size - n, dtype=np.int64)])
        if shift is not None:
            shift = torch.cat([shift, shift.new_zeros(size - n)])
        return num_keys, shift

    def _capture(self, tables, block_size: int, kv_caches: list[torch.Tensor]) -> None:
        def forward_for(size: int, query_len: int):
            num_keys, _ = self._pad(size, [], None)
            target_kv = self.reader.prepare(num_keys, tables, np.empty(0, dtype=np.int64), block_size, kv_caches)
            tokens, hidden, positions = self.tokens[:size], self.hidden[:size], self.reader.positions.dev[:size]

            def forward() -> torch.Tensor:
                rope = self.assistant.rope(positions + 1, self.dtype)   # the drafted-from tokens' positions
                return self.loop(tokens, hidden, rope, target_kv)
            return forward
        self._captured = True
        try:
            self.graphs.capture_all(forward_for)
        except Exception as exc:   # e.g. a host sync in the drafter: its rounds run eagerly
            logger.warning("drafter graph capture failed; drafting runs eagerly", exc_info=True)
            self.failed = f"{type(exc).__name__}: {str(exc)[:200]}"

    def run(self, tokens: torch.Tensor, hidden: torch.Tensor, num_keys, tables, rows: np.ndarray,
            block_size: int, kv_caches: list[torch.Tensor], shift: torch.Tensor | None = None) -> torch.Tensor | None:
        """The round's drafts [R, K] from a replay, or None where the capture just failed (run it
        eagerly). `tokens` [R] and `hidden` [R, backbone hidden] are the drafted-from tokens and rows;
        `num_keys`, `tables` (the runner's BlockTables), `rows` and `shift` as TargetKVReader.prepare
        takes them."""
        if not self._captured:
            self._capture(tables, block_size, kv_caches)
            if self.failed is not None:
                return None
        n = len(num_keys)
        size = self.graphs.size_for(n)
        num_keys, shift = self._pad(size, num_keys, shift)
        self.reader.prepare(num_keys, tables, rows, block_size, kv_caches, shift=shift)   # refills the buffers in place
        self.tokens[:n].copy_(tokens)
        self.tokens[n:size].zero_()
        self.hidden[:n].copy_(hidden)
        self.hidden[n:size].zero_()
        return self.graphs.replay(size)[:n].clone()
