"""On CUDA: pinned staging buffers copy to the device unchanged, and the engine's greedy tokens
match the CPU run (fp32). Skipped without a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import PROMPTS, build_request, make_llm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_step_inputs_match_cpu():
    from sched_helpers import SPECS, admit, make_request, make_scheduler

    from mmserve.worker.block_table import BlockTables
    from mmserve.worker.step_inputs import StepInputBuilder

    sched = make_scheduler(max_num_batched_tokens=48)
    for i in range(5):
        admit(sched, make_request(f"r{i}", 20 + 7 * i, [(3, 9), (12, 19)], max_tokens=3))
    width = sched.kv.max_blocks_per_req
    opts = dict(max_num_tokens=48, max_num_seqs=sched.max_num_seqs, max_blocks_per_req=width,
                block_size=sched.kv.block_size)
    cpu, gpu = StepInputBuilder(SPECS, device="cpu", **opts), StepInputBuilder(SPECS, device="cuda", **opts)
    tables = BlockTables(SPECS, width)
    assert gpu.input_ids.cpu.is_pinned() and gpu.input_ids.dev.is_cuda
    for _ in range(4):
        out = sched.schedule()
        rows = tables.apply(out.scheduled)
        a, b = cpu.build(out.scheduled, tables.rows, rows), gpu.build(out.scheduled, tables.rows, rows)
        torch.cuda.synchronize()
        assert torch.equal(a.input_ids, b.input_ids.cpu()) and torch.equal(a.positions, b.positions.cpu())
        for t in SPECS:
            ma, mb = a.common[t], b.common[t]
            for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
                assert torch.equal(getattr(ma, name), getattr(mb, name).cpu()), name
            assert (ma.query_ranges is None) == (mb.query_ranges is None)
            if ma.query_ranges is not None:
                assert torch.equal(ma.query_ranges, mb.query_ranges.cpu())
        sched.update(out)


def test_cuda_engine_tokens_match_cpu(load_backend, engine_checkpoint):
    from mmserve.model import load_model

    path, _ = engine_checkpoint
    cpu_model_tok = load_backend("reference")
    cuda_model = load_model(path, dtype="float32", device="cuda", attention_backend="sdpa")
    reqs = [build_request(kind, parts, 5) for kind, parts in PROMPTS.items()]
    want = [c.token_ids for c in make_llm(cpu_model_tok, max_num_batched_tokens=16).generate(reqs)]
    got = [c.token_ids for c in make_llm((cuda_model, cpu_model_tok[1]), device="cuda",
                                         max_num_batched_tokens=16).generate(reqs)]
    assert got == want


def gpu_model(engine_checkpoint, backend: str = "auto"):
    """The engine checkpoint in bf16 on CUDA with `--attention-backend backend` (FA4 where it runs, flex elsewhere)."""
    from mmserve.model import load_model

    path, _ = engine_checkpoint
    return load_model(path, dtype="bfloat16", device="cuda", attention_backend=backend)


def test_decode_graphs_give_the_eager_tokens(load_backend, engine_checkpoint):
    """The same bf16 kernels replayed as decode graphs and run eagerly: identical greedy tokens."""
    tok = load_backend("reference")[1]
    model = gpu_model(engine_checkpoint)
    reqs = [build_request(kind, parts, 11, max_tokens=12) for kind, parts in PROMPTS.items()]
    eager = make_llm((model, tok), device="cuda", block_size=16, enforce_eager=True)
    graphs = make_llm((model, tok), device="cuda", block_size=16)
    assert not eager.core.runner.graphs.enabled and graphs.core.runner.graphs.enabled
    assert [c.token_ids for c in graphs.generate(reqs)] == [c.token_ids for c in eager.generate(reqs)]


def without_syncs(fn):
    """`fn` under CUDA sync debug mode "error": any device->host sync inside it raises."""
    def run(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return run


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_a_step_syncs_with_the_host_only_in_the_sampler(load_backend, engine_checkpoint, enforce_eager):
    """CUDA sync debug mode raises on any device->host sync inside the runner's step (prefill with frames,
    decode); the sampler's one copy of the sampled tokens is outside it."""
    tok = load_backend("reference")[1]
    llm = make_llm((gpu_model(engine_checkpoint), tok), device="cuda", block_size=16, enforce_eager=enforce_eager)
    llm.core.runner.execute = without_syncs(llm.core.runner.execute)
    llm.generate([build_request(kind, parts, 3, max_tokens=6) for kind, parts in PROMPTS.items()])


def test_the_sampling_of_every_row_kind_never_syncs(load_backend, engine_checkpoint):
    """CUDA sync debug mode raises on any device->host sync while the async loop queues a step's
    sampling (random, seeded, penalised, biased, logprob and grammar rows) and its prompt logprobs
    (in the runner's step): their results reach the host only through pinned non-blocking copies."""
    from test_engine_async import ROW_KINDS

    tok = load_backend("reference")[1]
    llm = make_llm((gpu_model(engine_checkpoint), tok), device="cuda", block_size=16, async_scheduling="on")
    llm.core.runner.execute = without_syncs(llm.core.runner.execute)
    llm.core.sampler.launch = without_syncs(llm.core.sampler.launch)
    requests = []
    for k, (kind, options) in enumerate(ROW_KINDS.items()):
        request = build_request(kind, PROMPTS["image"] if kind == "prompt_logprobs" else [12], 3 + k, max_tokens=6)
        request.sampling = dataclasses.replace(request.sampling, **options)
        requests.append(request)
    assert all(c.token_ids for c in llm.generate(requests))


def test_the_top_p_kernel_keeps_the_bisections_nucleus():
    """At Gemma 4's vocabulary, the Triton kernel the sampler launches on CUDA keeps, row for row,
    the set torch's bisection keeps (top_p random, so a tie in float32 sums is unlikely), and leaves
    rows not asked for alone."""
    from mmserve.sample.nucleus import launch_nucleus_filter, nucleus

    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ())))
    probs = torch.softmax(torch.randn(17, 262_144, generator=gen, device="cuda") * 4, dim=-1)
    top_p = torch.rand(16, generator=gen, device="cuda") * 0.9 + 0.05
    got = probs.clone()
    launch_nucleus_filter(got, torch.arange(1, 17, device="cuda"), top_p)
    assert torch.equal(got[1:] > 0, nucleus(probs[1:], top_p))
    assert torch.equal(got[0], probs[0])
