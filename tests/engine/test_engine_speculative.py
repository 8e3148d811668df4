"""Speculative decoding changes how many steps a request takes, never its greedy tokens.

A fresh random tiny Gemma 4 target (sliding window 6) and a tiny assistant that mostly drafts the
token it is given (gemma4_fixtures.make_assistant(copy_from=...): random layers, so drafts are
accepted where the target repeats itself and rejected elsewhere, both at every draft position) run
the same requests as an engine without speculation (the oracle): chunked prefill beside verify
chunks, frames, a prefix-cache hit, requests that do not speculate sharing the steps, preemption,
EOS and max_tokens inside accepted drafts. At the end every KV block is free (empty or cached with
no reference) and every cached block's key names verified tokens only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from engine_helpers import (
    NEAR_TIE,
    assert_token_logprobs_close,
    assert_tokens_agree,
    build_request,
    greedy_agree,
    make_llm,
    near_tie_in,
    record_decisions,
    record_draft_gaps,
    step_through,
)
from gemma4_fixtures import NUM_SPECIALS, VOCAB, make_assistant, make_checkpoint, tiny_config
from test_engine_batching import assert_pools_full

from mmserve.block_hash import block_hashes
from mmserve.engine.observer import NullObserver
from mmserve.errors import InvalidInputError
from mmserve.model import load_model
from mmserve.model.tokenizer import load_tokenizer
from mmserve.request import Request
from mmserve.sampling_params import SamplingParams

BS = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    cfg = tiny_config(window=6)
    hf = make_checkpoint(root / "target", config=cfg, seed=31)
    make_assistant(root / "assistant", cfg, seed=33, copy_from=hf)
    model = load_model(root / "target")
    return (model, load_tokenizer(root / "target")), str(root / "assistant")


def sdpa_models(models):
    """`models` with the target attending through SDPA, which plans from the host's positions."""
    (_, tok), assistant = models
    return (load_model(Path(assistant).parent / "target", attention_backend="sdpa"), tok), assistant


def run(models, requests, *, speculate: bool, **options):
    model_tok, assistant = models
    if speculate:
        options.update(speculative_model=assistant, num_speculative_tokens=3)
    llm = make_llm(model_tok, block_size=BS, max_num_batched_tokens=16, **options)
    if not (speculate and llm.core.async_scheduling):   # the reference's logits, for near ties (greedy_agree)
        llm.decisions = record_decisions(llm)
    return llm, {c.request_id: c for c in llm.generate(requests)}


def assert_only_verified_keys(llm, requests, completions) -> None:
    """Every key a pool holds is the chain hash of a block of some request's prompt + output."""
    verified = set()
    for r in requests:
        done = Request(r.request_id, list(r.prompt_token_ids) + completions[r.request_id].token_ids, SamplingParams(),
                       mm_ranges=list(r.mm_ranges), mm_inputs=list(r.mm_inputs))
        verified.update(block_hashes(done, BS, done.num_tokens // BS))
    for name, pool in llm.core.kv.pools.items():
        assert pool._by_key, f"pool {name} cached nothing"
        assert set(pool._by_key) <= verified, f"pool {name} holds a key of unverified tokens"


def mixed_requests(seed: int):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(5, 40, (4,), generator=gen).tolist()
    return [
        build_request("long", [sizes[0] + 30], seed=seed, max_tokens=20),           # chunked over steps
        build_request("short", [sizes[1]], seed=seed + 1, max_tokens=17, logprobs=True, top_logprobs=3),
        build_request("video", [3, ("video", [8, 4]), sizes[2]], seed=seed + 2, max_tokens=15),
        build_request("opted-out", [sizes[3]], seed=seed + 3, max_tokens=12, disable_speculation=True),
        build_request("penalised", [sizes[3]], seed=seed + 4, max_tokens=12, repetition_penalty=1.3),
        # negative penalties favour repeats, which this drafter proposes: each verify row's penalty
        # must count the drafts before it
        build_request("repeating", [sizes[1] + 3], seed=seed + 6, max_tokens=18, presence_penalty=-1.0,
                      frequency_penalty=-0.5, min_tokens=4),
        build_request("biased", [sizes[2]], seed=seed + 5, max_tokens=14,
                      logit_bias=tuple((t, 3.0) for t in range(NUM_SPECIALS, VOCAB, 5))),
    ]


# async: drafts made and verified on the device; each named (the suite may run with MMSERVE_ASYNC_SCHEDULING=on)
LOOPS = {"sync": {"async_scheduling": "off"}, "async": {"async_scheduling": "on"}}


# Workloads a test draws until its draw covers what it is about (the drafter kept every draft of some
# step and rejected some; a preemption and an abort of a running request): about 1 draw in 10-20 does
# not (the seed sweep: 3 of 30 and 1 of 22). Every draw is checked in full; 4 miss at most ~1e-4.
DRAWS = 4


@pytest.mark.parametrize("loop", [*LOOPS, "async, device twins"])
def test_greedy_tokens_equal_those_without_speculation(models, loop, monkeypatch):
    """Device twins: every staged buffer's device tensor apart from its host mirror, as on CUDA,
    under SDPA, which plans from the host: the positions the async loop moves back on the device
    must reach the host before a step plans."""
    from test_cuda_graphs import device_twins

    for _ in range(DRAWS):
        requests = mixed_requests(seed=int(torch.randint(0, 1000, ())))
        target, expected = run(models, requests, speculate=False)
        with monkeypatch.context() as patch:
            speculating = models
            if loop.endswith("device twins"):
                device_twins(patch)
                speculating = sdpa_models(models)
            llm, got = run(speculating, requests, speculate=True, **LOOPS[loop.split(",")[0]])
            assert_equal_to_the_target(llm, requests, expected, got, target.decisions)
            if kept_every_draft_and_rejected_some(llm):
                again = [dataclasses.replace(r, request_id=f"{r.request_id}-again") for r in requests]
                hits = {c.request_id: c for c in llm.generate(again)}
                break
    else:
        pytest.fail(f"in {DRAWS} request sets no step kept all its drafts, or none rejected one: the test proves little")

    # The same prompts again: prefix-cache hits, then speculation over the reused blocks.
    for r in requests:
        greedy_agree(expected[r.request_id].token_ids, hits[f"{r.request_id}-again"].token_ids,
                     target.decisions[r.request_id])
        assert hits[f"{r.request_id}-again"].usage.cached_tokens > 0
    assert_pools_full(llm.core)


def kept_every_draft_and_rejected_some(llm) -> bool:
    spec = llm.core.speculator
    return spec.accepted[-1] > 0 and spec.verified[0] > spec.accepted[0]


def assert_equal_to_the_target(llm, requests, expected, got, decisions) -> None:
    """`assert_outputs_agree`; every block is free and every cached key names verified tokens."""
    assert_outputs_agree(expected, got, decisions)
    assert_pools_full(llm.core)
    assert_only_verified_keys(llm, requests, got)


def assert_outputs_agree(expected, got, decisions) -> None:
    """Greedy tokens, logprobs of every emitted token (verify chunks' included) and finish reasons are
    the target's, up to a near tie of its own logits (`decisions`; what follows one is not compared)."""
    same = {}
    for rid, c in expected.items():
        same[rid] = greedy_agree(c.token_ids, got[rid].token_ids, decisions[rid])
        assert got[rid].finish_reason == c.finish_reason == "length", rid
    theirs, ours = expected["short"].logprobs, got["short"].logprobs
    assert len(ours) == len(theirs) == 17
    for a, b, row in list(zip(ours, theirs, decisions["short"], strict=True))[:same["short"]]:
        assert_token_logprobs_close(a, b, row)   # "short" has no bias or penalties: its rows are the model's


def test_async_speculation_moves_positions_on_the_device(models, monkeypatch):
    """Async scheduling on a backend that reads positions on the device (FA4's paging, fa4_paging.py),
    under emulated graphs, with every staged buffer's device tensor apart from its host mirror (as on
    CUDA: test_cuda_graphs.device_twins): each step is built as if the step in flight kept every
    draft, its first input and drafts taken and its positions, context lengths and slots moved back
    on the device by what that step rejected, the host's left as they were. Greedy tokens (and
    logprobs) equal those without speculation; drafts are kept and rejected. (No video: the test
    backend has no frame ranges.)"""
    import fa4_paging
    from test_cuda_graphs import device_twins

    from mmserve.worker.backend_check import use_backend

    (model, tok), assistant = models
    fa4_paging.register(monkeypatch)
    device_twins(monkeypatch)
    model = load_model(Path(assistant).parent / "target", attention_backend="reference")
    for layer_type in list(model.attention_backends):
        use_backend(model, layer_type, "fa4_paging")
    llm = make_llm((model, tok), block_size=BS, max_num_batched_tokens=16, speculative_model=assistant,
                   num_speculative_tokens=3, async_scheduling="on", attention_backend="fa4_paging",
                   emulate_cuda_graphs=True)
    inputs, moved = llm.core.runner.inputs, []
    shift_on_device = inputs.shift_on_device

    def shifting(rows, shift):
        shift_on_device(rows, shift)
        moved.extend((inputs.positions.cpu[rows.token_rows] - inputs.positions.dev[rows.token_rows]).tolist())

    inputs.shift_on_device = shifting
    for _ in range(3):   # a workload whose drafts are all kept or all rejected (~1 in 25) moves no row by part
        seed = int(torch.randint(0, 1000, ()))
        requests = [r for r in mixed_requests(seed=seed) if r.request_id != "video"]
        target, expected = run(models, requests, speculate=False)
        assert_outputs_agree(expected, {c.request_id: c for c in llm.generate(requests)}, target.decisions)
        if set(moved) & {1, 2}:
            break
    spec = llm.core.speculator
    assert spec.accepted[0] > 0 and spec.verified[0] > spec.accepted[0]
    assert 3 in moved and set(moved) & {1, 2}, f"some rows moved back by all drafts, some by part: {set(moved)}"
    assert llm.core.runner.graphs.replays_by_query_len.get(4, 0) > 0, "verify steps replayed their graph"
    assert_pools_full(llm.core)


@pytest.mark.parametrize("loop", list(LOOPS))
def test_eos_and_max_tokens_inside_accepted_drafts_end_the_request_there(models, loop):
    requests = [build_request(f"r{i}", [20 + 9 * i], seed=50 + i, max_tokens=24) for i in range(4)]
    _, expected = run(models, requests, speculate=False)
    # an end-of-sequence id the target emits twice in a row somewhere: drafts of it get accepted
    repeats = [(c.token_ids[j], rid) for rid, c in expected.items() for j in range(1, 24)
               if c.token_ids[j] == c.token_ids[j - 1]]
    assert repeats, "no repeated token to put EOS on"
    eos = repeats[0][0]
    requests = [dataclasses.replace(r, sampling=SamplingParams(max_tokens=24)) for r in requests]   # EOS counts
    llm, got = run(models, [], speculate=True, **LOOPS[loop])
    llm.core.eos_token_ids = frozenset({eos})
    got = {c.request_id: c for c in llm.generate(requests)}
    for rid, c in expected.items():
        cut = c.token_ids.index(eos) + 1 if eos in c.token_ids else len(c.token_ids)
        assert got[rid].token_ids == c.token_ids[:cut], rid
        assert got[rid].finish_reason == ("eos" if eos in c.token_ids else "length"), rid
    assert_pools_full(llm.core)


@pytest.mark.parametrize("loop", list(LOOPS))
def test_preempted_speculating_requests_recompute_to_the_same_tokens(models, loop):
    requests = [build_request(f"r{i}", [28 + 3 * i], seed=70 + i, max_tokens=20) for i in range(4)]
    _, expected = run(models, requests, speculate=False, num_kv_blocks=60)
    llm, _ = run(models, [], speculate=True, num_kv_blocks=36, **LOOPS[loop])
    llm.core.scheduler.verify_width = 4   # speculating chunks padded to 1 + K rows, as with verify graphs
    preempt, preempted = llm.core.scheduler._preempt, []
    llm.core.scheduler._preempt = lambda victim: (preempted.append(victim.request_id), preempt(victim))
    got = {c.request_id: c for c in llm.generate(requests)}
    assert preempted, "nothing was preempted: the KV budget is too generous for this test"
    assert {rid: c.token_ids for rid, c in got.items()} == {rid: c.token_ids for rid, c in expected.items()}
    assert_pools_full(llm.core)


@pytest.mark.parametrize("loop", list(LOOPS))
def test_requests_at_their_kv_bound_speculate_without_preemption(models, loop):
    """Speculation's K at the admission bound, verify chunks padded to 1 + K rows (as with verify
    graphs). One request's bound leaves K out (KVCacheManager.max_blocks_needed says why): exactly
    at it, near its end its pads need a block the pool lacks and are dropped, and it gives the
    target's greedy tokens unpreempted (preempting first instead, it preempted itself up to 3
    times). The bound of n samples counts each one's pads past its end (without them a sample's
    pads took the free block its sibling still needed, and the sibling was preempted): at it, 2
    samples give those tokens with nothing refused; one block less is refused naming sampling.n."""
    for _ in range(DRAWS):   # until a pad is refused: a draw that keeps every draft near its end skips it (~1 in 12)
        prompt = int(torch.randint(16, 29, ()))
        max_tokens = 16 + (-(prompt + 16)) % BS   # prompt + max_tokens in whole blocks: a pad past the end needs one more
        request = build_request("r", [prompt - 1], seed=int(torch.randint(0, 1000, ())), max_tokens=max_tokens)
        target, expected = run(models, [request], speculate=False)
        llm = padded_verify_engine(models, loop, usable=(prompt + max_tokens) // BS)
        preempted = record_preemptions(llm)
        greedy_agree(expected["r"].token_ids, llm.generate([request])[0].token_ids, target.decisions["r"])
        assert not preempted, preempted
        assert_pools_full(llm.core)
        if llm.core.kv.refusals:
            break
    else:
        pytest.fail(f"in {DRAWS} draws no pad was refused a block: the bound was never reached")

    blocks = -(-(prompt + max_tokens + 2) // BS)   # a sample's pads reach K - 1 positions past its end
    bound = blocks + (blocks - (prompt - 1) // BS)   # the second sample shares the blocks before the prompt's last token
    samples = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, n=2))
    with pytest.raises(InvalidInputError) as info:
        padded_verify_engine(models, loop, usable=bound - 1).core.add_request(samples)
    assert info.value.field == "sampling.n" and "pool full_attention" in str(info.value)
    assert "+ 2 speculative pad positions" in str(info.value) and "lower n or max_tokens" in str(info.value)
    llm = padded_verify_engine(models, loop, usable=bound)
    preempted = record_preemptions(llm)
    for sample in llm.generate([samples])[0].samples:
        greedy_agree(expected["r"].token_ids, sample.token_ids, target.decisions["r"])
    assert not preempted and not llm.core.kv.refusals, (preempted, llm.core.kv.refusals)
    assert_pools_full(llm.core)


def padded_verify_engine(models, loop: str, usable: int):
    """A speculating engine whose pools have `usable` blocks each, its speculating chunks padded to
    1 + K rows as with verify graphs."""
    llm, _ = run(models, [], speculate=True, num_kv_blocks=usable + 1, **LOOPS[loop])   # (+ the null block)
    llm.core.scheduler.verify_width = 4
    return llm


@pytest.mark.parametrize("variant", ["e_model", "moe"])
def test_kv_sharing_and_expert_targets_give_the_same_greedy_tokens(tmp_path, variant):
    """E2B-like (per-layer embeddings, KV-sharing layers: a verify chunk runs every row through them)
    and 26B-A4B-like (experts) targets."""
    import gemma4_fixtures

    cfg = getattr(gemma4_fixtures, f"{variant}_config")()
    hf = make_checkpoint(tmp_path / "target", config=cfg, seed=81)
    make_assistant(tmp_path / "assistant", cfg, seed=83, copy_from=hf)
    model = load_model(tmp_path / "target")
    models = ((model, None), str(tmp_path / "assistant"))
    requests = [build_request("text", [37], seed=1, max_tokens=20),
                build_request("video", [3, ("video", [8, 4]), 9], seed=9, max_tokens=16)]
    _, expected = run(models, requests, speculate=False)
    llm, got = run(models, requests, speculate=True)
    assert {rid: c.token_ids for rid, c in got.items()} == {rid: c.token_ids for rid, c in expected.items()}
    assert llm.core.speculator.verified[0] > 0
    assert_pools_full(llm.core)


def test_each_verify_row_is_adjusted_as_the_plain_step_at_its_position():
    """Penalties, min_tokens and logit_bias of verify row j count the j drafts before it as output,
    exactly as the step that would have sampled position j alone (greedy rows: the same argmax)."""
    from mmserve.core.sched.output import ScheduledRequest
    from mmserve.sample.sampler import Sampler
    from mmserve.spec_decode.verify import verify_rows

    eos = 1
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1000, ())))
    params = SamplingParams(max_tokens=20, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.6,
                            min_tokens=5, logit_bias=((40, 2.5),))
    prompt, output, drafts = [20, 21, 22, 23], [30, 31, 32], [33, 34, 35, 36]
    logits = torch.randn(len(drafts) + 1, VOCAB, generator=gen)
    logits[:, drafts] += 3.0     # the drafts and EOS would win unadjusted
    logits[:, eos] += 8.0
    request = Request("r", prompt, params)
    request.output_token_ids = list(output)
    chunk = ScheduledRequest(request, len(drafts) + 1, len(prompt) + len(output) - 1, False, draft_token_ids=drafts)
    got = Sampler(eos_token_ids=[eos]).sample(logits, verify_rows([chunk])).token_ids
    expected = []
    for j in range(len(drafts) + 1):
        alone = Request("r", prompt, params)
        alone.output_token_ids = output + drafts[:j]
        expected += Sampler(eos_token_ids=[eos]).sample(logits[j:j + 1], [alone]).token_ids
    assert got == expected
    assert eos not in expected[:2] and eos in expected[2:], "min_tokens must hold EOS back for rows 0-1 only"


def test_tokens_equal_transformers_assisted_generation_at_batch_1(tmp_path):
    """transformers' generate(assistant_model=...) with the same assistant checkpoint, greedy, batch 1,
    on a fresh random prompt (a sampled media placeholder id embeds as the pad token in both): its
    tokens up to a near tie of its own logits (engine_helpers.greedy_agree)."""
    cfg = tiny_config(window=6)
    hf = make_checkpoint(tmp_path / "target", config=cfg, seed=91)
    hf_assistant = make_assistant(tmp_path / "assistant", cfg, seed=93, copy_from=hf)
    hf_assistant.generation_config.num_assistant_tokens = 3
    seed = int(torch.randint(0, 1000, ()))
    request = build_request("r", [24 + seed % 8], seed=seed, max_tokens=20)
    ids = torch.tensor([request.prompt_token_ids])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=hf_assistant,
                          max_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_logits=True)
    theirs = out.sequences[0, ids.shape[1]:].tolist()
    model = load_model(tmp_path / "target")
    llm, got = run(((model, None), str(tmp_path / "assistant")), [request], speculate=True)
    greedy_agree(theirs, got["r"].token_ids, torch.cat(out.logits))
    assert llm.core.speculator.verified[0] > 0


class StepRecorder(NullObserver):
    def __init__(self):
        self.records = []

    def on_step(self, record) -> None:
        self.records.append(record)


@pytest.mark.parametrize("loop", LOOPS)
def test_step_records_carry_emitted_tokens_and_the_drafting_the_perf_model_bills(models, loop):
    """Emitted tokens add up to each completion; a verify chunk starts where the tokens verified
    before it end (the async loop scheduled it before the step before rejected drafts); every
    request that drafts ran the batch's longest draft loop over the keys left after rollback (its
    context minus the rejected rows)."""
    requests = mixed_requests(seed=int(torch.randint(0, 1000, ())))
    recorder = StepRecorder()
    _, got = run(models, requests, speculate=True, observer=recorder, **LOOPS[loop])
    prompt = {r.request_id: len(r.prompt_token_ids) for r in requests}
    emitted = {rid: 0 for rid in got}
    drafted = 0
    for record in recorder.records:
        rows = {i.draft_rows for i in record.items if i.draft_rows}
        assert len(rows) <= 1 and rows <= set(range(1, 4)), record.items   # one batched loop, K = 3
        for item in record.items:
            if not item.is_prefill and item.emitted_tokens:
                # in the cache before it: every token known but the last, the chunk's first input
                assert item.context_len - item.num_tokens == prompt[item.request_id] + emitted[item.request_id] - 1, item
            emitted[item.request_id] += item.emitted_tokens
            if item.draft_rows:
                drafted += 1
                assert item.draft_keys == item.context_len - (1 + item.draft_tokens - item.emitted_tokens), item
        assert not any(i.draft_rows for i in record.items if i.request_id == "opted-out")
    assert emitted == {rid: len(c.token_ids) for rid, c in got.items()}
    assert drafted > 0


def test_the_async_loop_records_the_steps_it_shares_with_the_synchronous_loop_alike(models):
    """One greedy speculating run on both loops: the steps both schedule alike (until the async
    loop, which counts a verify chunk's rows as placeholders until they reach the host, drafts fewer
    near max_tokens) have equal records, context, drafts kept and drafting billed included, among them
    verify chunks after a step that rejected drafts (the async loop's record is built before it
    learns those: its context once counted them). On a request's last step the async loop drafted
    on the device before it knew the request ends (billed: the device ran it); the synchronous does not."""
    steps = {}
    # The records follow the tokens and drafts, which the async loop's other batches may flip at a near
    # tie: a draw whose synchronous run has one (~1 in 25 for its ~110 tokens, as many for its ~200 drafts) again.
    for _ in range(DRAWS):
        requests = mixed_requests(seed=int(torch.randint(0, 1000, ())))
        recorder = StepRecorder()
        reference, _ = run(models, [], speculate=True, observer=recorder, **LOOPS["sync"])
        draft_gaps = record_draft_gaps(reference)
        got = {c.request_id: c for c in reference.generate(requests)}
        if not (near_tie_in(reference.decisions, {rid: c.token_ids for rid, c in got.items()})
                or any(bool((g < NEAR_TIE).any()) for g in draft_gaps)):
            break
    steps["sync"] = [record.items for record in recorder.records]
    recorder = StepRecorder()
    run(models, requests, speculate=True, observer=recorder, **LOOPS["async"])
    steps["async"] = [record.items for record in recorder.records]
    last_step = {i.request_id: n for n, items in enumerate(steps["sync"]) for i in items}
    after_rejection, rejected = 0, set()
    for n, (sync, async_) in enumerate(zip(steps["sync"], steps["async"], strict=False)):
        if [(i.request_id, i.num_tokens) for i in sync] != [(i.request_id, i.num_tokens) for i in async_]:
            break   # the loops schedule apart from here
        assert [dataclasses.replace(i, draft_rows=0, draft_keys=0) if last_step[i.request_id] == n else i
                for i in async_] == sync
        after_rejection += sum(i.request_id in rejected and not i.is_prefill for i in sync)
        rejected = {i.request_id for i in sync if i.draft_tokens > i.accepted_drafts}
    assert after_rejection >= 3, "too few shared verify chunks after a rejection: the test proves little"


@pytest.mark.parametrize("loop", LOOPS)
def test_a_verify_row_whose_sampling_fails_ends_only_its_own_request(models, monkeypatch, loop):
    """Fault injection (a sampler bug on one request's later verify rows, in the batched call either
    loop makes: `sample`, or the async loop's `launch`): the batch is sampled again row by row, the
    request's first row succeeds and its later rows fail. Their tokens are placeholders, so the
    request ends with the error; its step-mate keeps its solo tokens."""
    from mmserve.spec_decode.verify import VerifyRow

    def requests():
        return [build_request("victim", [20], seed=1, max_tokens=12), build_request("mate", [22], seed=2, max_tokens=12)]

    _, alone = run(models, requests()[1:], speculate=True, **LOOPS[loop])
    model_tok, assistant = models
    llm = make_llm(model_tok, block_size=BS, max_num_batched_tokens=16, speculative_model=assistant,
                   num_speculative_tokens=3, **LOOPS[loop])

    def failing(call):
        def sample(logits, rows):
            if any(isinstance(r, VerifyRow) and r.drafts and r.request_id == "victim" for r in rows):
                raise RuntimeError("injected sampler bug")
            return call(logits, rows)
        return sample

    for name in ("sample", "launch"):
        monkeypatch.setattr(llm.core.sampler, name, failing(getattr(llm.core.sampler, name)))
    for r in requests():
        llm.add_request(r)
    tokens, errors = {"victim": [], "mate": []}, {}
    while llm.has_work:
        for rid, item in llm.step():
            if isinstance(item, BaseException):
                errors[rid] = item
            else:
                tokens[rid] += item.new_token_ids
    assert set(errors) == {"victim"} and "sampling failed" in str(errors["victim"])
    assert tokens["mate"] == alone["mate"].token_ids


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"enum": ["ab", "cd"]},
                                           "s": {"type": "string"}},
          "required": ["n", "tag", "s"], "additionalProperties": False}


def test_constrained_requests_speculate_with_drafts_the_grammar_allows(models):
    """A JSON-schema and a regex request speculate: the same greedy tokens as without speculation,
    valid output, drafts verified and accepted. Every draft proposed continues the request's output
    as its grammar allows (a fresh matcher accepts output + drafts): the copying drafter alone would
    propose `{{` and `""`. At the end every matcher is freed and no KV block is held."""
    import json
    import re

    import xgrammar as xgr

    from mmserve.sampling_params import ResponseFormat

    formats = [ResponseFormat("json_schema", json.dumps(SCHEMA)), ResponseFormat("regex", r"(ab|cd)( [0-9]{1,3})+\.")]
    seed = int(torch.randint(0, 1000, ()))
    requests = [dataclasses.replace(build_request(f"r{i}", [9 + 11 * i], seed=seed + i),
                                    sampling=SamplingParams(max_tokens=60, response_format=formats[i % 2]))
                for i in range(4)]
    requests.append(build_request("free", [14], seed=seed + 9, max_tokens=20))   # shares the steps, unconstrained
    target, expected = run(models, requests, speculate=False)
    # The synchronous loop's: the async loop drafts before the matcher sees the step's tokens, unmasked
    # (architecture.md, the engine loop); its constrained tokens are checked by the tests run on both.
    llm, _ = run(models, [], speculate=True, **LOOPS["sync"])
    proposed = []   # (request id, output so far, drafts) of every draft loop
    propose = llm.core.speculator.propose

    def recording(items, *args, **kwargs):
        out = propose(items, *args, **kwargs)
        proposed.extend((i.request.request_id, list(i.request.output_token_ids), d) for i, d in zip(items, out, strict=True))
        return out

    llm.core.speculator.propose = recording
    got = {c.request_id: c for c in llm.generate(requests)}
    assert_tokens_agree({rid: c.token_ids for rid, c in expected.items()},
                        {rid: c.token_ids for rid, c in got.items()}, target.decisions)
    for i in range(4):
        text = got[f"r{i}"].text
        if got[f"r{i}"].finish_reason == "eos":
            assert (set(json.loads(text)) == {"n", "tag", "s"}) if i % 2 == 0 else re.fullmatch(formats[1].spec, text)
    spec = llm.core.speculator
    assert spec.accepted[0] > 0 and spec.verified[0] > spec.accepted[0], (spec.verified, spec.accepted)
    compiler = llm.core.sampler.grammar.compiler
    checked = 0
    for rid, output, drafts in proposed:
        if rid == "free" or not drafts:
            continue
        matcher = xgr.GrammarMatcher(compiler.compile(requests[int(rid[1:])].sampling.response_format))
        assert all(matcher.accept_token(t) for t in output + drafts), (rid, output, drafts)
        checked += 1
    assert checked > 10
    assert not llm.core.sampler.grammar._matchers
    assert_pools_full(llm.core)


def test_prompt_logprobs_requests_speculate_to_the_same_outputs(models):
    """Prompt logprobs come from prefill chunks, which never carry drafts (a verify chunk starts at
    the last prompt token or later): such a request speculates and returns the same tokens, token
    logprobs and prompt logprobs as without speculation, its prompt chunked over steps."""
    seed = int(torch.randint(0, 1000, ()))
    requests = [build_request("long", [45], seed=seed, max_tokens=18, prompt_logprobs=True, top_logprobs=2,
                              logprobs=True),
                build_request("short", [12], seed=seed + 1, max_tokens=16, prompt_logprobs=True)]
    target, expected = run(models, requests, speculate=False)
    recorder = StepRecorder()
    _, got = run(models, requests, speculate=True, observer=recorder)
    for rid, c in expected.items():
        same = greedy_agree(c.token_ids, got[rid].token_ids, target.decisions[rid])
        ours, theirs = got[rid].prompt_logprobs, c.prompt_logprobs
        assert len(ours) == len(theirs) == len(requests[rid == "short"].prompt_token_ids) - 1
        # prompt rows are the same prefill chunks either way (6 salts: logprobs bitwise equal): exact
        for a, b in zip(ours, theirs, strict=True):
            assert (a.token_id, a.rank, a.top_ids) == (b.token_id, b.rank, b.top_ids)
            torch.testing.assert_close(torch.tensor([a.logprob, *a.top_logprobs]),
                                       torch.tensor([b.logprob, *b.top_logprobs]), rtol=1e-4, atol=1e-4)
        # generated tokens' come from verify rows (up to 1.4e-5 apart): near ties of the target's rows
        for a, b, row in list(zip(got[rid].logprobs or [], c.logprobs or [], target.decisions[rid], strict=False))[:same]:
            assert_token_logprobs_close(a, b, row)
        assert len(got[rid].logprobs or []) == len(c.logprobs or [])
    verified = {i.request_id for r in recorder.records for i in r.items if i.draft_tokens}
    assert verified == {"long", "short"}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_cancellations_and_preemptions_among_speculating_requests_leave_nothing_held(models, loop):
    """Reliability: speculating and opted-out requests under a KV budget that preempts, a random
    third of them aborted at random steps (some mid-verify, with drafts pending; async: with a
    step's tokens and drafts in flight), every speculating chunk padded to 1 + K rows (pad
    positions take KV and are rolled back). Survivors keep the tokens they have without
    speculation; at the end every block is free (empty or cached with no reference), every cached
    key names verified tokens only, no matcher, generator or placeholder is left."""
    import random
    from types import SimpleNamespace

    for _ in range(DRAWS):   # until the budget preempts and an abort finds its request running (~1 draw in 20 misses)
        rng = random.Random(int(torch.randint(0, 10_000, ())))
        requests = [build_request(f"r{i}", [rng.randrange(10, 40)], seed=rng.randrange(1000),
                                  max_tokens=rng.randrange(8, 24), disable_speculation=i % 3 == 0) for i in range(9)]
        target, expected = run(models, requests, speculate=False, num_kv_blocks=96)
        llm, _ = run(models, [], speculate=True, num_kv_blocks=36, **LOOPS[loop])
        llm.core.scheduler.verify_width = 4   # speculating chunks padded to 1 + K rows, as with verify graphs
        preempted = record_preemptions(llm)
        doomed = {r.request_id: rng.randrange(2, 30) for r in rng.sample(requests, 3)}   # aborted at that step
        tokens, aborted = step_through(llm, requests, aborts=doomed)
        assert_tokens_agree({rid: c.token_ids for rid, c in expected.items()}, tokens, target.decisions, cut=aborted)
        assert llm.core.speculator.verified[0] > 0
        assert_pools_full(llm.core)
        assert not llm.core.sampler.grammar or not llm.core.sampler.grammar._matchers
        assert not llm.core.requests and not llm.core.scheduler.running
        emitted = {rid: SimpleNamespace(token_ids=ids) for rid, ids in tokens.items()}   # all verified, aborted ones' too
        assert_only_verified_keys(llm, requests, emitted)
        if preempted and aborted:
            break
    else:
        pytest.fail(f"in {DRAWS} workloads nothing was preempted ({preempted}) or no abort came while its request "
                    f"ran ({aborted}): the KV budget is too generous for this test")


def record_preemptions(llm) -> list[str]:
    """The ids of the requests the scheduler preempts from now on, in order."""
    preempt, preempted = llm.core.scheduler._preempt, []
    llm.core.scheduler._preempt = lambda victim: (preempted.append(victim.request_id), preempt(victim))
    return preempted


@pytest.mark.parametrize("loop", [*LOOPS, "async, device twins"])
def test_every_round_reads_the_tables_the_kv_manager_holds_for_its_requests(models, loop, monkeypatch):
    """The drafter reads the runner's device block tables by request row (TargetKVReader.prepare).
    At every round each request's row there must be the table the KV manager holds for it at that
    moment (the reference: what the round needs, its window's released entries null, the null block
    after its blocks), while requests are admitted, finish and are preempted (rows reused),
    contexts cross many blocks and the sliding window releases blocks; async: the next step is
    scheduled while the round's step runs. The reader's tables hold garbage before every round.
    Device twins: the staged tables' device tensors apart from their host mirrors, as on CUDA,
    where the device rows are gathered on the device and a host-planned backend's (SDPA's) host
    mirror is filled from the runner's host rows: both checked. Every key a round's row reads
    (the assistant's sliding window + 1 before its position, the async round's moved back by the
    rows the device rejected) lies in a block those tables still hold."""
    import random

    from test_cuda_graphs import device_twins

    rng = random.Random(int(torch.randint(0, 10_000, ())))
    requests = [build_request(f"r{i}", [rng.randrange(30, 80)], seed=rng.randrange(1000), max_tokens=rng.randrange(6, 16))
                for i in range(8)]
    twins = loop.endswith("device twins")
    if twins:
        device_twins(monkeypatch)
    llm, _ = run(models, [], speculate=True, num_kv_blocks=36, max_num_seqs=4, **LOOPS[loop.split(",")[0]])
    core, spec = llm.core, llm.core.speculator
    preempt, preempted = core.scheduler._preempt, []
    monkeypatch.setattr(core.scheduler, "_preempt", lambda victim: (preempted.append(victim.request_id), preempt(victim)))
    rounds, holders = [], {}   # per round: the manager's tables of its requests; per runner row: its requests

    def snapshot(ids: list[str]) -> None:
        if not ids:   # no round
            return
        rounds.append({t: [list(core.kv.block_table(rid, t)) for rid in ids] for t in spec.attention.layer_types})
        for rid, row in zip(ids, core.runner.block_tables.rows_of(ids).tolist(), strict=True):
            holders.setdefault(row, set()).add(rid)

    propose, on_device, prepare = spec.propose, spec.propose_on_device, spec.attention.prepare
    monkeypatch.setattr(spec, "propose", lambda items, *a, **k: (
        snapshot([i.request.request_id for i in items]), propose(items, *a, **k))[1])
    monkeypatch.setattr(spec, "propose_on_device", lambda requests, *a, **k: (
        snapshot([r.request_id for r in requests]), on_device(requests, *a, **k))[1])
    checked, lost = [], []   # (an assert in a round would end only that round's drafting: collected instead)

    def checked_prepare(num_keys, tables, rows, *args, shift=None, **kwargs):
        for kind in spec.attention._types.values():
            kind.table.cpu.fill_(-7)
            kind.table.dev.fill_(-7)
        # the keys each request's row reads: [0, num_keys), less the rows the device rejected (async)
        ends = [n - s for n, s in zip(num_keys, shift.tolist() if shift is not None else [0] * len(num_keys),
                                      strict=True)]
        out = prepare(num_keys, tables, rows, *args, shift=shift, **kwargs)
        for t, want in rounds[-1].items():
            table = spec.attention._types[t].table
            assert (table.dev is not table.cpu) == twins
            assert len(want) == len(rows)
            for got in (table.cpu, table.dev) if twins else (table.cpu,):
                for r, blocks in enumerate(want):
                    assert got[r].tolist() == blocks + [0] * (got.shape[1] - len(blocks)), (len(rounds), t, r)
            window = spec.assistant.spec.attention[t].window   # a sliding layer reads its last window + 1 keys
            for r, (blocks, end) in enumerate(zip(want, ends, strict=True)):
                first = 0 if window is None else max(0, end - window - 1)
                lost.extend((len(rounds), t, r, key) for key in range(first, end) if blocks[key // BS] == 0)
        checked.append(len(rows))
        return out

    monkeypatch.setattr(spec.attention, "prepare", checked_prepare)
    tokens, _ = step_through(llm, requests)
    assert all(tokens.values())
    assert not lost, f"(round, layer type, request, key) read from blocks the KV manager released: {lost[:5]}"
    assert len(checked) == len(rounds) > 10 and max(checked) > 1
    assert preempted, "nothing was preempted: the KV budget is too generous for this test"
    assert any(len(rids) > 1 for rids in holders.values()), "no row was reused"
    tables = [blocks for r in rounds for rows in r.values() for blocks in rows]
    assert max(len(b) for b in tables) >= 15, "no context crossed many blocks"
    assert any(b[0] == 0 for b in tables), "no sliding window released a block"
    assert_pools_full(core)


@pytest.mark.parametrize("loop", list(LOOPS))
def test_a_seeded_request_ignores_its_batch_mates_with_and_without_speculation(models, loop):
    """A seeded random request (temperature 1) gives the same tokens alone and behind three decoding
    requests and before long prompts, which cut its step budget and its KV (fewer drafts, or none,
    on some steps), with speculation off and on: its draws are keyed by output position, and a
    verify row is drawn once, as the plain step at that position would be."""
    model_tok, assistant = models
    seed = int(torch.randint(0, 1000, ()))
    victim = build_request("victim", [11], seed=seed, max_tokens=16)
    victim = dataclasses.replace(victim, sampling=SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))
    mates = [build_request(f"mate{i}", [6], seed=seed + 1 + i, max_tokens=20 + 3 * i) for i in range(3)]
    longs = [build_request(f"long{i}", [40 + 8 * i], seed=seed + 5 + i, max_tokens=4) for i in range(4)]
    tokens, victim_rows = {}, []
    for speculate in (False, True):
        options = dict(speculative_model=assistant, num_speculative_tokens=3) if speculate else {}
        for crowded in (False, True):
            llm = make_llm(model_tok, block_size=BS, max_num_batched_tokens=14, num_kv_blocks=64, **options,
                           **LOOPS[loop])
            execute = llm.core.runner.execute

            def counting(out, *prev, execute=execute):
                victim_rows.extend(1 + len(s.draft_token_ids) for s in out.scheduled if s.request.request_id == "victim"
                                   and s.num_computed_tokens >= s.request.num_prompt_tokens)
                return execute(out, *prev)

            llm.core.runner.execute = counting
            done = llm.generate(mates + [victim] + longs if crowded else [victim])
            tokens[speculate, crowded] = next(c.token_ids for c in done if c.request_id == "victim")
    assert set(victim_rows) > {1, 4}, "the crowded runs must cut some verify chunks short"
    for speculate in (False, True):
        assert tokens[speculate, True] == tokens[speculate, False], f"speculation {speculate}: batch-mates changed it"
    assert tokens[True, False] == tokens[False, False], "speculation changed a seeded request's tokens"


def test_block_size_128_gives_the_tokens_of_block_size_16(models):
    """128-token blocks (FA4's TMA page on SM100; docs/architecture.md, "Block size") under
    speculation, prefix caching and window reclaim: the same greedy tokens as 16-token blocks,
    prefix hits of whole 128-token blocks, and a sliding pool that holds the window's blocks
    alone while the full pool grows with the context. Prompts span several 128-token blocks."""
    from mmserve.attention.backend import FULL, SLIDING

    model_tok, assistant = models
    seed = int(torch.randint(0, 1000, ()))
    requests = [build_request("long", [300], seed=seed, max_tokens=40),
                build_request("video", [3, ("video", [8, 4]), 150], seed=seed + 1, max_tokens=24),
                build_request("short", [40], seed=seed + 2, max_tokens=20)]
    again = [dataclasses.replace(r, request_id=f"{r.request_id}-again") for r in requests]
    runs = {}
    for bs in (16, 128):
        # the reference (16) on the synchronous loop, whose decisions have known positions (record_decisions)
        llm = make_llm(model_tok, block_size=bs, num_kv_blocks=64, max_num_batched_tokens=64,
                       speculative_model=assistant, num_speculative_tokens=3,
                       **(LOOPS["sync"] if bs == 16 else {}))
        if bs == 16:
            decisions = record_decisions(llm)
        held = {SLIDING: [], FULL: []}
        execute = llm.core.runner.execute

        def watched(out, *prev, llm=llm, held=held, execute=execute):
            result = execute(out, *prev)
            if all(not s.is_prefill for s in out.scheduled if s.request.request_id == "long"):
                for t in held:
                    held[t].append(llm.core.kv.num_held("long", t))
            return result

        llm.core.runner.execute = watched
        first = {c.request_id: c for c in llm.generate(requests)}
        hits = {c.request_id: c for c in llm.generate(again)}
        runs[bs] = {rid: c.token_ids for rid, c in (first | hits).items()}
        for r in again:
            n = len(r.prompt_token_ids)
            assert hits[r.request_id].usage.cached_tokens == (n - 1) // bs * bs, (bs, r.request_id, n)
        assert hits["long-again"].usage.cached_tokens > 0, bs
        total = len(requests[0].prompt_token_ids) + 40
        assert max(held[FULL]) == -(-total // bs), bs
        assert max(held[SLIDING]) <= 2 < max(held[FULL]) if bs == 128 else max(held[SLIDING]) <= 3, (bs, held)
        spec = llm.core.speculator
        assert spec.accepted[0] > 0 and spec.verified[0] > spec.accepted[0], bs
        assert_pools_full(llm.core)
    assert_tokens_agree(runs[16], runs[128], decisions)   # other blocks sum attention in another order
