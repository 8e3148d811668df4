"""Per-step batch metadata in persistent buffers: the zero-allocation hot path.

Every buffer is allocated once, sized by max_num_batched_tokens (token rows) and max_num_seqs
(request rows): pinned CPU staging tensors written through numpy views, and device tensors that
receive one non-blocking copy per step. A step's `AttentionMetadata` objects are views of them.
On a CPU device the staging tensors are the device tensors, so nothing is copied.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.attention.backend import AttentionMetadata, LayerAttentionSpec
from mmserve.scheduler.kv_cache_manager import KVCacheManager
from mmserve.scheduler.output import ScheduledRequest


def fill_query_ranges(
    out: np.ndarray,
    query_start_loc: np.ndarray,
    context_lens: np.ndarray,
    ranges: Sequence[np.ndarray],
) -> int:
    """Write the mm_prefix query-range table: row i = inclusive absolute [start, end] of the range
    holding scheduled query token i, (-1, -1) outside. `ranges[r]` is request r's sorted [K, 2]
    ranges; `context_lens[r]` the absolute position of its first scheduled token. Ranges are
    clipped to the scheduled chunk; single-token ranges are skipped (their mask is causal anyway).
    Returns the number of rows written, or 0 without touching `out` when no scheduled token lies
    in a range, so the caller attaches no mask at all."""
    num_reqs = len(ranges)
    counts = [len(rg) for rg in ranges]
    if not any(counts):
        return 0
    # Every range of the batch at once: clip it to its request's scheduled chunk.
    all_ranges = np.concatenate(ranges)
    req = np.repeat(np.arange(num_reqs), counts)
    q0 = query_start_loc[:num_reqs].astype(np.int64)[req]
    ctx = context_lens[req]
    last = ctx + (query_start_loc[1:num_reqs + 1].astype(np.int64)[req] - q0) - 1
    first_pos = np.maximum(all_ranges[:, 0], ctx)
    last_pos = np.minimum(all_ranges[:, 1], last)
    hit = (all_ranges[:, 0] < all_ranges[:, 1]) & (first_pos <= last_pos)
    if not hit.any():
        return 0
    starts = (first_pos - ctx + q0)[hit]
    lengths = (last_pos - first_pos + 1)[hit]
    offsets = np.cumsum(lengths) - lengths
    rows = np.arange(int(lengths.sum())) + np.repeat(starts - offsets, lengths)
    num_tokens = int(query_start_loc[num_reqs])
    out[:num_tokens] = -1
    out[rows] = np.repeat(all_ranges[hit], lengths, axis=0)
    return num_tokens


@dataclass
class StepInputs:
    """Everything the model runner feeds the model for one step (views of persistent buffers)."""

    num_tokens: int
    input_ids: torch.Tensor            # int64 [T]
    positions: torch.Tensor            # int64 [T]
    attn_metadata: dict[str, AttentionMetadata]
    logits_indices: torch.Tensor       # int64 [S]: flat rows whose logits are sampled
    sampled: list[int]                 # which scheduled requests those rows belong to (index into the step)
    mm_token_index: torch.Tensor | None  # int64 [M]: rows that take this step's vision embeddings


class _Buf:
    """A staging tensor (pinned on CUDA), its numpy view, and the device tensor it is copied to."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        pin = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.dev = self.cpu if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)

    def push(self, n: int) -> torch.Tensor:
        """Copy the first n rows to the device; return the device view."""
        if self.dev is not self.cpu:
            self.dev[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.dev[:n]


class MetadataBuilder:
    def __init__(
        self,
        specs: dict[str, LayerAttentionSpec],
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device | str,
    ):
        device = torch.device(device)
        self.specs = specs
        self.block_size = block_size
        self.max_tokens = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.max_blocks = math.ceil(max_model_len / block_size)
        n, s = max_num_batched_tokens, max_num_seqs
        self.input_ids = _Buf((n,), torch.int64, device)
        self.positions = _Buf((n,), torch.int64, device)
        self.query_start_loc = _Buf((s + 1,), torch.int32, device)
        self.seq_lens = _Buf((s,), torch.int32, device)
        self.logits_indices = _Buf((s,), torch.int64, device)
        self.mm_token_index = _Buf((n,), torch.int64, device)
        self.mm_ranges = _Buf((n, 2), torch.int32, device)
        self.slot_mapping = {t: _Buf((n,), torch.int64, device) for t in specs}
        self.block_table = {t: _Buf((s, self.max_blocks), torch.int32, device) for t in specs}
        self.mm_ranges.np.fill(-1)
        self._any_bidirectional = any(spec.bidirectional for spec in specs.values())
        self._high_water = 0     # token rows the last step used; rows past this step's are reset

    def build(self, scheduled: Sequence[ScheduledRequest], kv: KVCacheManager) -> StepInputs:
        num_reqs = len(scheduled)
        if not 0 < num_reqs <= self.max_seqs:
            raise ValueError(f"{num_reqs} scheduled requests (1..{self.max_seqs} allowed)")
        bs = self.block_size
        lens = np.fromiter((s.num_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
        ctx = np.fromiter((s.context_len for s in scheduled), dtype=np.int64, count=num_reqs)
        qsl = self.query_start_loc.np
        qsl[0] = 0
        np.cumsum(lens, out=qsl[1:num_reqs + 1])
        num_tokens = int(qsl[num_reqs])
        if num_tokens > self.max_tokens:
            raise ValueError(f"{num_tokens} scheduled tokens exceed the buffers ({self.max_tokens})")
        self.seq_lens.np[:num_reqs] = ctx + lens

        req_of_token = np.repeat(np.arange(num_reqs), lens)
        positions = np.arange(num_tokens) - qsl[req_of_token] + ctx[req_of_token]
        self.positions.np[:num_tokens] = positions

        ids = self.input_ids.np
        sampled: list[int] = []
        for i, s in enumerate(scheduled):
            ids[qsl[i]:qsl[i + 1]] = s.request.token_ids_slice(s.context_len, s.context_len + s.num_tokens)
            if s.samples:
                sampled.append(i)
        self.logits_indices.np[:len(sampled)] = qsl[1:num_reqs + 1][sampled] - 1

        if kv.max_blocks_per_req != self.max_blocks:
            raise ValueError(f"KV tables are {kv.max_blocks_per_req} blocks wide, the builder's {self.max_blocks}")
        rows = np.fromiter((kv.row_of(s.request.request_id) for s in scheduled), dtype=np.int64, count=num_reqs)
        block_of_pos = positions // bs
        offset_in_block = positions % bs
        for t in self.specs:
            table = self.block_table[t].np
            np.take(kv.table_rows[t], rows, axis=0, out=table[:num_reqs])
            self.slot_mapping[t].np[:num_tokens] = table[req_of_token, block_of_pos] * bs + offset_in_block

        ranges_rows = 0
        if self._any_bidirectional:   # models without bidirectional layers never need the table
            ranges_rows = fill_query_ranges(
                self.mm_ranges.np, qsl, ctx, [s.request.mm_ranges_np for s in scheduled])
        if ranges_rows == 0 and self._high_water:
            self.mm_ranges.np[:self._high_water] = -1
        elif num_tokens < self._high_water:
            self.mm_ranges.np[num_tokens:self._high_water] = -1
        self._high_water = ranges_rows

        mm_rows = self._fill_mm_token_index(scheduled, qsl)

        input_ids = self.input_ids.push(num_tokens)
        pos_dev = self.positions.push(num_tokens)
        qsl_dev = self.query_start_loc.push(num_reqs + 1)
        seq_lens_dev = self.seq_lens.push(num_reqs)
        logits_indices = self.logits_indices.push(len(sampled))
        mm_ranges = self.mm_ranges.push(num_tokens) if ranges_rows else None
        mm_token_index = self.mm_token_index.push(mm_rows) if mm_rows else None
        max_query_len = int(lens.max())
        max_seq_len = int((ctx + lens).max())
        metadata = {}
        for t, spec in self.specs.items():
            metadata[t] = AttentionMetadata(
                num_actual_tokens=num_tokens,
                num_reqs=num_reqs,
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                query_start_loc=qsl_dev,
                seq_lens=seq_lens_dev,
                positions=pos_dev,
                block_table=self.block_table[t].push(num_reqs),
                slot_mapping=self.slot_mapping[t].push(num_tokens),
                block_size=bs,
                mm_ranges=mm_ranges if spec.bidirectional else None,
                query_start_loc_cpu=self.query_start_loc.cpu[:num_reqs + 1],
                seq_lens_cpu=self.seq_lens.cpu[:num_reqs],
            )
        return StepInputs(num_tokens, input_ids, pos_dev, metadata, logits_indices, sampled, mm_token_index)

    def _fill_mm_token_index(self, scheduled: Sequence[ScheduledRequest], qsl: np.ndarray) -> int:
        """Flat rows of the frames encoded this step, in (request, frame) order: the order the
        runner concatenates their embeddings in."""
        starts, lengths = [], []
        for i, s in enumerate(scheduled):
            if s.frames:
                sel = s.request.mm_ranges_np[s.frames]
                starts.append(sel[:, 0] - s.context_len + qsl[i])
                lengths.append(sel[:, 1] - sel[:, 0] + 1)
        if not starts:
            return 0
        st, ln = np.concatenate(starts), np.concatenate(lengths)
        total = int(ln.sum())
        offsets = np.cumsum(ln) - ln
        self.mm_token_index.np[:total] = np.arange(total) + np.repeat(st - offsets, ln)
        return total
