"""Every CPU backend against the dense float32 reference on fresh random paged batches."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from attn_batches import SPECS, make_batch, rel_err, standard_batches

from mmserve.attention import create_impl

CPU_BACKENDS = ["sdpa", "flex"]  # flex: every spec of a head dim shares one compiled graph (per dtype)
SPEC_IDS = [f"{s.layer_type}-bidi{s.bidirectional}-clamp{s.clamp_bidirectional}" for s in SPECS]


def run(backend: str, batch, spec):
    cache = batch.kv_cache.clone()
    return create_impl(backend, spec).forward(batch.q, batch.k, batch.v, cache, batch.metadata), cache


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("name", list(standard_batches()))
def test_backend_matches_reference_fp32(backend, spec, name):
    batch = make_batch(standard_batches()[name], spec, gen=torch.Generator().manual_seed(torch.seed() % 2**31),
                       free_outside_window=True)
    expected, ref_cache = run("reference", batch, spec)
    got, cache = run(backend, batch, spec)
    assert rel_err(got, expected) < 1e-5
    assert torch.equal(cache, ref_cache)  # this step's K/V landed at the same slots


# flex in bf16 is checked by test_attn_flex_compile.py (its own graphs, counted there).
@pytest.mark.parametrize("backend", ["sdpa"])
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("name", ["chunked_prefill", "mixed", "decode"])
def test_backend_matches_reference_bf16(backend, spec, name):
    batch = make_batch(standard_batches()[name], spec, dtype=torch.bfloat16,
                       gen=torch.Generator().manual_seed(torch.seed() % 2**31), free_outside_window=True)
    expected, _ = run("reference", batch, spec)
    got, _ = run(backend, batch, spec)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, expected) < 2e-2


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", ["chunked_prefill", "mixed"])
def test_backend_matches_reference_with_window_wider_than_blocks(backend, name):
    """Windows spanning several cache blocks: flex lists inner blocks as full and skips the mask there."""
    spec = replace(SPECS[0], window=40)
    batch = make_batch(standard_batches(window=40)[name], spec, gen=torch.Generator().manual_seed(torch.seed() % 2**31),
                       free_outside_window=True)
    expected, _ = run("reference", batch, spec)
    got, _ = run(backend, batch, spec)
    assert rel_err(got, expected) < 1e-5
