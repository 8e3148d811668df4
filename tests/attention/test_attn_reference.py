"""The oracle itself, checked against attention computed pair by pair from keep() in float64."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from attn_batches import SLIDING_SPEC, SPECS, Req, frames, make_batch, standard_batches

from mmserve.attention.mask import keep_for_spec
from mmserve.attention.synthetic import run_backend


def naive_attention(batch, spec) -> torch.Tensor:
    """Per token and head: the kept keys found by keep() on ints, read slot by slot, softmax in float64."""
    md = batch.metadata
    cache = batch.kv_cache.clone().double()
    flat = cache.view(2, -1, spec.num_kv_heads, spec.head_dim)
    flat[0, md.slot_mapping] = batch.k.double()
    flat[1, md.slot_mapping] = batch.v.double()
    group = spec.num_heads // spec.num_kv_heads
    out = torch.zeros(batch.q.shape, dtype=torch.float64)
    qsl = md.query_start_loc.tolist()
    for r, req in enumerate(batch.reqs):
        table = md.block_table[r].tolist()
        for i in range(qsl[r], qsl[r + 1]):
            q = int(md.positions[i])
            rs, re = (md.query_ranges[i].tolist() if md.query_ranges is not None else (-1, -1))
            kept = [k for k in range(req.seq_len)
                    if table[k // md.block_size] != 0 and bool(keep_for_spec(q, k, rs, re, spec))]
            if not kept:
                continue
            slots = [table[k // md.block_size] * md.block_size + k % md.block_size for k in kept]
            for h in range(spec.num_heads):
                keys, values = flat[0, slots, h // group], flat[1, slots, h // group]
                scores = (keys @ batch.q[i, h].double()) * spec.scale
                weights = torch.exp(scores - scores.max())
                out[i, h] = (weights / weights.sum()) @ values
    return out


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layer_type}-bidi{s.bidirectional}-clamp{s.clamp_bidirectional}")
@pytest.mark.parametrize("name", ["varlen_prefill", "chunked_prefill", "decode", "mixed", "split_frame"])
def test_reference_matches_naive_loop(spec, name):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    batch = make_batch(standard_batches()[name], spec, gen=gen, free_outside_window=True)
    expected = naive_attention(batch, spec)
    got, _ = run_backend("reference", batch, spec)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_reference_writes_this_steps_kv_into_the_cache():
    batch = make_batch([Req(3, 5), Req(0, 4)], SLIDING_SPEC)
    run_backend("reference", batch, SLIDING_SPEC, kv_cache=batch.kv_cache)
    flat = batch.kv_cache.view(2, -1, SLIDING_SPEC.num_kv_heads, SLIDING_SPEC.head_dim)
    assert torch.equal(flat[0, batch.metadata.slot_mapping], batch.k)
    assert torch.equal(flat[1, batch.metadata.slot_mapping], batch.v)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex"])
def test_frame_query_sees_future_frame_key_and_not_beyond(backend):
    """Change one key's value: exactly the queries of its frame (and the window after it) change."""
    spec = SLIDING_SPEC
    (s, e), = frames(4, 1, 6, 0)
    reqs = [Req(0, 16, [(s, e)])]
    batch = make_batch(reqs, spec)
    base, _ = run_backend(backend, batch, spec)
    for key, affected in ((e, set(range(s, e + 1)) | set(range(e, e + spec.window))),
                          (e + 1, set(range(e + 1, e + 1 + spec.window)))):
        v2 = batch.v.clone()
        v2[key] += 10.0
        out, _ = run_backend(backend, replace(batch, v=v2), spec)
        changed = {p for p in range(16) if not torch.allclose(out[p], base[p])}
        assert changed == {p for p in affected if p < 16}


def test_gather_kv_reads_a_requests_keys_through_the_block_table():
    from mmserve.attention.paged import gather_kv
    batch = make_batch([Req(50, 20), Req(0, 7)], SLIDING_SPEC)
    run_backend("reference", batch, SLIDING_SPEC, kv_cache=batch.kv_cache)
    table, bs = batch.metadata.block_table[0].tolist(), batch.metadata.block_size
    for last in (70, 48, 17, 1):
        keys, values = gather_kv(batch.kv_cache, batch.metadata.block_table[0], last)
        slots = [table[p // bs] * bs + p % bs for p in range(last)]
        flat = batch.kv_cache.view(2, -1, SLIDING_SPEC.num_kv_heads, SLIDING_SPEC.head_dim)
        assert torch.equal(keys, flat[0, slots]) and torch.equal(values, flat[1, slots])
