"""Every CPU backend against the dense float32 reference on fresh random paged batches, each
backend's builder reused over a random sequence of steps as the engine reuses it.

sdpa runs in all three of its plans: auto (the engine's), one padded call per group ("batched")
and one call per request ("loop", the correctness reference of the batched path).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from attn_batches import SPECS, make_batch, random_step, rel_err, standard_batches

from mmserve.attention import create_builder, create_impl
from mmserve.attention.synthetic import pool_for, run_backend

CPU_BACKENDS = [("sdpa", "auto"), ("sdpa", "batched"), ("sdpa", "loop"), ("flex", "auto")]
BACKEND_IDS = ["sdpa-auto", "sdpa-batched", "sdpa-loop", "flex"]
SPEC_IDS = [f"{s.layer_type}-bidi{s.bidirectional}-clamp{s.clamp_bidirectional}" for s in SPECS]
MAX_STEP_TOKENS = 512   # pool_for's default: one builder's capacity for every step of a sequence


def fresh() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))


@pytest.mark.parametrize("backend,mode", CPU_BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_backend_matches_reference_fp32(backend, mode, spec):
    """One builder and one impl serve a random sequence of steps, as in the engine (persistent
    buffers, reused plans): every standard batch and random steps of other sizes, shuffled."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    steps = list(standard_batches().values())
    while len(steps) < 10:
        step = random_step(rng, spec.window or 8)
        if sum(r.query for r in step) <= MAX_STEP_TOKENS:
            steps.append(step)
    rng.shuffle(steps)
    builder, impl = None, create_impl(backend, spec)
    for reqs in steps:
        batch = make_batch(reqs, spec, gen=fresh(), table_width=16,
                           free_outside_window=rng.random() < 0.8)
        builder = builder or create_builder(backend, pool_for(batch, spec, sdpa_batching=mode))
        expected, ref_cache = run_backend("reference", batch, spec)
        cache = batch.kv_cache.clone()
        got = impl.forward(batch.q, batch.k, batch.v, cache, builder.build(batch.metadata))
        assert rel_err(got[:len(expected)], expected) < 1e-5, reqs
        assert torch.equal(cache, ref_cache), reqs  # this step's K/V landed at the same slots


# flex in bf16 is checked by test_attn_flex_compile.py (its own graphs, counted there).
@pytest.mark.parametrize("mode", ["batched", "loop"])
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("name", ["chunked_prefill", "mixed", "decode"])
def test_sdpa_matches_reference_bf16(mode, spec, name):
    batch = make_batch(standard_batches()[name], spec, dtype=torch.bfloat16, gen=fresh(), free_outside_window=True)
    expected, _ = run_backend("reference", batch, spec)
    got, _ = run_backend("sdpa", batch, spec, sdpa_batching=mode)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, expected) < 2e-2


@pytest.mark.parametrize("backend,mode", CPU_BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("name", ["chunked_prefill", "mixed"])
def test_backend_matches_reference_with_window_wider_than_blocks(backend, mode, name):
    """Windows spanning several cache blocks: flex lists inner blocks as full and skips the mask there."""
    spec = replace(SPECS[0], window=40)
    batch = make_batch(standard_batches(window=40)[name], spec, gen=fresh(), free_outside_window=True)
    expected, _ = run_backend("reference", batch, spec)
    got, _ = run_backend(backend, batch, spec, sdpa_batching=mode)
    assert rel_err(got, expected) < 1e-5


@pytest.mark.parametrize("backend,mode", CPU_BACKENDS + [("reference", "auto")], ids=BACKEND_IDS + ["reference"])
@pytest.mark.parametrize("spec", [SPECS[0], SPECS[2]], ids=["sliding", "full"])
def test_attend_only_reads_the_cache_and_writes_nothing(backend, mode, spec):
    """KV sharing: forward(q, None, None, cache, md) attends over a cache another layer wrote."""
    batch = make_batch(standard_batches()["mixed"], spec, gen=fresh(), free_outside_window=True)
    written = batch.kv_cache.clone()
    expected, _ = run_backend("reference", batch, spec, kv_cache=written)   # the producer layer writes
    before = written.clone()
    got, _ = run_backend(backend, replace(batch, k=None, v=None), spec, kv_cache=written, sdpa_batching=mode)
    assert torch.equal(written, before)
    assert rel_err(got, expected) < 1e-5
