"""Seek-based frame sampling against the full scan, on real PyAV clips: the same frames and
timestamps, work that grows with the sampled frames rather than the clip's length, and a decode
that stops at the next packet once cancelled or past its time limit."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest

from mmserve.errors import LimitExceededError, RequestAbortedError
from mmserve.multimodal.decode_control import TIMEOUT_FLAG, DecodeControl
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.synthetic import encode, remux, write_video
from mmserve.multimodal.video import decode_video

LIMITS = MediaLimits(max_frames_per_video=64)
REQUESTS = [{"num_frames": 1}, {"num_frames": 4}, {"num_frames": 16}, {"num_frames": 60}, {"fps": 0.5}, {"fps": 3.0}]


def block_frames(n: int, seed: int, h: int = 32, w: int = 48):
    """Random 8x8-block frames: every frame differs, so a wrong pick shows in the pixels."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield np.kron(rng.integers(0, 256, (h // 8, w // 8, 3)), np.ones((8, 8, 1))).astype(np.uint8)


def assert_same(a, b) -> None:
    assert len(a.frames) == len(b.frames)
    for x, y in zip(a.frames, b.frames, strict=True):
        np.testing.assert_array_equal(x, y)
    assert a.timestamps_s == pytest.approx(b.timestamps_s, abs=1e-3)
    assert a.duration_s == pytest.approx(b.duration_s, abs=0.11)


@pytest.mark.parametrize("container", ["mp4", "webm", "avi", "mkv"])
@pytest.mark.parametrize("keyframe_interval", [None, 5])
def test_seeking_picks_the_frames_a_full_scan_picks(container, keyframe_interval):
    data = encode(list(block_frames(60, seed=int(np.random.randint(1000)))), fps=10,
                  container=container, keyframe_interval=keyframe_interval)
    for request in REQUESTS:
        sought = decode_video(data, limits=LIMITS, **request)
        scanned = decode_video(data, limits=LIMITS, seek=False, **request)
        assert sought.method == "seek" and scanned.method == "scan"
        assert_same(sought, scanned)


@pytest.fixture(scope="module")
def twenty_minutes(tmp_path_factory):
    """20 min at 1 fps, a keyframe every 10 s (as a camera's 1-2 s GOP at 30 fps is, in frames)."""
    path = tmp_path_factory.mktemp("long") / "20min.mp4"
    write_video(path, block_frames(1200, seed=4), fps=1, keyframe_interval=10, codec_options={"preset": "ultrafast"})
    return path


def test_long_video_costs_what_its_sampled_frames_cost(twenty_minutes):
    sought = decode_video(twenty_minutes, num_frames=16, limits=LIMITS)
    scanned = decode_video(twenty_minutes, num_frames=16, limits=LIMITS, seek=False)
    assert_same(sought, scanned)
    assert sought.timestamps_s == pytest.approx([75.0 * i for i in range(16)])
    assert scanned.frames_decoded > 1100
    assert sought.frames_decoded <= 16 * 10, "at most one keyframe interval per sampled frame"


def test_a_file_decodes_as_its_bytes_do(twenty_minutes):
    assert_same(decode_video(twenty_minutes, num_frames=5, limits=LIMITS),
                decode_video(twenty_minutes.read_bytes(), num_frames=5, limits=LIMITS))


def test_sparse_keyframes_never_cost_a_scan_per_frame():
    """One keyframe for 300 frames: seeking cannot help, and must not decode from it per frame."""
    data = encode(list(block_frames(300, seed=5)), fps=25, keyframe_interval=1000,
                  codec_options={"preset": "ultrafast", "x264-params": "scenecut=0"})
    sought = decode_video(data, num_frames=16, limits=LIMITS)
    assert_same(sought, decode_video(data, num_frames=16, limits=LIMITS, seek=False))
    assert sought.frames_decoded <= 2 * 300


def test_mpegts_has_no_index_so_it_is_scanned_and_the_log_says_so(caplog):
    out = io.BytesIO()
    remux(io.BytesIO(encode(list(block_frames(30, seed=6)), fps=10, container="mp4")), out, "mpegts")
    with caplog.at_level(logging.INFO, logger="mmserve.multimodal.video"):
        video = decode_video(out.getvalue(), num_frames=4, limits=LIMITS)
    assert video.method == "scan" and len(video.frames) == 4
    assert "mpegts has no seek index; decoding it from the start" in caplog.text


class StopAt(DecodeControl):
    """Cancels itself (or lets its deadline pass) at its n-th check, and counts the checks."""

    def __init__(self, n: int, *, cancel: bool) -> None:
        super().__init__(timeout_s=3600.0, label="messages[0].parts[1]")
        self.n, self.do_cancel, self.checks = n, cancel, 0

    def expired(self) -> bool:
        return not self.do_cancel and self.checks >= self.n

    def check(self) -> None:
        self.checks += 1
        if self.do_cancel and self.checks == self.n:
            self.cancel()
        super().check()


@pytest.mark.parametrize("seek", [True, False])
def test_a_cancel_stops_the_decode_at_the_next_packet(twenty_minutes, seek):
    control = StopAt(30, cancel=True)
    with pytest.raises(RequestAbortedError, match="decoding was cancelled"):
        decode_video(twenty_minutes, num_frames=16, limits=LIMITS, control=control, seek=seek)
    assert control.checks == 30


@pytest.mark.parametrize("seek", [True, False])
def test_the_time_limit_stops_the_decode_at_the_next_packet(twenty_minutes, seek):
    control = StopAt(30, cancel=False)
    with pytest.raises(LimitExceededError) as e:
        decode_video(twenty_minutes, num_frames=16, limits=LIMITS, control=control, seek=seek)
    assert control.checks == 30 and e.value.flag == TIMEOUT_FLAG
    assert str(e.value).startswith("messages[0].parts[1]: decoding") and not e.value.retryable


def test_an_expired_deadline_refuses_before_opening_anything():
    with pytest.raises(LimitExceededError, match=TIMEOUT_FLAG):
        decode_video(b"not even a video", limits=LIMITS, control=DecodeControl(timeout_s=-1.0))


def test_a_finished_seek_leaves_nothing_for_the_garbage_collector():
    """The seeker's suspended decode (a generator whose frame holds the seeker) is closed when the
    sampling ends: left open, that cycle held the container, its file and the payload's bytes
    until a full collection (the front end's RSS climbed by each 720p clip's size)."""
    import gc

    import av

    from mmserve.multimodal import video

    data = encode(block_frames(48, seed=9), fps=24, keyframe_interval=12)
    gc.collect()
    gc.disable()
    try:
        decoded = decode_video(data, num_frames=2, limits=LIMITS)   # stops mid-stream
        left = [type(o).__qualname__ for o in gc.get_objects()
                if isinstance(o, (video._Seeker, av.container.InputContainer))]
    finally:
        gc.enable()
    assert decoded.method == "seek" and len(decoded.frames) == 2
    assert not left, f"alive after the decode returned: {left}"
