"""Encode-ahead (--encode-ahead): the frames the next step will consume are encoded while this step
runs, batched across requests, and that step takes them without a tower call.

The reference is the engine with encode-ahead off (each step encodes its own frames; itself tested
against transformers): the same tokens on fresh random prompts, in both loops and with emulated
graphs; per step, which frames the vision tower ran on (a spy on the model's tower) shows that only
a video's first chunk, which no step before could foresee, is encoded in its own step.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from engine_helpers import assert_tokens_agree, build_request, make_llm, record_decisions, step_through
from test_engine_batching import assert_pools_full

from mmserve.request import MultiModalInput


@pytest.fixture(scope="module")
def model_tok(load_backend):
    return load_backend("sdpa")


def spy_towers(llm, monkeypatch) -> list[dict]:
    """Per step: the frames the step consumed ("frames"), whether one was in the first chunk a
    request was scheduled (its "first": a prefix hit may start it past token 0), how many frames the tower encoded inside the step ("in_step") and ahead of the next
    ("ahead"), the step's per-request frame counts ("counted") and whether it reports when the tower
    ran for them ("timed")."""
    runner, steps, seen = llm.core.runner, [], set()
    phase = ["ahead"]
    encode, execute, vision = runner._encode, runner.execute, runner.model.encode_vision

    def in_step(scheduled):
        phase[0] = "in_step"
        try:
            return encode(scheduled)
        finally:
            phase[0] = "ahead"

    def tower(pixels, positions):
        steps[-1][phase[0]] += pixels.shape[0]
        return vision(pixels, positions)

    def recording(out, prev=None):
        steps.append(Counter(frames=sum(len(s.frames) for s in out.scheduled),
                             first=any(s.frames and s.request.request_id not in seen for s in out.scheduled)))
        seen.update(s.request.request_id for s in out.scheduled)
        result = execute(out, prev)
        steps[-1]["counted"] = sum(result.frames_encoded.values())
        steps[-1]["timed"] = result.encode_perf is not None and result.encode_perf[0] < result.encode_perf[1]
        return result

    monkeypatch.setattr(runner, "_encode", in_step)
    monkeypatch.setattr(runner, "execute", recording)
    monkeypatch.setattr(runner.model, "encode_vision", tower)   # the session's shared model: undone after
    return steps


def test_frames_encoded_ahead_give_the_same_tokens_and_no_tower_call_in_the_consuming_step(model_tok, monkeypatch):
    """Decoding requests, then two videos arriving while they decode (chunked over several steps):
    with encode-ahead on (the synchronous loop eager; the async loop with emulated graphs and prefix
    caching off, so no encoder cache), the tokens equal those with it off; every step that consumes frames past a video's first chunk runs no tower
    call (they were encoded the step before); each frame is counted once, by the step that consumed it,
    which reports when the tower ran for it."""
    rng = random.Random(int(torch.randint(0, 10_000, ())))
    decoders = [build_request(f"d{i}", [rng.randrange(5, 15)], seed=rng.randrange(1000), max_tokens=30)
                for i in range(3)]
    # (no request ends while a video prefills: an end frees budget the step before could not foresee)
    videos = [build_request(f"v{i}", [3, ("video", [8] * rng.randrange(4, 7)), 4], seed=rng.randrange(1000),
                            max_tokens=24) for i in range(2)]
    arrivals = {"v0": 2, "v1": 3}
    runs = {}
    for ahead in (False, True):
        for loop, graphs in (("off", False), ("on", True)):
            llm = make_llm(model_tok, encode_ahead=ahead, async_scheduling=loop, emulate_cuda_graphs=graphs,
                           enable_prefix_caching=not graphs, max_num_batched_tokens=24, attention_backend="sdpa")
            assert llm.core.runner.encoder_cache.max_bytes == 0 or not graphs
            if (ahead, loop) == (False, "off"):   # the reference
                decisions = record_decisions(llm)
            with monkeypatch.context() as patch:
                steps = spy_towers(llm, patch)
                runs[ahead, loop], _ = step_through(llm, decoders + videos, arrivals=arrivals)
            assert_pools_full(llm.core)
            assert llm.core.held_resources()["encoded_ahead_bytes"] == 0
            frames = sum(len(v.mm_inputs) for v in videos)
            assert sum(s["counted"] for s in steps) == sum(s["frames"] for s in steps) == frames
            assert all(s["timed"] == (s["counted"] > 0) for s in steps)   # a prefetched frame's call: its consumer's
            assert sum(s["in_step"] + s["ahead"] for s in steps) == frames   # each frame through the tower once
            if ahead:
                later = [s for s in steps if s["frames"] and not s["first"]]
                assert later and all(s["in_step"] == 0 for s in later), (loop, [dict(s) for s in steps])
                assert sum(s["ahead"] for s in steps) >= frames - sum(s["frames"] for s in steps if s["first"])
            else:
                assert sum(s["ahead"] for s in steps) == 0
    for tokens in runs.values():
        assert_tokens_agree(runs[False, "off"], tokens, decisions)


@pytest.mark.parametrize("loop", ["off", "on"])
def test_a_cancelled_requests_frames_encoded_ahead_are_freed(model_tok, loop):
    """A video aborted while its next frames are held (encoded ahead, not yet consumed): the next
    step, which schedules nothing, drops them, and the engine ends with nothing held."""
    llm = make_llm(model_tok, max_num_batched_tokens=24, async_scheduling=loop)
    llm.add_request(build_request("video", [3, ("video", [8] * 6), 4], seed=int(torch.randint(0, 1000, ())),
                                  max_tokens=4))
    held = llm.core.runner.encoded_ahead
    while llm.has_work and not len(held):
        llm.step()
    assert held.num_bytes > 0 and llm.core.held_resources()["encoded_ahead_bytes"] == held.num_bytes
    assert llm.core.abort("video")
    llm.processor.forget("video")
    while llm.has_work:
        llm.step()
    assert len(held) == 0 and held.num_bytes == 0
    assert_pools_full(llm.core)


def test_frames_encoded_ahead_are_held_only_for_running_requests_through_preemptions(model_tok):
    """Three videos under a KV budget that preempts: after every step, what is held was encoded for
    requests still running (a preempted one's are dropped, and encoded again once it is back); the
    tokens equal those with encode-ahead off under the same budget."""
    rng = random.Random(int(torch.randint(0, 10_000, ())))
    videos = [build_request(f"v{i}", [3, ("video", [8] * 5), 4], seed=rng.randrange(1000),
                            max_tokens=rng.randrange(8, 12)) for i in range(3)]
    runs = {}
    for ahead in (False, True):
        llm = make_llm(model_tok, encode_ahead=ahead, max_num_batched_tokens=32, num_kv_blocks=32)
        preempted = []
        preempt = llm.core.scheduler._preempt
        llm.core.scheduler._preempt = lambda victim, preempt=preempt, seen=preempted: (seen.append(victim), preempt(victim))
        for r in videos:
            llm.add_request(r)
        tokens = {r.request_id: [] for r in videos}
        while llm.has_work:
            for rid, item in llm.step():
                assert not isinstance(item, BaseException), (rid, item)
                tokens[rid] += item.new_token_ids
            running = {r.request_id for r in llm.core.scheduler.running}
            assert set(llm.core.runner.encoded_ahead._by_request) <= running
        assert preempted, "the budget preempts"
        assert len(llm.core.runner.encoded_ahead) == 0
        assert_pools_full(llm.core)
        runs[ahead] = tokens
    assert runs[True] == runs[False]


def test_a_request_whose_media_fails_ahead_fails_alone(model_tok):
    """Two videos prefilling together, one with a frame the tower refuses (patch positions past its
    table): the look-ahead batch holding both fails, is retried request by request, and the bad
    request alone ends with the encoder's error; the good one's tokens equal its tokens alone."""
    seed = int(torch.randint(0, 1000, ()))
    good = build_request("good", [2, ("video", [8] * 4), 2], seed=seed, max_tokens=5)
    bad = build_request("bad", [2, ("video", [8] * 4), 2], seed=seed + 1, max_tokens=5)
    broken = bad.mm_inputs[1]
    bad.mm_inputs[1] = MultiModalInput(broken.pixel_values, torch.full_like(broken.position_ids, 10 ** 6))
    alone = make_llm(model_tok, encode_ahead=False, max_num_batched_tokens=40).generate([good])[0].token_ids
    llm = make_llm(model_tok, max_num_batched_tokens=40)
    ahead = llm.core.runner._encode_ahead
    batches = []
    llm.core.runner._encode_ahead = lambda items: (batches.append({r.request_id for r, _ in items}), ahead(items))[1]
    errors = {}
    tokens, _ = step_through(llm, [good, bad], errors=errors)
    assert {"good", "bad"} in batches   # one look-ahead batch held both requests' frames
    assert set(errors) == {"bad"} and "request bad: the vision encoder failed" in str(errors["bad"])
    assert tokens["good"] == alone
    assert_pools_full(llm.core)
    assert len(llm.core.runner.encoded_ahead) == 0
