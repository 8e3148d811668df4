"""Decode-only steps (one query per request, no ranges) at many very different lengths, against the reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from attn_batches import SPECS, Req, frames, make_batch, rel_err

from mmserve.attention.synthetic import run_backend


def decode_reqs(gen: torch.Generator, count: int = 24) -> list[Req]:
    """Lengths from 1 to ~300 tokens: some below the window and a block, most far beyond both."""
    lens = torch.randint(1, 300, (count,), generator=gen).tolist() + [1, 2, 17, 40, 41]
    return [Req(n - 1, 1, frames(0, 2, 5, 1) if n > 20 else []) for n in lens]


@pytest.mark.parametrize("spec", [replace(SPECS[0], window=40), replace(SPECS[1], window=40), SPECS[2], SPECS[3]],
                         ids=["sliding40", "sliding40-unclamped", "full", "full-bidi"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("free_outside_window", [True, False])
def test_decode_many_lengths_matches_reference(spec, dtype, tol, free_outside_window):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    batch = make_batch(decode_reqs(gen), spec, dtype=dtype, num_blocks=600, gen=gen,
                       free_outside_window=free_outside_window, table_width=24)
    assert batch.metadata.max_query_len == 1 and batch.metadata.query_ranges is None  # a decode-only step
    expected, ref_cache = run_backend("reference", batch, spec)
    for mode in ("auto", "batched", "loop"):
        got, cache = run_backend("sdpa", batch, spec, sdpa_batching=mode)
        assert got.dtype == dtype
        assert rel_err(got, expected) < tol, mode
        assert torch.equal(cache, ref_cache)


def test_decode_ignores_padded_query_rows():
    """The runner pads q/k/v past num_actual_tokens; those rows must not change the real ones."""
    spec = replace(SPECS[0], window=40)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    batch = make_batch(decode_reqs(gen, 8), spec, num_blocks=300, gen=gen, free_outside_window=True)
    T = batch.metadata.num_actual_tokens
    pad = lambda x: torch.cat([x, torch.randn(5, *x.shape[1:], generator=gen)])  # noqa: E731
    expected, _ = run_backend("reference", batch, spec)
    for mode in ("batched", "loop"):
        got, _ = run_backend("sdpa", replace(batch, q=pad(batch.q), k=pad(batch.k), v=pad(batch.v)), spec,
                             sdpa_batching=mode)
        assert got.shape[0] == T + 5
        assert rel_err(got[:T], expected) < 1e-5
