"""Hostile video bytes straight into the decoder: random, truncated and bit-flipped real clips.

The decoder may accept a damaged clip (codecs conceal errors) or refuse it, but only with
InvalidInputError / LimitExceededError (INVALID_ARGUMENT / RESOURCE_EXHAUSTED at the edge), quickly,
and what it accepts is well-formed. The same payloads through a real server are in test_rel_fuzz_server.py.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.synthetic import make_clip
from mmserve.multimodal.video import decode_video

LIMITS = MediaLimits(max_frames_per_video=8, default_num_frames=4)
# A tiny clip decodes in milliseconds; seconds would mean a decoder spinning on garbage.
MAX_DECODE_S = 5.0
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return {c: make_clip(seed, size=32, num_frames=6, container=c).data
            for seed, c in enumerate(("mp4", "webm"))}


def _decode_or_refuse(data: bytes, num_frames: int | None = None) -> None:
    started = time.monotonic()
    try:
        video = decode_video(data, num_frames=num_frames, limits=LIMITS)
    except (InvalidInputError, LimitExceededError) as e:
        assert str(e), "a refusal must say why"
    else:
        assert 1 <= len(video.frames) == len(video.timestamps_s) <= LIMITS.max_frames_per_video
        for frame in video.frames:
            assert frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[2] == 3
        # Order is not promised for damaged clips (corrupt pts can reorder frames); sanity is.
        assert all(0 <= t <= video.duration_s + 1 for t in video.timestamps_s)
    assert time.monotonic() - started < MAX_DECODE_S


def test_intact_clips_decode(clips):
    for data in clips.values():
        video = decode_video(data, num_frames=3, limits=LIMITS)
        assert len(video.frames) == 3


@FUZZ
@given(data=st.binary(max_size=2048))
def test_random_bytes(data):
    _decode_or_refuse(data)


@FUZZ
@given(container=st.sampled_from(["mp4", "webm"]), cut=st.floats(0, 1, exclude_max=True))
def test_truncated_clips(clips, container, cut):
    data = clips[container]
    _decode_or_refuse(data[: int(len(data) * cut)])


@FUZZ
@given(container=st.sampled_from(["mp4", "webm"]),
       flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)), min_size=1, max_size=24),
       num_frames=st.none() | st.integers(1, 8))
def test_bit_flipped_clips(clips, container, flips, num_frames):
    data = bytearray(clips[container])
    for where, bit in flips:
        data[int(where * len(data))] ^= 1 << bit
    _decode_or_refuse(bytes(data), num_frames)


@FUZZ
@given(container=st.sampled_from(["mp4", "webm"]), keep=st.integers(8, 256), tail=st.binary(max_size=4096))
def test_real_header_random_body(clips, container, keep, tail):
    """Past the container sniffing: a genuine header followed by garbage reaches the demuxer."""
    _decode_or_refuse(clips[container][:keep] + tail)
