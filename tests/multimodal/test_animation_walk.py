"""An animated GIF/WebP sent as a video is walked frame by frame (frames are deltas of the ones
before): the sampled frames are Pillow's own, and the decode time limit stops the walk within one
frame wherever the deadline falls. The clock here ticks once per frame Pillow decodes, so the margin
is counted in frames, not measured in seconds."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from mmserve.errors import LimitExceededError
from mmserve.multimodal import decode_control
from mmserve.multimodal.decode_control import TIMEOUT_FLAG, DecodeControl
from mmserve.multimodal.image import to_rgb
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.video import decode_video

LIMITS = MediaLimits(max_frames_per_video=64)
FRAMES = 24
FRAME_S = 0.1
REQUESTS = {  # name: (request, the frames it samples)
    "two at the end": (dict(num_frames=2, start_s=(FRAMES - 2) * FRAME_S), [22, 23]),
    "one at the end": (dict(num_frames=1, start_s=(FRAMES - 1) * FRAME_S), [23]),
    "four": (dict(num_frames=4), [0, 6, 12, 18]),
    "a window in the middle": (dict(fps=5.0, start_s=0.7, end_s=1.6), [7, 9, 11, 13]),
    "all": (dict(num_frames=FRAMES), list(range(FRAMES))),
}


def changing_animation(fmt: str, rng: np.random.Generator, count: int = FRAMES, side: int = 16) -> bytes:
    """Random frames where each changes a random rectangle of the one before (with some transparent
    pixels), so the encoders store deltas and a frame's pixels depend on the frames before it."""
    frame = rng.integers(0, 256, (side, side, 4), dtype=np.uint8)
    frame[..., 3] = np.where(rng.random((side, side)) < 0.2, 0, 255)
    frames = []
    for _ in range(count):
        frame = frame.copy()
        y, x, h, w = rng.integers(0, side, 4)
        frame[y:y + h + 1, x:x + w + 1, :3] = rng.integers(0, 256, 3)
        frames.append(Image.fromarray(frame))
    out = io.BytesIO()
    frames[0].save(out, format=fmt, save_all=True, append_images=frames[1:], duration=int(FRAME_S * 1000), loop=0,
                   lossless=True)
    return out.getvalue()


def pillow_frame(data: bytes, index: int) -> np.ndarray:
    """Frame `index` as Pillow gives it to a fresh image seeking straight to it."""
    with Image.open(io.BytesIO(data)) as image:
        image.seek(index)
        return np.asarray(to_rgb(image), dtype=np.uint8)


def count_pillow_frame_decodes(monkeypatch) -> list[int]:
    """A counter of the frames Pillow decodes from now on: a GIF frame makes one "gif" decoder; WebP's
    animation decoder decodes one frame per get_next (also the frames a seek steps over)."""
    from PIL import Image as PillowImage
    from PIL import _webp

    decoded, real_getdecoder, real_animation = [0], PillowImage._getdecoder, _webp.WebPAnimDecoder

    def getdecoder(mode, name, *args, **kwargs):
        decoded[0] += name == "gif"
        return real_getdecoder(mode, name, *args, **kwargs)

    class CountingAnimation:
        def __init__(self, data: bytes) -> None:
            self._real = real_animation(data)

        def get_next(self):
            decoded[0] += 1
            return self._real.get_next()

        def __getattr__(self, name):
            return getattr(self._real, name)

    monkeypatch.setattr(PillowImage, "_getdecoder", getdecoder)
    monkeypatch.setattr(_webp, "WebPAnimDecoder", CountingAnimation)
    return decoded


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_walked_frames_are_the_frames_pillow_seeks_to(fmt):
    data = changing_animation(fmt, np.random.default_rng(np.random.randint(2**31)))
    for name, (request, indices) in REQUESTS.items():
        video = decode_video(data, limits=LIMITS, **request)
        assert video.timestamps_s == pytest.approx([i * FRAME_S for i in indices]), name
        assert video.frames_decoded == indices[-1] + 1, name
        for index, frame in zip(indices, video.frames, strict=True):
            np.testing.assert_array_equal(frame, pillow_frame(data, index), err_msg=f"{name}: frame {index}")


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_each_frame_is_decoded_once_per_walk(monkeypatch, fmt):
    """The frame-times walk decodes every frame, the walk to the samples each frame up to the last
    sampled one again, and nothing when the only sample is the frame the first walk ended on."""
    data = changing_animation(fmt, np.random.default_rng(np.random.randint(2**31)))
    decoded = count_pillow_frame_decodes(monkeypatch)
    for name, (request, indices) in REQUESTS.items():
        decoded[0] = 0
        decode_video(data, limits=LIMITS, **request)
        assert decoded[0] == FRAMES + (0 if indices == [FRAMES - 1] else indices[-1] + 1), name


@pytest.mark.parametrize("request_name", ["two at the end", "four", "a window in the middle"])
@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_the_time_limit_stops_the_walk_within_one_frame(monkeypatch, fmt, request_name):
    """For every deadline inside the decode (the clock ticks as each frame's decode starts), the
    refusal comes at the next frame: the time limit's error, never a frame later. Two samples at the
    end once redecoded the whole animation unchecked after the frame-times walk (about one more
    time limit), and a gap between samples was as unchecked."""
    data, (request, _) = changing_animation(fmt, np.random.default_rng(np.random.randint(2**31))), REQUESTS[request_name]
    decoded = count_pillow_frame_decodes(monkeypatch)
    monkeypatch.setattr(decode_control, "time", SimpleNamespace(monotonic=lambda: float(decoded[0])))
    decode_video(data, limits=LIMITS, **request)
    whole = decoded[0]
    assert whole > FRAMES  # the frame-times walk, then the walk to the samples
    for deadline in range(whole - 1):  # the last frame started past its deadline returns: it is done
        decoded[0] = 0
        timeout_s = deadline + 0.5
        with pytest.raises(LimitExceededError) as refused:
            decode_video(data, limits=LIMITS, control=DecodeControl(timeout_s, label="messages[0].parts[1]"), **request)
        assert refused.value.flag == TIMEOUT_FLAG and not refused.value.retryable
        assert str(refused.value).startswith(f"messages[0].parts[1]: decoding took longer than {timeout_s:g}s")
        assert decoded[0] - timeout_s <= 1, f"{decoded[0]} frames decoded for a deadline at {timeout_s}"
