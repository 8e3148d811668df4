"""Per-step model inputs in persistent buffers, owned by the model runner: the zero-allocation hot path.

Every buffer is allocated once, sized by the largest token budget (token rows) and max_num_seqs
(request rows): pinned CPU staging tensors written through numpy views, and device tensors that
receive one non-blocking copy per step (attention/buffers.py). A step's
`CommonAttentionMetadata` objects (one per KV pool) are views of them; each attention backend's
metadata builder then prepares its own per-step state from those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.attention.backend import CommonAttentionMetadata, LayerAttentionSpec
from mmserve.attention.buffers import StagedBuffer
from mmserve.core.sched.output import DEVICE_DRAFT, ScheduledRequest
from mmserve.worker.block_table import BlockTables


def fill_query_ranges(
    out: np.ndarray,
    query_start_loc: np.ndarray,
    num_computed: np.ndarray,
    ranges: Sequence[np.ndarray],
) -> int:
    """Write the per-token range table: row i = inclusive absolute [start, end] of the range holding
    scheduled query token i, (-1, -1) outside. `ranges[r]` is request r's sorted [K, 2] ranges;
    `num_computed[r]` the absolute position of its first scheduled token. Ranges are clipped to the
    scheduled chunk; single-token ranges are skipped (their mask is causal anyway). Returns the
    number of rows written, or 0 without touching `out` when no scheduled token lies in a range,
    so the caller attaches no table at all."""
    num_reqs = len(ranges)
    counts = [len(rg) for rg in ranges]
    if not any(counts):
        return 0
    # Every range of the batch at once: clip it to its request's scheduled chunk.
    all_ranges = np.concatenate(ranges)
    req = np.repeat(np.arange(num_reqs), counts)
    q0 = query_start_loc[:num_reqs].astype(np.int64)[req]
    first_q = num_computed[req]
    last = first_q + (query_start_loc[1:num_reqs + 1].astype(np.int64)[req] - q0) - 1
    first_pos = np.maximum(all_ranges[:, 0], first_q)
    last_pos = np.minimum(all_ranges[:, 1], last)
    hit = (all_ranges[:, 0] < all_ranges[:, 1]) & (first_pos <= last_pos)
    if not hit.any():
        return 0
    starts = (first_pos - first_q + q0)[hit]
    lengths = (last_pos - first_pos + 1)[hit]
    offsets = np.cumsum(lengths) - lengths
    rows = np.arange(int(lengths.sum())) + np.repeat(starts - offsets, lengths)
    num_tokens = int(query_start_loc[num_reqs])
    out[:num_tokens] = -1
    out[rows] = np.repeat(all_ranges[hit], lengths, axis=0)
    return num_tokens


@dataclass
class PrevStep:
    """The step in flight as the next step's inputs see it (async scheduling): each request's row
    of that step's next inputs on the device (`width` ids a row: the token after its kept rows,
    then, with speculation, the drafts made after it), and `host_shift` (per row: positions the
    host counted as kept that the device's acceptance rolled back) when this step's positions must
    be exact on the host; None: they are moved back on the device (`StepInputBuilder.shift_on_device`)."""

    rows: dict[str, int]
    width: int = 1
    host_shift: np.ndarray | None = None


@dataclass
class ShiftedRows:
    """The rows of a step's requests whose last input is in flight (device tensors): their positions,
    context lengths and slots move back by their request's shift, known on the device only."""

    token_rows: torch.Tensor   # [m] rows of the step
    token_of: torch.Tensor     # [m] each row's entry in `reqs`
    reqs: torch.Tensor         # [k] the requests (index into the step)
    src: torch.Tensor          # [k] their rows of the step in flight


@dataclass
class StepInputs:
    """Everything the model runner feeds the model for one step (views of persistent buffers)."""

    num_tokens: int
    input_ids: torch.Tensor            # int64 [T] (a piecewise step: [bucket], padding rows past T)
    positions: torch.Tensor            # int64 [T] (likewise)
    common: dict[str, CommonAttentionMetadata]   # per KV pool (layer type)
    logits_indices: torch.Tensor       # int64 [L]: flat rows whose logits are sampled, 1 + drafts per sampled request
                                       # (a verify chunk's pad positions are not)
    sampling_index: np.ndarray         # int64 [S]: the scheduled requests that sample (index into the step)
    mm_token_index: torch.Tensor | None  # int64 [M]: rows that take this step's vision embeddings
    # async scheduling: (rows of input_ids, flat indices into the step in flight's next inputs) to copy on the device
    prev_token: tuple[torch.Tensor, torch.Tensor] | None = None
    shifted: ShiftedRows | None = None   # async speculation: rows whose positions move back on the device


class StepInputBuilder:
    def __init__(
        self,
        specs: dict[str, LayerAttentionSpec],
        *,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_req: int,
        block_size: int,
        device: torch.device | str,
    ):
        device = torch.device(device)
        self.specs = specs
        self.block_size = block_size
        self.max_tokens = max_num_tokens
        self.max_seqs = max_num_seqs
        self.max_blocks = max_blocks_per_req
        n, s = max_num_tokens, max_num_seqs
        self.input_ids = StagedBuffer((n,), torch.int64, device)
        self.positions = StagedBuffer((n,), torch.int64, device)
        self.query_start_loc = StagedBuffer((s + 1,), torch.int32, device)
        self.seq_lens = StagedBuffer((s,), torch.int32, device)
        self.logits_indices = StagedBuffer((max(n, s),), torch.int64, device)   # a verify step samples 1 + K rows each
        self.mm_token_index = StagedBuffer((n,), torch.int64, device)
        self.query_ranges = StagedBuffer((n, 2), torch.int32, device)
        self.row_index = StagedBuffer((s,), torch.int64, device)   # the scheduled requests' rows of BlockTables
        self.prev_token_dst = StagedBuffer((n,), torch.int64, device)   # the token in flight and the device's drafts
        self.prev_token_src = StagedBuffer((n,), torch.int64, device)
        self.shift_rows = StagedBuffer((n,), torch.int64, device)
        self.shift_of = StagedBuffer((n,), torch.int64, device)
        self.shift_reqs = StagedBuffer((s,), torch.int64, device)
        self.shift_src = StagedBuffer((s,), torch.int64, device)
        self.slot_mapping = {t: StagedBuffer((n,), torch.int64, device) for t in specs}
        # every pool's table as wide as max_blocks: the step's slots index them all by one flat entry
        self.block_table = {t: StagedBuffer((s, self.max_blocks), torch.int32, device) for t in specs}
        self.query_ranges.np.fill(-1)
        self._any_bidirectional = any(spec.bidirectional for spec in specs.values())
        self._high_water = 0     # token rows the last step used; rows past this step's are reset

    def buffers(self) -> list[StagedBuffer]:
        return [self.input_ids, self.positions, self.query_start_loc, self.seq_lens, self.logits_indices,
                self.mm_token_index, self.query_ranges, self.row_index, self.prev_token_dst, self.prev_token_src,
                self.shift_rows, self.shift_of, self.shift_reqs, self.shift_src,
                *self.slot_mapping.values(), *self.block_table.values()]

    def build(self, scheduled: Sequence[ScheduledRequest], block_tables: dict[str, np.ndarray],
              rows: np.ndarray, *, pad_to: int | None = None, query_len: int = 1,
              pad_tokens_to: int | None = None, prev: PrevStep | None = None,
              gather_from: BlockTables | None = None) -> StepInputs:
        """`block_tables[pool][rows[i]]` is scheduled request i's table (the runner's BlockTables).

        `pad_to` (uniform steps of `query_len` tokens per request, run as a CUDA graph of that many
        requests): the step is padded with requests of `query_len` tokens that live in the null
        block alone (`_pad`). `pad_tokens_to` (a piecewise graph's bucket): `input_ids`, `positions`
        and the slot mappings' device buffers cover that many rows, the rows past the step's tokens
        id 0 at position 0, their K/V slot the null block's slot 0 (the dense pieces write every
        row's K/V; padding rows all compute the same finite values, `PiecewiseGraphs`); the attention
        metadata keeps the step's own tokens (padding rows never enter attention). `prev` (async
        scheduling): the step in flight; a request whose last input it samples gets id 0 there (and
        at its `DEVICE_DRAFT` drafts), `StepInputs.prev_token` says where the runner copies them from
        on the device, and `StepInputs.shifted` which rows it moves back there (or, with
        `prev.host_shift`, they are built at their place). `gather_from` (the runner's `BlockTables`, whose
        device tables mirror `block_tables`): the step's device block tables are gathered there, not
        copied from the host at the tables' full width."""
        num_reqs = len(scheduled)
        if not (0 < num_reqs or pad_to) or num_reqs > (pad_to or self.max_seqs):
            raise ValueError(f"{num_reqs} scheduled requests (1..{pad_to or self.max_seqs} allowed)")
        bs = self.block_size
        # one Python pass over the requests; everything after it is numpy over the batch
        host_drafts: list[int] = []   # requests whose drafts the host knows (their ids are written here)
        device_drafted = np.zeros(num_reqs, dtype=bool)   # drafts made on the device (ids copied in there)
        rows_of: list[int] = []   # 7 fields per request, flat (one numpy conversion)
        for i, s in enumerate(scheduled):
            request, draft = s.request, s.draft_token_ids
            if draft:
                if draft[0] == DEVICE_DRAFT:
                    device_drafted[i] = True
                else:
                    host_drafts.append(i)
            prompt = len(request.prompt_token_ids)
            rows_of += (s.num_tokens, s.num_computed_tokens, len(draft), s.num_pad_drafts,
                        prompt + len(request.output_token_ids), bool(request.open_prompt), prompt)
        fields = np.array(rows_of, dtype=np.int64).reshape(num_reqs, 7)
        lens, computed, drafts, pads, known = (fields[:, j] for j in range(5))
        # media (ranges, frames) lies in the prompt: a step whose chunks all start past it (steady
        # decode) has none to place
        in_prompt = bool((computed < fields[:, 6]).any())
        computed = computed.copy()   # moved back below where the step in flight's acceptance says so
        # a chunk's own tokens (not drafts or pads) past what the host knows: its last, sampled by the step in flight
        in_flight = np.flatnonzero(computed + lens - drafts - pads > known)
        src = in_flight
        if len(in_flight):
            prev_rows = prev.rows if prev is not None else {}
            src = np.array([prev_rows.get(scheduled[i].request.request_id, -1) for i in in_flight.tolist()],
                           dtype=np.int64)
            if (missing := np.flatnonzero(src < 0)).size:
                i = int(in_flight[missing[0]])
                raise ValueError(f"request {scheduled[i].request.request_id}: an input token not sampled yet")
        if len(in_flight) and prev.host_shift is not None:   # built at the positions the device's acceptance left
            computed[in_flight] -= prev.host_shift[src]
        qsl = self.query_start_loc.np
        qsl[0] = 0
        np.cumsum(lens, out=qsl[1:num_reqs + 1])
        num_tokens = int(qsl[num_reqs])
        if num_tokens > self.max_tokens:
            raise ValueError(f"{num_tokens} scheduled tokens exceed the buffers ({self.max_tokens})")
        seq_lens = computed + lens
        self.seq_lens.np[:num_reqs] = seq_lens

        req_of_token = np.repeat(np.arange(num_reqs), lens)
        positions = self.positions.np[:num_tokens]
        np.subtract(np.arange(num_tokens), qsl[req_of_token] - computed[req_of_token], out=positions)

        # input ids: 0 wherever the host does not know the token (the one in flight, the device's drafts,
        # pads), then each request's known tokens and host-known drafts written over it
        starts = qsl[:num_reqs].astype(np.int64)
        real_end = starts + lens - pads
        own = real_end - drafts
        have = np.maximum(starts, np.minimum(own, starts + known - computed))   # rows the host knows
        if (unknown := np.flatnonzero(own - have > 1)).size:   # only the last input may be in flight (from the device)
            i = int(unknown[0])
            raise ValueError(f"request {scheduled[i].request.request_id}: {int(own[i] - have[i])} input tokens "
                             "not sampled yet")
        ids = self.input_ids.np
        ids[:num_tokens] = 0
        num_known = have - starts   # async decodes have none: their one input is in flight
        if (single := np.flatnonzero(num_known == 1)).size:   # one known input (a decode): one write for all
            ids[starts[single]] = [scheduled[i].request.token_at(c)
                                   for i, c in zip(single.tolist(), computed[single].tolist(), strict=True)]
        known_rows = np.flatnonzero(num_known > 1)
        for i, a, b, c in zip(known_rows.tolist(), starts[known_rows].tolist(), have[known_rows].tolist(),
                              computed[known_rows].tolist(), strict=True):
            ids[a:b] = scheduled[i].request.token_ids_slice(c, c + b - a)
        for i in host_drafts:
            ids[int(own[i]):int(real_end[i])] = scheduled[i].draft_token_ids
        num_copied = self._fill_in_flight(scheduled, in_flight, src, own, np.where(device_drafted, drafts, 0),
                                          prev.width if prev is not None else 1)
        # the total a sampling chunk reaches (> it with its last input in flight, async); an open
        # prompt (a live context) never samples
        totals = known + drafts + pads
        samples = (seq_lens >= totals) & (fields[:, 5] == 0)
        sampling_index = np.flatnonzero(samples)
        num_rows = 1 + drafts[sampling_index]
        ends = qsl[1:num_reqs + 1][sampling_index] - pads[sampling_index]   # pad rows are never sampled
        num_logits = int(num_rows.sum())
        # request j's rows end at ends[j] and fill flat slots up to cumsum(num_rows)[j]: one shift per request
        self.logits_indices.np[:num_logits] = np.arange(num_logits) + np.repeat(ends - np.cumsum(num_rows), num_rows)

        # each token's entry of its request's table row, as a flat index into the [num_reqs, max_blocks] tables
        entry = req_of_token * self.max_blocks + positions // bs
        offset_in_block = positions % bs
        for t in self.specs:
            table = self.block_table[t].np
            np.take(block_tables[t], rows, axis=0, out=table[:num_reqs])
            slots = self.slot_mapping[t].np[:num_tokens]
            np.multiply(table.reshape(-1)[entry], bs, out=slots)
            slots += offset_in_block

        ranges_rows = 0
        if self._any_bidirectional and in_prompt:   # models without bidirectional layers never need the table
            ranges_rows = fill_query_ranges(
                self.query_ranges.np, qsl, computed, [s.request.vision_ranges_np for s in scheduled])
        if ranges_rows == 0 and self._high_water:
            self.query_ranges.np[:self._high_water] = -1
        elif num_tokens < self._high_water:
            self.query_ranges.np[num_tokens:self._high_water] = -1
        self._high_water = ranges_rows

        mm_rows = self._fill_mm_token_index(scheduled, qsl) if in_prompt else 0
        max_query_len, max_seq_len = int(lens.max(initial=1)), int(seq_lens.max(initial=1))
        if pad_to is not None:   # a graph bakes max_query_len in: the capture's all-padding step has it too
            self._pad(num_reqs, num_tokens, pad_to, query_len, ranges_rows > 0)
            num_reqs, num_tokens, max_query_len = pad_to, pad_to * query_len, query_len
            max_seq_len = max(max_seq_len, query_len)

        dense_rows = num_tokens
        if pad_tokens_to is not None:
            if pad_tokens_to > self.max_tokens or pad_tokens_to < num_tokens:
                raise ValueError(f"{num_tokens} tokens cannot be padded to {pad_tokens_to} rows")
            self.input_ids.np[num_tokens:pad_tokens_to] = 0
            self.positions.np[num_tokens:pad_tokens_to] = 0
            for t in self.specs:   # a piece writes every row's K/V: padding rows' to the null block's slot 0
                self.slot_mapping[t].np[num_tokens:pad_tokens_to] = 0
            dense_rows = pad_tokens_to
        device_tables = gather_from is not None and self.row_index.dev is not self.row_index.cpu
        if device_tables:
            self.row_index.np[:len(scheduled)] = rows
            rows_dev = self.row_index.push(len(scheduled))
        input_ids = self.input_ids.push(dense_rows)
        pos_dev = self.positions.push(dense_rows)
        qsl_dev = self.query_start_loc.push(num_reqs + 1)
        seq_lens_dev = self.seq_lens.push(num_reqs)
        logits_indices = self.logits_indices.push(num_logits)
        prev_token = (self.prev_token_dst.push(num_copied), self.prev_token_src.push(num_copied)) if num_copied else None
        shifted = None
        if len(in_flight) and prev.host_shift is None and prev.width > 1:   # moved back on the device (speculation)
            shifted = self._shifted_rows(in_flight, src, lens)
        query_ranges = self.query_ranges.push(num_tokens) if ranges_rows else None
        mm_token_index = self.mm_token_index.push(mm_rows) if mm_rows else None
        common = {}
        qsl_cpu, seq_lens_cpu = self.query_start_loc.cpu[:num_reqs + 1], self.seq_lens.cpu[:num_reqs]   # shared by the pools
        positions_cpu, positions_dev = self.positions.cpu[:num_tokens], pos_dev[:num_tokens]
        query_ranges_cpu = self.query_ranges.cpu[:num_tokens] if query_ranges is not None else None
        for t, spec in self.specs.items():
            with_ranges = query_ranges is not None and spec.bidirectional
            if device_tables:   # gathered on the device; padding rows (a graph's) all null block
                gather_from.gather(t, rows_dev, self.block_table[t].dev[:len(scheduled)])
                self.block_table[t].dev[len(scheduled):num_reqs].zero_()
                table_dev = self.block_table[t].dev[:num_reqs]
            else:
                table_dev = self.block_table[t].push(num_reqs)
            slot_mapping = self.slot_mapping[t].push(dense_rows)
            common[t] = CommonAttentionMetadata(
                num_actual_tokens=num_tokens, num_reqs=num_reqs, max_query_len=max_query_len,
                max_seq_len=max_seq_len, query_start_loc=qsl_dev, seq_lens=seq_lens_dev, positions=positions_dev,
                block_table=table_dev, slot_mapping=slot_mapping[:num_tokens] if dense_rows != num_tokens else slot_mapping,
                block_size=bs, query_ranges=query_ranges if with_ranges else None,
                query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu,
                positions_cpu=positions_cpu, block_table_cpu=self.block_table[t].cpu[:num_reqs],
                query_ranges_cpu=query_ranges_cpu if with_ranges else None)
        return StepInputs(num_tokens, input_ids, pos_dev, common, logits_indices, sampling_index, mm_token_index,
                          prev_token, shifted)

    def _fill_in_flight(self, scheduled: Sequence[ScheduledRequest], in_flight: np.ndarray, src: np.ndarray,
                        own: np.ndarray, device_drafts: np.ndarray, width: int) -> int:
        """Where the in-flight requests' last input (and their `DEVICE_DRAFT` drafts) come from: rows
        of input_ids, and flat indices into the step in flight's [rows, width] next inputs. `own`:
        per request, the end of its own tokens (before drafts and pads); `device_drafts`: per
        request, its drafts the device made."""
        if not device_drafts.any():   # no drafts made on the device (no speculation): one id each
            k = len(in_flight)
            self.prev_token_dst.np[:k] = own[in_flight] - 1
            np.multiply(src, width, out=self.prev_token_src.np[:k])
            return k
        counts = 1 + device_drafts[in_flight]
        if len(in_flight) and (too_many := np.flatnonzero(counts > width)).size:
            i = int(in_flight[too_many[0]])
            raise ValueError(f"request {scheduled[i].request.request_id}: {int(device_drafts[i])} drafts, "
                             f"{width - 1} made on the device")
        n = int(counts.sum())
        within = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)   # 0.. count-1 per request
        self.prev_token_dst.np[:n] = np.repeat(own[in_flight] - 1, counts) + within
        self.prev_token_src.np[:n] = np.repeat(src * width, counts) + within
        return n

    def _shifted_rows(self, in_flight: np.ndarray, src: np.ndarray, lens: np.ndarray) -> ShiftedRows:
        """The in-flight requests' rows, for `shift_on_device`."""
        qsl = self.query_start_loc.np
        counts = lens[in_flight]
        m, k = int(counts.sum()), len(in_flight)
        starts = qsl[in_flight].astype(np.int64)
        self.shift_rows.np[:m] = np.arange(m) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
        self.shift_of.np[:m] = np.repeat(np.arange(k), counts)
        self.shift_reqs.np[:k] = in_flight
        self.shift_src.np[:k] = src
        return ShiftedRows(self.shift_rows.push(m), self.shift_of.push(m), self.shift_reqs.push(k), self.shift_src.push(k))

    def shift_on_device(self, rows: ShiftedRows, shift: torch.Tensor) -> None:
        """Move the rows back by their request's `shift` (the step in flight's, on the device): their
        positions, their requests' context lengths, and their K/V slots (from the device's block
        tables). Queued after the step's copies; every later reader of these buffers sees it."""
        by_req = shift.index_select(0, rows.src)
        positions = self.positions.dev.index_select(0, rows.token_rows) - by_req.index_select(0, rows.token_of)
        self.positions.dev.index_copy_(0, rows.token_rows, positions)
        lens = self.seq_lens.dev.index_select(0, rows.reqs) - by_req.to(self.seq_lens.dev.dtype)
        self.seq_lens.dev.index_copy_(0, rows.reqs, lens)
        req = rows.reqs.index_select(0, rows.token_of)
        bs = self.block_size
        for t in self.specs:
            blocks = self.block_table[t].dev[req, positions // bs].long()
            self.slot_mapping[t].dev.index_copy_(0, rows.token_rows, blocks * bs + positions % bs)

    def _pad(self, num_reqs: int, num_tokens: int, size: int, query_len: int, with_ranges: bool) -> None:
        """Requests num_reqs..size-1 become padding (uniform steps only: every real request schedules
        `query_len` tokens): token id 0 at positions 0..q-1, an all-null table, and each token at the
        slot its position names in the null block 0 (slot p). Every padding request so computes the
        same rows and writes the same K/V to the same slots, and attends over exactly the q keys it
        has just written: it reads nothing a real request or an earlier step left in block 0, and
        duplicate writes (index_copy_ is unordered on CUDA) all carry the same bits. What padding
        leaves in block 0 is therefore finite and step-independent. Real rows load block 0 only where
        a freed sliding-window entry lies in a kernel tile, and never see padding: the KV manager
        frees only keys before the window of every row a request can run next (a row the async loop
        moves back included: KVCacheManager._lowest_query), which a window mask weighs by 0 (FA4's
        built-in local path masks by position alone; split-KV, flex and the CPU backends also leave
        out block 0). tests/engine/test_cuda_graphs.py fills every buffer with NaN to check it."""
        if num_tokens != num_reqs * query_len:
            raise ValueError(f"only uniform steps ({query_len} token(s) per request) are padded")
        if query_len > self.block_size:
            raise ValueError(f"padding of {query_len} tokens per request needs a block size >= {query_len}")
        end = size * query_len
        if end > self.max_tokens:
            raise ValueError(f"a padded step of {end} tokens exceeds the buffers ({self.max_tokens})")
        pads = size - num_reqs
        positions = np.tile(np.arange(query_len), pads)
        self.query_start_loc.np[num_reqs + 1: size + 1] = num_tokens + query_len * np.arange(1, pads + 1)
        self.seq_lens.np[num_reqs:size] = query_len
        self.positions.np[num_tokens:end] = positions
        self.input_ids.np[num_tokens:end] = 0
        if with_ranges:
            self.query_ranges.np[num_tokens:end] = -1
        for t in self.specs:
            self.block_table[t].np[num_reqs:size] = 0
            self.slot_mapping[t].np[num_tokens:end] = positions   # block 0, offset p

    def _fill_mm_token_index(self, scheduled: Sequence[ScheduledRequest], qsl: np.ndarray) -> int:
        """Flat rows of the frames encoded this step, in (request, frame) order: the order the
        runner concatenates their embeddings in. A range is clipped to its request's chunk (an audio
        segment split between chunks; images and frames lie wholly inside)."""
        starts, lengths = [], []
        for i, s in enumerate(scheduled):
            if s.frames:
                sel = s.request.mm_ranges_np[s.frames]
                first = np.maximum(sel[:, 0], s.num_computed_tokens)
                last = np.minimum(sel[:, 1], s.seq_len - 1)
                starts.append(first - s.num_computed_tokens + qsl[i])
                lengths.append(last - first + 1)
        if not starts:
            return 0
        st, ln = np.concatenate(starts), np.concatenate(lengths)
        total = int(ln.sum())
        offsets = np.cumsum(ln) - ln
        self.mm_token_index.np[:total] = np.arange(total) + np.repeat(st - offsets, ln)
        return total
