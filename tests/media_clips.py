"""Large test videos, made with PyAV at test time (never committed).

`write_padded` puts a few content frames at fixed spacing with filler between, losslessly
(x264 at crf 0), so a content frame decodes to the same pixels in any file it is written into.
Two files with the same content and the same spacing in seconds then give a model exactly the same
input when sampled: a 200 MB one padded with noise, and a small one padded with black.

`encode` and the helpers after it make the video zoo: rotated, interlaced, 10-bit, AV1, VFR clips
and animations, in memory."""

from __future__ import annotations

import io
import itertools
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

from mmserve.multimodal.synthetic import make_clip, write_video

LOSSLESS = {"crf": "0", "preset": "ultrafast"}


def content_frames(seed: int, count: int, size: int) -> list[np.ndarray]:
    """A demo-task clip (a shape moving) scaled up from 32x32 to `size` pixels."""
    frames = make_clip(seed, num_frames=count).frames
    return [np.kron(f, np.ones((size // 32, size // 32, 1), dtype=np.uint8)) for f in frames]


def noise(size: int, seed: int = 0) -> itertools.cycle:
    """Incompressible frames (a pool of 16, cycled: each differs from the one before)."""
    rng = np.random.default_rng(seed)
    return itertools.cycle([rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(16)])


def write_padded(path: Path, content: list[np.ndarray], *, spacing: int, fps: float, filler,
                 keyframe_interval: int | None = None) -> Path:
    """`content[i]` at frame i * spacing, frames from `filler` (an iterator) in between."""

    def frames():
        for frame in content:
            yield frame
            yield from itertools.islice(filler, spacing - 1)

    write_video(path, frames(), fps=fps, codec_options=LOSSLESS, keyframe_interval=keyframe_interval)
    return path



def encode(frames: list[np.ndarray], *, fps: float = 4.0, codec: str = "libx264rgb", pix_fmt: str = "rgb24",
           container: str = "mp4", rotation: int | None = None, options: dict[str, str] | None = None,
           times_s: list[float] | None = None, gop: int | None = None) -> bytes:
    """`frames` (RGB) encoded in memory. The default is lossless RGB (libx264rgb at crf 0), so a
    decoded frame equals what went in. `rotation` writes a display matrix (counterclockwise degrees,
    as a phone's portrait clip carries); `times_s` gives each frame its own time (variable rate)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as box:
        defaults = {"crf": "0", "preset": "ultrafast"} if codec.startswith("libx264") else {}
        stream = box.add_stream(codec, rate=Fraction(fps).limit_denominator(1000), options={**defaults, **(options or {})})
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = pix_fmt
        if gop:
            stream.codec_context.gop_size = gop
        if times_s is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for k, array in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            if times_s is not None:
                frame.pts, frame.time_base = round(times_s[k] * 1000), Fraction(1, 1000)
            box.mux(stream.encode(frame))
        box.mux(stream.encode())
    return buf.getvalue()


def sideways(frames: list[np.ndarray], rotation: int) -> list[np.ndarray]:
    """What a camera stores for upright `frames` shown with a `rotation` display matrix."""
    return [np.ascontiguousarray(np.rot90(f, -(rotation // 90))) for f in frames]


def woven(num_frames: int, *, width: int = 96, height: int = 64, shift: int = 6) -> list[np.ndarray]:
    """Frames as an interlaced camera weaves them: a bar moving right, its bottom field caught
    `shift` pixels further along than its top field, so undeinterlaced frames are combed."""
    frames = []
    for k in range(num_frames):
        frame = np.zeros((height, width, 3), np.uint8)
        x = 8 + 6 * k
        frame[0::2, x:x + 24] = 255
        frame[1::2, x + shift:x + shift + 24] = 255
        frames.append(frame)
    return frames


def combing(frame: np.ndarray) -> float:
    """Mean difference between neighbouring rows: high when the two fields disagree."""
    rows = frame.astype(np.float32).mean(axis=-1)
    return float(np.abs(rows[1:] - rows[:-1]).mean())


def animation(frames: list[np.ndarray], durations_ms: list[int], fmt: str) -> bytes:
    """An animated GIF or WebP (lossless) of `frames`, each shown for its duration."""
    images = [Image.fromarray(f) for f in frames]
    out = io.BytesIO()
    images[0].save(out, format=fmt, save_all=True, append_images=images[1:], duration=durations_ms, loop=0,
                   lossless=True)
    return out.getvalue()


def growing_gif(screen: int, sides: list[int]) -> bytes:
    """A GIF whose header declares a `screen`-square screen and whose frames are squares of `sides`,
    each disposed to the background (Pillow enlarges its canvas at a frame larger than the screen, and
    allocates the frame's area for the disposal while seeking to it). The frames' pixels are encoded by
    Pillow, one single-frame GIF each, and spliced after the screen's header."""
    palette = [0, 0, 0, 255, 255, 255] + [0] * 762

    def single(side: int) -> bytes:
        image = Image.new("P", (side, side), 1)
        image.putpalette(palette)
        out = io.BytesIO()
        image.save(out, format="GIF", optimize=False)
        return out.getvalue()

    header = single(screen)
    screen_end = 13 + 3 * (2 << (header[10] & 7))  # screen descriptor and global colour table
    frames = []
    for side in sides:
        gif = single(side)
        assert gif[screen_end] == 0x2C and gif[10] == header[10]  # no extension before the image; same table
        disposal_to_background = b"\x21\xf9\x04\x08\x0a\x00\x00\x00"
        frames.append(disposal_to_background + gif[screen_end:-1])
    return header[:screen_end] + b"".join(frames) + b";"


def record_pillow_fills(monkeypatch) -> list[int]:
    """The pixel counts of the areas Pillow fills from now on (a GIF frame's disposal among them):
    the spy records and calls the real fill."""
    from PIL import Image as PillowImage

    fills, real_fill = [], PillowImage.core.fill
    monkeypatch.setattr(PillowImage.core, "fill", lambda mode, size, *a: fills.append(size[0] * size[1])
                        or real_fill(mode, size, *a))
    return fills
