"""Prefix caching changes what is computed, never what is generated: every case runs the same
requests through an engine with the cache and one without (the oracle) on a fresh random tiny
Gemma 4 (sliding window 6, far shorter than the prefixes reused), and compares greedy tokens and the
sampled logits; then checks what the cache served (Usage.cached_tokens) and what the vision tower
had to encode."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import shutil
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from engine_helpers import build_request, greedy_agree, make_llm
from gemma4_fixtures import NUM_SPECIALS, VOCAB
from test_engine_batching import assert_pools_full

from mmserve.attention.backend import FULL, SLIDING
from mmserve.block_hash import block_hashes
from mmserve.config import EngineConfig
from mmserve.core.kv_cache.manager import NULL_BLOCK
from mmserve.engine.input.processor import InputMessage, InputProcessor, TextInput, VideoInput
from mmserve.engine.observer import NullObserver
from mmserve.model.spec import load_spec_without_transformers
from mmserve.request import Request
from mmserve.sampling_params import SamplingParams

BS = 4


class Watch(NullObserver):
    """Frames encoded per request id, and preemptions, as the front end's observer sees them."""

    def __init__(self):
        self.encoded, self.preempted = Counter(), 0

    def on_step(self, record):
        self.preempted += record.num_preempted
        for item in record.items:
            self.encoded[item.request_id] += item.num_frames_encoded


def engine(model_tok, **options):
    """An LLM whose sampled logits rows are recorded per request id, with a Watch observer."""
    llm = make_llm(model_tok, block_size=BS, **options)
    llm.observer = watch = Watch()
    llm.logits = {}
    execute = llm.core.runner.execute

    def recording(out, *prev):   # (async scheduling: the step in flight's tokens)
        result = execute(out, *prev)
        for row, s in zip(result.logits, result.sampling, strict=True):
            llm.logits.setdefault(s.request.request_id, []).append(row.clone())
        return result

    llm.core.runner.execute = recording
    return llm, watch


def compare(model_tok, batches, **options):
    """Run `batches` (each a list of requests generated together, one batch after another) with and
    without prefix caching; tokens must be equal and logits close. Returns the cached run's
    completions by id and its Watch."""
    results = {}
    for caching in (True, False):
        llm, watch = engine(model_tok, enable_prefix_caching=caching, **options)
        done = {}
        for batch in batches:
            done.update({c.request_id: c for c in llm.generate(batch)})
        results[caching] = (llm, watch, done)
        assert_pools_full(llm.core)
    (on, watch, got), (off, _, want) = results[True], results[False]
    for rid, c in want.items():
        # equal tokens save a near tie of the uncached run's own; logits up to the divergence (its row included)
        same = greedy_agree(c.token_ids, got[rid].token_ids, off.logits[rid]) + 1
        torch.testing.assert_close(torch.stack(on.logits[rid][:same]), torch.stack(off.logits[rid][:same]),
                                   rtol=1e-4, atol=1e-4)
        assert want[rid].usage.cached_tokens == 0
    return got, watch, on


def with_tail(req, rid: str, keep: int, tail: list[int], **kw):
    """`req`'s first `keep` prompt tokens (and the frames inside them) followed by `tail`."""
    ranges = [(s, e) for s, e in req.mm_ranges if e < keep]
    return dataclasses.replace(req, request_id=rid, prompt_token_ids=req.prompt_token_ids[:keep] + tail,
                               mm_ranges=ranges, mm_inputs=req.mm_inputs[:len(ranges)], **kw)


def text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(NUM_SPECIALS, VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def processor(engine_checkpoint, tmp_path_factory):
    """The real input path (PyAV decode, sampling, resize, hashing) for the engine checkpoint, with
    9 soft tokens per frame so that prompts stay short."""
    path, _ = engine_checkpoint
    root = tmp_path_factory.mktemp("prefix_processor")
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        shutil.copy(path / name, root / name)
    (root / "video_preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 9}))
    with ThreadPoolExecutor(2) as pool:
        yield InputProcessor.from_checkpoint(EngineConfig(model=str(root)), pool, spec=load_spec_without_transformers(root),
                                             context_length=1024)


def process(processor, rid: str, *parts, max_tokens: int = 4):
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return asyncio.run(processor.process(rid, [InputMessage("user", tuple(parts))], sampling))


def test_follow_up_questions_about_one_video_reuse_its_frames(load_backend, processor, make_video):
    video = make_video(random.randrange(1000), num_frames=4, size=16)
    q1 = process(processor, "q1", VideoInput(data=video, num_frames=3), TextInput("Question: what moves?"))
    q2 = process(processor, "q2", VideoInput(data=video, num_frames=3), TextInput("Question: which colour?"))
    assert [m.content_hash for m in q1.mm_inputs] == [m.content_hash for m in q2.mm_inputs]
    got, watch, _ = compare(load_backend("reference"), [[q1], [q2]])
    assert got["q1"].usage.cached_tokens == 0 and watch.encoded["q1"] == 3
    assert got["q2"].usage.cached_tokens > q2.mm_ranges[-1][1]   # every frame came from the cache
    assert watch.encoded["q2"] == 0


def test_three_turn_conversation_reuses_earlier_turns_and_answers(load_backend):
    model_tok = load_backend("reference")
    rng = random.Random(random.randrange(10**6))
    t1 = build_request("t1", [5, ("video", [8, 8, 4]), 7], seed=rng.randrange(10**6), max_tokens=5)
    llm, _ = engine(model_tok)                     # the answers the later turns repeat
    a1 = llm.generate([t1])[0].token_ids
    t2 = with_tail(t1, "t2", len(t1.prompt_token_ids), a1 + text(rng, 9))
    a2 = llm.generate([t2])[0].token_ids
    # Turn 3 shows the same video again, after the conversation so far.
    p2 = t2.prompt_token_ids + a2 + text(rng, 3)
    again = [(s + len(p2) - t1.mm_ranges[0][0] + 2, e + len(p2) - t1.mm_ranges[0][0] + 2) for s, e in t1.mm_ranges]
    video = t1.prompt_token_ids[t1.mm_ranges[0][0] - 2:t1.mm_ranges[-1][1] + 2]
    t3 = dataclasses.replace(t1, request_id="t3", prompt_token_ids=p2 + video + text(rng, 5),
                             mm_ranges=t1.mm_ranges + again, mm_inputs=t1.mm_inputs * 2)
    got, watch, _ = compare(model_tok, [[t1], [t2], [t3]])
    assert got["t1"].token_ids == a1 and got["t2"].token_ids == a2
    # Everything turn 1 computed (its last answer token never entered the model) is reused.
    for turn, before in (("t2", t1.prompt_token_ids + a1), ("t3", t2.prompt_token_ids + a2)):
        assert got[turn].usage.cached_tokens == (len(before) - 1) // BS * BS, turn
    assert +watch.encoded == {"t1": 3}             # the repeated video's frames: encoder cache
    for _, e in t3.mm_ranges[3:]:
        assert e >= got["t3"].usage.cached_tokens  # ... while its K/V at the new place was computed


def test_different_videos_with_the_same_tokens_never_share_frames(load_backend):
    seed = random.randrange(10**6)
    a = build_request("a", [6, ("video", [8, 8]), 5], seed=seed)
    b = dataclasses.replace(build_request("b", [6, ("video", [8, 8]), 5], seed=seed + 1),
                            prompt_token_ids=a.prompt_token_ids)   # same ids, other pixels
    assert a.mm_ranges == b.mm_ranges
    got, watch, _ = compare(load_backend("reference"), [[a], [b]])
    assert got["b"].usage.cached_tokens == a.mm_ranges[0][0] // BS * BS
    assert watch.encoded["b"] == 2


def test_other_num_frames_reuses_only_the_frames_that_are_the_same(load_backend, processor, make_video):
    video = make_video(random.randrange(1000), num_frames=8, size=16)
    a = process(processor, "a", VideoInput(data=video, num_frames=4), TextInput("What happens?"))
    b = process(processor, "b", VideoInput(data=video, num_frames=8), TextInput("What happens?"))
    same = 0
    while (same < len(a.mm_ranges) and a.mm_ranges[same] == b.mm_ranges[same]
           and a.mm_inputs[same].content_hash == b.mm_inputs[same].content_hash
           and a.prompt_token_ids[:a.mm_ranges[same][1] + 1] == b.prompt_token_ids[:b.mm_ranges[same][1] + 1]):
        same += 1
    assert same < 4, "the sampling should differ somewhere"
    got, watch, _ = compare(load_backend("reference"), [[a], [b]])
    cached = got["b"].usage.cached_tokens
    assert cached <= b.mm_ranges[same][0]          # never into the first frame that differs
    if same:
        assert cached >= b.mm_ranges[same - 1][1] // BS * BS
    # Frames b shares with a at other places (4 of 8 sample times agree) come from the encoder cache.
    seen = {m.content_hash for m in a.mm_inputs}
    assert watch.encoded["b"] == sum(m.content_hash not in seen for m in b.mm_inputs) < 8


def test_a_hit_that_would_end_inside_a_frame_restarts_at_the_frame(load_backend):
    # <bos> + 5 text, a timestamp token and <boi>: the 9-token image is [8, 16], <eoi> at 17.
    a = build_request("a", [5, ("image", 9), 6], seed=random.randrange(10**6))
    assert a.mm_ranges == [(8, 16)]
    b = with_tail(a, "b", 18, [a.prompt_token_ids[18] + 1])   # 19 tokens: the hit may cover at most 16
    got, watch, on = compare(load_backend("reference"), [[a], [b]])
    assert got["b"].usage.cached_tokens == 8       # 16 lies inside the image: back to its start
    assert watch.encoded["b"] == 0                 # recomputed K/V, cached embeddings


def test_budget_of_16_tokens_with_hits_in_flight(load_backend):
    rng = random.Random(random.randrange(10**6))
    doc = build_request("doc", [5, ("video", [8, 8, 8]), 4], seed=rng.randrange(10**6), max_tokens=4)
    n = len(doc.prompt_token_ids)
    first = [with_tail(doc, f"a{i}", n, text(rng, rng.randint(1, 9))) for i in range(3)]
    later = [with_tail(doc, f"b{i}", rng.randint(4, n), text(rng, rng.randint(1, 9))) for i in range(4)]
    got, watch, _ = compare(load_backend("reference"), [first, later], max_num_batched_tokens=16)
    assert sum(got[r.request_id].usage.cached_tokens > 0 for r in first + later) >= 4


@pytest.mark.parametrize("loop", ["off", "on"])   # async: blocks released and keyed with a step in flight
def test_a_small_kv_cache_evicts_and_preempts_while_requests_run(load_backend, loop):
    # Two documents run first (all their full blocks stay cached), then six follow-ups about them
    # arrive together. The pool is sized from these prompts so that the six are admitted in one step
    # without evicting anything (each reuses its document's cached prefix and takes empty blocks
    # for the rest of its prompt, which uses up the empty ones), and so that decoding in lockstep
    # must outgrow it: growth evicts the document blocks no follow-up reuses, then preempts.
    # The seed changes the prompts and sizes, never that outcome.
    rng = random.Random(random.randrange(10**6))
    docs = [build_request(f"d{k}", [4, ("image", 9), 20], seed=rng.randrange(10**6), max_tokens=1)
            for k in range(2)]
    doc_blocks = len(docs[0].prompt_token_ids) // BS      # full blocks each document's run caches
    lo = (docs[0].mm_ranges[-1][1] // BS + 1) * BS         # a reused prefix never ends inside the frame
    fresh = sorted(set(range(NUM_SPECIALS, VOCAB)) - {t for d in docs for t in d.prompt_token_ids})
    firsts = rng.sample(fresh, 6)   # so no follow-up shares a block past its reused prefix with another
    max_tokens, follow, hit = 12, [], {}
    for i in range(6):
        keep = rng.randint(lo, doc_blocks * BS - 1)      # reuses fewer blocks than its document cached
        follow.append(with_tail(docs[i % 2], f"f{i}", keep, [firsts[i]] + text(rng, rng.randint(1, 11)),
                                sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        hit[f"f{i}"] = keep // BS * BS

    def blocks(n):
        return -(-n // BS)

    prompt = {r.request_id: len(r.prompt_token_ids) for r in follow}
    reused = [max(hit[r.request_id] for r in follow[k::2]) // BS for k in range(2)]   # blocks, per document
    cached = 2 * doc_blocks
    own = sum(blocks(prompt[r]) - hit[r] // BS for r in hit)   # empty blocks the six take at admission
    growth = sum(blocks(prompt[r] + max_tokens - 1) - blocks(prompt[r]) for r in hit)
    # The pool holds `cached + own`; the six end up needing sum(reused) + own + growth of it.
    assert 0 < cached - sum(reused) < growth     # evictions first, then more than the pool holds
    got, watch, on = compare(load_backend("reference"), [docs, follow], num_kv_blocks=cached + own + 1,
                             max_num_seqs=6, max_num_batched_tokens=sum(prompt[r] - hit[r] for r in hit),
                             async_scheduling=loop)
    assert watch.preempted > 0
    assert {r: got[r].usage.cached_tokens for r in hit} == hit
    unreused = [key for d, n in zip(docs, reused, strict=True)
                for key in block_hashes(Request("x", d.prompt_token_ids, d.sampling, d.mm_ranges, d.mm_inputs),
                                        BS, doc_blocks)[n:]]
    assert any(on.core.kv.pools[FULL].lookup(key) is None for key in unreused)   # evicted, never recomputed


def test_evicted_sliding_blocks_limit_the_hit_though_full_blocks_remain(load_backend):
    model_tok = load_backend("reference")
    rng = random.Random(random.randrange(10**6))
    a = build_request("a", [60], seed=rng.randrange(10**6))
    c = build_request("c", [60], seed=rng.randrange(10**6))
    b = with_tail(a, "b", len(a.prompt_token_ids), text(rng, 3))
    # One request at a time and 16-token chunks, no room for cached windows: the sliding pool holds
    # what one request can (window 6 + one chunk), so running c evicts what a left there; the full
    # pool keeps a.
    options = dict(num_kv_blocks=0, kv_cache_bytes=2**20, max_num_seqs=1, max_num_batched_tokens=16,
                   window_cache_share=0.0)
    got, _, on = compare(model_tok, [[a], [c], [b]], **options)
    kv = on.core.kv
    assert kv.plans[SLIDING].num_blocks < 16 < kv.plans[FULL].num_blocks
    reusable = (len(b.prompt_token_ids) - 1) // BS
    keys = block_hashes(Request("x", b.prompt_token_ids, b.sampling), BS, reusable)
    assert all(kv.pools[FULL].lookup(k) is not None for k in keys)   # the full pool alone: 60 tokens
    assert got["b"].usage.cached_tokens < reusable * BS


def test_a_hits_sliding_table_starts_with_null_blocks(load_backend):
    a = build_request("a", [40], seed=random.randrange(10**6))
    b = with_tail(a, "b", 41, [a.prompt_token_ids[-1] + 1])
    tables = {}

    def first_tables(execute):
        """Each request's table as its first step launches (the async loop's records come a step later)."""
        def recording(out, *prev):
            for s in out.scheduled:
                tables.setdefault(s.request.request_id, list(llm.core.kv.block_table(s.request.request_id, SLIDING)))
            return execute(out, *prev)
        return recording

    got = {}
    for caching in (False, True):                  # the cached run last: its tables are checked
        llm, _ = engine(load_backend("reference"), enable_prefix_caching=caching)
        llm.core.runner.execute = first_tables(llm.core.runner.execute)
        tables.clear()
        got[caching] = [c.token_ids for c in (llm.generate([a])[0], llm.generate([b])[0])]
        assert_pools_full(llm.core)
    assert got[True] == got[False]
    cached = 40                                    # 41 prompt tokens: all but the last
    first = (cached - 6 + 1) // BS                 # the window (6) reaches back to key 35
    assert tables["b"][:first] == [NULL_BLOCK] * first
    assert NULL_BLOCK not in tables["b"][first:]


def test_a_request_ended_on_a_stop_string_reports_its_cached_tokens(load_backend):
    # Stop strings end a request in the front end, whose copy of the request never sees the cache:
    # the cached-token count must have crossed with the core's outputs before the stop.
    model_tok = load_backend("reference")
    llm, _ = engine(model_tok)
    for _ in range(20):   # a random model's bytes may not decode to two clean characters (3% of prompts)
        seed = random.randrange(10**6)
        full = llm.generate([build_request(f"a{seed}", [25], seed=seed, max_tokens=24)])[0]
        starts = [i for i in range(len(full.text) // 3, len(full.text) - 2)
                  if "\ufffd" not in full.text[i:i + 2] and full.text[i:i + 2].strip()]
        if starts:
            break
    stop = full.text[starts[0]:starts[0] + 2]
    got = llm.generate([build_request("b", [25], seed=seed, max_tokens=24, stop=(stop,))])[0]
    assert got.finish_reason == "stop" and got.matched_stop == stop
    assert got.usage.cached_tokens == 25 // BS * BS   # 26 prompt tokens: every whole block but the last token's
    assert got.token_ids == full.token_ids[:len(got.token_ids)]
    assert_pools_full(llm.core)


@pytest.mark.parametrize("loop", ["off", "on"])
def test_a_prompt_asked_again_reuses_every_whole_block_in_either_loop(load_backend, loop):
    """A 41-token text prompt prefilled in one step, asked again: every whole block before its last
    token is served from the cache (40 tokens), with async scheduling as without (where the window
    released the sliding blocks the step in flight computed before its update keyed them)."""
    a = build_request("a", [40], seed=random.randrange(10**6))
    got, _, _ = compare(load_backend("reference"), [[a], [dataclasses.replace(a, request_id="b")]],
                        async_scheduling=loop, max_num_batched_tokens=64)
    assert got["b"].usage.cached_tokens == 40
