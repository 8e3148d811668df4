"""Synthetic captioned clips: coloured shapes moving across a small frame, encoded to real video.

They give the demo model a task that needs every part of the pipeline: colour and shape live
inside a frame (bidirectional vision tokens), direction only across frames (causal attention
to earlier frames' keys, correct positions). Everything follows from the seed.
"""

from __future__ import annotations

import argparse
import io
import itertools
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (225, 30, 30),
    "green": (30, 200, 40),
    "blue": (40, 80, 255),
    "yellow": (240, 225, 30),
    "purple": (160, 40, 220),
    "white": (240, 240, 240),
}
SHAPE_RADIUS = 6.0
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
CONTAINERS = {"mp4": ("mp4", "libx264"), "webm": ("webm", "libvpx"), "avi": ("avi", "mpeg4"), "mkv": ("matroska", "libx264")}


@dataclass(frozen=True)
class Motion:
    """One shape's appearance and path (pixel centre at frame 0, pixels per frame)."""

    shape: str
    colour: str
    direction: str
    radius: float
    start: tuple[float, float]
    speed: float

    def words(self) -> str:
        return f"a {self.colour} {self.shape} moves {self.direction}"


@dataclass
class SyntheticClip:
    data: bytes  # the encoded container
    caption: str
    container: str
    fps: float
    frames: list[np.ndarray]  # what was drawn, before encoding


def caption(motions: list[Motion]) -> str:
    """Canonical caption: shapes in SHAPES order, joined by 'and'."""
    ordered = sorted(motions, key=lambda m: SHAPES.index(m.shape))
    return " and ".join(m.words() for m in ordered)


def _motion(rng: np.random.Generator, shape: str, size: int, num_frames: int) -> Motion:
    colour = list(COLOURS)[rng.integers(len(COLOURS))]
    direction = list(DIRECTIONS)[rng.integers(len(DIRECTIONS))]
    # One size for every shape: then a square (12x12) covers clearly more pixels than a circle
    # (d=12), which covers more than a triangle; at 32x32 the outline alone is a few pixels.
    radius = SHAPE_RADIUS
    travel = float(rng.uniform(10.0, 14.0))  # over the whole clip, whatever its frame count
    speed = travel / max(1, num_frames - 1)
    dx, dy = DIRECTIONS[direction]
    lo, hi = radius + 0.5, size - 1.5 - radius

    def start_on(axis_step: int) -> float:
        if axis_step > 0:
            return float(rng.uniform(lo, max(lo, hi - travel)))
        if axis_step < 0:
            return float(rng.uniform(min(hi, lo + travel), hi))
        return float(rng.uniform(lo, hi))

    return Motion(shape, colour, direction, radius, (start_on(dx), start_on(dy)), speed)


def plan(seed: int, *, num_shapes: int = 1, size: int = 32, num_frames: int = 4) -> list[Motion]:
    """The motions a seed draws; distinct shapes when there are two."""
    rng = np.random.default_rng(seed)
    shapes = [SHAPES[i] for i in rng.permutation(len(SHAPES))[:num_shapes]]
    return [_motion(rng, s, size, num_frames) for s in shapes]


def _draw(draw: ImageDraw.ImageDraw, m: Motion, cx: float, cy: float) -> None:
    r, fill = m.radius, COLOURS[m.colour]
    if m.shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif m.shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=fill)


def render(motions: list[Motion], *, size: int = 32, num_frames: int = 4,
           background: tuple[int, int, int] = (16, 16, 16)) -> list[np.ndarray]:
    frames = []
    for t in range(num_frames):
        img = Image.new("RGB", (size, size), background)
        draw = ImageDraw.Draw(img)
        for m in motions:
            dx, dy = DIRECTIONS[m.direction]
            _draw(draw, m, m.start[0] + dx * m.speed * t, m.start[1] + dy * m.speed * t)
        frames.append(np.asarray(img, dtype=np.uint8))
    return frames


def write_video(out, frames: Iterable[np.ndarray], *, fps: float, container: str = "mp4",
                keyframe_interval: int | None = None, codec_options: dict[str, str] | None = None) -> None:
    """Encode RGB frames into `out` (a path or a writable binary file) with PyAV, one frame at a
    time, so an hour-long or 200 MB clip never sits in memory. High quality unless `codec_options`
    (e.g. `{"qp": "0"}`: lossless x264) say otherwise; `keyframe_interval` frames per GOP."""
    fmt, codec = CONTAINERS[container]
    rate = Fraction(fps).limit_denominator(1000)
    with av.open(out, mode="w", format=fmt, container_options={"fflags": "+bitexact"}) as box:
        options = {"crf": "12", "preset": "fast"} if codec == "libx264" else {}
        stream = box.add_stream(codec, rate=rate, options={**options, **(codec_options or {})})
        stream.pix_fmt = "yuv420p"
        if codec == "libvpx":
            stream.bit_rate = 2_000_000
        elif codec == "mpeg4":
            stream.codec_context.qscale = 2
        if keyframe_interval is not None:
            stream.codec_context.gop_size = keyframe_interval
        frames = iter(frames)
        first = next(frames)
        stream.width, stream.height = first.shape[1], first.shape[0]
        for arr in itertools.chain([first], frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                box.mux(packet)
        for packet in stream.encode():
            box.mux(packet)


def remux(source, out, fmt: str) -> None:
    """The same video packets in another container (`source`, `out`: paths or binary files), e.g.
    MPEG-TS, which has no seek index."""
    with av.open(source) as src, av.open(out, mode="w", format=fmt) as dst:
        stream = dst.add_stream_from_template(src.streams.video[0])
        for packet in src.demux(src.streams.video[0]):
            if packet.dts is not None:
                packet.stream = stream
                dst.mux(packet)


def encode(frames: list[np.ndarray], *, fps: float, container: str = "mp4", **options) -> bytes:
    """Encode RGB frames to a real container in memory (options: those of `write_video`)."""
    out = io.BytesIO()
    write_video(out, frames, fps=fps, container=container, **options)
    return out.getvalue()


def make_clip(seed: int, *, num_shapes: int = 1, size: int = 32, num_frames: int = 4, fps: float = 2.0,
              container: str = "mp4") -> SyntheticClip:
    """The clip and caption for `seed` (same seed, same bytes). The defaults are the demo task's clips."""
    motions = plan(seed, num_shapes=num_shapes, size=size, num_frames=num_frames)
    frames = render(motions, size=size, num_frames=num_frames)
    return SyntheticClip(encode(frames, fps=fps, container=container), caption(motions), container, fps, frames)


def _run(args: argparse.Namespace) -> int:
    clip = make_clip(args.seed, num_shapes=args.shapes, container=args.format)
    with open(args.out, "wb") as f:
        f.write(clip.data)
    sys.stdout.write(clip.caption + "\n")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo-video", help="write a synthetic captioned clip; prints its caption")
    p.add_argument("--out", required=True, help="file to write")
    p.add_argument("--seed", type=int, default=0, help="which clip: the same seed gives the same bytes and caption")
    p.add_argument("--format", choices=sorted(CONTAINERS), default="mp4", help="container (default mp4)")
    p.add_argument("--shapes", type=int, choices=(1, 2), default=1, help="moving shapes in the clip")
    p.set_defaults(func=_run)
