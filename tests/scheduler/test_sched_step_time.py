"""The prefill cap beside decodes (core/sched/step_time.py, `max_step_slowdown`), against the perf
model itself: each step's roofline (the perf model's bytes and FLOPs of every row the step carries
and of the frames its chunks bring through the vision tower, over the peaks) within the slowdown of
its decode rows' alone, chunks as long as that allows, and every prompt still moving."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from sched_helpers import admit, make_request, make_scheduler, random_ranges, step

from mmserve.config import EngineConfig
from mmserve.core.sched.chunks import align_chunk, smallest_chunk, whole_lengths
from mmserve.core.sched.step_time import StepTimeModel
from mmserve.metrics.perf_model import AudioWork, PerfModel, RequestWork, StepContext, VisionWork
from mmserve.model.spec import load_spec_without_transformers
from mmserve.request import AudioFeatures, RequestStatus

FAMILY = Path(__file__).resolve().parents[1] / "fixtures" / "gemma4_family"
H200 = dict(flops=790e12, bandwidth=4.3e12)   # bench/gpu_check.py's floors (the issue's)
FRAME = 70   # soft tokens a video frame


def perf_model(name: str) -> PerfModel:
    return PerfModel(load_spec_without_transformers(FAMILY / f"{name}.json"))


def frames_of(perf: PerfModel, lengths) -> tuple[VisionWork, ...]:
    """The vision tower's work for frames of these soft-token lengths (patches: tokens x pooling)."""
    pool = perf.spec.vision.pool_kernel ** 2
    return tuple(VisionWork(int(n) * pool, int(n)) for n in lengths)


def roofline(perf: PerfModel, rows, flops: float, bandwidth: float, images=(), audio=(), experts=None) -> float:
    """The reference: the whole step through the perf model at once."""
    out = perf.step(StepContext(tuple(rows), images=tuple(images), audio=tuple(audio), experts_touched=experts))
    return max(out.total_bytes / bandwidth, out.total_flops / flops)


def video_ranges(frames: int, first: int = 1) -> list[tuple[int, int]]:
    """`frames` frames of FRAME tokens from `first`, a text token before each but the first."""
    return [(first + f * (FRAME + 1), first + f * (FRAME + 1) + FRAME - 1) for f in range(frames)]


@pytest.mark.parametrize("name", ["12b_unified", "e4b", "26b_a4b"])
def test_room_is_the_longest_chunk_the_perf_model_allows(name):
    """Random decode sets (contexts up to 32k, every other set with verify rows), a video prompt (or,
    for E4B, every third set an audio one) at a random start, random peaks and slowdowns: the chunk
    `room` gives keeps the whole step (its frames through the vision tower, the segments it starts
    through the audio tower: 4 log-mel frames a soft token) within the limit, ends outside every
    frame, and the next length that does would pass the limit."""
    perf = perf_model(name)
    rng = random.Random(random.getrandbits(64))   # this test's draw (tests/conftest.py seeds it)
    for i in range(6):
        peaks = dict(flops=rng.uniform(300e12, 2000e12), bandwidth=rng.uniform(2e12, 8e12))
        slowdown = rng.uniform(1.05, 3.0)
        model = StepTimeModel(perf, slowdown=slowdown, **peaks)
        width = 1 + 3 * (i % 2)   # verify rows of K = 3 drafts in every other set
        rows = [RequestWork(width, rng.randint(1, 32_768) + width, False) for _ in range(rng.choice([1, 5, 16, 64]))]
        offset = rng.randint(0, 20_000)
        if perf.spec.audio is not None and i % 3 == 2:
            lengths = [rng.randint(50, 750) for _ in range(8)]
            firsts = offset + 1 + np.cumsum([0] + [n + 2 for n in lengths[:-1]])
            ranges = [(int(a), int(a) + n - 1) for a, n in zip(firsts, lengths, strict=True)]
            video = make_request("audio", ranges[-1][1] + 8, ranges)
            video.mm_inputs = [AudioFeatures(torch.zeros(4 * n, 128), b"x") for n in lengths]
            video.__post_init__()
        else:
            video = make_request("video", offset + 40 * (FRAME + 1), video_ranges(40, offset + 1))
        start = offset + rng.randint(0, 3) * (FRAME + 1)
        want = rng.randint(1, 4096)
        cap = model.cap(rows)
        moe = perf.spec.layers[0].moe   # an MoE model's limit: the rows as if they reached every expert
        limit = slowdown * roofline(perf, rows, **peaks, experts=moe.num_experts if moe else None)
        assert cap.limit_s == pytest.approx(limit, rel=1e-9)
        n = cap.room(video, start, want)

        whole = video.vision_ranges_np   # the next length a chunk may take (none ends inside a frame)
        after = next((t for t in range(n + 1, want + 1) if align_chunk(whole, start, t) == t), want + 1)
        assert align_chunk(whole, start, n) == n, n
        times = []
        for tokens in (n, after):
            inside = [(a, b) for a, b in video.mm_ranges if start <= a and b < start + tokens]
            started = [(a, b) for a, b in video.mm_ranges if start <= a < start + tokens]
            audio = video.request_id == "audio"
            times.append(roofline(perf, rows + [RequestWork(tokens, start + tokens, True, samples=False)], **peaks,
                                  images=() if audio else frames_of(perf, [b - a + 1 for a, b in inside]),
                                  audio=[AudioWork(4 * (b - a + 1), b - a + 1) for a, b in started] if audio else ()))
        assert n == 0 or times[0] <= limit * (1 + 1e-9), (n, times, limit)
        if after <= want:
            assert times[1] > limit * (1 - 1e-9), (n, after, want, times, limit)


def test_smallest_chunk_is_the_one_align_chunk_leaves_whole():
    ranges = np.array([[5, 9], [12, 12], [20, 89]])
    for start in range(0, 95):
        n = smallest_chunk(ranges, start)
        assert align_chunk(ranges, start, n) == n   # whole
        assert n == 1 or align_chunk(ranges, start, n - 1) == 0   # and nothing shorter is


def test_whole_lengths_are_the_ones_align_chunk_keeps():
    """The lengths `room` searches over are exactly those `align_chunk` leaves as they are."""
    rng = random.Random(random.getrandbits(64))
    for _ in range(20):
        ranges = np.array(random_ranges(rng, 400, max_len=40), dtype=np.int64).reshape(-1, 2)
        start, want = rng.randint(0, 380), rng.randint(1, 120)
        lengths = whole_lengths(ranges, start, want)
        expected = [n for n in range(1, want + 1) if align_chunk(ranges, start, n) == n]
        assert (list(range(1, want + 1)) if lengths is None else lengths.tolist()) == expected, (ranges, start, want)


def capped_scheduler(model, budget: int = 2048, **kw):
    return make_scheduler(num_blocks=4096, block_size=16, max_num_batched_tokens=budget, max_num_seqs=32,
                          max_model_len=8192, step_time=model, **kw)


def decoders(sched, count: int, **kw):
    """`count` requests admitted and decoding (long max_tokens)."""
    for i in range(count):
        admit(sched, make_request(f"d{i}", 8, max_tokens=4000, first=1000 * (i + 1), **kw))
    while sched.waiting or any(r.is_prefill for r in sched.running):
        step(sched)


def speculating_step(sched, drafts: int = 3):
    """One step as the engine runs it with speculation (K = 3): every decode proposes `drafts`
    drafts (its chunk padded to 1 + K), none is accepted (each verify chunk keeps one token), a
    prompt's last chunk samples."""
    for r in sched.running:
        if not r.is_prefill:
            r.draft_token_ids = [30, 31, 32][:drafts]
    out = sched.schedule()
    rejected = {}
    for s in out.scheduled:
        if not s.is_prefill:
            s.request.output_token_ids.append(7)
            rejected[s.request.request_id] = s.num_tokens - 1
        elif s.seq_len == s.request.num_tokens:
            s.request.output_token_ids.append(7)
    sched.update(out, rejected)
    return out


def worst_step(perf, sched, video, stepper=step):
    """Step until the video's prompt is computed: the worst step's roofline over its decode rows'
    (with the frames the step runs through the tower: its chunks' own, less those the step before
    encoded ahead, and those it names to encode ahead beside it), and the number of steps."""
    worst, steps, encoded_ahead = 0.0, 0, set()
    while video.is_prefill or video.status == RequestStatus.WAITING:
        out = stepper(sched)
        steps += 1
        decodes = [RequestWork(s.num_tokens, s.seq_len, False) for s in out.scheduled if not s.is_prefill]
        chunks = [s for s in out.scheduled if s.is_prefill]
        assert decodes and len(decodes) == len(sched.running) - len(chunks), "every step decodes every decoder"
        for s in chunks:   # never inside a frame
            end = s.num_computed_tokens + s.num_tokens - 1
            assert not any(a <= end < b for a, b in s.request.mm_ranges)
        ahead = {(r.request_id, f) for r, frames in out.encode_ahead for f in frames}
        run = {(s.request.request_id, f) for s in chunks for f in s.frames} - encoded_ahead | ahead
        encoded_ahead = ahead
        lengths = [sched._by_id[rid].mm_ranges[f][1] - sched._by_id[rid].mm_ranges[f][0] + 1 for rid, f in run]
        rows = decodes + [RequestWork(s.num_tokens, s.seq_len, True, samples=False) for s in chunks]
        worst = max(worst, roofline(perf, rows, **H200, images=frames_of(perf, lengths)) / roofline(perf, decodes, **H200))
        assert steps < 500
    return worst, steps


@pytest.mark.parametrize("name", ["12b_unified", "e4b", "26b_a4b"])
@pytest.mark.parametrize("encode_ahead", [False, True])
def test_decodes_keep_their_step_time_while_a_video_prefills(name, encode_ahead):
    """16 requests decode while a 32-frame video prefills under a 2048-token budget (CUDA's): with the
    cap every step that carries a chunk stays within 1.5x of its decode rows' roofline, the frames
    it runs through the tower included (with encode-ahead, the next chunk's beside its own); with the
    budget alone the same steps reach several times it."""
    perf, slowdown = perf_model(name), 1.5
    results = {}
    for capped in (True, False):
        sched = capped_scheduler(StepTimeModel(perf, slowdown=slowdown, **H200) if capped else None,
                                 encode_ahead=encode_ahead)
        decoders(sched, 16)
        video = make_request("video", 32 * (FRAME + 1) + 8, video_ranges(32), max_tokens=1, first=50_000)
        admit(sched, video)
        results[capped] = worst_step(perf, sched, video)
    assert results[True][0] <= slowdown * (1 + 1e-9), results
    assert results[False][0] > 2 * slowdown, results   # what the cap is for
    assert results[True][1] > results[False][1]       # smaller chunks, more steps


@pytest.mark.parametrize("name", ["12b_unified", "e4b"])
@pytest.mark.parametrize("behind,drafts", [(0, 3), (8, 3), (8, 0)])
def test_speculating_decodes_keep_theirs_too(name, behind, drafts):
    """With speculation (verify rows padded to 1 + K = 4, drafts made every step) the cap prices the
    decode rows the step really carries: those scheduled before the video's chunk (their drafts
    already taken from the request) and those behind it in the running order (sized before they are
    scheduled: with no drafts, still padded to the verify width). E4B's KV-sharing layers run every
    row of a verify step, the chunk's too."""
    perf, slowdown = perf_model(name), 1.4
    sched = capped_scheduler(StepTimeModel(perf, slowdown=slowdown, **H200), verify_width=4)
    decoders(sched, 16 - behind)
    video = make_request("video", 32 * (FRAME + 1) + 8, video_ranges(32), max_tokens=1, first=50_000)
    admit(sched, video)
    for i in range(behind):
        admit(sched, make_request(f"b{i}", 8, max_tokens=4000, first=200_000 + 1000 * i))
    worst, _ = worst_step(perf, sched, video, lambda sched: speculating_step(sched, drafts))
    assert worst <= slowdown * (1 + 1e-9), worst


@pytest.mark.parametrize("name", ["12b_unified", "26b_a4b"])
def test_a_steps_running_totals_are_the_perf_models_of_the_whole_step(name, monkeypatch):
    """Two long prompts and a waiting one beside 2 decodes: each capped step's running totals (decode
    rows and every chunk taken, MoE experts from all the step's tokens) equal the perf model's bytes
    and FLOPs of the whole step."""
    perf = perf_model(name)
    model = StepTimeModel(perf, slowdown=1.6, **H200)
    caps = []
    make_cap = model.cap
    monkeypatch.setattr(model, "cap", lambda rows: caps.append(make_cap(rows)) or caps[-1])
    sched = capped_scheduler(model)
    decoders(sched, 2)
    for i in range(3):
        admit(sched, make_request(f"p{i}", 3000, max_tokens=1, first=20_000 * (i + 1)))
    checked = 0
    for _ in range(6):
        caps.clear()
        out = step(sched)
        if not caps:
            continue
        (cap,) = caps
        decodes = [RequestWork(s.num_tokens, s.seq_len, False) for s in out.scheduled if not s.is_prefill]
        chunks = [RequestWork(s.num_tokens, s.seq_len, True, samples=False) for s in out.scheduled if s.is_prefill]
        whole = perf.step(StepContext(tuple(decodes + chunks)))
        assert (cap.num_bytes, cap.num_flops) == pytest.approx((whole.total_bytes, whole.total_flops), rel=1e-9)
        checked += len(chunks) > 1
    assert checked, "no step carried two chunks"


def test_a_cap_below_one_frame_still_moves_the_video_a_frame_a_step():
    """A slowdown so tight that no frame fits: the step's first chunk goes anyway, one whole frame
    (or the text token between frames), so the prompt finishes."""
    sched = capped_scheduler(StepTimeModel(perf_model("12b_unified"), slowdown=1.000001, **H200))
    decoders(sched, 4)
    video = make_request("video", 4 * (FRAME + 1) + 8, video_ranges(4), max_tokens=1, first=50_000)
    admit(sched, video)
    sizes = []
    while video.is_prefill:
        chunks = [s.num_tokens for s in step(sched).scheduled if s.is_prefill]
        assert len(chunks) == 1, chunks
        sizes += chunks
    assert set(sizes) <= {1, FRAME}, sizes   # a text token, or a whole frame
    assert sum(sizes) == video.num_prompt_tokens


def test_a_long_prompt_holds_back_no_other_kind_of_chunk():
    """While a running prompt fills the cap, a live session's newly added frame and a waiting
    request still move every step (each kind's first chunk may pass the cap by its smallest whole
    chunk), so neither waits for the long prompt to finish."""
    sched = capped_scheduler(StepTimeModel(perf_model("12b_unified"), slowdown=1.2, **H200))
    live = make_request("live", 4, open_prompt=10_000, first=90_000)
    admit(sched, live)
    decoders(sched, 4)
    admit(sched, make_request("long", 6000, max_tokens=1, first=60_000))
    step(sched)
    live.extend_prompt([9] * (FRAME + 2), [(live.num_prompt_tokens + 1, live.num_prompt_tokens + FRAME)], [])
    late = make_request("late", 40, max_tokens=1, first=70_000)
    admit(sched, late)
    live_before = live.num_computed_tokens
    out = step(sched)
    kinds = {s.request.request_id: s.num_tokens for s in out.scheduled if s.is_prefill}
    assert {"long", "live", "late"} <= kinds.keys(), kinds
    assert live.num_computed_tokens > live_before and sched._by_id["late"].status == RequestStatus.RUNNING


def test_encode_ahead_guesses_the_capped_chunks():
    """Encode-ahead names frames the next step will consume: under the cap, of the next capped chunk
    (not the token budget's), as many as this step can encode beside its own (the rest the next
    step encodes itself)."""
    perf = perf_model("e4b")
    sched = capped_scheduler(StepTimeModel(perf, slowdown=1.4, **H200), encode_ahead=True)
    decoders(sched, 16)
    video = make_request("video", 32 * (FRAME + 1) + 8, video_ranges(32), max_tokens=1, first=50_000)
    admit(sched, video)
    out = step(sched)
    for _ in range(4):
        ahead = {r.request_id: frames for r, frames in out.encode_ahead}
        out = step(sched)
        consumed = {s.request.request_id: s.frames for s in out.scheduled if s.frames}
        assert ahead.keys() == consumed.keys() == {"video"}, (ahead, consumed)
        assert ahead["video"] == consumed["video"][:len(ahead["video"])], (ahead, consumed)


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
    for bad in (0.5, 1.0, -2.0, math.nan):
        with pytest.raises(ValueError, match="max_step_slowdown must be above 1"):
            EngineConfig(device="cpu", max_step_slowdown=bad)


def test_outputs_recomputed_after_a_preemption_are_capped_like_a_prompt():
    """A request preempted after 600 outputs recomputes prompt and outputs beside the others'
    decodes: its chunks past the prompt stay within the cap too."""
    perf, slowdown = perf_model("12b_unified"), 1.4
    sched = capped_scheduler(StepTimeModel(perf, slowdown=slowdown, **H200))
    decoders(sched, 8)
    victim = sched._by_id["d7"]
    victim.output_token_ids += [7] * 600
    victim.num_computed_tokens += 600
    sched._preempt(victim)
    past_prompt, worst = 0, 0.0
    while victim.is_prefill or victim.status != RequestStatus.RUNNING:
        out = step(sched)
        decodes = [RequestWork(s.num_tokens, s.seq_len, False) for s in out.scheduled if not s.is_prefill]
        chunks = [s for s in out.scheduled if s.is_prefill]
        past_prompt += sum(s.num_tokens for s in chunks if s.seq_len > victim.num_prompt_tokens)
        rows = decodes + [RequestWork(s.num_tokens, s.seq_len, True, samples=False) for s in chunks]
        worst = max(worst, roofline(perf, rows, **H200) / roofline(perf, decodes, **H200))
    assert past_prompt >= 590 and worst <= slowdown * (1 + 1e-9), (past_prompt, worst)
