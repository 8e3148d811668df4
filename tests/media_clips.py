"""Large test videos, made with PyAV at test time (never committed).

`write_padded` puts a few content frames at fixed spacing with filler between, losslessly
(x264 at crf 0), so a content frame decodes to the same pixels in any file it is written into.
Two files with the same content and the same spacing in seconds then give a model exactly the same
input when sampled: a 200 MB one padded with noise, and a small one padded with black."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

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

