"""Flex with GQA packed into query rows (attention/flex.py): equal to the dense fp32 reference for
group sizes whose heads fill, straddle and span query blocks, with prefix blocks two requests
share; a decode step's lists name each request's blocks once per KV head (the unpacked layout
named a 16-request query block's blocks for each of 16 heads); and the block-mask build makes no
cache-wide matrix and sorts nothing. Flex compiles on this CPU; Triton's GPU kernel is another
matter (bench/gpu_check.py's fallback section)."""

from __future__ import annotations

import random

import pytest
import torch
from attn_batches import Req, frames, make_batch, rel_err
from torch.utils._python_dispatch import TorchDispatchMode

from mmserve.attention import create_builder
from mmserve.attention.backend import FULL, SLIDING, LayerAttentionSpec
from mmserve.attention.synthetic import pool_for, run_backend


def spec_for(layer_type: str, heads: int, kv_heads: int) -> LayerAttentionSpec:
    if layer_type == SLIDING:
        return LayerAttentionSpec(SLIDING, heads, kv_heads, 8, window=10, bidirectional=True,
                                  clamp_bidirectional=False, scale=0.5)
    return LayerAttentionSpec(FULL, heads, kv_heads, 8, window=None, bidirectional=True, scale=0.5)


def mixed_step(rng: random.Random) -> list[Req]:
    """A chunk with frames (one older than the window), decodes and a short prefill, random lengths."""
    ctx = rng.randint(5, 30)
    return [Req(ctx, rng.randint(20, 40), frames(ctx - 3, 2, rng.randint(6, 14), 2)),
            *(Req(rng.randint(1, 60), 1) for _ in range(rng.randint(1, 4))), Req(0, rng.randint(2, 9))]


@pytest.mark.slow
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (16, 1), (32, 1)])   # g = 3 straddles, 16 fills, 32 spans
@pytest.mark.parametrize("layer_type", [SLIDING, FULL])
def test_packed_rows_match_the_reference(layer_type, heads, kv_heads):
    rng = random.Random(random.getrandbits(64))
    spec = spec_for(layer_type, heads, kv_heads)
    batch = make_batch(mixed_step(rng), spec, gen=torch.Generator().manual_seed(rng.randrange(2**31)),
                       free_outside_window=True)
    got, _ = run_backend("flex", batch, spec)
    want, _ = run_backend("reference", batch, spec)
    assert rel_err(got, want) < 1e-5


@pytest.mark.slow
def test_prefix_blocks_two_requests_share_count_once():
    """Two decodes and a chunk over the same cached prefix blocks (prefix caching hands requests the
    same physical blocks): listing a shared block twice in one query block would count its keys twice."""
    spec = spec_for(FULL, 4, 2)
    batch = make_batch([Req(40, 1), Req(40, 1), Req(36, 8)], spec, gen=torch.Generator().manual_seed(3))
    md = batch.metadata
    shared = md.block_table[0, :2].clone()        # the first 32 positions: one prefix in all three
    for r in (1, 2):
        md.block_table[r, :2] = shared
        md.block_table_cpu[r, :2] = shared
    slots = []
    for r, req in enumerate(batch.reqs):
        for p in range(req.context, req.seq_len):
            slots.append(int(md.block_table[r, p // 16]) * 16 + p % 16)
    md.slot_mapping = torch.tensor(slots, dtype=torch.int64)
    got, _ = run_backend("flex", batch, spec)
    want, _ = run_backend("reference", batch, spec)
    assert rel_err(got, want) < 1e-5


def test_decode_lists_each_requests_blocks_once_per_kv_head():
    spec = spec_for(FULL, 16, 1)
    reqs = [Req(random.randint(20, 200), 1) for _ in range(16)]
    batch = make_batch(reqs, spec, num_blocks=sum(-(-r.seq_len // 16) for r in reqs) + 4)
    md = create_builder("flex", pool_for(batch, spec)).build(batch.metadata)
    listed = int(md.block_mask.kv_num_blocks.sum() + md.block_mask.full_kv_num_blocks.sum())
    programs_per_block = md.q_pad.shape[1]   # flex runs one program per (query block, head of q_pad)
    # each request's blocks, once per KV head; the unpacked layout read them once per query head (16x)
    assert listed * programs_per_block == sum(-(-r.seq_len // 16) for r in reqs) * spec.num_kv_heads


class LargestOutput(TorchDispatchMode):
    """The largest tensor an op allocated (views and in-place writes of existing storage excluded)."""

    def __init__(self):
        super().__init__()
        self.largest, self.ops = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.__name__.split(".")[0])
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


def test_block_mask_build_is_linear_in_the_step_not_the_cache():
    """A big pool (8192 blocks) and a 64-request decode: the build's largest tensor is the table
    gather, far below one cache-wide row per query block, and no sort runs."""
    spec = spec_for(FULL, 16, 1)
    reqs = [Req(random.randint(20, 300), 1) for _ in range(64)]
    batch = make_batch(reqs, spec, num_blocks=8192)
    builder = create_builder("flex", pool_for(batch, spec))
    builder.build(batch.metadata)                                            # warm
    with LargestOutput() as seen:
        md = builder.build(batch.metadata)
    num_q_blocks = 64   # one 16-row block per decode token at g = 16
    assert seen.largest < num_q_blocks * 8192 // 8, seen.largest
    assert not seen.ops & {"sort", "argsort", "topk"}, seen.ops
    assert int(md.block_mask.kv_num_blocks.sum() + md.block_mask.full_kv_num_blocks.sum()) == sum(
        -(-r.seq_len // 16) for r in reqs)


def packed_rows(lens: list[int], g: int) -> tuple[dict[int, int], list[int]]:
    """The packed layout by its definition, row by row: token t's head h (t the flat token index)
    -> its row, and the owner of each query block; request r's rows start a query block."""
    row_of, owners, start, token = {}, [], 0, 0
    for r, n in enumerate(lens):
        for t in range(n):
            for h in range(g):
                row_of[(token + t) * g + h] = start + t * g + h
        blocks = -(-n * g // 16)
        owners += [r] * blocks
        start, token = start + 16 * blocks, token + n
    return row_of, owners


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (32, 1)])
def test_row_layout_kept_across_steps_is_the_definition(heads, kv_heads):
    """One builder over a run of steps whose query lengths repeat (the layout is kept), change, or
    are the same lengths in another order (as many requests and tokens: rebuilt), with contexts
    that change either way: after every step its rows are the definition's."""
    rng = random.Random(random.getrandbits(64))
    spec = spec_for(FULL, heads, kv_heads)
    g, builder, lens = heads // kv_heads, None, []
    for step in range(9):
        if step % 3 == 0:   # new lengths (a decode and a longer chunk at least), then kept, then reordered
            lens = [1, rng.randint(2, 20)] + [rng.choice([1, 4, rng.randint(2, 20)]) for _ in range(rng.randint(0, 10))]
        elif step % 3 == 2:
            lens = lens[1:] + lens[:1]
        reqs = [Req(rng.randint(0, 40), n) for n in lens]
        batch = make_batch(reqs, spec, num_blocks=80, gen=torch.Generator().manual_seed(rng.randrange(2**31)))
        builder = builder or create_builder("flex", pool_for(batch, spec))
        builder.build(batch.metadata)
        row_of, owners = packed_rows(lens, g)
        T = sum(lens)
        want_tok = [builder.pad_token] * builder.num_rows
        for flat, row in row_of.items():
            want_tok[row] = flat // g
        assert builder.head_rows.np[:T * g].tolist() == [row_of[i] for i in range(T * g)], f"step {step}"
        assert builder.row_tok.np.tolist() == want_tok, f"step {step}"
        assert builder.block_owner.np[:len(owners)].tolist() == owners, f"step {step}"
        assert builder.tok_row.np[:T].tolist() == [row_of[t * g] for t in range(T)], f"step {step}"
