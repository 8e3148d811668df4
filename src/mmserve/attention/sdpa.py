"""torch SDPA over gathered windowed page tables: one padded call per group of requests, or one per request.

The builder (once per step per layer type) computes the windowed page tables (page_tables.py),
splits the requests into decode rows (one query each) and prefill chunks, and for each group
chooses one padded call ("batched") or a call per request ("loop"), whichever costs less work:
padding every request to the group's longest query and key span against a fixed overhead per
call. Very long mixed contexts are where the loop wins. It then prepares the gather indices and an
additive float mask built vectorised from mask.keep over the range table, in persistent buffers.

The impl (per layer) writes this step's K/V, gathers each group's blocks from the cache and makes
one SDPA call per group. GQA is packed: the g query heads that share a KV head become g query rows
of one head, so K/V are never repeated and the CPU flash kernel runs (a 3-D mask would send SDPA to
its math fallback; enable_gqa re-reads K/V per query head). A decode row outside any range needs
no mask in the per-request form: its keys are exactly the sliced window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from mmserve.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    LayerAttentionSpec,
    PoolConfig,
)
from mmserve.attention.buffers import StagedWorkspace
from mmserve.attention.mask import keep_into
from mmserve.attention.page_tables import WindowedTables, first_kept_keys, windowed_tables
from mmserve.attention.paged import write_kv
from mmserve.config import SDPA_BATCHING_CHOICES

# The plan's cost model, in units of work: query rows x gathered keys x heads x head_dim. One more
# SDPA call (gathers, views, dispatch) costs about CALL_OVERHEAD units. A padded call of decode rows
# does each unit about DECODE_BATCH_FACTOR times slower than per-request calls (one large gather
# leaves the cache before the kernel reads it); padded prefill work costs what it is. Fitted to
# bench/attention.py's "batching" table on CPU (demo, 55M and Gemma 4 head shapes).
CALL_OVERHEAD = 100_000
DECODE_BATCH_FACTOR = 1.5
NO_KEY = 2**62   # absolute position given to padding keys, so mask.keep drops them by its own rule


@dataclass
class SdpaGroup:
    """Requests attended by one SDPA call: num_reqs requests padded to q_len rows and num_blocks blocks."""

    num_reqs: int
    q_len: int
    num_blocks: int
    token_rows: slice | torch.Tensor     # the step's rows this group computes (int64 [T_g] or a slice)
    q_index: torch.Tensor | None         # int64 [R * q_len]: row of q per padded row; None: token_rows in order
    out_index: torch.Tensor | None       # int64 [T_g]: padded row of each token row; None: the identity
    kv_blocks: torch.Tensor              # int64 [R * num_blocks]: physical blocks gathered
    key_slice: slice                     # gathered keys attended (a lone decode row drops the window's head)
    mask: torch.Tensor | None            # additive [R, 1, g * q_len (1 for decode), keys]; None: keep all
    k_buf: torch.Tensor                  # gather destinations [R * num_blocks, block_size, Hkv, D]
    v_buf: torch.Tensor


@dataclass
class SdpaMetadata:
    common: CommonAttentionMetadata
    groups: list[SdpaGroup]


class SdpaMetadataBuilder:
    """Plans each step's SDPA calls for one layer type; `mode` forces "batched" or "loop" (tests, bench)."""

    def __init__(self, pool: PoolConfig, mode: str | None = None) -> None:
        mode = mode or pool.sdpa_batching
        if mode not in SDPA_BATCHING_CHOICES:
            raise ValueError(f"--sdpa-batching {mode!r}: choose from {', '.join(SDPA_BATCHING_CHOICES)}")
        self.pool, self.spec, self.mode = pool, pool.spec, mode
        self.group_size = pool.spec.num_heads // pool.spec.num_kv_heads
        self.ws = StagedWorkspace(pool.device)
        self.tables = np.zeros((pool.max_num_reqs, pool.max_blocks_per_req), dtype=np.int32)

    def build(self, common: CommonAttentionMetadata) -> SdpaMetadata:
        R, T = common.num_reqs, common.num_actual_tokens
        qsl = common.query_start_loc_cpu.numpy()[: R + 1].astype(np.int64)
        seq_lens = common.seq_lens_cpu.numpy()[:R].astype(np.int64)
        ranges = None
        if common.query_ranges_cpu is not None and self.spec.bidirectional:
            ranges = common.query_ranges_cpu.numpy()[:T].astype(np.int64)
        starts = None if ranges is None else ranges[:, 0]
        tables = windowed_tables(self.spec, common.block_size, qsl, seq_lens, common.block_table_cpu.numpy(),
                                 starts, self.tables)
        step = _HostStep(qsl, np.diff(qsl), common.positions_cpu.numpy()[:T], ranges, tables,
                         first_kept_keys(self.spec, qsl, seq_lens, starts))
        calls: list[np.ndarray] = []
        lone: np.ndarray = np.zeros(0, dtype=np.int64)   # decode rows in no range, attended one by one
        for members in (np.flatnonzero(step.q_lens == 1), np.flatnonzero(step.q_lens > 1)):
            if not len(members):
                continue
            groups = self._partition(members, step)
            calls += [g for g in groups if len(g) > 1]
            single = np.array([g[0] for g in groups if len(g) == 1], dtype=np.int64)
            if step.q_lens[members[0]] == 1 and len(single):
                in_range = np.zeros(len(single), dtype=bool) if ranges is None else ranges[qsl[single], 0] >= 0
                lone, single = single[~in_range], single[in_range]
            calls += [single[i: i + 1] for i in range(len(single))]
        # Calls run one after another in each layer, so they share one gather buffer.
        most = max([len(m) * int(tables.num_blocks[m].max()) for m in calls] + [int(tables.num_blocks[lone].max(initial=0))])
        shape = (most, common.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        k_buf, v_buf = (self.ws.dev.get(n, shape, self.pool.dtype) for n in ("k", "v"))
        groups = [self._group(f"c{i}", m, step, k_buf, v_buf) for i, m in enumerate(calls)]
        return SdpaMetadata(common, groups + self._lone_decodes(lone, step, k_buf, v_buf))

    def _lone_decodes(self, members: np.ndarray, step: _HostStep, k_buf: torch.Tensor,
                      v_buf: torch.Tensor) -> list[SdpaGroup]:
        """One unmasked call per decode row outside any range: its keys are exactly the sliced window.
        Built in one vectorised pass (the many-request loop must not cost a numpy round per request)."""
        if not len(members):
            return []
        counts = step.tables.num_blocks[members]
        used = np.arange(step.tables.width) < counts[:, None]
        total = int(counts.sum())
        self.ws.array("lone.blocks", (total,), torch.int64)[:] = step.tables.block_table[members][used]
        blocks = self.ws.push("lone.blocks", (total,), torch.int64)
        ends = np.cumsum(counts).tolist()
        firsts = (step.first_kept[members] - step.tables.key_start[members]).tolist()
        groups = []
        for r, n, end, first, num_keys in zip(members.tolist(), counts.tolist(), ends, firsts,
                                              step.tables.num_keys[members].tolist(), strict=True):
            row = int(step.qsl[r])
            groups.append(SdpaGroup(1, 1, n, slice(row, row + 1), None, None, blocks[end - n: end],
                                    slice(first, num_keys), None, k_buf[:n], v_buf[:n]))
        return groups

    def _partition(self, members: np.ndarray, step: _HostStep) -> list[np.ndarray]:
        """Requests of one kind (decode rows or prefill chunks) split into padded calls: longest first,
        a request joins the current call while padding it costs less than a call of its own."""
        if self.mode != "auto":
            return [members] if self.mode == "batched" else [members[i: i + 1] for i in range(len(members))]
        q, blocks = step.q_lens[members], step.tables.num_blocks[members]
        order = members[np.lexsort((-blocks, -q))]
        factor = DECODE_BATCH_FACTOR if q[0] == 1 else 1.0
        unit = self.spec.num_heads * self.spec.head_dim * self.pool.block_size
        groups, current = [], [order[0]]
        q_max, nb_max = int(step.q_lens[order[0]]), int(step.tables.num_blocks[order[0]])
        for r in order[1:]:
            qr, nbr = int(step.q_lens[r]), int(step.tables.num_blocks[r])
            grown = (len(current) + 1) * q_max * max(nb_max, nbr) * unit * factor
            kept = len(current) * q_max * nb_max * unit * factor + qr * nbr * unit + CALL_OVERHEAD
            if grown <= kept:
                current.append(r)
                nb_max = max(nb_max, nbr)
            else:
                groups.append(np.array(current))
                current, q_max, nb_max = [r], qr, nbr
        groups.append(np.array(current))
        return [np.sort(g) for g in groups]

    def _group(self, name: str, members: np.ndarray, step: _HostStep, k_buf: torch.Tensor,
               v_buf: torch.Tensor) -> SdpaGroup:
        """Indices and mask of one call over `members` (request indices, in step order)."""
        R, bs, i64 = len(members), self.pool.block_size, torch.int64
        q_lens = step.q_lens[members]
        Q, NB = int(q_lens.max()), int(step.tables.num_blocks[members].max())
        starts, total = step.qsl[members], int(q_lens.sum())
        offsets = np.cumsum(q_lens) - q_lens
        token_rows = np.repeat(starts - offsets, q_lens) + np.arange(total)
        padded_row = np.repeat(np.arange(R) * Q - offsets, q_lens) + np.arange(total)

        self.ws.array(f"{name}.blocks", (R, NB), i64)[:] = step.tables.block_table[members, :NB]
        blocks = self.ws.push(f"{name}.blocks", (R, NB), i64).view(-1)
        size = R * NB
        num_keys = step.tables.num_keys[members]
        if R == 1:   # unpadded: attend from the first kept key to the last
            first = int(step.first_kept[members[0]] - step.tables.key_start[members[0]])
            key_slice = slice(first, int(num_keys[0]))
        else:
            key_slice = slice(0, NB * bs)
        lone_decode = R == 1 and Q == 1 and (step.ranges is None or step.ranges[token_rows[0], 0] < 0)
        mask = None if lone_decode else self._mask(name, members, Q, key_slice, token_rows, padded_row, step)
        if R * Q == total and bool(np.all(np.diff(starts) == q_lens[:-1])):   # rows already in padded order
            rows: slice | torch.Tensor = slice(int(starts[0]), int(starts[0]) + total)
            q_index = out_index = None
        else:
            self.ws.array(f"{name}.rows", (total,), i64)[:] = token_rows
            rows = self.ws.push(f"{name}.rows", (total,), i64)
            q_index_np = self.ws.array(f"{name}.q_index", (R * Q,), i64)
            q_index_np.fill(int(token_rows[0]))      # padded rows read any real row; their mask drops them
            q_index_np[padded_row] = token_rows
            q_index = self.ws.push(f"{name}.q_index", (R * Q,), i64)
            self.ws.array(f"{name}.out_index", (total,), i64)[:] = padded_row
            out_index = self.ws.push(f"{name}.out_index", (total,), i64)
        return SdpaGroup(R, Q, NB, rows, q_index, out_index, blocks, key_slice, mask, k_buf[:size], v_buf[:size])

    def _mask(self, name: str, members: np.ndarray, Q: int, key_slice: slice, token_rows: np.ndarray,
              padded_row: np.ndarray, step: _HostStep) -> torch.Tensor:
        """Additive mask [R, 1, g*Q (1 when Q == 1), L]: mask.keep over padded rows and gathered keys."""
        R, L, bs, i64 = len(members), key_slice.stop - key_slice.start, self.pool.block_size, torch.int64
        q_pos = self.ws.array(f"{name}.q_pos", (R, Q), i64)
        q_pos.fill(-1)   # padded rows keep nothing: no key lies at or before -1, and their range is (-1, -1)
        q_pos.reshape(-1)[padded_row] = step.positions[token_rows]
        local = np.arange(key_slice.start, key_slice.stop)
        k_abs = self.ws.array(f"{name}.k_abs", (R, L), i64)
        np.add(step.tables.key_start[members, None], local, out=k_abs)
        missing = (local >= step.tables.num_keys[members, None]) | (step.tables.block_table[members][:, local // bs] == 0)
        k_abs[missing] = NO_KEY      # past the request's context, or in a freed (null) block
        q_dev = self.ws.push(f"{name}.q_pos", (R, Q), i64)[:, :, None]
        k_dev = self.ws.push(f"{name}.k_abs", (R, L), i64)[:, None, :]
        r_start = r_end = None
        if step.ranges is not None:
            bounds = self.ws.array(f"{name}.ranges", (2, R, Q), i64)
            bounds.fill(-1)
            bounds.reshape(2, -1)[:, padded_row] = step.ranges[token_rows].T
            bounds_dev = self.ws.push(f"{name}.ranges", (2, R, Q), i64)
            r_start, r_end = bounds_dev[0][:, :, None], bounds_dev[1][:, :, None]
        shape = (R, Q, L)
        keep = self.ws.dev.get("keep", shape, torch.bool)
        scratch = [self.ws.dev.get("diff", shape, i64)] + [self.ws.dev.get(f"s{i}", shape, torch.bool) for i in range(3)]
        keep_into(keep, q_dev, k_dev, r_start, r_end, self.spec, scratch)
        g = self.group_size if Q > 1 else 1
        mask = self.ws.dev.get(f"{name}.mask", (R, g, Q, L), self.pool.dtype)
        mask.fill_(float("-inf")).masked_fill_(keep[:, None], 0.0)
        return mask.view(R, 1, g * Q, L)


@dataclass
class _HostStep:
    """The step's host arrays every call is planned from."""

    qsl: np.ndarray
    q_lens: np.ndarray
    positions: np.ndarray
    ranges: np.ndarray | None     # int64 [T, 2], or None (no range on this layer type this step)
    tables: WindowedTables
    first_kept: np.ndarray


class SdpaImpl:
    """AttentionImpl on F.scaled_dot_product_attention, one call per planned group."""

    def __init__(self, spec: LayerAttentionSpec) -> None:
        self.spec = spec

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                metadata: SdpaMetadata) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.common)
        out = torch.empty_like(q)
        out[metadata.common.num_actual_tokens:].zero_()
        for group in metadata.groups:
            rows = self._attend(q, kv_cache, group)
            if isinstance(group.token_rows, slice):
                out[group.token_rows] = rows
            else:
                out.index_copy_(0, group.token_rows, rows)
        return out

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, grp: SdpaGroup) -> torch.Tensor:
        R, Q = grp.num_reqs, grp.q_len
        H, D = q.shape[1], q.shape[2]
        Hkv = kv_cache.shape[3]
        g = H // Hkv
        torch.index_select(kv_cache[0], 0, grp.kv_blocks, out=grp.k_buf)
        torch.index_select(kv_cache[1], 0, grp.kv_blocks, out=grp.v_buf)
        keys = grp.k_buf.view(R, -1, Hkv, D)[:, grp.key_slice].transpose(1, 2)      # [R, Hkv, L, D]
        values = grp.v_buf.view(R, -1, Hkv, D)[:, grp.key_slice].transpose(1, 2)
        rows = q[grp.token_rows] if grp.q_index is None else q.index_select(0, grp.q_index)
        if Q == 1:
            packed = rows.view(R, Hkv, g, D)
        else:
            packed = rows.view(R, Q, Hkv, g, D).permute(0, 2, 3, 1, 4).reshape(R, Hkv, g * Q, D)
        o = F.scaled_dot_product_attention(packed, keys, values, attn_mask=grp.mask, scale=self.spec.scale)
        if Q == 1:
            o = o.reshape(R, H, D)
        else:
            o = o.view(R, Hkv, g, Q, D).permute(0, 3, 1, 2, 4).reshape(R * Q, H, D)
        return o if grp.out_index is None else o.index_select(0, grp.out_index)


BACKEND = AttentionBackend("sdpa", SdpaImpl, SdpaMetadataBuilder)
