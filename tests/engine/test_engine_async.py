"""Async scheduling (--async-scheduling on): step N+1 is scheduled and launched before step N's
tokens reach the host, its inputs taking them on the device; outputs arrive one step late.

The reference is the synchronous loop (itself tested against transformers): the same requests give
the same tokens, logprobs, prompt logprobs and finish reasons, whatever mix of text, images,
video, seeded sampling, penalties, grammars, EOS, n > 1, preemption and cancellation the steps hold;
at the end every KV block is free and no generator or matcher is left.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path

import pytest
import torch
from engine_helpers import (
    PROMPTS,
    assert_tokens_agree,
    build_request,
    greedy_agree,
    make_llm,
    record_decisions,
    step_through,
)
from test_engine_batching import assert_pools_full, random_requests

import mmserve.worker.model_runner as model_runner_module
from mmserve.sampling_params import ResponseFormat

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_scripts import bench_script  # noqa: E402


@pytest.fixture(scope="module")
def model_tok(load_backend):
    return load_backend("sdpa")


def outputs(completions) -> dict:
    return {c.request_id: (c.token_ids, c.finish_reason, [lp.logprob for lp in c.logprobs or []],
                           [lp.logprob for lp in c.prompt_logprobs or []]) for c in completions}


def assert_synchronous_outputs(got: dict, want: dict, requests: list, decisions: dict) -> None:
    """`got` (the async loop's `outputs`) are `want` (the synchronous loop's): seeded draws' tokens
    exactly, greedy ones up to a near tie the synchronous run's own logits hold (`decisions`,
    engine_helpers.greedy_agree), finish reasons and logprobs up to such a divergence (float
    rounding: a step's batch-mates may differ), prompt logprobs whole."""
    greedy = {r.request_id for r in requests if r.sampling.greedy}
    assert got.keys() == want.keys()
    for rid, (tokens, reason, logprobs, prompt_logprobs) in want.items():
        ours = got[rid]
        same = greedy_agree(tokens, ours[0], decisions[rid]) if rid in greedy else len(tokens)
        assert rid in greedy or ours[0] == tokens, rid
        assert same < len(tokens) or ours[1] == reason, rid
        for a, b in ((ours[2][:same], logprobs[:same]), (ours[3], prompt_logprobs)):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)


def mixed_requests(seed: int) -> list:
    reqs = random_requests(8, seed, max_tokens=(1, 12))
    extra = [build_request("seeded", PROMPTS["image"], seed=seed + 1, max_tokens=10),
             build_request("scored", PROMPTS["text"], seed=seed + 2, max_tokens=7),
             build_request("grammar", [9], seed=seed + 3, max_tokens=24),
             build_request("eos", [6], seed=seed + 4, max_tokens=30)]
    extra[0].sampling = dataclasses.replace(extra[0].sampling, temperature=0.9, top_p=0.9, seed=5)
    extra[1].sampling = dataclasses.replace(extra[1].sampling, logprobs=True, top_logprobs=2, prompt_logprobs=True,
                                            repetition_penalty=1.4, min_tokens=3)
    extra[2].sampling = dataclasses.replace(extra[2].sampling, ignore_eos=False, response_format=ResponseFormat(
        "json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})))
    extra[3].sampling = dataclasses.replace(extra[3].sampling, ignore_eos=False, temperature=1.0, seed=11, n=2,
                                            logit_bias=((1, 6.0),))   # EOS (id 1) likely within a few steps
    return reqs + extra


def test_async_steps_give_the_synchronous_outputs(model_tok):
    """Mixed requests (text, images, video, chunked prefill beside decodes; greedy, seeded top-p,
    logprobs and prompt logprobs with penalties, a JSON grammar, EOS live, n = 2), with and without
    emulated graphs: async and synchronous loops give the same tokens and finish reasons, the same
    logprobs (to float rounding: a step's batch-mates may differ) and leave nothing held."""
    seed = int(torch.randint(0, 1000, ()))
    requests = mixed_requests(seed)
    runs, decisions = {}, {}
    for mode in ("off", "on"):
        for graphs in (False, True):
            llm = make_llm(model_tok, async_scheduling=mode, emulate_cuda_graphs=graphs, max_num_batched_tokens=48,
                           attention_backend="sdpa")
            decisions[mode, graphs] = record_decisions(llm)
            runs[mode, graphs] = outputs(llm.generate(requests))
            assert llm.core.async_scheduling == (mode == "on")
            assert_pools_full(llm.core)
            assert not llm.core.sampler.grammar._matchers
    for graphs in (False, True):   # steps hold other batch-mates (a request ended at N is computed in N + 1)
        assert_synchronous_outputs(runs["on", graphs], runs["off", graphs], requests, decisions["off", graphs])
    assert any(reason == "eos" for _, reason, _, _ in runs["on", False].values()), "some request ended on EOS"


ROW_KINDS = {   # each kind of row the sampler treats apart
    "greedy": {}, "random": dict(temperature=0.8, top_p=0.9, top_k=50),
    "seeded": dict(temperature=1.0, top_p=0.7, seed=7),
    "penalised": dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3),
    "biased": dict(logit_bias=((5, 3.0), (9, -2.0)), min_tokens=4, ignore_eos=False),
    "logprobs": dict(logprobs=True, top_logprobs=5), "prompt_logprobs": dict(prompt_logprobs=True, top_logprobs=3),
    "json": dict(ignore_eos=False, response_format=ResponseFormat("json_schema", json.dumps(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))),
}


@pytest.fixture(scope="module")
def device_reads():
    with bench_script("device_reads") as module:
        yield module


def test_no_row_kind_makes_the_sampling_wait_for_the_device(model_tok, device_reads, monkeypatch):
    """Every kind of row (random, seeded, top-k/top-p, penalties, bias and min_tokens, logprobs,
    prompt logprobs, a JSON grammar) is sampled, and its prompt logprobs computed, with no call that
    waits for the stream on CUDA (bench/device_reads.py: a device tensor indexed with a host list,
    torch.tensor(device=), .tolist(), .item(), .cpu(), boolean masks), so the async loop queues a
    step's sampling while the next forward runs; tokens and logprobs are the synchronous loop's."""
    seed = int(torch.randint(0, 1000, ()))
    requests = []
    for k, (kind, options) in enumerate(ROW_KINDS.items()):
        request = build_request(kind, PROMPTS["image"] if kind == "prompt_logprobs" else [12], seed=seed + k,
                                max_tokens=8)
        request.sampling = dataclasses.replace(request.sampling, **options)
        requests.append(request)
    runs = {}
    for mode in ("off", "on"):
        llm = make_llm(model_tok, async_scheduling=mode, attention_backend="sdpa")
        if mode == "off":
            decisions = record_decisions(llm)
        reads = device_reads.DeviceReads()
        monkeypatch.setattr(llm.core.sampler, "launch", reads.around(llm.core.sampler.launch, 0))
        monkeypatch.setattr(model_runner_module, "prompt_logprobs", reads.around(model_runner_module.prompt_logprobs, 1))
        runs[mode] = outputs(llm.generate(requests))
        monkeypatch.undo()
        assert not reads.sites, (mode, dict(reads.sites))
        assert all(len(runs[mode][r.request_id][0]) > 0 for r in requests)
    got = runs["on"]
    assert_synchronous_outputs(got, runs["off"], requests, decisions)
    assert len(got["logprobs"][2]) == len(got["logprobs"][0]) and got["prompt_logprobs"][3]
    probe = device_reads.DeviceReads()   # the instrument counts what today's sampler did
    logits = torch.randn(4, 8)
    probe.mark(logits)
    with probe:
        logits[[0, 2]].argmax(-1).tolist()
    assert sum(probe.sites.values()) == 2


def test_a_step_takes_the_token_in_flight_on_the_device_and_outputs_arrive_one_step_late(model_tok):
    """With async scheduling the decode step after a request's prompt is launched before the prompt's
    token reached the host: the runner's inputs hold that token once the device copied it there,
    and each step's outputs are those of the step before."""
    request = build_request("one", [20], seed=3, max_tokens=4)
    per_step = {}
    for mode in ("off", "on"):
        llm = make_llm(model_tok, async_scheduling=mode, attention_backend="sdpa")
        llm.add_request(request)
        tokens, seen_inputs = [], []
        execute = llm.core.runner.execute

        def recording(out, prev=None, execute=execute, runner=llm.core.runner, seen=seen_inputs):
            result = execute(out, prev)
            seen.append((out.scheduled[0].num_computed_tokens, int(runner.inputs.input_ids.dev[0])))
            return result

        llm.core.runner.execute = recording
        while llm.has_work:
            tokens.append([t for _, item in llm.step() for t in item.new_token_ids])
        per_step[mode] = tokens, seen_inputs
    sync_tokens, sync_inputs = per_step["off"]
    async_tokens, async_inputs = per_step["on"]
    emitted = [t for step in sync_tokens for t in step]
    assert [t for step in async_tokens for t in step] == emitted and len(emitted) == 4
    assert async_tokens[0] == [] and async_tokens[1:len(sync_tokens) + 1] == sync_tokens[:len(async_tokens) - 1]
    prompt_len = len(request.prompt_token_ids)
    # each decode step's input is the token the step before sampled: on the device, in async steps
    assert [token for computed, token in async_inputs if computed >= prompt_len] == emitted[:3]
    assert async_inputs == sync_inputs


DRAWS = 5   # fresh draws of the cancellation scenario before it counts as never preempting


def test_cancellations_and_preemptions_under_async_scheduling_leave_nothing_held(model_tok):
    """Reliability: requests under a KV budget that preempts, a random third of them aborted at
    random steps (some with a token in flight, some preempted with one), the rest seeded random or
    greedy. Survivors give the synchronous loop's tokens; aborted ones a prefix of them; at the end
    every block is free and no generator or matcher is left. About 1 draw in 40 preempts nothing (its
    aborts free blocks early) or aborts only finished requests: such a draw is still checked, then a
    fresh one is drawn, up to DRAWS; the test fails if none preempted and aborted a running request."""
    rng = random.Random(int(torch.randint(0, 10_000, ())))
    for _ in range(DRAWS):
        preempted, aborted = _cancel_and_preempt_once(model_tok, rng)
        if preempted and aborted:
            break
    assert preempted, f"nothing was preempted in {DRAWS} draws: the KV budget is too generous for this test"
    assert aborted, f"no request was still running when its abort came, in {DRAWS} draws"


def _cancel_and_preempt_once(model_tok, rng: random.Random) -> tuple[list[int], set[str]]:
    """One random draw of the scenario above, checked; returns the placeholders each preempted
    request held and the ids aborted while running."""
    requests = [build_request(f"r{i}", [rng.randrange(10, 40)], seed=rng.randrange(1000), max_tokens=rng.randrange(6, 20))
                for i in range(9)]
    for r in requests[::2]:
        r.sampling = dataclasses.replace(r.sampling, temperature=1.0, seed=rng.randrange(100))
    reference = make_llm(model_tok, num_kv_blocks=96)
    decisions = record_decisions(reference)
    expected = {c.request_id: c.token_ids for c in reference.generate(requests)}
    llm = make_llm(model_tok, num_kv_blocks=24, async_scheduling="on")
    preempt, preempted = llm.core.scheduler._preempt, []
    llm.core.scheduler._preempt = lambda victim: (preempted.append(victim.num_output_placeholders), preempt(victim))
    doomed = {r.request_id: rng.randrange(2, 25) for r in rng.sample(requests, 3)}
    tokens, aborted = step_through(llm, requests, aborts=doomed)
    assert_tokens_agree(expected, tokens, decisions, cut=aborted)
    assert_pools_full(llm.core)
    assert all(r.num_output_placeholders == 0 for r in llm.core.scheduler.running)
    return preempted, aborted


def test_a_request_id_used_again_at_once_gets_its_own_tokens(model_tok):
    """A request is cancelled mid-decode while the step after its last, which scheduled it, is in
    flight (a client's cancel, or a stop string the front end found); its id comes back at once with
    another prompt and other sampling (a client reusing ids does). The new request's tokens and
    logprobs are those a fresh engine gives it: none of the old request's in-flight rows reach it."""
    rng = random.Random(random.randrange(2**31))
    first = build_request("same", [rng.randrange(4, 30)], seed=rng.randrange(10_000), max_tokens=20)
    again = build_request("same", [rng.randrange(4, 30)], seed=rng.randrange(10_000), max_tokens=9, logprobs=True,
                          repetition_penalty=1.3)
    llm = make_llm(model_tok, async_scheduling="on", attention_backend="sdpa")
    llm.add_request(first)
    emitted = 0
    while emitted < rng.randrange(2, 6):
        emitted += sum(len(item.new_token_ids) for _, item in llm.step())
    assert llm.core.abort("same") and llm.core._in_flight is not None   # a step that scheduled it is in flight
    llm.processor.forget("same")
    got = llm.generate([again])[0]
    want = make_llm(model_tok, async_scheduling="on", attention_backend="sdpa").generate([again])[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "length"
    assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    assert_pools_full(llm.core)


def test_async_scheduling_auto_is_on_cuda_with_or_without_tensor_parallelism(model_tok):
    from mmserve.config import EngineConfig
    from mmserve.core.engine_core import uses_async_scheduling

    auto = dict(async_scheduling="auto")   # named: the suite may run with MMSERVE_ASYNC_SCHEDULING=on
    assert uses_async_scheduling(EngineConfig(async_scheduling="on", tensor_parallel_size=2), torch.device("cpu"))
    assert uses_async_scheduling(EngineConfig(tensor_parallel_size=2, **auto), torch.device("cuda"))
    assert not uses_async_scheduling(EngineConfig(tensor_parallel_size=2, **auto), torch.device("cpu"))
    assert uses_async_scheduling(EngineConfig(speculative_model="assistant", **auto), torch.device("cuda"))
    assert not make_llm(model_tok, **auto).core.async_scheduling   # auto: on CUDA only


def test_mmserve_async_scheduling_is_the_default_of_engines_built_in_python_too(model_tok, monkeypatch):
    """The variable reaches an engine built in Python (mmserve.LLM, a test's), not only `mmserve
    serve`'s flag: one switch for a process and the servers and ranks it starts. A value given wins;
    a bad one is refused naming the variable."""
    from mmserve.cli import build_parser
    from mmserve.config import EngineConfig, from_args

    monkeypatch.setenv("MMSERVE_ASYNC_SCHEDULING", "on")
    assert make_llm(model_tok).core.async_scheduling
    assert EngineConfig(async_scheduling="off").async_scheduling == "off"
    monkeypatch.setenv("MMSERVE_ASYNC_SCHEDULING", "off")
    argv = ["serve", "--port", "0"]
    assert from_args(EngineConfig, build_parser(argv).parse_args(argv)).async_scheduling == "off"
    monkeypatch.setenv("MMSERVE_ASYNC_SCHEDULING", "sometimes")
    with pytest.raises(ValueError, match="'sometimes'.*MMSERVE_ASYNC_SCHEDULING"):
        EngineConfig()


def test_the_served_loop_runs_async_steps_and_sends_outputs_from_its_thread(model_tok):
    """AsyncEngine's core loop (here on a thread, over the same sockets as the engine process) with
    async scheduling: streams end with the synchronous tokens, every step's outputs go out through
    the output thread, and nothing is held at the end."""
    import asyncio

    from mmserve.config import EngineConfig
    from mmserve.engine.async_engine import AsyncEngine

    model, tok = model_tok
    requests = random_requests(6, int(torch.randint(0, 1000, ())), max_tokens=(2, 9))
    reference = make_llm(model_tok)
    decisions = record_decisions(reference)
    expected = {c.request_id: c.token_ids for c in reference.generate(requests)}
    engine = AsyncEngine(EngineConfig(device="cpu", block_size=4, num_kv_blocks=256, max_num_seqs=8,
                                      max_num_batched_tokens=64, async_scheduling="on"), model=model, tokenizer=tok)

    async def main():
        await engine.start()

        async def one(r):
            return r.request_id, [t async for o in engine.generate(r) for t in o.new_token_ids]
        try:
            return dict(await asyncio.gather(*(one(r) for r in requests)))
        finally:
            await engine.shutdown()

    assert_tokens_agree(expected, asyncio.run(main()), decisions)
    assert engine.core.async_scheduling
    assert_pools_full(engine.core)
