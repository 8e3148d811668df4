"""Per-step thread counts: the policy (measured classes, the gain the pool must show, no probing of
long steps, re-probing) on synthetic step timings; the engine core using it; and the premise it rests
on: the thread count changes what the model computes by rounding only."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import PROMPTS, build_request, make_llm, run_recording_logits
from gemma4_fixtures import make_checkpoint, tiny_config

from mmserve.core.sched.output import ScheduledRequest, SchedulerOutput
from mmserve.request import Request
from mmserve.worker import step_threads
from mmserve.worker.cpu_threads import torch_threads
from mmserve.worker.step_threads import StepThreads, size_class


def step(num_requests: int, tokens_each: int = 1, *, prefill: bool = False, frames: bool = False) -> SchedulerOutput:
    scheduled = [ScheduledRequest(Request(f"r{i}", [1] * 8, None), tokens_each, 0, prefill, [0] if frames else [])
                 for i in range(num_requests)]
    return SchedulerOutput(scheduled)


def run(threads: StepThreads, out: SchedulerOutput, seconds_on: dict[int, float], steps: int,
        rng: random.Random) -> list[int]:
    """`steps` steps of one class whose time on n threads is seconds_on[n] (+-1% noise); the counts used."""
    used, size = [], size_class(out)
    for _ in range(steps):
        n = threads.threads_for(size)
        used.append(n)
        threads.record(size, n, seconds_on[n] * rng.uniform(0.99, 1.01))
    return used


def test_size_classes_split_decode_prefill_frames_and_token_scale():
    assert size_class(step(16)) == (False, False, 5)
    assert size_class(step(17)) == size_class(step(31))
    assert size_class(step(16)) != size_class(step(32))
    assert size_class(step(4, 100, prefill=True)) == (True, False, 9)
    assert size_class(step(4, 100, prefill=True, frames=True)) == (True, True, 9)


def test_a_class_that_runs_as_fast_on_one_core_fewer_leaves_that_core():
    rng = random.Random()
    pool = rng.choice([2, 4, 8])
    threads = StepThreads(pool)
    narrow_s = rng.uniform(0.002, 0.02)
    used = run(threads, step(16), {pool: narrow_s * rng.uniform(1.0, 1.2), pool - 1: narrow_s}, 20, rng)
    probes = step_threads.PROBES
    assert used[:probes] == [pool] * probes and used[probes:2 * probes] == [pool - 1] * probes
    assert used[2 * probes:] == [pool - 1] * (20 - 2 * probes)
    assert threads.choices() == {size_class(step(16)): pool - 1}


@pytest.mark.parametrize("pool, speedup, keeps_pool", [(2, 1.6, True), (2, 1.1, False), (8, 1.1, True), (8, 1.01, False)])
def test_the_last_core_must_add_a_quarter_of_a_threads_work(pool, speedup, keeps_pool):
    """With 2 cores the second must make steps 1.25x faster; with 8 the eighth 1 + 0.25/7 = 1.036x.
    Less is not worth a core the front end needs."""
    rng = random.Random()
    threads = StepThreads(pool)
    narrow_s = rng.uniform(0.005, 0.04)
    run(threads, step(8), {pool: narrow_s / speedup, pool - 1: narrow_s}, 10, rng)
    assert threads.choices() == {size_class(step(8)): pool if keeps_pool else pool - 1}


def test_long_steps_never_try_fewer_threads():
    rng = random.Random()
    threads = StepThreads(2)
    used = run(threads, step(4, 512, prefill=True), {2: step_threads.PROBE_BELOW_S * rng.uniform(1.1, 5), 1: 0.001},
               12, rng)
    assert used == [2] * 12


def test_classes_are_measured_separately_and_reprobed():
    rng = random.Random()
    threads = StepThreads(2)
    decode, prefill = step(16), step(2, 300, prefill=True, frames=True)
    run(threads, decode, {2: 0.010, 1: 0.005}, 10, rng)
    run(threads, prefill, {2: 0.010, 1: 0.030}, 10, rng)
    assert threads.choices() == {size_class(decode): 1, size_class(prefill): 2}
    # The load changed: after REPROBE_EVERY steps the decode class measures again and follows it.
    used = run(threads, decode, {2: 0.005, 1: 0.015}, step_threads.REPROBE_EVERY + 2 * step_threads.PROBES + 1, rng)
    assert used[-1] == 2 and threads.choices()[size_class(decode)] == 2


def test_not_adaptive_or_one_thread_means_the_whole_pool():
    rng = random.Random()
    assert run(StepThreads(4, adaptive=False), step(16), {4: 0.01, 1: 0.001}, 10, rng) == [4] * 10
    assert run(StepThreads(1), step(16), {1: 0.01}, 10, rng) == [1] * 10


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A checkpoint wide enough that torch's CPU matmuls really split across threads (hidden 256,
    MLP 1024), loaded without the transformers reference."""
    from mmserve.model import load_model
    from mmserve.model.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("wide_gemma4")
    make_checkpoint(path, seed=5, config=tiny_config(hidden_size=256, intermediate_size=1024))
    return load_model(path, dtype="float32", device="cpu", attention_backend="sdpa"), load_tokenizer(path)


def test_the_thread_count_changes_logits_only_by_rounding(wide_model):
    """The premise of choosing threads per step: on one thread and on two, greedy tokens are the same
    and logits differ by float rounding only, for prefill with frames, chunked prefill and decode."""
    seed = random.randrange(2**16)
    requests = [build_request(f"{kind}-{seed}", parts, seed + i, max_tokens=4) for i, (kind, parts) in enumerate(PROMPTS.items())]
    results = []
    for n in (1, 2):
        with torch_threads(n):
            llm = make_llm(wide_model, enable_prefix_caching=False)
            results.append(run_recording_logits(llm, requests))
    (done_1, logits_1), (done_2, logits_2) = results
    assert [c.token_ids for c in done_1] == [c.token_ids for c in done_2]
    for rid in logits_1:
        torch.testing.assert_close(logits_1[rid], logits_2[rid], rtol=1e-4, atol=1e-4, msg=rid)


def test_the_core_measures_its_steps_and_leaves_the_pool_as_it_was(wide_model):
    """A real engine: decode steps of one class get decided by their own timings, and the torch pool is
    the configured one again after every step."""
    with torch_threads(2):
        llm = make_llm(wide_model, adaptive_threads=True, enable_prefix_caching=False)
        seed = random.randrange(2**16)
        requests = [build_request(f"t{i}-{seed}", [random.randrange(5, 30)], seed + i, max_tokens=16) for i in range(6)]
        llm.generate(requests)
        decode_class = (False, False, len(requests).bit_length())
        assert llm.core.threads.enabled and decode_class in llm.core.threads.choices()
        assert torch.get_num_threads() == 2


def test_the_offline_llm_keeps_a_fixed_pool(wide_model):
    assert not make_llm(wide_model).core.threads.enabled
