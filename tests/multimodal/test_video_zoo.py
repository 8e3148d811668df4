"""The video zoo: clips as people send them, encoded here with PyAV, each accepted with upright
frames and the documented frame count and timestamps (docs/api.md, "Sampling frames").

The sampling rule under test: `num_frames` frames spread uniformly over the window's frames
(index i * n_window // k), `fps` frames per second of the window, never more than the per-video
maximum (fps asking more gets the maximum, spread uniformly) nor than the window holds."""

from __future__ import annotations

import io
import os

import av
import numpy as np
import pytest
from gif_clips import EXTRA_RUN_EXTENSIONS, hidden_growing_gif, one_pixel_frame, screen
from media_clips import animation, combing, encode, growing_gif, record_pillow_fills, sideways, woven

from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.video import decode_video

LIMITS = MediaLimits()


def random_frames(count: int, height: int, width: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(count)]


def grays(count: int, height: int = 48, width: int = 64) -> list[np.ndarray]:
    """Flat frames of distinct gray levels: any codec keeps them within a few levels."""
    return [np.full((height, width, 3), 16 + 24 * k, np.uint8) for k in range(count)]


@pytest.mark.parametrize("seek", [True, False], ids=["seek", "scan"])
@pytest.mark.parametrize("rotation", [90, 180, 270, -90])
def test_rotated_clip_decodes_upright(rotation, seek):
    """A portrait clip stored sideways with a display matrix (as phones record) decodes to exactly
    the pixels of the same clip stored upright (lossless RGB, so any wrong turn or flip shows)."""
    upright = random_frames(8, 48, 32, seed=rotation % 360)
    want = decode_video(encode(upright), num_frames=4, limits=LIMITS, seek=seek)
    got = decode_video(encode(sideways(upright, rotation), rotation=rotation), num_frames=4, limits=LIMITS, seek=seek)
    assert got.rotation_deg == rotation % 360 and want.rotation_deg == 0
    assert got.timestamps_s == want.timestamps_s == [0.0, 0.5, 1.0, 1.5]
    for a, b in zip(got.frames, want.frames, strict=True):
        assert a.shape == (48, 32, 3)
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(want.frames[1], upright[2])  # frame 2 of 8 at 4 frames


def _h264_interlaced(frames: list[np.ndarray]) -> bytes:
    """H.264 coded interlaced, top field first (lossless)."""
    return encode(frames, fps=25, codec="libx264", pix_fmt="yuv420p", options={"x264-params": "tff=1"})


def _mpeg2_interlaced(frames: list[np.ndarray]) -> bytes:
    """MPEG-2 in MPEG-TS with interlaced coding flags (the broadcast 1080i shape, tiny)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mpegts") as box:
        stream = box.add_stream("mpeg2video", rate=25)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        flags = av.codec.context.Flags
        stream.codec_context.flags |= flags.interlaced_dct | flags.interlaced_me
        stream.codec_context.qscale = 2
        for array in frames:
            box.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
        box.mux(stream.encode())
    return buf.getvalue()


@pytest.mark.parametrize("make", [_h264_interlaced, _mpeg2_interlaced], ids=["h264-mp4", "mpeg2-ts"])
def test_interlaced_clip_is_deinterlaced(make):
    """Frames the bitstream flags as interlaced reach the model deinterlaced: the combing of two
    fields caught apart is gone (the flag is what FFmpeg's decoder reports for the frame)."""
    data = make(woven(6))
    with av.open(io.BytesIO(data)) as box:
        raw = next(box.decode(video=0))
        assert raw.interlaced_frame
        raw_combing = combing(raw.to_ndarray(format="rgb24"))
    video = decode_video(data, num_frames=3, limits=LIMITS)
    assert video.deinterlaced and len(video.frames) == 3
    assert video.timestamps_s == pytest.approx([0.0, 0.08, 0.16], abs=1e-6)  # frames 0, 2, 4 at 25 fps
    assert raw_combing > 20
    assert max(combing(f) for f in video.frames) < raw_combing / 4


def test_progressive_clip_is_left_alone():
    """No interlaced flag, no filter: the pixels are exactly the lossless input's."""
    frames = woven(4)  # combed content, but progressive: it must stay as it is
    video = decode_video(encode(frames, fps=25), num_frames=4, limits=LIMITS)
    assert not video.deinterlaced
    for got, want in zip(video.frames, frames, strict=True):
        np.testing.assert_array_equal(got, want)


def test_phone_portrait_turns_clockwise():
    """FFmpeg's convention, independently of `sideways`: a display matrix of -90 degrees (what
    ffprobe shows for a phone's `rotate=90` portrait clip) is shown turned 90 degrees clockwise
    (ffmpeg's autorotate inserts transpose=clock), so the stored top-left corner lands top-right."""
    stored = np.zeros((32, 48, 3), np.uint8)
    stored[:8, :8] = 255
    frame = decode_video(encode([stored] * 2, rotation=-90), num_frames=1, limits=LIMITS).frames[0]
    assert frame.shape == (48, 32, 3)
    assert frame[:8, -8:].min() == 255 and frame[:8, :8].max() == 0


@pytest.mark.parametrize("codec,container,pix_fmt,options", [
    ("libx264", "mp4", "yuv420p10le", {"crf": "4"}),
    ("libx265", "mp4", "yuv420p10le", {"x265-params": "log-level=error:lossless=1"}),
    ("libsvtav1", "mp4", "yuv420p", {"preset": "12", "crf": "10"}),
    ("libvpx-vp9", "webm", "yuv420p", {"lossless": "1"}),
], ids=["h264-10bit", "hevc-10bit", "av1", "vp9"])
def test_codecs_and_bit_depths(codec, container, pix_fmt, options):
    """10-bit H.264/HEVC, AV1 and VP9: 4 of 8 frames at 4 fps are frames 0, 2, 4, 6 (0.5 s apart),
    each the gray level that went in."""
    frames = grays(8)
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        data = encode(frames, codec=codec, container=container, pix_fmt=pix_fmt, options=options)
    finally:   # SVT-AV1's encoder makes its calling thread SCHED_FIFO 99 where it may (as root): this
        os.sched_setscheduler(0, policy, param)   # xdist worker, and all it spawned, then starved the other
    assert os.sched_getscheduler(0) == policy
    video = decode_video(data, num_frames=4, limits=LIMITS)
    assert video.timestamps_s == pytest.approx([0.0, 0.5, 1.0, 1.5], abs=1e-6)
    assert [int(round(f.mean())) for f in video.frames] == pytest.approx([16, 64, 112, 160], abs=3)


def test_variable_frame_rate_keeps_real_times():
    """A VFR clip's timestamps are the frames' own presentation times, not index / average rate."""
    times = [0.0, 0.1, 0.15, 0.7, 0.8, 1.5, 1.6, 2.0]
    video = decode_video(encode(grays(8), times_s=times), num_frames=8, limits=LIMITS)
    assert video.timestamps_s == pytest.approx(times, abs=1e-3)
    assert [int(round(f.mean())) for f in video.frames] == [16 + 24 * k for k in range(8)]


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_animation_sent_as_a_video_is_a_video(fmt):
    """Animated GIF and WebP are decoded as videos: frame times from their durations."""
    data = animation(grays(5), [250, 250, 500, 250, 250], fmt)
    video = decode_video(data, num_frames=3, limits=LIMITS)
    assert video.method == "animation" and video.duration_s == pytest.approx(1.5)
    assert video.timestamps_s == pytest.approx([0.0, 0.25, 1.0])  # frames 0, 1, 3 of 5
    assert [int(f.mean()) for f in video.frames] == [16, 40, 88]
    window = decode_video(data, fps=2, start_s=0.5, limits=LIMITS)  # [0.5, 1.5): frames 2..4, 1 s -> 2 frames
    assert window.timestamps_s == pytest.approx([0.5, 1.0])


@pytest.mark.parametrize("seek", [True, False], ids=["seek", "scan"])
def test_a_matroska_clip_starting_hours_in_lasts_what_its_frames_do(seek):
    """Matroska declares its segment's duration from the segment's time 0: a 2 s clip whose first
    frame is at 5 h declares 5 h, and was refused as 18000 s long (or, under the limit, reported as
    lasting hours). Its start is taken off; timestamps count from its first frame."""
    data = encode(grays(8), container="matroska", times_s=[18000 + k / 4 for k in range(8)])
    video = decode_video(data, num_frames=4, limits=MediaLimits(max_video_duration_s=3600), seek=seek)
    assert video.duration_s == pytest.approx(2.0, abs=0.26)
    assert video.timestamps_s == pytest.approx([0.0, 0.5, 1.0, 1.5], abs=1e-3)


def test_one_frame_clip_gives_its_one_frame():
    """Asking more frames than a clip holds gives what it holds (the Final reports how many)."""
    video = decode_video(encode(grays(1)), num_frames=20, limits=LIMITS)
    assert video.timestamps_s == [0.0] and len(video.frames) == 1


@pytest.fixture(scope="module")
def two_hours() -> bytes:
    """Two hours at 1 fps, 32x32, a keyframe every 600 frames (half a megabyte)."""
    frames = [np.full((32, 32, 3), (k * 7) % 256, np.uint8) for k in range(7200)]
    return encode(frames, fps=1, codec="libx264", pix_fmt="yuv420p", options={"crf": "30"}, gop=600)


def test_two_hour_clip_fps_gives_at_most_the_maximum(two_hours):
    """fps=1 over two hours asks 7200 frames: it gets the per-video maximum, spread uniformly."""
    video = decode_video(two_hours, fps=1, limits=LIMITS)
    assert len(video.frames) == LIMITS.max_frames_per_video == 32
    assert video.timestamps_s == pytest.approx([225.0 * k for k in range(32)])
    with pytest.raises(LimitExceededError, match="--max-frames-per-video"):
        decode_video(two_hours, num_frames=33, limits=LIMITS)


def test_window_late_in_a_long_clip_costs_a_short_clip(two_hours):
    """A 10 s window near the end of two hours is reached by seeking: timestamps absolute, and the
    decoder touches at most two keyframe intervals, not the hours before."""
    video = decode_video(two_hours, fps=1, start_s=7000, end_s=7010, limits=LIMITS)
    assert video.method == "seek"
    assert video.timestamps_s == pytest.approx([7000.0 + k for k in range(10)])
    assert [int(round(f.mean())) for f in video.frames] == pytest.approx([(k * 7) % 256 for k in range(7000, 7010)],
                                                                         abs=8)
    assert video.frames_decoded <= 2 * 600


@pytest.mark.parametrize("seek", [True, False], ids=["seek", "scan"])
def test_window_samples_inside_it_only(seek):
    data = encode(grays(8) * 5, fps=4)  # 40 frames, 10 s
    video = decode_video(data, num_frames=4, start_s=5, end_s=7, limits=LIMITS, seek=seek)
    assert video.timestamps_s == pytest.approx([5.0, 5.5, 6.0, 6.5])  # 8 frames in [5, 7): every other
    video = decode_video(data, start_s=9, limits=LIMITS, seek=seek)  # to the end: 4 frames left
    assert video.timestamps_s == pytest.approx([9.0, 9.25, 9.5, 9.75])


@pytest.mark.parametrize("window,message", [
    (dict(start_s=10), "start_s 10 is at or past the end of the video, which lasts 10.000 s"),
    (dict(start_s=2, end_s=30), "end_s 30 is past the end of the video"),
    (dict(start_s=2, end_s=1), "end_s must come after start_s"),
    (dict(start_s=2.1, end_s=2.2), r"the window \[2.1 s, 2.2 s\) holds no frame"),
    (dict(start_s=-1), "start_s must be a number of seconds >= 0"),
])
def test_bad_windows_are_refused_clearly(window, message):
    with pytest.raises(InvalidInputError, match=message):
        decode_video(encode(grays(8) * 5, fps=4), limits=LIMITS, **window)


def test_animation_bounds():
    """An animation is bounded like a video: frame count, duration and canvas, before the work."""
    data = animation(grays(6, 16, 16), [100] * 6, "GIF")
    with pytest.raises(LimitExceededError, match="more than 4 frames"):
        decode_video(data, limits=MediaLimits(max_decoded_frames=4))
    with pytest.raises(LimitExceededError, match="--max-video-duration-s"):
        decode_video(data, limits=MediaLimits(max_video_duration_s=0.3))
    with pytest.raises(LimitExceededError, match="--max-image-pixels"):
        decode_video(data, limits=MediaLimits(max_image_pixels=100))
    for damaged in (data[:40], data[:-30]):  # our words, not Pillow's (its text can carry reprs)
        with pytest.raises(InvalidInputError, match="^video: cannot decode the animation: it is (truncated|corrupt)$"):
            decode_video(damaged, limits=LIMITS)


def test_animation_frames_are_downscaled_like_a_videos():
    """Animation frames were kept at full size (a 1.6 KB animated WebP of 32 4096x4096 frames held
    1.7 GiB); they are downscaled to --max-decoded-frame-pixels by the video's rule and scaler, so the
    same frames give the same pixels whether sent as an animation or as a (lossless RGB) video."""
    limits = MediaLimits(max_decoded_frame_pixels=256 * 256)
    levels = [np.full((2048, 2048), 16 + 24 * k, np.uint8) for k in range(8)]  # greyscale: quick to encode
    video = decode_video(animation(levels, [100] * 8, "GIF"), num_frames=8, limits=limits)
    assert [f.shape for f in video.frames] == [(256, 256, 3)] * 8
    assert [int(round(f.mean())) for f in video.frames] == [16 + 24 * k for k in range(8)]
    frames, small = random_frames(4, 96, 64), MediaLimits(max_decoded_frame_pixels=32 * 32)
    want = decode_video(encode(frames, fps=10), num_frames=4, limits=small).frames
    got = decode_video(animation(frames, [100] * 4, "WEBP"), num_frames=4, limits=small).frames
    assert [f.shape for f in got] == [(39, 26, 3)] * 4
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_frame_side_over_the_cap_is_refused_as_an_images_is():
    """Video and animation frames reach the same bicubic resize as images: a side over
    `max_image_side` is refused from the container's or the canvas's size."""
    limits = MediaLimits(max_image_side=64)
    frames = grays(2, 16, 96)
    for data in (encode(frames), animation(frames, [100, 100], "GIF")):
        with pytest.raises(LimitExceededError, match="96x16, a side longer than the limit of 64 pixels"):
            decode_video(data, limits=limits)
        assert len(decode_video(data, limits=MediaLimits(max_image_side=96)).frames) == 2


def test_a_gif_frame_larger_than_its_screen_is_held_to_the_pixel_limit(monkeypatch):
    """A GIF frame may describe an area past the screen its header declares; Pillow then enlarges the
    canvas, allocating the frame's area while seeking to it. The canvas was checked only at open: a
    108 KB GIF with a 16x16 screen decoded three 12000x12000 frames (2.7 GiB). Now every frame's area
    is read from the descriptors and refused before Pillow allocates any of it."""
    limits = MediaLimits(max_image_pixels=32 * 32)
    data = growing_gif(16, [16, 64, 16])
    fills = record_pillow_fills(monkeypatch)
    with pytest.raises(LimitExceededError, match="64x64 = 4096 pixels, more than the limit of 1024") as e:
        decode_video(data, limits=limits)
    assert e.value.flag == "--max-image-pixels"
    assert max(fills, default=0) <= limits.max_image_pixels
    assert len(decode_video(data, limits=MediaLimits(max_image_pixels=64 * 64)).frames) == 3


@pytest.mark.parametrize("extension,first", [("empty extension", True), ("empty extension", False),
                                             ("empty NETSCAPE2.0 loop", True)])
def test_a_frame_hidden_behind_an_extension_pillow_reads_further_is_held_to_the_pixel_limit(monkeypatch, extension,
                                                                                            first):
    """Pillow reads one more run of sub-blocks after an empty extension (or, before the first frame,
    an empty NETSCAPE2.0 loop block) than the GIF specification says: a walker following the
    specification took the ';' starting that run for the trailer, and Pillow filled the 20000x20000
    canvas of a ~100-byte GIF it had passed as 16x16."""
    limits = MediaLimits(max_image_pixels=32 * 32)
    data = hidden_growing_gif(EXTRA_RUN_EXTENSIONS[extension], 64, first)
    fills = record_pillow_fills(monkeypatch)
    with pytest.raises(LimitExceededError, match="64x64 = 4096 pixels, more than the limit of 1024") as e:
        decode_video(data, limits=limits)
    assert e.value.flag == "--max-image-pixels"
    assert max(fills, default=0) <= limits.max_image_pixels


@pytest.mark.parametrize("where", ["before the first frame", "between frames", "after the last frame, no trailer"])
def test_an_animation_of_stray_bytes_is_refused_before_pillow_reads_them(monkeypatch, where):
    """Pillow steps over bytes that start no block one read at a time, inside a seek no decode timeout
    can stop: 47.5 MiB of zeros between two frames held decode_video 5.5 s. The walk counts them with the
    blocks (MAX_BLOCKS made small here: the two frames are 6 blocks) and refuses the file first."""
    from mmserve.multimodal import gif

    def animation_with(stray: int) -> bytes:
        frame, zeros = one_pixel_frame(0, 0, 1, 1), b"\x00" * stray
        return {"before the first frame": screen(16, 16) + zeros + frame + frame + b";",
                "between frames": screen(16, 16) + frame + zeros + frame + b";",
                "after the last frame, no trailer": screen(16, 16) + frame + frame + zeros}[where]

    monkeypatch.setattr(gif, "MAX_BLOCKS", 100)
    with pytest.raises(InvalidInputError, match="video: the GIF has more than 100 blocks and stray bytes"):
        decode_video(animation_with(95), limits=LIMITS)
    assert len(decode_video(animation_with(94), limits=LIMITS).frames) == 2


def test_encoders_write_no_stray_bytes_so_the_count_refuses_no_real_file(monkeypatch):
    """The walk counts stray bytes between blocks against MAX_BLOCKS on the premise that encoders write
    none: Pillow's and FFmpeg's (PyAV) GIFs have none (gifsicle's neither, checked by hand), and their
    image data comes in 255-byte sub-blocks."""
    from mmserve.multimodal import gif

    frames = [np.random.randint(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(3)]
    made = {"Pillow": animation(frames, [100] * 3, "GIF"),
            "FFmpeg": encode(frames, codec="gif", pix_fmt="rgb8", container="gif")}
    counted, sub_blocks = [], []
    count, sub_block = gif._Walk.count, gif._Walk.sub_block
    monkeypatch.setattr(gif._Walk, "count", lambda walk, blocks=1: counted.append(blocks) or count(walk, blocks))
    monkeypatch.setattr(gif._Walk, "sub_block", lambda walk: sub_blocks.append(walk.data[walk.pos]) or sub_block(walk))
    for name, data in made.items():
        counted.clear(), sub_blocks.clear()
        assert gif.gif_canvas(data) == (64, 48), name
        assert set(counted) == {0, 1}, name   # 0: no stray bytes before a block
        shorter = [n for n in sub_blocks if n not in (0, 255)]   # a run's last, an extension's
        assert sub_blocks.count(255) > 40 and len(shorter) <= 2 * len(frames) + 2, (name, shorter)
        assert len(decode_video(data, limits=LIMITS).frames) == 3, name
