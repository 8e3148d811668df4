"""Decode CUDA graphs: which steps and sizes take a graph (CPU), and capture/replay on a GPU."""

from __future__ import annotations

import pytest
import torch

from mmserve.engine.cuda_graphs import DecodeGraphs, capture_sizes, is_decode_only


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(3) == (1, 2, 3)
    graphs = DecodeGraphs(capture_sizes(20), enabled=True)
    assert [graphs.size_for(n) for n in (1, 2, 3, 5, 8, 9, 17, 20, 21)] == [1, 2, 4, 8, 8, 16, 20, 20, None]


def test_disabled_graphs_run_everything_eagerly():
    graphs = DecodeGraphs(capture_sizes(64), enabled=False)
    assert not graphs.enabled and graphs.size_for(1) is None


def test_only_one_token_per_request_without_frames_is_a_decode_step():
    assert is_decode_only([1, 1, 1], has_frames=False)
    assert not is_decode_only([1, 2], has_frames=False)
    assert not is_decode_only([1], has_frames=True)
    assert not is_decode_only([], has_frames=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_replay_reads_the_persistent_inputs_of_its_size():
    x = torch.zeros(8, 4, device="cuda")
    weight = torch.randn(4, 4, device="cuda")
    graphs = DecodeGraphs((2, 8), enabled=True)
    graphs.capture_all(lambda size: (lambda: torch.tanh(x[:size] @ weight)))
    for size in (2, 8):
        x.copy_(torch.randn_like(x))
        out = graphs.replay(size)
        torch.testing.assert_close(out, torch.tanh(x[:size] @ weight))


def test_graphs_only_on_cuda_without_enforce_eager_and_with_capturable_backends():
    from mmserve.engine.cuda_graphs import graphs_enabled

    assert graphs_enabled("cuda", False, [True, True])
    assert not graphs_enabled("cuda", True, [True, True])       # --enforce-eager
    assert not graphs_enabled("cpu", False, [True, True])
    assert not graphs_enabled("cuda", False, [True, False])     # e.g. sdpa on one layer type


def decode_step(num_reqs: int):
    """A scheduler past its prefills (every request now schedules one token) and the runner's tables."""
    from sched_helpers import SPECS, make_request, make_scheduler

    from mmserve.engine.block_table import BlockTables
    from mmserve.engine.step_inputs import StepInputBuilder

    sched = make_scheduler(max_num_batched_tokens=256, max_num_seqs=16)
    for i in range(num_reqs):   # prompts share no block: one that did would wait for the first to compute it
        sched.add_request(make_request(f"r{i}", 5 + 3 * i, max_tokens=8, first=3 + 100 * i))
    tables = BlockTables(SPECS, sched.kv.max_blocks_per_req)
    builder = StepInputBuilder(SPECS, max_num_tokens=256, max_num_seqs=16, max_blocks_per_req=sched.kv.max_blocks_per_req,
                               block_size=sched.kv.block_size, device="cpu")
    out = sched.schedule()
    tables.apply(out.scheduled)
    sched.update(out)
    for s in out.scheduled:
        s.request.output_token_ids.append(7)
    out = sched.schedule()
    assert all(s.num_tokens == 1 for s in out.scheduled)
    return out, tables, builder, SPECS


def test_a_padded_decode_step_keeps_real_rows_and_pads_with_null_block_requests():
    out, tables, builder, specs = decode_step(3)
    rows = tables.apply(out.scheduled)
    plain = builder.build(out.scheduled, tables.rows, rows)
    want = {t: {f: getattr(plain.common[t], f).clone() for f in ("query_start_loc", "seq_lens", "block_table",
                                                                  "slot_mapping")} for t in specs}
    ids, positions, logits = plain.input_ids.clone(), plain.positions.clone(), plain.logits_indices.clone()
    padded = builder.build(out.scheduled, tables.rows, rows, pad_to=8)
    assert padded.num_tokens == 8 and torch.equal(padded.logits_indices, logits)   # only real rows are sampled
    assert torch.equal(padded.input_ids[:3], ids) and torch.equal(padded.positions[:3], positions)
    assert (padded.positions[3:] == 0).all()
    for t in specs:
        md = padded.common[t]
        assert md.num_reqs == md.num_actual_tokens == 8 and md.max_query_len == 1
        assert md.query_start_loc.tolist() == want[t]["query_start_loc"].tolist() + [4, 5, 6, 7, 8]
        assert torch.equal(md.seq_lens[:3], want[t]["seq_lens"]) and (md.seq_lens[3:] == 1).all()
        assert torch.equal(md.block_table[:3], want[t]["block_table"]) and (md.block_table[3:] == 0).all()
        assert torch.equal(md.slot_mapping[:3], want[t]["slot_mapping"]) and (md.slot_mapping[3:] == 0).all()


def test_graph_inputs_sit_at_the_same_addresses_every_step_of_a_size():
    """What a replay reads: the same persistent storage, whatever the step (an all-padding capture step too)."""
    import numpy as np

    out, tables, builder, specs = decode_step(5)
    capture = builder.build([], tables.rows, np.empty(0, dtype=np.int64), pad_to=8)
    step = builder.build(out.scheduled, tables.rows, tables.apply(out.scheduled), pad_to=8)

    def addresses(inputs):
        views = [inputs.input_ids, inputs.positions] + [getattr(inputs.common[t], f) for t in specs
                                                         for f in ("query_start_loc", "seq_lens", "block_table",
                                                                   "slot_mapping")]
        return [(v.data_ptr(), tuple(v.shape)) for v in views]
    assert addresses(capture) == addresses(step)


def test_enforce_eager_reaches_the_runner(monkeypatch):
    from mmserve.engine import model_runner
    from mmserve.engine.llm import LLM

    seen = []
    real = model_runner.graphs_enabled
    monkeypatch.setattr(model_runner, "graphs_enabled", lambda *args: seen.append(args) or real(*args))
    for eager in (True, False):
        llm = LLM(device="cpu", enforce_eager=eager, max_num_seqs=4)
        assert not llm.core.runner.graphs.enabled   # CPU steps are always eager
    assert [(device, eager) for device, eager, _ in seen] == [("cpu", True), ("cpu", False)]
