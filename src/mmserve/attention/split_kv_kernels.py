"""The Triton kernel of split-KV attention over the paged cache (attention/split_kv.py plans it).

`attend_splits`: one program per (query tile, KV head, split). A query tile is BLOCK_M packed rows
of one request (row m is its query token m // GROUP under query head kv_head * GROUP + m % GROUP,
so the heads sharing a KV head read each key once); a split is one interval of that request's keys,
[key_lo + s * split_len, + split_len). The program streams its interval's keys through the block
table BLOCK_N at a time (any block size: each key's slot is looked up), applies mask.keep from the
rows' positions and ranges, and keeps an online softmax in float32.

With one split in the grid (DIRECT) it writes the normalised output. Otherwise each split writes
its normalised partial output and log2-sum-exp, then counts itself done on its (tile, KV head)'s
counter (an acquire-release atomic: its partials are visible to whoever reads the count after it),
and the split that finishes last merges them, out = sum_s o_s * 2^(lse_s - lse) with
lse = log2 sum_s 2^lse_s, and puts the counter back to 0 for the next launch: one launch per layer
whether or not it splits (a merge kernel would be a second). A row that kept no key (the null block,
a graph's padding request) gives zeros, as the dense reference does.

No program returns early: one past its request's rows or splits gets an empty key interval and
masked stores, which every Triton version compiles. Row reductions go through tl.reduce with the
combine functions of mmserve/triton_combine.py, not tl.max / tl.sum, so Triton's interpreter runs
this kernel in any process (tests/attention/test_attn_split_kv.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mmserve.triton_combine import add, maximum


@triton.jit
def attend_splits(
    q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, lse_ptr, counter_ptr,
    qsl_ptr, seq_lens_ptr, positions_ptr, ranges_ptr, table_ptr, key_lo_ptr, num_splits_ptr, split_len_ptr,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_table,
    stride_ps, num_heads, tiles_per_req, block_size, window, clamp, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    req = pid_m // tiles_per_req
    first = tl.load(qsl_ptr + req)
    rows = (pid_m % tiles_per_req) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows // GROUP < tl.load(qsl_ptr + req + 1) - first
    token = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP

    seq_len = tl.load(seq_lens_ptr + req)
    split_len = tl.load(split_len_ptr + req)
    num_splits = tl.load(num_splits_ptr + req)
    start = tl.load(key_lo_ptr + req) + split * split_len
    end = tl.where(split < num_splits, tl.minimum(start + split_len, seq_len), start)

    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = tl.load(positions_ptr + token, mask=row_ok, other=-1)
    r_start = tl.load(ranges_ptr + 2 * token, mask=row_ok, other=-1)
    r_end = tl.load(ranges_ptr + 2 * token + 1, mask=row_ok, other=-1)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, HEAD_DIM_PAD), 0.0, tl.float32)
    for key0 in range(start, end, BLOCK_N):
        keys = key0 + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        block = tl.load(table_ptr + req * stride_table + keys // block_size, mask=key_ok, other=0)
        slot = block.to(tl.int64) * stride_kb + (keys % block_size) * stride_ks + kv_head * stride_kh
        load_ok = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] + dims[None, :], mask=load_ok, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        # mask.keep: (k <= q and q - k < W) or (k in q's range and (not clamp or q - k < W))
        diff = q_pos[:, None] - keys[None, :]
        in_window = diff < window
        in_range = (keys[None, :] >= r_start[:, None]) & (keys[None, :] <= r_end[:, None]) & (in_window | (clamp == 0))
        kept = (((diff >= 0) & in_window) | in_range) & (key_ok & (block != 0))[None, :] & row_ok[:, None]
        scores = tl.where(kept, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(scores, 1, maximum))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row with nothing kept yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, add)
        v = tl.load(v_ptr + slot[:, None] + dims[None, :], mask=load_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    found = l_i > 0
    out_at = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    out_ok = row_ok[:, None] & dim_ok[None, :]
    if DIRECT:
        o = acc / tl.where(found, l_i, 1.0)[:, None]
        tl.store(out_at, o.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        row = token.to(tl.int64) * num_heads + head
        lse_stride = stride_ps // HEAD_DIM
        active = tl.full((BLOCK_M,), split, tl.int32) < num_splits   # a vector: the interpreter's masks
        o = acc / tl.where(found, l_i, 1.0)[:, None]
        tl.store(part_ptr + split * stride_ps + row[:, None] * HEAD_DIM + dims[None, :], o,
                 mask=active[:, None] & out_ok)
        lse = tl.where(found, m_i + tl.log2(tl.where(found, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split * lse_stride + row, lse, mask=active & row_ok)
        counter = counter_ptr + pid_m * tl.num_programs(1) + kv_head
        done = tl.atomic_add(counter, 1, mask=split < num_splits, sem="acq_rel")
        if (split < num_splits) & (done == num_splits - 1):   # the last split of this tile: merge
            m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
            acc = tl.full((BLOCK_M, HEAD_DIM_PAD), 0.0, tl.float32)
            for s in range(0, num_splits):
                lse_s = tl.load(lse_ptr + s * lse_stride + row, mask=row_ok, other=float("-inf"),
                                cache_modifier=".cg")
                o_s = tl.load(part_ptr + s * stride_ps + row[:, None] * HEAD_DIM + dims[None, :], mask=out_ok,
                              other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m_i, lse_s)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                w = tl.exp2(lse_s - m_safe)
                l_i = l_i * alpha + w
                acc = acc * alpha[:, None] + o_s * w[:, None]
                m_i = m_new
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_at, o.to(out_ptr.dtype.element_ty), mask=out_ok)
            tl.store(counter, 0)   # ready for the next launch (a replayed graph's too)
