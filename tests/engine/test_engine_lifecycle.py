"""AsyncEngine lifecycle: abort within a step, early exit, failing steps, admission errors,
observer hooks, shutdown. Every admitted request ends exactly once and returns its blocks."""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter

import pytest
from engine_helpers import build_request, serve

from mmserve.config import EngineConfig
from mmserve.engine.async_engine import AsyncEngine
from mmserve.engine.observer import NullObserver
from mmserve.engine.parallel_sampling import fan_out
from mmserve.errors import (
    EngineInternalError,
    EngineUnavailableError,
    LimitExceededError,
    RequestAbortedError,
)
from mmserve.request import MultiModalInput

LOOPS = ["off", "on"]   # --async-scheduling: CUDA's default is on


class Recorder(NullObserver):
    def __init__(self):
        self.events: list[tuple[str, str]] = []
        self.steps = []

    def on_request_queued(self, request):
        self.events.append(("queued", request.request_id))

    def on_first_token(self, request):
        self.events.append(("first", request.request_id))

    def on_request_finished(self, request, finish_reason, error):
        self.events.append(("finished", request.request_id, finish_reason, type(error).__name__ if error else None))

    def on_step(self, record):
        self.steps.append(record)


def run_engine(load_backend, body, **options):
    model, tok = load_backend("reference")
    opts = dict(device="cpu", block_size=4, num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=32,
                prefill_batched_tokens=0)
    opts.update(options)
    recorder = Recorder()
    engine = AsyncEngine(EngineConfig(**opts), model=model, tokenizer=tok, observer=recorder)
    result = serve(engine, body)
    assert all(p.num_free == p.num_usable and not any(p.ref_cnt) for p in engine.core.kv.pools.values())
    assert engine.core.runner.encoder_cache.num_bytes <= engine.core.runner.encoder_cache.max_bytes
    assert not engine.core.requests
    ends = Counter(e[1] for e in recorder.events if e[0] == "finished")
    assert all(n == 1 for n in ends.values()), ends
    assert set(ends) == {e[1] for e in recorder.events if e[0] == "queued"}
    return result, recorder


async def wait_idle(engine, timeout=10.0):
    for _ in range(int(timeout / 0.01)):
        if engine.load().running == 0 and engine.load().waiting == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("engine did not go idle")


def test_abort_stops_the_request_and_others_finish(load_backend):
    async def body(engine):
        long = build_request("long", [10, ("video", [8, 8])], seed=1, max_tokens=300)
        short = build_request("short", [12], seed=2, max_tokens=5)
        task, got_first = _read_in_background(engine, long)
        short_outs = asyncio.create_task(_collect(engine, short))
        await asyncio.wait([asyncio.create_task(got_first.wait()), task], return_when=asyncio.FIRST_COMPLETED)
        assert engine.abort("long") is True
        with pytest.raises(RequestAbortedError):
            await task
        assert engine.abort("long") is False
        outs = await short_outs
        assert outs[-1].finish_reason == "length" and outs[-1].usage.completion_tokens == 5
        await wait_idle(engine)

    _, rec = run_engine(load_backend, body)
    assert ("finished", "long", None, "RequestAbortedError") in rec.events


async def _collect(engine, req):
    return [o async for o in engine.generate(req)]


def _read_in_background(engine, req) -> tuple[asyncio.Task, asyncio.Event]:
    """A task reading `req`'s stream to its end, and an event set once its first delta arrived."""
    first = asyncio.Event()

    async def reader():
        async for _ in engine.generate(req):
            first.set()

    return asyncio.create_task(reader()), first


def test_leaving_the_stream_early_aborts(load_backend):
    async def body(engine):
        req = build_request("gone", [20], seed=3, max_tokens=300)
        stream = engine.generate(req)
        await stream.__anext__()
        await stream.aclose()        # the client went away
        await wait_idle(engine)

    _, rec = run_engine(load_backend, body)
    assert ("finished", "gone", None, "RequestAbortedError") in rec.events


def test_a_reader_cancelled_while_it_waits_aborts_the_request(load_backend):
    """A server handler is cancelled (the client hung up) while it awaits the next delta, not at a
    yield: the request must still be aborted, not left to run to max_tokens."""
    async def body(engine):
        req = build_request("hung-up", [20], seed=4, max_tokens=300)
        task, first = _read_in_background(engine, req)
        await first.wait()
        await asyncio.sleep(0)   # the reader is back to waiting on the stream
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(engine)

    _, rec = run_engine(load_backend, body)
    finished = [e for e in rec.events if e[0] == "finished" and e[1] == "hung-up"]
    assert finished and finished[0][2] is None, finished   # aborted, not finished by length


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(load_backend):
    async def body(engine):
        bad = build_request("bad", [5, ("image", 4), 5], seed=4)
        good = build_request("good", [5, ("image", 4), 5], seed=5)
        # pixels of an 8-token frame behind a 4-token range: the vision step cannot line them up
        bad.mm_inputs[0] = MultiModalInput(good.mm_inputs[0].pixel_values.repeat(2, 1),
                                           good.mm_inputs[0].position_ids.repeat(2, 1))
        with pytest.raises(EngineInternalError, match="request bad"):
            await _collect(engine, bad)
        outs = await _collect(engine, good)
        assert outs[-1].finished and outs[-1].usage.completion_tokens == 6

    run_engine(load_backend, body)


def test_admission_errors_reach_the_caller_before_queueing(load_backend):
    async def body(engine):
        with pytest.raises(LimitExceededError, match="--max-num-batched-tokens"):
            await _collect(engine, build_request("wide", [3, ("image", 9)], seed=6))
        with pytest.raises(LimitExceededError, match="--max-model-len"):
            await _collect(engine, build_request("long", [60], seed=6, max_tokens=100))
        assert engine.load().waiting == 0

    _, rec = run_engine(load_backend, body, max_num_batched_tokens=8, max_model_len=128)
    assert rec.events == []


def test_observer_sees_each_request_in_order_and_steps(load_backend):
    async def body(engine):
        reqs = [build_request(f"o{i}", [8 + i, ("video", [4])], seed=i, max_tokens=3) for i in range(3)]
        return await asyncio.gather(*(_collect(engine, r) for r in reqs))

    results, rec = run_engine(load_backend, body)
    for i in range(3):
        mine = [e[0] for e in rec.events if e[1] == f"o{i}"]
        assert mine == ["queued", "first", "finished"]
    assert [s.step_index for s in rec.steps] == list(range(len(rec.steps)))
    frames = sum(item.num_frames_encoded for s in rec.steps for item in s.items)
    assert frames == 3
    for s in rec.steps:
        assert s.end_perf >= s.start_perf and s.end_ns >= s.start_ns
        assert sum(i.num_tokens for i in s.items) <= 32
    for outs in results:
        t = outs[-1].timings
        assert 0 <= t.queue_s <= t.time_to_first_token_s <= t.end_to_end_s


def test_shutdown_ends_requests_in_flight(load_backend):
    model, tok = load_backend("reference")
    engine = AsyncEngine(EngineConfig(device="cpu", block_size=4, num_kv_blocks=128), model=model, tokenizer=tok)

    async def main():
        await engine.start()
        task = asyncio.create_task(_collect(engine, build_request("x", [10], seed=7, max_tokens=300)))
        await asyncio.sleep(0.05)
        await engine.shutdown()
        with pytest.raises(EngineUnavailableError):
            await task
        with pytest.raises(EngineUnavailableError):
            await _collect(engine, build_request("y", [10], seed=7))

    asyncio.run(main())


def test_offline_llm_raises_after_draining_and_stays_usable(load_backend):
    from engine_helpers import make_llm

    llm = make_llm(load_backend("reference"))
    bad = build_request("bad", [5, ("image", 4)], seed=8)
    bad.mm_inputs[0] = MultiModalInput(bad.mm_inputs[0].pixel_values[:0], bad.mm_inputs[0].position_ids[:0])
    good = build_request("good", [30], seed=9, max_tokens=3)
    # its image fails in the vision encoder: it alone ends (good goes on), and generate raises its error
    with pytest.raises(EngineInternalError, match="request bad: the vision encoder failed"):
        llm.generate([good, bad])
    assert not llm.has_work
    assert all(p.num_free == p.num_usable for p in llm.core.kv.pools.values())
    again = llm.generate([build_request("good2", [30], seed=9, max_tokens=3)])
    assert again[0].finish_reason == "length"


def empty_pixels(rid: str, seed: int):
    """A request whose image the vision encoder fails on (no pixels), in the second 16-token chunk."""
    request = build_request(rid, [15, ("image", 4), 10], seed=seed, max_tokens=4)
    request.mm_inputs[0] = MultiModalInput(request.mm_inputs[0].pixel_values[:0], request.mm_inputs[0].position_ids[:0])
    return request


@pytest.mark.parametrize("loop", LOOPS)
def test_a_chunk_whose_image_failed_is_never_cached(load_backend, loop):
    """The async loop launches the image's chunk before the chunk ahead of it finishes: that
    finish must not key the blocks the image's chunk (run on zero embeddings) is writing, or the
    same request sent again would hit them and succeed on them."""
    from engine_helpers import make_llm

    llm = make_llm(load_backend("reference"), max_num_batched_tokens=16, async_scheduling=loop)
    seed = random.randrange(10_000)
    for rid in ("try1", "try2"):
        with pytest.raises(EngineInternalError, match=f"request {rid}: the vision encoder failed"):
            llm.generate([empty_pixels(rid, seed)])
    assert all(p.num_free == p.num_usable and not any(p.ref_cnt) for p in llm.core.kv.pools.values())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_sample_never_joins_a_prompt_whose_image_failed(load_backend, loop):
    """n=2: sample 1 joins sample 0's K/V of the prompt; under the async loop the chunk holding
    the image is still in flight when the chunk before it finishes. The encoder fails until the
    first error comes back (sample 0's), then works: every sample that finishes equals a clean run."""
    from engine_helpers import make_llm

    model_tok = load_backend("reference")
    parts, seed = [15, ("image", 9), 3], random.randrange(10_000)
    want = make_llm(model_tok, max_num_batched_tokens=16, enable_prefix_caching=False).generate(
        [build_request("clean", parts, seed=seed, max_tokens=8)])[0].token_ids
    llm = make_llm(model_tok, max_num_batched_tokens=16, enable_prefix_caching=False, async_scheduling=loop)
    model, failing = llm.core.model, [True]
    encode = model.encode_vision

    def flaky(*args, **kwargs):   # fault injection: fails while `failing`
        if failing[0]:
            raise RuntimeError("encoder failed (injected)")
        return encode(*args, **kwargs)

    model.encode_vision = flaky
    for sample in fan_out(build_request("p", parts, seed=seed, max_tokens=8, n=2)):
        llm.add_request(sample)
    tokens, failed = {}, set()
    while llm.has_work:
        for rid, item in llm.step():
            if isinstance(item, BaseException):
                failed.add(rid)
                failing[0] = False
            else:
                tokens.setdefault(rid, []).extend(item.new_token_ids)
    assert "p" in failed
    assert {rid: t for rid, t in tokens.items() if rid not in failed} == {rid: want for rid in tokens if rid not in failed}
    assert all(p.num_free == p.num_usable and not any(p.ref_cnt) for p in llm.core.kv.pools.values())


def test_model_info_and_load_describe_the_engine(load_backend):
    async def body(engine):
        info = engine.model_info
        spec = engine.core.model.spec
        assert info.context_length == min(128, spec.max_model_len)
        assert info.tokens_per_frame == spec.video_max_soft_tokens and info.backend == "reference"
        stream = engine.generate(build_request("busy", [20], seed=10, max_tokens=50))
        await stream.__anext__()
        load = engine.load()
        assert load.running == 1 and 0 < load.kv_usage < 1 and load.max_num_seqs == 8
        await stream.aclose()
        await wait_idle(engine)
        assert engine.load().kv_usage == 0

    run_engine(load_backend, body, max_model_len=128)


def test_a_failing_observer_never_fails_a_request(load_backend):
    from engine_helpers import make_llm

    class Broken(NullObserver):
        def on_request_queued(self, request):
            raise RuntimeError("observer bug")

        on_first_token = on_step = on_request_queued

        def on_request_finished(self, request, finish_reason, error):
            raise RuntimeError("observer bug")

    llm = make_llm(load_backend("reference"))
    llm.observer = Broken()
    out = llm.generate([build_request("ok", [12, ("video", [4])], seed=13, max_tokens=4)])
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 4
    assert not llm.has_work


def test_a_scheduler_bug_ends_requests_instead_of_looping(load_backend):
    async def body(engine):
        schedule = engine.core.scheduler.schedule
        calls = []

        def failing_once():   # fault injection: the first schedule() after admission raises
            if not calls:
                calls.append(1)
                raise RuntimeError("scheduler bug")
            return schedule()

        engine.core.scheduler.schedule = failing_once
        with pytest.raises(EngineInternalError, match="request first: engine error"):
            await _collect(engine, build_request("first", [10], seed=14, max_tokens=3))
        outs = await _collect(engine, build_request("second", [10], seed=15, max_tokens=3))
        assert outs[-1].finish_reason == "length"

    run_engine(load_backend, body)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_request_whose_cleanup_fails_still_ends(load_backend, loop):
    """A scheduler bug fails every request; freeing one of them raises as well (its state is what
    is suspect): that request's stream must still end with the error, not stay open."""
    async def body(engine):
        schedule, finish = engine.core.scheduler.schedule, engine.core.scheduler.finish
        armed = []

        def failing_once():   # fault injection: the first schedule() once both streams run raises
            if armed:
                armed.clear()
                raise RuntimeError("scheduler bug")
            return schedule()

        def finish_then_fail(rid):   # frees the request, then raises for "victim"
            finish(rid)
            if rid == "victim":
                raise RuntimeError("finish bug")

        engine.core.scheduler.schedule = failing_once
        engine.core.scheduler.finish = finish_then_fail

        fired = []

        async def read(rid, seed):
            async for _ in engine.generate(build_request(rid, [10], seed=seed, max_tokens=200)):
                if not fired:   # arms the failing schedule() once, on the first delta
                    fired.append(rid)
                    armed.append(1)

        tasks = [asyncio.create_task(read(rid, seed)) for rid, seed in (("victim", 16), ("other", 17))]
        for task, rid in zip(tasks, ("victim", "other"), strict=True):
            with pytest.raises(EngineInternalError, match=f"request {rid}: engine error"):
                await asyncio.wait_for(task, 30)
        engine.core.scheduler.finish = finish

    run_engine(load_backend, body, async_scheduling=loop)


@pytest.mark.parametrize("given_up_by", ["shutdown timeout", "stall watch"])
def test_shutdown_returns_while_an_in_process_step_hangs(load_backend, given_up_by):
    """The core on a thread of this process (a preloaded model) wedged inside a step: shutdown() gives
    up on it after its timeout (a thread cannot be killed), or the stall watch already has, and the
    request in flight ends with EngineDeadError saying so; shutdown() returns instead of waiting forever
    or raising at the engine it gave up on."""
    model, tok = load_backend("reference")
    engine = AsyncEngine(EngineConfig(device="cpu", block_size=4, num_kv_blocks=128, max_num_seqs=8,
                                      engine_stall_timeout_s=2.0), model=model, tokenizer=tok)   # > HEARTBEAT_S
    entered, release = threading.Event(), threading.Event()

    async def main():
        await engine.start()
        step = engine.core.step

        def wedged():   # fault injection: a step that does not return (a native hang) until released
            entered.set()
            release.wait()
            return step()

        engine.core.step = wedged
        engine.watch_stalls()   # also while shutting down: shutdown's own timeout, not the stall watch, ends the wait
        reader = asyncio.create_task(_collect(engine, build_request("stuck", [10], seed=18, max_tokens=5)))
        try:
            assert await asyncio.to_thread(entered.wait, 60)
            if given_up_by == "stall watch":
                with pytest.raises(EngineUnavailableError, match="gave up on the engine thread: it sent nothing for 2s"):
                    await reader
                assert engine.client.thread.is_alive()   # still wedged: the shutdown below has nothing to ask
                await asyncio.wait_for(engine.shutdown(), 30)
            else:
                await asyncio.wait_for(engine.client.shutdown(timeout_s=2.5), 30)   # not serve(): it would wait again
                with pytest.raises(EngineUnavailableError, match="gave up on the engine thread: it did not exit within 2.5s"):
                    await reader
        finally:
            release.set()   # the abandoned thread finishes its step and exits

    asyncio.run(main())
