"""The sdpa backend's batched plan: random mixed steps against the dense fp32 reference, the
windowed page tables it gathers, the kernel SDPA really runs, and the batched/loop choice."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from attn_batches import SPECS, Req, frames, make_batch, random_step, rel_err

from mmserve.attention.mask import batch_dense_mask
from mmserve.attention.page_tables import windowed_tables
from mmserve.attention.sdpa import SdpaMetadataBuilder
from mmserve.attention.synthetic import pool_for, run_backend
from mmserve.config import SDPA_BATCHING_CHOICES

SPEC_IDS = [f"{s.layer_type}-bidi{s.bidirectional}-clamp{s.clamp_bidirectional}" for s in SPECS]


@pytest.mark.parametrize("mode", ["auto", "batched"])
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_random_mixed_steps_match_the_dense_reference(mode, spec, dtype, tol):
    seed = int(torch.randint(0, 2**31, ()))
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(4):
        reqs = random_step(rng, spec.window or 8)
        batch = make_batch(reqs, spec, dtype=dtype, gen=gen, num_blocks=sum(r.seq_len // 16 + 2 for r in reqs) + 8,
                           free_outside_window=rng.random() < 0.5)
        want, want_cache = run_backend("reference", batch, spec)
        got, cache = run_backend("sdpa", batch, spec, sdpa_batching=mode)
        assert got.dtype == dtype
        assert rel_err(got, want) < tol, (seed, reqs)
        assert torch.equal(cache, want_cache)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_windowed_tables_hold_every_kept_key_and_start_at_the_first(spec):
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    for _ in range(5):
        batch = make_batch(random_step(rng, spec.window or 8), spec, free_outside_window=True, num_blocks=400)
        md = batch.metadata
        qsl, seq = md.query_start_loc.numpy().astype(np.int64), md.seq_lens.numpy().astype(np.int64)
        starts = None if md.query_ranges is None or not spec.bidirectional else md.query_ranges[:, 0].numpy()
        out = np.zeros((md.num_reqs, md.block_table.shape[1]), dtype=np.int32)
        tables = windowed_tables(spec, md.block_size, qsl, seq, md.block_table.numpy(), starts, out)
        kept = batch_dense_mask(md, spec)
        bs = md.block_size
        for r in range(md.num_reqs):
            keys = torch.nonzero(kept[qsl[r]:qsl[r + 1]].any(0)).flatten().tolist()
            start = int(tables.key_start[r])
            assert start % bs == 0 and tables.num_keys[r] == seq[r] - start
            assert not keys or start <= keys[0] < start + bs    # starts at the first kept key's block
            n = int(tables.num_blocks[r])
            assert tables.block_table[r, :n].tolist() == md.block_table[r, start // bs: start // bs + n].tolist()
            assert not tables.block_table[r, n:].any()


def test_sdpa_runs_the_flash_kernel_never_its_math_fallback():
    """GQA with a mask and frames, prefill and decode in one step, both plans: the CPU flash kernel only."""
    from torch.profiler import profile

    spec = SPECS[0]
    batch = make_batch([Req(0, 40, frames(3, 3, 6, 2)), Req(30, 1), Req(12, 20, frames(14, 1, 10, 0)), Req(50, 1)],
                       spec)
    for mode in ("batched", "loop"):
        with profile() as prof:
            run_backend("sdpa", batch, spec, sdpa_batching=mode)
        ops = {e.key for e in prof.key_averages()}
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops, mode
        assert not {op for op in ops if "math" in op or "softmax" in op}, (mode, ops)


def test_auto_pads_alike_requests_together_and_leaves_outliers_alone():
    spec = replace(SPECS[2], head_dim=64)

    def plan(reqs) -> list[tuple[int, int, int]]:
        """(requests, padded query rows, padded blocks) of each call."""
        batch = make_batch(reqs, spec, num_blocks=260)
        groups = SdpaMetadataBuilder(pool_for(batch, spec)).build(batch.metadata).groups
        return sorted((g.num_reqs, g.q_len, g.num_blocks) for g in groups)

    assert plan([Req(200 + i, 1) for i in range(8)]) == [(8, 1, 13)]          # alike decodes: one call
    # A very long context among short ones gets its own call; the short ones share one.
    assert plan([Req(3000, 1)] + [Req(5, 1) for _ in range(3)]) == [(1, 1, 188), (3, 1, 1)]
    # Equal prompt chunks share a call; a much shorter chunk does not pad them.
    assert plan([Req(0, 200), Req(0, 9), Req(0, 200), Req(0, 200)]) == [(1, 9, 1), (3, 200, 13)]


def test_each_flag_choice_plans_and_anything_else_is_refused_naming_the_flag():
    """--sdpa-batching's choices are the builder's (config.SDPA_BATCHING_CHOICES, one list): an engine
    built in Python with another value (mmserve.LLM(sdpa_batching=...)) is told which flag it set."""
    spec = SPECS[0]
    batch = make_batch([Req(0, 20), Req(30, 1)], spec)
    for mode in SDPA_BATCHING_CHOICES:
        assert SdpaMetadataBuilder(pool_for(batch, spec, sdpa_batching=mode)).mode == mode
    with pytest.raises(ValueError, match="--sdpa-batching 'padded': choose from auto, batched, loop"):
        SdpaMetadataBuilder(pool_for(batch, spec, sdpa_batching="padded"))
