"""Async scheduling under tensor parallelism: rank 0 (this process, the engine core over its shard)
and a real spawned worker rank over gloo, as `mmserve serve --tensor-parallel-size 2
--async-scheduling on` runs them. The worker gets step N+1's message before step N's tokens reach
rank 0's host and takes them from rank 0's device by one broadcast; with speculation the async
drafting round after each step broadcasts its acceptance instead, every rank drafts from it
(replaying emulated drafter graphs) and builds the next step's inputs itself: one broadcast a step,
counted here, every verify step's drafts checked by the workers (in the next step's message, or in a
check of their own where no step follows), and a worker whose drafts differ from rank 0's stops the group.

References, on fresh random prompts: the same TP=2 engine's synchronous loop (the flags the core
reads, switched between runs) and TP=1 engines in-process, with and without speculation (requests
that opt out decode without drafts): greedy and seeded tokens identical everywhere, and per step the
same drafts verified and kept in TP=2 as in TP=1 for each loop. A cancel and a preemption leave no
KV block or embedding held on any rank; a video prefills with encode-ahead beside decodes. One TP
group for the module; the last test ends it (a worker told other drafts than its own).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist
from engine_helpers import (
    NEAR_TIE,
    assert_tokens_agree,
    build_request,
    make_llm,
    near_tie_in,
    record_decisions,
    record_draft_gaps,
    step_core,
)
from gemma4_fixtures import make_assistant, tiny_config

from mmserve.config import EngineConfig
from mmserve.executor import ranks, tensor_parallel

K = 3
OPTIONS = dict(device="cpu", dtype="float32", attention_backend="flex", block_size=4, num_kv_blocks=256,
               max_num_seqs=8, max_num_batched_tokens=16, prefill_batched_tokens=0, enable_prefix_caching=False,
               emulate_cuda_graphs=True, num_speculative_tokens=K)


@pytest.fixture(scope="module")
def assistant(engine_checkpoint, tmp_path_factory) -> str:
    """A drafter that often proposes what the target says (drafts kept and rejected)."""
    root = tmp_path_factory.mktemp("tp_async_assistant")
    make_assistant(root, tiny_config(), seed=23, copy_from=engine_checkpoint[1])
    return str(root)


@pytest.fixture(scope="module")
def tp_core(engine_checkpoint, assistant):
    """A TP=2 engine core with async scheduling on, speculation and emulated graphs."""
    from mmserve.core.engine_core import EngineCore

    patch = pytest.MonkeyPatch()
    patch.setenv("GLOO_SOCKET_IFNAME", "lo")   # (the rendezvous would set it for good in this process)
    config = EngineConfig(model=str(engine_checkpoint[0]), speculative_model=assistant, tensor_parallel_size=2,
                          engine_threads=2, async_scheduling="on", **OPTIONS)
    threads = torch.get_num_threads()
    torch.set_num_threads(ranks.rank_threads(config))   # rank 0's threads, as in the engine process
    tp = tensor_parallel.TensorParallelGroup(config)
    try:
        core = EngineCore(config, model=ranks.load_rank_model(config, tp.group),
                          runner_factory=tp.runner_factory)
        tp.runner.serve_drafts(core.speculator)   # as the engine process does
        yield core
    finally:
        tp.close()
        # The module's last test fails the group on purpose, and close() leaves a failed group as it
        # is (the engine process exits then); this pytest worker goes on to other TP modules.
        if dist.is_initialized():
            dist.destroy_process_group()
        patch.undo()
        torch.set_num_threads(threads)


def use_loop(core, loop: str) -> None:
    """What --async-scheduling sets in the core and its scheduler (switched only while idle)."""
    assert not core.has_work
    core.async_scheduling = core.scheduler.async_scheduling = loop == "async"


def run(core, requests, *, arrivals=None, aborts=None, after_step=None) -> tuple[dict[str, list[int]], dict[str, list]]:
    """Step `core` until idle: each request added at its arrival step, each in `aborts` aborted
    after that step (then `after_step(step)`). Returns each request's tokens and, per step it was
    scheduled in, (drafts verified, drafts kept)."""
    aborts = aborts or {}
    drafts = {r.request_id: [] for r in requests}

    def record_and_abort(step, result):
        if after_step is not None:
            after_step(step)
        for item in result.step.items if result.step else []:
            if item.draft_tokens:
                drafts[item.request_id].append((item.draft_tokens, item.accepted_drafts))
        for rid, at in aborts.items():
            if at == step:
                assert core.abort(rid), rid

    return step_core(core, requests, arrivals=arrivals, after_step=record_and_abort), drafts


def tp1(load_backend, assistant, loop: str, **options):
    return make_llm(load_backend(OPTIONS["attention_backend"]), speculative_model=assistant,
                    async_scheduling="on" if loop == "async" else "off",
                    **{k: v for k, v in OPTIONS.items() if k not in ("device", "dtype")} | options).core


def workload(rng: random.Random, speculate: bool):
    requests = [build_request(f"g{i}", [rng.randrange(4, 20)], seed=rng.randrange(10_000),
                              max_tokens=rng.randrange(6, 16), temperature=0.0, disable_speculation=not speculate)
                for i in range(3)]
    # A seeded draw inverts its row's CDF at a fixed uniform: exact given the logits, but a row's logits
    # differ in the last bits between batch shapes (verify chunks, the async loop's extra rows) and
    # all-reduce orders, so a uniform within that noise of a CDF boundary takes the next token. Top-2
    # keeps one boundary a draw (a random model's ~300 near-equal tokens put hundreds in reach: a full
    # run failed on one), and two comparable tokens keep every draw a coin the seed decides.
    seeded = build_request("seeded", [rng.randrange(4, 20)], seed=rng.randrange(10_000), max_tokens=12,
                           temperature=0.9, top_k=2, top_p=0.9, disable_speculation=not speculate)
    seeded.sampling = dataclasses.replace(seeded.sampling, seed=rng.randrange(1000))
    # ends on EOS (id 1, favoured) at a step the host learns of after the next one was launched
    eos = build_request("eos", [rng.randrange(4, 20)], seed=rng.randrange(10_000), max_tokens=30,
                        disable_speculation=not speculate)
    eos.sampling = dataclasses.replace(eos.sampling, ignore_eos=False, temperature=1.0, seed=rng.randrange(1000),
                                       logit_bias=((1, 6.0),))
    return requests + [seeded, eos]


def assert_nothing_held(core) -> None:
    held = core.held_resources()   # encoded_ahead_bytes: every rank's (one all-reduce)
    assert (held["requests"], held["kv_blocks_held"], held["encoded_ahead_bytes"]) == ([], {}, 0), held


DRAWS = 5   # workloads drawn until one covers what a test checks (a draft kept in TP=1; a verify step last before a drain)


def kept_drafts(drafts: dict[str, list]) -> int:
    return sum(kept for steps in drafts.values() for _, kept in steps)


class Broadcasts:
    """Rank 0's tensor broadcasts per step (the protocol's: the model's layers make none here) and the
    drafts its step messages send the workers to check (`StepMessage.verified`)."""

    def __init__(self, core, monkeypatch):
        from mmserve.model.parallel import ParallelGroup

        self.per_step, self.verified, self._count = [], 0, 0
        tp = core.runner.tp
        broadcast, send = ParallelGroup.broadcast, tp.send

        def counted(group, x):
            self._count += 1
            return broadcast(group, x)

        def sending(msg):
            self.verified += len(getattr(msg, "verified", None) or ())
            return send(msg)

        monkeypatch.setattr(ParallelGroup, "broadcast", counted)   # this process: rank 0's
        monkeypatch.setattr(tp, "send", sending)

    def start(self) -> None:
        self._count = 0

    def step_done(self, step) -> None:
        self.per_step.append(self._count)
        self._count = 0


def test_tp2_async_gives_the_tokens_and_acceptance_of_sync_and_tp1(tp_core, load_backend, assistant, monkeypatch):
    """Greedy and seeded requests, one ending on EOS, with and without speculation: TP=2 async ==
    TP=2 sync == TP=1, the drafts verified and kept per step equal to TP=1's in the same loop, and
    the drafting rounds replayed graphs (no eager round: tensor parallelism no longer forces one).
    Speculating in the async loop, a step broadcasts once (the drafting round's acceptance: the
    workers build the next inputs from it; before, the in-flight tokens went by a second one), and
    the workers check their drafts against rank 0's."""
    # A draw whose drafter keeps nothing happens (12 of 60 seeds): draw again. So is one where a greedy
    # choice of the reference's target, or a draft of TP=1's drafter (either loop), is a near tie, which
    # TP=2's other sums may flip (1 and 1 of those 60 seeds; the drafter's down to 1.6e-5): every token,
    # or the drafts kept, after it would differ, and they are compared exactly.
    for _ in range(DRAWS):
        seed = random.randrange(10_000)
        speculating = workload(random.Random(seed), True)
        drafting = tp1(load_backend, assistant, "async")
        draft_gaps = [record_draft_gaps(drafting)]   # each fills as its engine runs
        tp1_async = run(drafting, speculating)
        if not kept_drafts(tp1_async[1]):
            continue
        drafting = tp1(load_backend, assistant, "sync")
        draft_gaps.append(record_draft_gaps(drafting))
        tp1_sync = run(drafting, speculating)
        plain = workload(random.Random(seed), False)
        reference_core = tp1(load_backend, assistant, "sync")
        decisions = record_decisions(reference_core)
        tp1_plain = run(reference_core, plain)
        greedy = {r.request_id: tp1_plain[0][r.request_id] for r in plain if r.sampling.greedy}
        drafts = torch.cat([gap for gaps in draft_gaps for gap in gaps])
        print(f"seed {seed}: smallest top-two gap of TP=1's {len(drafts)} drafts {drafts.min().item():.2g} "
              f"(NEAR_TIE {NEAR_TIE})")
        if not (near_tie_in(decisions, greedy) or bool((drafts < NEAR_TIE).any())):
            break
    else:
        pytest.fail(f"no draft kept, or a near tie, in {DRAWS} workloads (last seed {seed})")
    replays = tp_core.speculator.graphs.replays
    runs = {("tp1", "async", True): tp1_async,
            ("tp1", "sync", True): tp1_sync,
            ("tp1", "sync", False): tp1_plain}
    broadcasts = Broadcasts(tp_core, monkeypatch)
    for loop in ("async", "sync"):
        use_loop(tp_core, loop)
        for requests in (plain, speculating):
            counting = loop == "async" and requests is speculating
            broadcasts.start()
            runs["tp2", loop, requests is speculating] = run(
                tp_core, requests, after_step=broadcasts.step_done if counting else None)
            assert_nothing_held(tp_core)
    use_loop(tp_core, "async")
    assert max(broadcasts.per_step) == 1, (seed, broadcasts.per_step)
    assert broadcasts.verified > 0, "no worker checked its drafts against rank 0's"
    reference = runs["tp1", "sync", False][0]
    assert [len(reference[r.request_id]) for r in plain[:-1]] == [r.sampling.max_tokens for r in plain[:-1]]
    assert len(reference["eos"]) < 30, (seed, "the EOS request did not end on EOS")
    for key, (tokens, _) in runs.items():
        assert tokens == reference, (seed, key)
    for loop in ("async", "sync"):
        ours, theirs = runs["tp2", loop, True][1], runs["tp1", loop, True][1]
        assert ours == theirs, (seed, loop)
        assert not any(runs["tp2", loop, False][1].values())
    assert tp_core.speculator.graphs.replays > replays and tp_core.speculator.graphs.eager_rounds == 0


def test_tp2_async_cancel_and_preemption_leave_nothing_held_on_any_rank(tp_core, load_backend, assistant):
    """Speculating requests on a KV budget too small for all of them (preemptions, recomputed with
    the step after them already launched) and one aborted mid-decode: the others' tokens are TP=1's,
    and no KV block, placeholder or embedding (summed over both ranks) is held at the end."""
    seed = random.randrange(10_000)
    rng = random.Random(seed)
    requests = [build_request(f"r{i}", [rng.randrange(10, 30)], seed=rng.randrange(10_000), max_tokens=16,
                              temperature=0.0) for i in range(6)]
    reference = tp1(load_backend, assistant, "sync")
    decisions = record_decisions(reference)
    want, _ = run(reference, requests)
    preempted, preempt = [], tp_core.scheduler._preempt
    aside = {name: pool.take(pool.num_free - 16) for name, pool in tp_core.kv.pools.items()}   # 16 blocks a pool
    tp_core.scheduler._preempt = lambda victim: (preempted.append(victim.request_id), preempt(victim))
    try:
        got, _ = run(tp_core, requests, aborts={"r1": 3})
    finally:
        tp_core.scheduler._preempt = preempt
        for name, blocks in aside.items():
            tp_core.kv.pools[name].release(blocks)
    assert preempted, (seed, "nothing was preempted: the KV budget is too generous for this test")
    assert_tokens_agree(want, got, decisions, cut={"r1"})
    assert len(got["r1"]) < len(want["r1"])
    assert all(r.num_output_placeholders == 0 for r in tp_core.scheduler.running)
    assert_nothing_held(tp_core)


def test_tp2_async_video_encodes_ahead_beside_decodes(tp_core, load_backend, assistant):
    """A video arriving beside decoding requests, its frames encoded ahead on every rank: the tokens
    of TP=1's synchronous loop, and nothing held on any rank at the end."""
    rng = random.Random(random.randrange(10_000))
    decoders = [build_request(f"d{i}", [rng.randrange(5, 15)], seed=rng.randrange(1000), max_tokens=16,
                              temperature=0.0) for i in range(2)]
    video = build_request("v", [3, ("video", [8] * rng.randrange(3, 6)), 4], seed=rng.randrange(1000),
                          max_tokens=8, temperature=0.0)
    requests, arrivals = decoders + [video], {"v": 2}
    ahead = []
    encode_ahead = tp_core.runner.local._encode_ahead
    tp_core.runner.local._encode_ahead = lambda items: (ahead.append(len(items)), encode_ahead(items))[1]
    try:
        got, _ = run(tp_core, requests, arrivals=arrivals)
    finally:
        del tp_core.runner.local._encode_ahead
    assert ahead, "no frame was encoded ahead"
    reference = tp1(load_backend, assistant, "sync")
    decisions = record_decisions(reference)
    assert_tokens_agree(run(reference, requests, arrivals=arrivals)[0], got, decisions)
    assert_nothing_held(tp_core)


def test_a_worker_takes_the_in_flight_tokens_from_rank_0s_broadcast():
    """The layout travels in the message, the tokens by broadcast: what a worker rebuilds is rank 0's
    `SampledTokens`, with and without the shift, and a step that sampled no row broadcasts nothing
    (here a group of one, whose broadcast keeps its input)."""
    from mmserve.executor.step_messages import InFlightTokens, share_in_flight
    from mmserve.model.parallel import ParallelGroup
    from mmserve.worker.model_runner import SampledTokens

    sent = []

    class Sender(ParallelGroup):   # rank 0: what it broadcasts
        def broadcast(self, x):
            sent.append(x.clone())
            return x

    class Receiver(ParallelGroup):   # another rank: rank 0's tensor lands in its buffer
        def broadcast(self, x):
            x.copy_(sent[-1])
            return x

    for shift in (None, torch.randint(0, K, (5,))):
        prev = SampledTokens(torch.randint(0, 300, (5, 1 + K)), {f"r{i}": i for i in range(5)}, shift)
        layout = InFlightTokens.of(prev)
        assert share_in_flight(Sender(0, 2), layout, prev) is prev
        theirs = share_in_flight(Receiver(1, 2), dataclasses.replace(layout), device="cpu")
        assert torch.equal(theirs.tokens, prev.tokens) and theirs.rows == prev.rows
        assert (theirs.shift is None) == (shift is None) and (shift is None or torch.equal(theirs.shift, shift))
    sent.clear()   # a step that sampled no row: nothing to broadcast, both sides know it from the layout
    empty = SampledTokens(torch.zeros((0, 1 + K), dtype=torch.int64), {}, torch.zeros(0, dtype=torch.int64))
    assert share_in_flight(Sender(0, 2), InFlightTokens.of(empty), empty) is empty and not sent
    theirs = share_in_flight(Receiver(1, 2), InFlightTokens.of(empty), device="cpu")
    assert theirs.tokens.shape == (0, 1 + K) and theirs.shift.shape == (0,)


def test_held_outcome_takes_the_round_it_drafted_and_catches_other_drafts():
    """A worker's own outcome (executor/step_messages.HeldOutcome) on fresh random tokens: the step
    takes exactly what its drafting round built; rank 0's drafts equal to its own pass the check one
    step later, one differing draft raises, and a step told to take an outcome no round built fails."""
    from mmserve.executor.step_messages import DraftsDiverged, HeldOutcome, InFlightTokens

    gen = torch.Generator().manual_seed(random.randrange(2**31))
    tokens, shift = torch.randint(0, 300, (5, 1 + K), generator=gen), torch.randint(0, K + 1, (5,), generator=gen)
    rows = {f"r{i}": i for i in torch.randperm(5, generator=gen).tolist()}
    outcome = HeldOutcome(rank=1)
    outcome.hold(tokens, shift)
    taken = outcome.take(InFlightTokens(rows, 1 + K, shifted=True, held=True))
    assert taken.tokens is tokens and taken.shift is shift and taken.rows == rows
    verified = {rid: tokens[row, 1:1 + n].tolist() for n, (rid, row) in enumerate(rows.items(), start=1)
                if n <= K}
    outcome.check(verified)
    rid = next(iter(verified))
    verified[rid][0] += 1
    with pytest.raises(DraftsDiverged, match=f"rank 1 drafted .* for request {rid}"):
        outcome.check(verified)
    assert outcome.take(InFlightTokens(rows, 1 + K, shifted=True)) is None   # broadcast instead
    with pytest.raises(RuntimeError, match="did not run"):
        outcome.take(InFlightTokens(rows, 1 + K, shifted=True, held=True))


def test_drafts_of_a_step_no_step_follows_are_checked_before_its_tokens(tp_core, load_backend, assistant,
                                                                        monkeypatch):
    """A verify step whose requests may end in it (every token they may still make in flight, all
    drafts assumed kept) is followed by no step, so no step message carries the drafts it took from
    the workers' own round: rank 0 sends them in a check of their own (`DraftsCheck`, one message
    and one all-reduce) before that step's tokens are emitted. Forced here on every step that
    verifies device-made drafts (the scheduler told the request is all in flight; alone, so no other
    request's step follows): each such step is followed by its check, and the tokens are TP=1's.
    (The checks riding step messages: the first test's.)"""
    from mmserve.executor.step_messages import DraftsCheck

    seed = random.randrange(10_000)
    rng = random.Random(seed)
    requests = [build_request("d", [rng.randrange(4, 20)], seed=rng.randrange(10_000),
                              max_tokens=rng.randrange(8, 16), temperature=0.0)]
    reference = tp1(load_backend, assistant, "sync")   # (the synchronous loop's decisions have known positions)
    decisions = record_decisions(reference)
    want, _ = run(reference, requests)
    runner = tp_core.runner
    sent = record_steps_and_checks(monkeypatch, runner, type(runner).execute, runner.tp.send, DraftsCheck)
    monkeypatch.setattr(tp_core.scheduler, "_all_in_flight", lambda request: request.num_output_placeholders > 1)
    use_loop(tp_core, "async")
    got, _ = run(tp_core, requests)
    assert_tokens_agree(want, got, decisions)
    checks = [i for i, (kind, n) in enumerate(sent) if kind == "check" and n]
    assert checks, (seed, "no verify step was the last before a drain", sent)
    for i, (kind, took) in enumerate(sent):
        if kind == "step" and took:   # no step follows it: the next message is its check
            assert i + 1 in checks, (seed, i, sent)
    assert_nothing_held(tp_core)


def record_steps_and_checks(patch, runner, execute, send, check_type) -> list[tuple[str, int]]:
    """("step", drafts the step took from the workers' round) per step rank 0 runs and ("check",
    requests checked) per drafts check it sends, in order."""
    sent = []

    def executing(self, out, prev=None):
        result = execute(self, out, prev)
        sent.append(("step", len(self._took_held)))
        return result

    def sending(msg):
        if isinstance(msg, check_type):
            sent.append(("check", len(msg.verified)))
        return send(msg)

    patch.setattr(type(runner), "execute", executing)
    patch.setattr(runner.tp, "send", sending)
    return sent


def test_a_worker_whose_drafts_differ_from_rank_0s_stops_the_group(tp_core):
    """LAST in the module (it ends the group): rank 0 tells the worker one draft other than the
    worker made, as if their drafters' logits differed: the worker's check stops the group, and the
    step whose message carried it fails on rank 0 with RankLostError (the tokens of the step that
    verified those drafts, still in flight, are never emitted)."""
    sent = tp_core.runner.tp.send
    tampered = []

    def tamper(msg):
        if getattr(msg, "verified", None) and not tampered:
            rid, drafts = next(iter(msg.verified.items()))
            msg.verified[rid] = [drafts[0] + 1, *drafts[1:]]
            tampered.append(rid)
        return sent(msg)

    tp_core.runner.tp.send = tamper
    use_loop(tp_core, "async")
    rng = random.Random(random.randrange(10_000))
    for i in range(2):
        tp_core.add_request(build_request(f"t{i}", [rng.randrange(4, 20)], seed=rng.randrange(10_000), max_tokens=24,
                                          temperature=0.0).core_request())
    for _ in range(30):
        before = list(tampered)
        try:
            tp_core.step()
        except tensor_parallel.RankLostError as exc:
            assert tampered and not before, "the group failed, but not in the step that carried the check"
            assert "rank 1" in str(exc)
            return
    pytest.fail(f"the worker took other drafts than its own without stopping (tampered: {tampered})")
