"""Decode CUDA graphs: which steps and sizes take a graph (CPU), and capture/replay on a GPU.

Verify steps (speculation: K + 1 rows per request) have graphs of their own. Without a GPU this
checks their capture set, their padded inputs, that a graph's inputs sit where the capture left
them, and, with graphs emulated (--emulate-cuda-graphs: each "graph" the forward closure built over
the all-padding capture step, reading what a CUDA graph would), that graph-run steps give the
tokens of eager ones, that padding never reaches a real row whatever the persistent buffers held
(the verify-graph failure of the first H200 run, reproduced with FA4's paging: fa4_paging.py), and
that the start-up check compares real requests' rows. It cannot check CUDA capture itself (a host
sync inside the forward), graph memory pools or kernel numerics: the tests marked gpu and
bench/gpu_check.py do; FA4's verify-step kernels are compile-checked under FakeTensorMode in
tests/attention/test_attn_fa4_compile.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mmserve.worker.cuda_graphs import (
    CUDA,
    UniformStepGraphs,
    capture_sizes,
    graph_query_lens,
    uniform_query_len,
)


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(3) == (1, 2, 3)
    graphs = UniformStepGraphs(capture_sizes(20), mode=CUDA)
    assert [graphs.size_for(n) for n in (1, 2, 3, 5, 8, 9, 17, 20, 21)] == [1, 2, 4, 8, 8, 16, 20, 20, None]


def test_disabled_graphs_run_everything_eagerly():
    graphs = UniformStepGraphs(capture_sizes(64), mode=None)
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
    assert graph_query_lens(0, 16) == (1,) and graph_query_lens(3, 16) == (1, 4)
    assert graph_query_lens(16, 16) == (1,)   # 17 rows of padding cannot each own a slot of the null block
    graphs = UniformStepGraphs(capture_sizes(20), mode=CUDA, query_lens=graph_query_lens(3, 4), max_tokens=48)
    assert graphs.by_query_len == {1: (1, 2, 4, 8, 16, 20), 4: (1, 2, 4, 8)}
    assert [graphs.size_for(n, 4) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]
    assert graphs.size_for(3, 2) is None and graphs.size_for(17) == 20
    rows = [s * q for s, q in graphs.keys]
    assert rows == sorted(rows, reverse=True) and len(graphs.keys) == 10   # most rows first: one memory pool
    assert UniformStepGraphs(capture_sizes(20), mode=None, query_lens=(1, 4)).size_for(1, 4) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_replay_reads_the_persistent_inputs_of_its_size():
    x = torch.zeros(8, 4, device="cuda")
    weight = torch.randn(4, 4, device="cuda")
    graphs = UniformStepGraphs((2, 8), mode=CUDA)
    graphs.capture_all(lambda size, query_len: (lambda: torch.tanh(x[:size] @ weight)))
    for size in (2, 8):
        x.copy_(torch.randn_like(x))
        out = graphs.replay(size)
        torch.testing.assert_close(out, torch.tanh(x[:size] @ weight))


def test_graphs_on_cuda_or_emulated_without_enforce_eager_and_with_capturable_backends():
    from mmserve.worker.cuda_graphs import EMULATED, graph_mode

    assert graph_mode("cuda", False, False, [True, True]) == CUDA
    assert graph_mode("cuda", True, False, [True, True]) is None       # --enforce-eager
    assert graph_mode("cpu", False, False, [True, True]) is None
    assert graph_mode("cpu", False, True, [True, True]) == EMULATED    # --emulate-cuda-graphs
    assert graph_mode("cpu", True, True, [True, True]) is None
    assert graph_mode("cuda", False, False, [True, False]) is None     # e.g. sdpa on one layer type


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
        s.request.draft_token_ids = [11 + j for j in range(drafts)]   # each verifies `drafts` drafts
    out = sched.schedule()
    assert all(s.num_tokens == 1 + drafts and len(s.draft_token_ids) == drafts for s in out.scheduled)
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
    assert_padding_reads_only_what_it_writes(padded, specs, 3, 1)


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
    real = model_runner.graph_mode
    monkeypatch.setattr(model_runner, "graph_mode", lambda *args: seen.append(args) or real(*args))
    for eager in (True, False):
        llm = LLM(device="cpu", enforce_eager=eager, max_num_seqs=4)
        assert not llm.core.runner.graphs.enabled and not llm.core.runner.piecewise.enabled   # eager unless emulated
    # the uniform graphs, then the piecewise ones
    assert [args[:3] for args in seen] == [("cpu", True, False)] * 2 + [("cpu", False, False)] * 2


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
        assert (md.seq_lens[3:] == 4).all() and (md.block_table[3:] == 0).all() and md.max_seq_len >= 4
        assert torch.equal(md.slot_mapping[:12], want[t]) and md.slot_mapping[12:].tolist() == [0, 1, 2, 3] * 5
    assert_padding_reads_only_what_it_writes(padded, specs, 3, 4)
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


def assert_padding_reads_only_what_it_writes(inputs, specs, num_real: int, query_len: int) -> None:
    """Every token, padding included, sits at the slot its own table names for its position; padding
    tables are all null block; a slot two tokens write is written by padding tokens of one position
    (so of equal values: every padding request computes the same rows), and a padding request's
    keys, positions 0..q-1 of its table, are exactly the slots it writes."""
    for t in specs:
        md = inputs.common[t]
        qsl, seq_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
        writers: dict[int, set] = {}
        for r in range(md.num_reqs):
            padding = r >= num_real
            for i in range(qsl[r], qsl[r + 1]):
                p = int(md.positions[i])
                slot = int(md.block_table[r, p // md.block_size]) * md.block_size + p % md.block_size
                assert int(md.slot_mapping[i]) == slot, (t, r, i)
                writers.setdefault(slot, set()).add(("padding", p, int(inputs.input_ids[i])) if padding else (r, p))
            if padding:
                assert (md.block_table[r] == 0).all() and seq_lens[r] == qsl[r + 1] - qsl[r] == query_len
                assert sorted(int(md.positions[i]) for i in range(qsl[r], qsl[r + 1])) == list(range(query_len))
        assert all(len(w) == 1 for w in writers.values()), {s: w for s, w in writers.items() if len(w) > 1}


def test_speculating_steps_run_as_graphs_give_the_tokens_of_eager_steps(speculating_target):
    """Flex (capturable, and it runs on a CPU) under emulated graphs: speculating requests, greedy and
    seeded random, whose draft counts differ step to step (max_tokens staggered, so each nears its
    end at another time) give the tokens of --enforce-eager, and every step in which they all
    decode replays a graph: the scheduler pads each chunk to K + 1 rows (pads never sampled, always
    rolled back), where before a single shorter chunk made the step eager. Every block is free at the end."""
    from engine_helpers import build_request, make_llm
    from test_engine_batching import assert_pools_full

    # The mixed-workload test's target and engine shapes (max_num_seqs 8): flex's 4 graphs (2 layer
    # types x the runner's and the drafter's capacities) compile once for both tests (~20 s cold).
    model, _, assistant = speculating_target
    requests = [build_request(f"r{i}", [12 + i], seed=i, max_tokens=[7, 10, 14][i]) for i in range(3)]
    requests[1].sampling = dataclasses.replace(requests[1].sampling, temperature=1.0, seed=7)
    runs, steps = {}, []
    for eager in (True, False):
        llm = make_llm((model, None), attention_backend="flex", max_num_seqs=8, enforce_eager=eager,
                       emulate_cuda_graphs=True, speculative_model=assistant,
                       num_speculative_tokens=3)
        runner = llm.core.runner
        execute = runner.execute

        def recording(out, *prev, runner=runner, execute=execute):
            replays = runner.graphs.replays
            result = execute(out, *prev)
            steps.append((not any(s.is_prefill for s in out.scheduled), runner.graphs.replays > replays,
                          {len(s.draft_token_ids) for s in out.scheduled}))
            return result

        runner.execute = recording
        runs[eager] = {c.request_id: c.token_ids for c in llm.generate(requests)}
        assert_pools_full(llm.core)
        if eager:
            steps.clear()
    assert runs[False] == runs[True]
    decode_steps = [(replayed, drafts) for decoding, replayed, drafts in steps if decoding]
    assert all(replayed for replayed, _ in decode_steps), decode_steps
    assert any(len(drafts) > 1 for _, drafts in decode_steps), "steps mixed draft counts"
    assert llm.core.runner.graphs.replays_by_query_len.get(4, 0) > 0 and llm.core.speculator.accepted[0] > 0


@pytest.fixture(scope="module")
def paged_target(tmp_path_factory):
    """A tiny target and its assistant; the window holds every context of these tests, so no real
    request's table has a freed (null) entry: a real row never loads the null block."""
    from gemma4_fixtures import make_assistant, make_checkpoint, tiny_config

    root = tmp_path_factory.mktemp("paged_target")
    cfg = tiny_config(window=64)
    hf = make_checkpoint(root / "target", config=cfg, seed=71)
    make_assistant(root / "assistant", cfg, seed=73, copy_from=hf)
    return root


def fa4_paging_model(root, monkeypatch):
    import fa4_paging

    from mmserve.model import load_model
    from mmserve.worker.backend_check import use_backend

    fa4_paging.register(monkeypatch)
    model = load_model(root / "target", dtype="float32", device="cpu", attention_backend="reference")
    for layer_type in list(model.attention_backends):
        use_backend(model, layer_type, "fa4_paging")
    return model


def test_padding_never_reaches_a_real_row_whatever_the_buffers_held(paged_target, monkeypatch):
    """The H200's verify-graph failure, on a CPU: FA4's paging (the null block is a page like any
    other; duplicate K/V writes land in any order) under emulated graphs, with every persistent buffer
    (step inputs, the backend's tables, the graphs' static outputs, the piecewise graphs' embeddings
    and attention outputs, so every padding row of a piecewise step) and the null block the padding
    requests' tables name filled with garbage (NaN, random ints) before capture and before every
    step. Real rows must give the eager engine's tokens; padding must read nothing but what it
    writes itself: its rows finite, and what it leaves in the null block (where a kernel tile may
    load it beside a real row's keys, weighed by 0: a NaN there would reach that row) finite too.
    Before the fix every padding token wrote slot 0 and read slots 0..q-1: garbage, and raced writes."""
    import fa4_paging
    from engine_helpers import build_request, make_llm

    model = fa4_paging_model(paged_target, monkeypatch)
    requests = [build_request(f"r{i}", [9 + 4 * i], seed=i, max_tokens=10) for i in range(3)]
    gen = torch.Generator().manual_seed(5)

    @torch.inference_mode()
    def fill_garbage(runner):
        buffers = [b.cpu for b in runner.inputs.buffers()]
        buffers += [t for b in runner.attn_builders.values() for t in b.buffers()]
        for t in buffers:
            t.copy_(torch.randint(-2**20, 2**20, t.shape, generator=gen))
        pieces = runner.piecewise
        for t in (runner.graphs._static, pieces._static, pieces._attn_in, pieces._attn_out, pieces.embeds):
            if t is not None:
                t.fill_(float("nan"))
        for cache in runner.kv_caches:
            cache[:, 0] = float("nan")

    runs, padding = {}, []
    for eager in (True, False):
        fa4_paging.write_order.manual_seed(int(eager))
        llm = make_llm((model, None), attention_backend="fa4_paging", max_num_seqs=4, enforce_eager=eager,
                       emulate_cuda_graphs=True, speculative_model=str(paged_target / "assistant"),
                       num_speculative_tokens=3)
        runner = llm.core.runner
        execute, replay = runner.execute, runner._replay

        def garbage_then_execute(out, *prev, runner=runner, execute=execute):
            fill_garbage(runner)
            return execute(out, *prev)

        def replay_recording(scheduled, tables, rows, size, query_len, prev=None, runner=runner, replay=replay):
            inputs, hidden = replay(scheduled, tables, rows, size, query_len, prev)
            real = sum(s.num_tokens for s in scheduled)
            if real < size * query_len:
                padding.append((query_len, hidden[real:size * query_len].clone(),
                                [c[:, 0, :query_len].clone() for c in runner.kv_caches]))
            return inputs, hidden

        runner.execute, runner._replay = garbage_then_execute, replay_recording
        runs[eager] = {c.request_id: c.token_ids for c in llm.generate(requests)}
    assert runs[False] == runs[True]
    assert 4 in {q for q, _, _ in padding}, "verify graphs ran beside padding"
    assert llm.core.runner.piecewise.replays > 0, "prefill steps ran as piecewise graphs, their padding rows NaN"
    for q, rows, null_block in padding:
        assert rows.isfinite().all(), f"padding rows of a {q}-row graph read garbage"
        assert all(c.isfinite().all() for c in null_block), f"padding of a {q}-row graph left garbage in block 0"


def test_the_graph_self_check_replays_real_requests_against_eager(paged_target, monkeypatch):
    """The start-up check of the graphs, on FA4's paging with unordered K/V writes: it passes, as the
    graphs serve correctly (on the H200 it compared only the all-padding capture step's rows, whose
    raced writes differ run to run: "max error 0.208"); and it fails, with --strict-backends refusing
    to start, when a graph's real rows differ from the eager forward: uniform graphs, then piecewise
    ones (each reported as its own component, the other still serving)."""
    from engine_helpers import make_llm

    from mmserve.worker.backend_check import BackendCheckError

    model = fa4_paging_model(paged_target, monkeypatch)
    opts = dict(attention_backend="fa4_paging", max_num_seqs=4, emulate_cuda_graphs=True,
                backend_self_check="on", speculative_model=str(paged_target / "assistant"), num_speculative_tokens=3)
    llm = make_llm((model, None), **opts)
    checks = {c.component: c for c in llm.core.runner.backend_checks}
    assert checks["cuda_graphs"].running == "cuda_graphs", checks["cuda_graphs"].reason
    assert checks["piecewise_graphs"].running == "piecewise_graphs", checks["piecewise_graphs"].reason
    assert llm.core.runner.graphs.replays == 0 and all(
        (c[:, 0] == 0).all() for c in llm.core.runner.kv_caches), "the check leaves no trace"

    from mmserve.worker import model_runner

    real_graphs = model_runner.UniformStepGraphs

    class OffByOneRow(real_graphs):   # a graph whose real rows are wrong: each gets its neighbour's state
        def replay(self, size, query_len=1):
            return super().replay(size, query_len).roll(1, 0)
    monkeypatch.setattr(model_runner, "UniformStepGraphs", OffByOneRow)
    llm = make_llm((model, None), **opts)
    check = {c.component: c for c in llm.core.runner.backend_checks}["cuda_graphs"]
    assert check.running == "eager" and "differs from the eager forward" in check.reason, check
    assert not llm.core.runner.graphs.enabled
    with pytest.raises(BackendCheckError, match="cuda_graphs"):
        make_llm((model, None), strict_backends=True, **opts)
    monkeypatch.undo()
    fa4_paging_model(paged_target, monkeypatch)

    from mmserve.worker.piecewise_graphs import PiecewiseGraphs

    real_attend = PiecewiseGraphs._attend   # pieces whose attention result never reaches the next piece
    monkeypatch.setattr(PiecewiseGraphs, "_attend", lambda self, call, md: real_attend(self, call, md).zero_())
    llm = make_llm((model, None), **opts)
    checks = {c.component: c for c in llm.core.runner.backend_checks}
    assert checks["cuda_graphs"].running == "cuda_graphs"
    assert checks["piecewise_graphs"].running == "eager" and "differs from the eager" in checks["piecewise_graphs"].reason
    assert not llm.core.runner.piecewise.enabled
    with pytest.raises(BackendCheckError, match="piecewise_graphs"):
        make_llm((model, None), strict_backends=True, **opts)


@pytest.fixture(scope="module")
def speculating_target(tmp_path_factory):
    """A tiny target with its tokenizer (grammars) and an assistant, loaded on flex (capturable)."""
    from gemma4_fixtures import make_assistant, make_checkpoint, tiny_config

    from mmserve.model import load_model
    from mmserve.model.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("speculating_target")
    cfg = tiny_config(window=6)
    hf = make_checkpoint(root / "target", config=cfg, seed=81)
    make_assistant(root / "assistant", cfg, seed=83, copy_from=hf)
    model = load_model(root / "target", dtype="float32", device="cpu", attention_backend="flex")
    return model, load_tokenizer(root / "target"), str(root / "assistant")


def mixed_workload():
    """Requests and their arrival steps: decoding ones (greedy, seeded random, a regex grammar, one that
    opts out of speculation) first, then a video whose prefill chunks and frames land among their decodes."""
    from engine_helpers import PROMPTS, build_request

    from mmserve.sampling_params import ResponseFormat

    reqs = [build_request("greedy", [14], seed=1, max_tokens=18),
            build_request("seeded", [11], seed=2, max_tokens=16),
            build_request("grammar", [9], seed=3, max_tokens=20),
            build_request("no-spec", [12], seed=4, max_tokens=14, disable_speculation=True),
            build_request("video", PROMPTS["video"], seed=5, max_tokens=8)]
    reqs[1].sampling = dataclasses.replace(reqs[1].sampling, temperature=1.0, seed=7)
    reqs[2].sampling = dataclasses.replace(reqs[2].sampling, ignore_eos=False,
                                           response_format=ResponseFormat("regex", r"(ab|cd)( [0-9]{1,3})+\."))
    return reqs, {"video": 3}


def device_twins(monkeypatch) -> None:
    """Every staged buffer's device tensor apart from its host staging tensor on a CPU, as on CUDA
    (on a CPU they are one tensor): what the runner moves on the device (async speculation's
    positions) is then not what the host mirrors hold, so a builder that planned from those mirrors,
    or a forward that read them, would compute other tokens."""
    from mmserve.attention import buffers

    def staged(self, shape, dtype, device):
        self.cpu = torch.zeros(shape, dtype=dtype)
        self.np, self.dev = self.cpu.numpy(), torch.zeros(shape, dtype=dtype)

    def workspace(self, device):
        self.host, self.dev = buffers.Workspace("cpu"), buffers.Workspace("cpu")

    monkeypatch.setattr(buffers.StagedBuffer, "__init__", staged)
    monkeypatch.setattr(buffers.StagedWorkspace, "__init__", workspace)


def test_a_mixed_workload_replays_a_graph_nearly_every_step(speculating_target, monkeypatch):
    """Video arriving while others decode, speculation on, a grammar request, a seeded random one, a
    disable_speculation one, under emulated graphs: at least 95% of the steps that ran the model
    replayed a graph (uniform verify steps whole; prefill chunks, frames and mixed lengths as
    piecewise graphs), with the eager engine's tokens, and every block free at the end. The same
    with async scheduling, its buffers' device tensors apart from their host mirrors
    (`device_twins`): each step built before the one in flight is accepted, its drafts and first
    input taken and its positions moved back on the device (flex plans from the host's
    query_start_loc alone), the host mirrors left where the host put them."""
    from engine_helpers import make_llm, step_through
    from test_engine_batching import assert_pools_full

    model, tok, assistant = speculating_target
    runs, steps, moved = {}, {}, []
    for loop in ("eager", "graphs", "async"):
        if loop == "async":
            device_twins(monkeypatch)
        llm = make_llm((model, tok), attention_backend="flex", max_num_seqs=8, enforce_eager=loop == "eager",
                       emulate_cuda_graphs=True, speculative_model=assistant, num_speculative_tokens=3,
                       async_scheduling="on" if loop == "async" else "off")
        runner = llm.core.runner
        execute, shift_on_device, ran = runner.execute, runner.inputs.shift_on_device, []

        def counting(out, *prev, runner=runner, execute=execute, ran=ran):
            before = runner.graphs.replays + runner.piecewise.replays
            result = execute(out, *prev)
            ran.append((runner.graphs.replays + runner.piecewise.replays > before,
                        any(s.frames for s in out.scheduled), any(s.is_prefill for s in out.scheduled)))
            return result

        def shifting(rows, shift, inputs=runner.inputs, shift_on_device=shift_on_device):
            shift_on_device(rows, shift)
            host, dev = inputs.positions.cpu[rows.token_rows], inputs.positions.dev[rows.token_rows]
            moved.append(bool((host != dev).any()))

        runner.execute, runner.inputs.shift_on_device = counting, shifting
        requests, arrivals = mixed_workload()
        runs[loop], steps[loop] = step_through(llm, requests, arrivals=arrivals)[0], ran
        assert_pools_full(llm.core)
        assert llm.core.async_scheduling == (loop == "async")
    assert runs["graphs"] == runs["eager"] and runs["async"] == runs["eager"]
    assert all(len(t) > 0 for t in runs["eager"].values())
    # (drafts rejected, so positions moved back; drafts kept under it: test_engine_speculative's device-positions test)
    assert any(moved) and llm.core.speculator.verified[0] > llm.core.speculator.accepted[0]
    for loop in ("graphs", "async"):
        ran = steps[loop]
        assert any(frames for _, frames, _ in ran) and sum(prefill for _, _, prefill in ran) >= 3
        share = sum(replayed for replayed, _, _ in ran) / len(ran)
        assert share >= 0.95, f"{loop}: {share:.0%} of {len(ran)} steps replayed a graph"
    assert llm.core.runner.graphs.replays > 0 and llm.core.runner.piecewise.replays > 0


def test_piecewise_buckets_cover_every_step_size():
    from mmserve.worker.piecewise_graphs import piecewise_sizes

    sizes = piecewise_sizes(2048)
    assert sizes[:12] == (1, 2, 4, 8, 10, 12, 14, 16, 20, 24, 28, 32) and sizes[-1] == 2048 and len(sizes) == 36
    assert all((b - a - 1) / b < 0.2 for a, b in zip(sizes[3:], sizes[4:], strict=False))   # a step past 8 tokens
    assert piecewise_sizes(100)[-1] == 100 and piecewise_sizes(3) == (1, 2, 3)


def test_the_buffers_piecewise_pieces_read_are_inference_tensors_as_an_eager_steps_are():
    """The first piece's embeddings, q and attention's result between pieces, and the output are
    inference tensors, as an eager step's activations are (the runner builds them outside inference
    mode): a compiled layer piece fed a normal tensor where it was traced with an inference one fails
    dynamo's guards and compiles again, per row regime."""
    from mmserve.worker.cuda_graphs import EMULATED
    from mmserve.worker.piecewise_graphs import PiecewiseGraphs

    pieces = PiecewiseGraphs((1, 2, 4), mode=EMULATED, attn_width=8, dtype=torch.float32, device=torch.device("cpu"),
                             hidden_size=16)
    assert all(t.is_inference() for t in (pieces.embeds, pieces._attn_in, pieces._attn_out, pieces._static))


def test_piecewise_steps_on_sdpa_give_the_eager_tokens(load_backend):
    """Piecewise graphs need no capturable attention (it runs eagerly between the pieces): on sdpa,
    the CPU default, text and image and video prompts chunked beside decodes replay pieces, with
    the tokens of the eager engine."""
    from engine_helpers import PROMPTS, build_request, make_llm

    model_tok = load_backend("sdpa")
    requests = [build_request(f"r{i}", PROMPTS[kind], seed=i, max_tokens=6) for i, kind in enumerate(PROMPTS)]
    runs = {}
    for eager in (True, False):
        llm = make_llm(model_tok, attention_backend="sdpa", enforce_eager=eager, emulate_cuda_graphs=True,
                       max_num_batched_tokens=24)
        runs[eager] = {c.request_id: c.token_ids for c in llm.generate(requests)}
    runner = llm.core.runner
    assert not runner.graphs.enabled and runner.piecewise.replays >= llm.core.step_index - 1
    assert runs[False] == runs[True]


def test_the_drafter_is_sized_for_the_requests_the_kv_plan_lets_run(speculating_target):
    """A KV cache that holds sliding windows for fewer requests than --max-num-seqs lowers the
    engine's count (core/kv_cache/planner.py). The drafter is loaded before that plan (the memory
    profile drafts with it) and then sized by the plan's count: its graphs' buckets, as the target's,
    and its reader's buffers. Before, its graphs went up to the configured count: captures no round
    could use, and their pool's memory."""
    from engine_helpers import make_llm

    model, tok, assistant = speculating_target
    llm = make_llm((model, tok), attention_backend="flex", emulate_cuda_graphs=True, max_num_seqs=16,
                   num_kv_blocks=0, kv_cache_bytes=300 * 1024, max_model_len=256, speculative_model=assistant,
                   num_speculative_tokens=3)
    core, speculator = llm.core, llm.core.speculator
    assert core.config.max_num_seqs < 16, "the plan left every configured request room: the test proves nothing"
    assert speculator.graphs.graphs.sizes == core.runner.graphs.sizes
    assert speculator.graphs.graphs.sizes[-1] == speculator.attention.max_num_seqs == core.config.max_num_seqs


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_drafter_graphs_draft_as_eager_drafting_whatever_their_buffers_held(speculating_target, monkeypatch,
                                                                            async_scheduling):
    """The drafter's K steps as one emulated graph per bucket (spec_decode/draft_graphs.py), over
    FA4's paging: every buffer a round refills (the round's tokens and hidden rows, the reader's
    key counts and positions, the backend's tables and the graphs' shared output; not the reader's
    block tables, whose unused tail it keeps pointing at the null block across rounds) filled with
    garbage before capture and before every round. Each round's drafts (real rows), the tokens and
    the acceptance counts (some drafts accepted, so acceptance is checked) must equal eager
    drafting's; rounds of 1 and 3 requests replay the buckets of 1 and 4 (padding beside real rows).
    Before the graphs every round ran eagerly."""
    from engine_helpers import build_request, make_llm

    root = Path(speculating_target[2]).parent
    model = fa4_paging_model(root, monkeypatch)
    requests = [build_request(f"r{i}", [9 + 4 * i], seed=i, max_tokens=[8, 16, 24][i]) for i in range(3)]
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    vocab = model.spec.vocab_size

    @torch.inference_mode()
    def fill_garbage(speculator):
        graphs, reader = speculator.graphs, speculator.attention
        graphs.tokens.copy_(torch.randint(0, vocab, graphs.tokens.shape, generator=gen))
        graphs.hidden.fill_(float("nan"))
        for t in [reader.seq_lens.cpu, reader.positions.cpu, *(k.table.cpu for k in reader._types.values()),
                  *(t for k in reader._types.values() for t in k.builder.buffers())]:
            t.copy_(torch.randint(-2**20, 2**20, t.shape, generator=gen))
        if graphs.graphs._static is not None:
            graphs.graphs._static.fill_(-7)

    runs = {}
    for use_graphs in (False, True):
        llm = make_llm((model, None), attention_backend="fa4_paging", max_num_seqs=4, emulate_cuda_graphs=True,
                       speculative_model=str(root / "assistant"), num_speculative_tokens=3,
                       async_scheduling=async_scheduling)
        speculator = llm.core.speculator
        if not use_graphs:
            speculator.use_graphs(None)
        rounds = []
        name = "propose_on_device" if async_scheduling == "on" else "propose"
        propose = getattr(speculator, name)

        def recording(*args, speculator=speculator, propose=propose, rounds=rounds, **kwargs):
            fill_garbage(speculator)
            drafts = propose(*args, **kwargs)
            if len(drafts):   # a step with no request to draft for makes no round
                rounds.append(drafts.tolist() if torch.is_tensor(drafts) else drafts)
            return drafts

        monkeypatch.setattr(speculator, name, recording)
        tokens = {c.request_id: c.token_ids for c in llm.generate(requests)}
        runs[use_graphs] = (tokens, rounds, speculator.verified, speculator.accepted)
        graphs = speculator.graphs
        assert (graphs.replays, graphs.eager_rounds) == ((len(rounds), 0) if use_graphs else (0, len(rounds)))
    assert runs[True] == runs[False]
    assert {len(r) for r in runs[True][1]} >= {1, 3}, runs[True][1]   # buckets 1 and 4 (padded) replayed
    assert sum(runs[True][3]) > 0, "no draft was ever accepted: acceptance went unchecked"


def test_drafting_rounds_that_cannot_replay_say_why_once(caplog):
    """Rounds without graphs, with grammar-masked drafts or larger than every bucket run eagerly
    (tensor parallelism replays: tests/engine/test_engine_tensor_parallel_async.py): each reason given, counted per round, logged once."""
    from mmserve.spec_decode.draft_graphs import DraftGraphs
    from mmserve.worker.cuda_graphs import EMULATED

    def graphs(mode):
        return DraftGraphs(None, None, None, mode=mode, max_num_seqs=4, hidden_size=8, dtype=torch.float32,
                           device=torch.device("cpu"))
    on = graphs(EMULATED)
    assert on.eager_reason(3, masked=False) is None
    assert "grammar" in on.eager_reason(1, masked=True)
    assert "no bucket holds them (largest 4)" in on.eager_reason(5, masked=False)
    reason = graphs(None).eager_reason(1, masked=False)
    assert "no graphs" in reason
    with caplog.at_level("INFO", logger="mmserve.spec_decode.draft_graphs"):
        for _ in range(3):
            on.count_eager(reason)
    assert on.eager_rounds == 3 and sum(reason in r.getMessage() for r in caplog.records) == 1
