"""Split-KV decode attention (attention/split_kv.py) without a GPU.

Numerics: the kernels themselves run under Triton's interpreter (TRITON_INTERPRET=1 executes their
Python body with numpy, every load, mask and dot as written) on fresh random paged steps, against
the dense float32 reference: GQA packed rows (16 heads on 1 KV head at head dim 512, as Gemma 4's
full layers), verify chunks of several rows, sliding windows with frames' bidirectional ranges
(clamped and not), many splits of ragged contexts, a graph's null-block padding request. In float32:
triton 3.9's interpreter multiplies bf16 operands of tl.dot wrongly (raw bits), so bf16 numerics
are the GPU's to check (the engine's start-up self-check and bench/gpu_check.py).
Planning: the grid depends only on the step's shape (a CUDA graph replays it), and one KV head at
batch 1 spreads over the GPU. Compilation: both kernels compile for sm_90a at Gemma 4's shapes, in
the shared memory an H100/H200 has (Triton's real GPU compiler and ptxas; running them needs a GPU:
bench/gpu_check.py).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from attn_batches import Req, make_batch, rel_err
from triton_interpreter import interpreted_kernels, reload_kernels

from mmserve.attention import create_builder, create_impl
from mmserve.attention.backend import FULL, SLIDING, LayerAttentionSpec
from mmserve.attention.flex import FlexMetadata
from mmserve.attention.paged import write_kv
from mmserve.attention.split_kv import SplitKvMetadata, SplitKvPlanner, split_kv_attention
from mmserve.attention.synthetic import pool_for, run_backend

triton = pytest.importorskip("triton", reason="triton (the fa4-check extra) runs the split-KV kernel")

GEMMA_FULL = LayerAttentionSpec(FULL, num_heads=16, num_kv_heads=1, head_dim=512, window=None, bidirectional=False)
GQA4_FULL = LayerAttentionSpec(FULL, num_heads=8, num_kv_heads=2, head_dim=64, window=None, bidirectional=True,
                               scale=0.125)
SLIDING_UNCLAMPED = LayerAttentionSpec(SLIDING, num_heads=4, num_kv_heads=2, head_dim=32, window=150,
                                       bidirectional=True, clamp_bidirectional=False, scale=0.25)


KERNELS = "mmserve.attention.split_kv_kernels"


def _kernels():
    return reload_kernels(KERNELS)


@pytest.fixture
def interpreted(monkeypatch):
    """The kernels run by Triton's interpreter for one test; as the GPU compiler sees them after."""
    yield from interpreted_kernels(monkeypatch, KERNELS)


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return _kernels()


def fresh() -> torch.Generator:
    return torch.Generator().manual_seed(random.randrange(2**31))


def run_split_kv(batch, spec, **planner_options) -> tuple[torch.Tensor, SplitKvMetadata]:
    cache = batch.kv_cache.clone()
    write_kv(cache, batch.k, batch.v, batch.metadata)
    md = SplitKvPlanner(pool_for(batch, spec), **planner_options).plan(batch.metadata)
    return split_kv_attention(batch.q, cache[0], cache[1], md, spec), md


def ragged(rng: random.Random, n: int, query_len: int, longest: int) -> list[Req]:
    return [Req(rng.randint(longest // 3, longest), query_len) for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gemma_full_decode", "gqa4_verify", "sliding_frames"])
def test_split_kv_matches_the_dense_reference(interpreted, case):
    rng = random.Random(random.getrandbits(64))
    if case == "gemma_full_decode":   # one KV head, 16 packed rows, head dim 512, a 32-key tile
        spec, reqs = GEMMA_FULL, ragged(rng, 3, 1, 400) + [Req(0, 1)]
    elif case == "gqa4_verify":   # verify chunks (K + 1 = 5 rows) of 4-head groups: 20 rows, 2 tiles; one
        # context of 250+ keys, which the planner always cuts in 3+ splits (two random ones were 2 splits at most 1 in 60)
        spec, reqs = GQA4_FULL, [Req(rng.randint(250, 300), 5)] + ragged(rng, 1, 5, 300) + [Req(rng.randint(0, 50), 5)]
    else:   # decodes beside a short chunk inside a frame older than the window (its range reaches back)
        spec = SLIDING_UNCLAMPED
        start = rng.randint(5, 30)
        reqs = [Req(start + 170, 8, [(start, start + 180)]), *ragged(rng, 2, 1, 400), Req(rng.randint(50, 90), 3)]
    batch = make_batch(reqs, spec, gen=fresh(), num_blocks=256, free_outside_window=True)
    want, _ = run_backend("reference", batch, spec)
    got, md = run_split_kv(batch, spec, programs=48, min_split_keys=32)
    # fp32 against fp32, in another summation order: 1e-5 of the output's largest magnitude, 2e-5 at head
    # dim 512 (each score sums 512 products and each split's partial is rescaled at the merge; 4 of 30 salts
    # drew 1.04-1.32e-5 there, salt 15134 in CI among them). A wrong key, split or merge errs by 1e-2 and up.
    assert rel_err(got, want) < (2e-5 if spec.head_dim == 512 else 1e-5)
    # the last split of each tile merged and put its counter back: a second launch (a graph replay) agrees
    assert not md.counters.any()
    cache = batch.kv_cache.clone()
    write_kv(cache, batch.k, batch.v, batch.metadata)
    assert torch.equal(split_kv_attention(batch.q, cache[0], cache[1], md, spec), got)
    splits = md.num_splits.tolist()
    assert max(splits) > 2 and len(set(splits)) > 1   # many splits, ragged


def test_a_padding_request_in_the_null_block_gives_zeros(interpreted):
    """A graph's padding request (one token at position 0, its table all null block) keeps no key:
    zeros, as the reference; its step-mates are unaffected."""
    spec = replace(GQA4_FULL, bidirectional=False)
    batch = make_batch([Req(90, 1), Req(0, 1)], spec, gen=fresh())
    md = batch.metadata
    for table in (md.block_table, md.block_table_cpu):
        table[1] = 0
    md.slot_mapping[1] = 0
    want, _ = run_backend("reference", batch, spec)
    got, _ = run_split_kv(batch, spec, programs=16, min_split_keys=16)
    assert torch.equal(got[1], torch.zeros_like(got[1])) and bool(want[0].abs().sum() > 0)
    assert rel_err(got, want) < 1e-5


def test_positions_moved_back_on_the_device_after_planning_keep_the_window(interpreted):
    """Async scheduling with speculation plans a step on the host as if the step in flight kept all
    K drafts, then moves positions and context lengths back by what it rejected, on the device
    (StepInputBuilder.shift_on_device, TargetKVReader.prepare). The plan's first key, from the
    host's longer contexts, then starts up to K keys too late for a sliding layer: the planner
    starts `position_slack` keys earlier and the kernel's window mask (device positions) keeps
    exactly the window, as the reference over the true contexts. The tables are freed as tightly
    as the KV manager can free them (its window kept from the lowest row a rejection can leave,
    KVCacheManager._lowest_query: here each row's true position), so some keys the slack adds lie
    in null blocks, which the kernel leaves out as it leaves out every key outside the window of a
    row's device position."""
    rng = random.Random(random.getrandbits(64))
    K = 3
    spec = LayerAttentionSpec(SLIDING, num_heads=4, num_kv_heads=2, head_dim=32, window=40, bidirectional=False,
                              scale=0.25)
    # the first request's window starts on a block boundary and its host position is 1 ahead: the
    # slack reaches K - 1 keys into the freed block before it
    first = Req(16 * rng.randint(4, 15) + spec.window - 1, 1)
    batch = make_batch([first, *ragged(rng, 3, 1, 300)], spec, gen=fresh(), num_blocks=128, free_outside_window=True)
    shift = torch.tensor([1] + [rng.randint(1, K) for _ in range(3)], dtype=torch.int32)
    md = batch.metadata
    assert md.block_table[0, (first.context - spec.window) // 16] == 0   # (what the test is about)
    host = replace(md, seq_lens_cpu=md.seq_lens_cpu + shift, positions_cpu=md.positions_cpu + shift)
    want, _ = run_backend("reference", batch, spec)
    cache = batch.kv_cache.clone()
    write_kv(cache, batch.k, batch.v, md)
    for slack, exact in ((K, True), (0, False)):
        plan = SplitKvPlanner(replace(pool_for(batch, spec), position_slack=slack), programs=16).plan(host)
        got = split_kv_attention(batch.q, cache[0], cache[1], replace(plan, common=md), spec)
        assert (rel_err(got, want) < 1e-5) == exact, (slack, rel_err(got, want))


def test_flex_builder_plans_decode_for_split_kv_and_prefill_for_flex(interpreted):
    """With split-KV on (CUDA's choice: attention/selection.py), decode-shaped steps get a split-KV
    plan the flex impl runs, longer chunks flex's block mask; without it decode stays on flex."""
    rng = random.Random(random.getrandbits(64))
    spec = replace(GEMMA_FULL, head_dim=64)
    decode = make_batch(ragged(rng, 3, 1, 200), spec, gen=fresh())
    prefill = make_batch([Req(10, 40), Req(30, 1)], spec, gen=fresh())
    builder = create_builder("flex", replace(pool_for(decode, spec), split_kv_decode=True))
    md = builder.build(decode.metadata)
    assert isinstance(md, SplitKvMetadata) and isinstance(builder.build(prefill.metadata), FlexMetadata)
    cache = decode.kv_cache.clone()
    got = create_impl("flex", spec).forward(decode.q, decode.k, decode.v, cache, md)
    want, ref_cache = run_backend("reference", decode, spec)
    assert rel_err(got, want) < 1e-5 and torch.equal(cache, ref_cache)   # K/V written, then attended
    assert isinstance(create_builder("flex", pool_for(decode, spec)).build(decode.metadata), FlexMetadata)   # CPU


def test_the_grid_depends_on_the_step_shape_only_and_one_kv_head_fills_the_gpu():
    """A graph bakes in the grid and the scalars: two decode steps of the same batch over other
    contexts plan the same grid over the same workspace. At batch 1 one KV head of a 32k context
    spreads over 128 programs (H200: 132 SMs); at batch 64 the requests fill it and splits shrink."""
    spec = GEMMA_FULL
    planner = SplitKvPlanner(pool_for(make_batch([Req(0, 1)] * 64, spec, num_blocks=130), spec), programs=264)

    def plan(reqs):   # the metadata of a step does not depend on the head dim: a small cache for it
        batch = make_batch(reqs, replace(spec, head_dim=8), num_blocks=2200, table_width=2100)
        return planner.plan(batch.metadata)
    a, b = plan([Req(40, 1), Req(700, 1)]), plan([Req(3000, 1), Req(9, 1)])
    assert (a.max_splits, a.tiles_per_req) == (b.max_splits, b.tiles_per_req) and a.max_splits > 1
    assert a.partials.data_ptr() == b.partials.data_ptr() and a.partials.shape == b.partials.shape
    assert a.num_splits.data_ptr() == b.num_splits.data_ptr()
    long = plan([Req(32767, 1)])
    assert int(long.num_splits[0]) * spec.num_kv_heads == 128
    assert plan([Req(0, 1)]).num_splits.tolist() == [1]   # one tile of keys: no partials to merge
    batch64 = plan([Req(500, 1)] * 64)
    assert batch64.max_splits <= -(-264 // 64) and max(batch64.num_splits.tolist()) == 4
    verify64 = plan([Req(500, 16)] * 64)   # 1024 tokens x 16 heads: more partial rows than the workspace
    assert verify64.max_splits == 1 and verify64.partials.numel() == 0


SM90_SHARED_MEMORY = 227 * 1024


@pytest.mark.slow
def test_kernels_compile_for_sm90_in_its_shared_memory(compiled):
    """Triton's GPU compiler (through ptxas to a cubin) for sm_90a at Gemma 4's shapes in bf16: the
    full layer's (head dim 512, 16 heads on 1) splitting kernel (its acquire-release count and
    merge), and the sliding layer's (head dim 256, 2 heads per KV head) one-split kernel; a tile
    overflowing shared memory fails here."""
    from triton.backends.compiler import GPUTarget

    from mmserve.attention.split_kv import tile_shape

    ptr = {"bf16": "*bf16", "f32": "*fp32", "i32": "*i32", "i64": "*i64"}
    attend_pointers = ["bf16"] * 4 + ["f32", "f32", "i32", "i32", "i32", "i64"] + ["i32"] * 5

    def compile_(fn, pointers, scalars, spec, **constexprs):
        block_m, block_n = tile_shape(spec.head_dim)
        constexprs = dict(GROUP=spec.num_heads // spec.num_kv_heads, HEAD_DIM=spec.head_dim,
                          HEAD_DIM_PAD=spec.head_dim, BLOCK_M=block_m, **constexprs)
        if "DIRECT" in constexprs:
            constexprs.update(BLOCK_N=block_n, PRECISION="tf32")
        signature = dict(zip(fn.arg_names, [ptr[p] for p in pointers] + scalars + ["constexpr"] * len(constexprs),
                             strict=True))
        kernel = triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32))
        assert "cubin" in kernel.asm and kernel.metadata.shared <= SM90_SHARED_MEMORY, kernel.metadata.shared
    sliding = replace(GEMMA_FULL, layer_type=SLIDING, num_kv_heads=8, head_dim=256)
    compile_(compiled.attend_splits, attend_pointers, ["i32"] * 14 + ["fp32"], GEMMA_FULL, DIRECT=False)
    compile_(compiled.attend_splits, attend_pointers, ["i32"] * 14 + ["fp32"], sliding, DIRECT=True)
