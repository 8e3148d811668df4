"""decode_video on real PyAV-encoded clips: sampling, timestamps, pixels, and every bad-input class."""

from __future__ import annotations

import io
import zlib

import av
import numpy as np
import pytest

from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.synthetic import encode
from mmserve.multimodal.video import decode_video, sample_indices

LIMITS = MediaLimits()


def level_frames(n: int, h: int = 32, w: int = 48) -> list[np.ndarray]:
    """Frame i is a flat grey of level 10 + 12 i, so a decoded frame reveals its index."""
    return [np.full((h, w, 3), 10 + 12 * i, dtype=np.uint8) for i in range(n)]


def frame_index(frame: np.ndarray) -> int:
    return int(round((float(frame.mean()) - 10) / 12))


@pytest.fixture(scope="module")
def clip20() -> bytes:
    return encode(level_frames(20), fps=10, container="mp4")


@pytest.mark.parametrize("container", ["mp4", "webm", "avi", "mkv"])
def test_decodes_every_frame_with_real_timestamps(container: str) -> None:
    rng = np.random.default_rng(7)
    frames = [np.kron(rng.integers(0, 256, (8, 12, 3)), np.ones((4, 4, 1))).astype(np.uint8) for _ in range(6)]
    video = decode_video(encode(frames, fps=5, container=container), num_frames=6, limits=LIMITS)
    assert len(video.frames) == 6
    assert video.timestamps_s == pytest.approx([i / 5 for i in range(6)], abs=1e-3)
    assert video.duration_s == pytest.approx(1.2, abs=0.21)
    for got, want in zip(video.frames, frames, strict=True):
        assert got.shape == (32, 48, 3) and got.dtype == np.uint8
        assert np.abs(got.astype(int) - want.astype(int)).mean() < 25  # lossy codec, 4x4 random blocks


def test_uniform_sampling_picks_transformers_indices(clip20: bytes) -> None:
    video = decode_video(clip20, num_frames=5, limits=LIMITS)
    want = [i * 20 // 5 for i in range(5)]
    assert [frame_index(f) for f in video.frames] == want
    assert video.timestamps_s == pytest.approx([i / 10 for i in want], abs=1e-3)


def test_fps_sampling(clip20: bytes) -> None:
    video = decode_video(clip20, fps=2.0, limits=LIMITS)  # 2 s of video at 2 frames/s -> 4 frames
    assert [frame_index(f) for f in video.frames] == [0, 5, 10, 15]
    assert video.timestamps_s == pytest.approx([0.0, 0.5, 1.0, 1.5], abs=1e-3)


def test_fps_sampling_is_capped(clip20: bytes) -> None:
    video = decode_video(clip20, fps=100.0, limits=MediaLimits(max_frames_per_video=7))
    assert len(video.frames) == 7


def test_more_frames_than_the_clip_has_returns_all(clip20: bytes) -> None:
    assert [frame_index(f) for f in decode_video(clip20, num_frames=30, limits=LIMITS).frames] == list(range(20))


def test_default_frame_count(clip20: bytes) -> None:
    assert len(decode_video(clip20, limits=MediaLimits(default_num_frames=3)).frames) == 3


def test_sample_indices_match_formula() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        total, n = int(rng.integers(1, 500)), int(rng.integers(1, 40))
        got = sample_indices(total, n)
        want = list(np.arange(min(n, total)) * total // min(n, total))
        assert got == want and len(set(got)) == len(got)


def test_large_frames_are_downscaled() -> None:
    data = encode(level_frames(2, h=240, w=320), fps=2, container="mp4")
    video = decode_video(data, num_frames=2, limits=MediaLimits(max_decoded_frame_pixels=80 * 60))
    assert video.frames[0].shape == (60, 80, 3)


# ---- bad input --------------------------------------------------------------------------------


def audio_only_mp4() -> bytes:
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as box:
        stream = box.add_stream("aac", rate=16000)
        for _ in range(4):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
            frame.sample_rate = 16000
            for packet in stream.encode(frame):
                box.mux(packet)
        for packet in stream.encode():
            box.mux(packet)
    return out.getvalue()


def png_bytes() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("name,make", [
    ("empty", lambda clip: b""),
    ("random bytes", lambda clip: np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8).tobytes()),
    ("truncated mp4", lambda clip: clip[: len(clip) // 2]),
    ("header only", lambda clip: clip[:40]),
    ("audio only", lambda clip: audio_only_mp4()),
    ("image, not a video", lambda clip: png_bytes()),
    ("HLS playlist (must not be fetched)", lambda clip: b"#EXTM3U\n#EXTINF:1,\nhttp://127.0.0.1:9/x.ts\n"),
    ("concat script (must not read files)", lambda clip: b"ffconcat version 1.0\nfile '/etc/passwd'\n"),
])
def test_bad_containers_are_invalid_input(clip20: bytes, name: str, make) -> None:
    with pytest.raises(InvalidInputError) as e:
        decode_video(make(clip20), num_frames=4, limits=LIMITS)
    assert e.value.field == "video"


def test_a_codec_without_a_decoder_is_named_as_such(clip20: bytes) -> None:
    """The stream's fourcc renamed: the message said "AttributeError: 'NoneType' object has no
    attribute 'width'"."""
    with pytest.raises(InvalidInputError, match="^video: unsupported video codec: no decoder for it here$"):
        decode_video(clip20.replace(b"avc1", b"zzzz"), num_frames=4, limits=LIMITS)


def test_fuzzed_real_clips_never_crash(clip20: bytes) -> None:
    """Bit flips and truncations of a real mp4 decode or raise our errors, nothing else."""
    rng = np.random.default_rng(3)
    outcomes = set()
    for i in range(40):
        data = bytearray(clip20)
        if i % 2:
            data = data[: int(rng.integers(1, len(data)))]
        else:
            for pos in rng.integers(0, len(data), int(rng.integers(1, 20))):
                data[pos] ^= 1 << int(rng.integers(8))
        try:
            video = decode_video(bytes(data), num_frames=4, limits=LIMITS)
            assert 1 <= len(video.frames) <= 4
            outcomes.add("ok")
        except (InvalidInputError, LimitExceededError):
            outcomes.add("error")
    assert outcomes == {"ok", "error"}


def test_num_frames_and_fps_together_are_refused(clip20: bytes) -> None:
    with pytest.raises(InvalidInputError):
        decode_video(clip20, num_frames=4, fps=2.0, limits=LIMITS)
    with pytest.raises(InvalidInputError):
        decode_video(clip20, fps=float("nan"), limits=LIMITS)


@pytest.mark.parametrize("limits,kwargs,flag", [
    (MediaLimits(max_video_bytes=100), {}, "--max-video-bytes"),
    (MediaLimits(max_frames_per_video=4), {"num_frames": 5}, "--max-frames-per-video"),
    (MediaLimits(max_video_duration_s=1.5), {}, "--max-video-duration-s"),
    (MediaLimits(max_image_pixels=32 * 48 - 1), {}, "--max-image-pixels"),
    (MediaLimits(max_packets=10), {"seek": False}, ""),  # the packet count bounds the scan's work
])
def test_limits(clip20: bytes, limits: MediaLimits, kwargs: dict, flag: str) -> None:
    """Every media limit is permanent (INVALID_ARGUMENT at the edge, as docs/security.md says): the
    same video can never pass, so it is not retryable."""
    with pytest.raises(LimitExceededError) as e:
        decode_video(clip20, limits=limits, **kwargs)
    assert e.value.flag == flag
    assert not e.value.retryable


def test_decompression_bomb_refused_from_metadata() -> None:
    """A 100 KB file of 8192x4352 frames is refused by its header, before 107 MB of pixels exist."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as box:
        stream = box.add_stream("libx264", rate=1, options={"preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = 8192, 4352, "yuv420p"
        frame = av.VideoFrame(8192, 4352, "yuv420p")
        for plane in frame.planes:
            plane.update(bytes(plane.buffer_size))
        for packet in [*stream.encode(frame), *stream.encode()]:
            box.mux(packet)
    data = out.getvalue()
    assert len(data) < 200_000
    with pytest.raises(LimitExceededError) as e:
        decode_video(data, limits=LIMITS)
    assert "8192x4352" in str(e.value)


def test_zlib_is_not_mistaken_for_video() -> None:
    with pytest.raises(InvalidInputError):
        decode_video(zlib.compress(bytes(10**6)), limits=LIMITS)
