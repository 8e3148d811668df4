"""Decode CUDA graphs: which steps and sizes take a graph (CPU), and capture/replay on a GPU.

Verify steps (speculation: K + 1 rows per request) have graphs of their own. Without a GPU this
checks their capture set, their padded inputs, that a graph's inputs sit where the capture left
them, and, with each "graph" emulated by the forward closure built over the all-padding capture
step (it reads what a CUDA graph would: the capture's views and metadata objects, refilled in place
by later steps), that graph-run verify steps give the tokens of eager ones. It cannot check CUDA
capture itself (a host sync inside the forward), graph memory pools or kernel numerics: the tests
marked gpu and bench/gpu_check.py do; FA4's verify-step kernels are compile-checked under
FakeTensorMode in tests/attention/test_attn_fa4_compile.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmserve.worker.cuda_graphs import UniformStepGraphs, capture_sizes, graph_query_lens, uniform_query_len


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(3) == (1, 2, 3)
    graphs = UniformStepGraphs(capture_sizes(20), enabled=True)
    assert [graphs.size_for(n) for n in (1, 2, 3, 5, 8, 9, 17, 20, 21)] == [1, 2, 4, 8, 8, 16, 20, 20, None]


def test_disabled_graphs_run_everything_eagerly():
    graphs = UniformStepGraphs(capture_sizes(64), enabled=False)
    assert not graphs.enabled and graphs.size_for(1) is None


def test_uniform_steps_without_frames_take_a_graph_of_their_query_length():
    assert uniform_query_len([1, 1, 1], False, False) == 1
    assert uniform_query_len([1], False, True) == 1           # a prompt's last token
    assert uniform_query_len([4, 4], False, False) == 4       # a verify step, K = 3
    assert uniform_query_len([4, 4], False, True) is None     # prompt chunks of 4: eager
    assert uniform_query_len([1, 4], False, False) is None    # a plain decode beside a verify chunk
    assert uniform_query_len([1], True, False) is None
    assert uniform_query_len([], False, False) is None


def test_verify_graphs_are_captured_for_k_plus_1_rows_within_the_token_buffers():
    assert graph_query_lens(0) == (1,) and graph_query_lens(3) == (1, 4)
    graphs = UniformStepGraphs(capture_sizes(20), enabled=True, query_lens=graph_query_lens(3), max_tokens=48)
    assert graphs.by_query_len == {1: (1, 2, 4, 8, 16, 20), 4: (1, 2, 4, 8)}
    assert [graphs.size_for(n, 4) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]
    assert graphs.size_for(3, 2) is None and graphs.size_for(17) == 20
    rows = [s * q for s, q in graphs.keys]
    assert rows == sorted(rows, reverse=True) and len(graphs.keys) == 10   # most rows first: one memory pool
    assert UniformStepGraphs(capture_sizes(20), enabled=False, query_lens=(1, 4)).size_for(1, 4) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_replay_reads_the_persistent_inputs_of_its_size():
    x = torch.zeros(8, 4, device="cuda")
    weight = torch.randn(4, 4, device="cuda")
    graphs = UniformStepGraphs((2, 8), enabled=True)
    graphs.capture_all(lambda size, query_len: (lambda: torch.tanh(x[:size] @ weight)))
    for size in (2, 8):
        x.copy_(torch.randn_like(x))
        out = graphs.replay(size)
        torch.testing.assert_close(out, torch.tanh(x[:size] @ weight))


def test_graphs_only_on_cuda_without_enforce_eager_and_with_capturable_backends():
    from mmserve.worker.cuda_graphs import graphs_enabled

    assert graphs_enabled("cuda", False, [True, True])
    assert not graphs_enabled("cuda", True, [True, True])       # --enforce-eager
    assert not graphs_enabled("cpu", False, [True, True])
    assert not graphs_enabled("cuda", False, [True, False])     # e.g. sdpa on one layer type


def decode_step(num_reqs: int, drafts: int = 0):
    """A scheduler past its prefills (every request now schedules one token) and the runner's tables."""
    from sched_helpers import SPECS, admit, make_request, make_scheduler

    from mmserve.worker.block_table import BlockTables
    from mmserve.worker.step_inputs import StepInputBuilder

    sched = make_scheduler(max_num_batched_tokens=256, max_num_seqs=16)
    for i in range(num_reqs):   # prompts share no block: one that did would wait for the first to compute it
        admit(sched, make_request(f"r{i}", 5 + 3 * i, max_tokens=8, first=3 + 100 * i))
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
    if drafts:   # each request verifies `drafts` draft tokens (their K/V slots are not allocated: shapes only)
        out.scheduled = [dataclasses.replace(s, num_tokens=1 + drafts, draft_token_ids=[11 + j for j in range(drafts)])
                         for s in out.scheduled]
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
    from mmserve.engine.llm import LLM
    from mmserve.worker import model_runner

    seen = []
    real = model_runner.graphs_enabled
    monkeypatch.setattr(model_runner, "graphs_enabled", lambda *args: seen.append(args) or real(*args))
    for eager in (True, False):
        llm = LLM(device="cpu", enforce_eager=eager, max_num_seqs=4)
        assert not llm.core.runner.graphs.enabled   # CPU steps are always eager
    assert [(device, eager) for device, eager, _ in seen] == [("cpu", True), ("cpu", False)]


def test_a_padded_verify_step_pads_with_null_block_requests_of_k_plus_1_rows():
    import numpy as np

    out, tables, builder, specs = decode_step(3, drafts=3)
    rows = tables.apply(out.scheduled)
    plain = builder.build(out.scheduled, tables.rows, rows)
    ids, positions, logits = plain.input_ids.clone(), plain.positions.clone(), plain.logits_indices.clone()
    want = {t: plain.common[t].slot_mapping.clone() for t in specs}
    padded = builder.build(out.scheduled, tables.rows, rows, pad_to=8, query_len=4)
    assert padded.num_tokens == 32 and torch.equal(padded.logits_indices, logits) and len(logits) == 12
    assert torch.equal(padded.input_ids[:12], ids) and torch.equal(padded.positions[:12], positions)
    assert padded.positions[12:].tolist() == [0, 1, 2, 3] * 5 and (padded.input_ids[12:] == 0).all()
    for t in specs:
        md = padded.common[t]
        assert (md.num_reqs, md.num_actual_tokens, md.max_query_len) == (8, 32, 4)
        assert md.query_start_loc.tolist() == list(range(0, 33, 4))
        assert (md.seq_lens[3:] == 4).all() and (md.block_table[3:] == 0).all()
        assert torch.equal(md.slot_mapping[:12], want[t]) and (md.slot_mapping[12:] == 0).all()
    # the capture's all-padding step reads the same storage and bakes in the same max_query_len
    capture = builder.build([], tables.rows, np.empty(0, dtype=np.int64), pad_to=8, query_len=4)
    step = builder.build(out.scheduled, tables.rows, rows, pad_to=8, query_len=4)

    def addresses(inputs):
        views = [inputs.input_ids, inputs.positions] + [getattr(inputs.common[t], f) for t in specs
                                                         for f in ("query_start_loc", "seq_lens", "block_table",
                                                                   "slot_mapping")]
        return [(v.data_ptr(), tuple(v.shape)) for v in views] + [inputs.common[t].max_query_len for t in specs]
    assert addresses(capture) == addresses(step)
    with pytest.raises(ValueError, match="uniform steps"):
        builder.build(out.scheduled, tables.rows, rows, pad_to=8)   # 4 tokens per request, padded as 1


class ReplayedClosures(UniformStepGraphs):
    """Each "graph" is the forward closure built over its all-padding capture step, run again at
    replay: what a CUDA graph reads (the capture's input views and metadata objects, refilled in
    place by each later step), on a CPU."""

    def capture_all(self, forward_for):
        self._closures = {key: forward_for(*key) for key in self.keys}

    def replay(self, size, query_len=1):
        self.replays += 1
        self.replays_by_query_len[query_len] = self.replays_by_query_len.get(query_len, 0) + 1
        return self._closures[size, query_len]()


def test_verify_steps_run_as_graphs_give_the_tokens_of_eager_steps(tmp_path, monkeypatch):
    """Flex (capturable, and it runs on a CPU) under emulated graphs: greedy speculating requests
    give the same tokens as --enforce-eager, and verify steps (4 rows per request) did run as graphs."""
    from engine_helpers import build_request, make_llm
    from gemma4_fixtures import make_assistant, make_checkpoint, tiny_config

    from mmserve.model import load_model
    from mmserve.worker import model_runner

    cfg = tiny_config(window=6)
    hf = make_checkpoint(tmp_path / "target", config=cfg, seed=61)
    make_assistant(tmp_path / "assistant", cfg, seed=63, copy_from=hf)
    model = load_model(tmp_path / "target", dtype="float32", device="cpu", attention_backend="flex")
    monkeypatch.setattr(model_runner, "UniformStepGraphs", ReplayedClosures)
    monkeypatch.setattr(model_runner, "graphs_enabled", lambda device, eager, capturable: not eager and all(capturable))
    requests = [build_request(f"r{i}", [12 + i], seed=i, max_tokens=24) for i in range(3)]
    runs = {}
    for eager in (True, False):
        llm = make_llm((model, None), attention_backend="flex", max_num_seqs=4, enforce_eager=eager,
                       speculative_model=str(tmp_path / "assistant"), num_speculative_tokens=3)
        runs[eager] = {c.request_id: c.token_ids for c in llm.generate(requests)}
    assert runs[False] == runs[True]
    graphs = llm.core.runner.graphs
    assert graphs.by_query_len.get(4) and graphs.replays_by_query_len.get(4, 0) > 0, graphs.replays_by_query_len
    assert llm.core.speculator.accepted[0] > 0
