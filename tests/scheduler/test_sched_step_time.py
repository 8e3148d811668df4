"""The prefill cap beside decodes (core/sched/step_time.py, `max_step_slowdown`), against the perf
model itself: each step's roofline (the perf model's bytes and FLOPs of every row the step carries,
over the peaks) within the slowdown of its decode rows' alone, chunks as long as that allows, and
every prompt still moving."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from sched_helpers import admit, make_request, make_scheduler, step

from mmserve.config import EngineConfig
from mmserve.core.sched.scheduler import align_chunk, smallest_chunk
from mmserve.core.sched.step_time import StepTimeModel
from mmserve.metrics.perf_model import PerfModel, RequestWork, StepContext
from mmserve.model.spec import read_spec
from mmserve.request import RequestStatus

FAMILY = Path(__file__).resolve().parents[1] / "fixtures" / "gemma4_family"
H200 = dict(flops=790e12, bandwidth=4.3e12)   # bench/gpu_check.py's floors (the issue's)


def perf_model(name: str) -> PerfModel:
    return PerfModel(read_spec(FAMILY / f"{name}.json"))


def roofline(perf: PerfModel, rows: list[RequestWork], flops: float, bandwidth: float) -> float:
    """The reference: the whole step through the perf model at once."""
    out = perf.step(StepContext(tuple(rows)))
    return max(out.total_bytes / bandwidth, out.total_flops / flops)


def decoding_request(rid: str, context: int, drafts: int):
    r = make_request(rid, context, max_tokens=4)
    r.num_computed_tokens = context
    r.output_token_ids.append(7)   # one token out: its next row decodes
    r.draft_token_ids = [5] * drafts
    return r


@pytest.mark.parametrize("name", ["12b_unified", "e4b", "26b_a4b"])
def test_room_is_the_longest_chunk_the_perf_model_allows(name):
    """Random decode sets (contexts up to 32k, some verify rows), chunk starts and slowdowns: the
    chunk `room` gives keeps the whole step within the limit, and one token more would pass it."""
    perf = perf_model(name)
    rng = random.Random(random.getrandbits(64))   # this test's draw (tests/conftest.py seeds it)
    for i in range(6):
        peaks = dict(flops=rng.uniform(300e12, 2000e12), bandwidth=rng.uniform(2e12, 8e12))
        slowdown = rng.uniform(1.05, 3.0)
        model = StepTimeModel(perf, slowdown=slowdown, **peaks)
        drafts = 3 * (i % 2)   # every other set with verify rows (K = 3) among its rows
        decoding = [decoding_request(f"d{i}", rng.randint(1, 32_768), drafts * (rng.random() < 0.7))
                    for i in range(rng.choice([1, 5, 16, 64]))]
        rows = [RequestWork(1 + len(r.draft_token_ids), r.num_computed_tokens + 1 + len(r.draft_token_ids), False)
                for r in decoding]
        start, want = rng.randint(0, 20_000), rng.randint(1, 8192)
        cap = model.cap(decoding)
        limit = slowdown * roofline(perf, rows, **peaks)
        assert cap.limit_s == pytest.approx(limit, rel=1e-9)
        n = cap.room(start, want)

        with_chunk = [roofline(perf, rows + [RequestWork(t, start + t, True, samples=False)], **peaks)
                      for t in (n, n + 1)]
        assert n == 0 or with_chunk[0] <= limit * (1 + 1e-9), (n, with_chunk, limit)
        if n < want:
            assert with_chunk[1] > limit * (1 - 1e-9), (n, want, with_chunk, limit)


def test_smallest_chunk_is_the_one_align_chunk_leaves_whole():
    import numpy as np
    ranges = np.array([[5, 9], [12, 12], [20, 89]])
    for start in range(0, 95):
        n = smallest_chunk(ranges, start)
        assert align_chunk(ranges, start, n) == n   # whole
        assert n == 1 or align_chunk(ranges, start, n - 1) == 0   # and nothing shorter is


def video_and_decoders(sched, frames: int, frame_tokens: int = 70, decoders: int = 16):
    """`decoders` requests admitted and decoding (long max_tokens), then a video prompt of `frames`
    frames (a text token before each) behind them."""
    for i in range(decoders):
        admit(sched, make_request(f"d{i}", 8, max_tokens=4000, first=1000 * (i + 1)))
    while sched.waiting or any(r.is_prefill for r in sched.running):
        step(sched)
    ranges = [(1 + f * (frame_tokens + 1), (f + 1) * (frame_tokens + 1) - 1) for f in range(frames)]
    video = make_request("video", frames * (frame_tokens + 1) + 8, ranges, max_tokens=1, first=50_000)
    admit(sched, video)
    return video


def run_video(sched, video):
    """Step until the video's prompt is computed; each step's (decode rows, prefill chunks)."""
    steps = []
    while video.status != RequestStatus.FINISHED and video.is_prefill or video.status == RequestStatus.WAITING:
        out = step(sched)
        steps.append(([RequestWork(1, s.seq_len, False) for s in out.scheduled if not s.is_prefill],
                      [s for s in out.scheduled if s.is_prefill]))
        assert len(steps) < 500
    return steps


@pytest.mark.parametrize("name", ["12b_unified", "e4b"])
def test_decodes_keep_their_step_time_while_a_video_prefills(name):
    """16 requests decode while a 32-frame video (70 tokens a frame) prefills under a 2048-token
    budget (CUDA's default): with the cap every step that carries a chunk stays within 1.5x of its
    decode rows' roofline; with the budget alone the same steps reach several times it."""
    perf, slowdown = perf_model(name), 1.5
    ratios = {}
    for capped in (True, False):
        model = StepTimeModel(perf, slowdown=slowdown, **H200) if capped else None
        sched = make_scheduler(num_blocks=4096, block_size=16, max_num_batched_tokens=2048, max_num_seqs=32,
                               max_model_len=8192, step_time=model)
        video = video_and_decoders(sched, frames=32)
        steps = run_video(sched, video)
        worst = 0.0
        for decodes, chunks in steps:
            assert decodes, "every step decodes the 16 requests"
            for s in chunks:   # never inside a frame
                end = s.num_computed_tokens + s.num_tokens - 1
                assert not any(a <= end < b for a, b in s.request.mm_ranges)
            rows = decodes + [RequestWork(s.num_tokens, s.seq_len, True, samples=False) for s in chunks]
            worst = max(worst, roofline(perf, rows, **H200) / roofline(perf, decodes, **H200))
        ratios[capped] = (worst, len(steps))
    assert ratios[True][0] <= slowdown * (1 + 1e-9), ratios
    assert ratios[False][0] > 2 * slowdown, ratios   # what the cap is for
    assert ratios[True][1] > ratios[False][1]         # smaller chunks, more steps


def test_a_cap_below_one_frame_still_moves_the_video_a_frame_a_step():
    """A slowdown so tight that no frame fits: the step's first chunk goes anyway, one whole frame
    (or the text token between frames), so the prompt finishes."""
    model = StepTimeModel(perf_model("12b_unified"), slowdown=1.000001, **H200)
    sched = make_scheduler(num_blocks=4096, block_size=16, max_num_batched_tokens=2048, max_num_seqs=32,
                           max_model_len=8192, step_time=model)
    video = video_and_decoders(sched, frames=4, decoders=4)
    steps = run_video(sched, video)
    sizes = [s.num_tokens for _, chunks in steps for s in chunks]
    assert all(len(chunks) <= 1 for _, chunks in steps)
    assert set(sizes) <= {1, 70}, sizes   # a text token, or a whole frame (then the question's tokens, one each)
    assert sum(sizes) == video.num_prompt_tokens


def test_no_decodes_no_cap():
    """Alone, a prompt takes the whole prefill budget: the cap only guards decoding requests."""
    model = StepTimeModel(perf_model("12b_unified"), slowdown=1.000001, **H200)
    sched = make_scheduler(num_blocks=4096, block_size=16, max_num_batched_tokens=512, prefill_batched_tokens=2048,
                           max_num_seqs=8, max_model_len=8192, step_time=model)
    admit(sched, make_request("p", 3000))
    assert step(sched).scheduled[0].num_tokens == 2048


def test_the_device_default_and_refused_values():
    assert EngineConfig(device="cpu").max_step_slowdown == 0   # CPU steps are overhead, not roofline
    assert EngineConfig(device="cpu", max_step_slowdown=1.4).max_step_slowdown == 1.4
    for bad in (0.5, 1.0, -2.0):
        with pytest.raises(ValueError, match="max_step_slowdown must be above 1"):
            EngineConfig(device="cpu", max_step_slowdown=bad)
