"""Animated GIF and WebP sent as a video: decoded as a video, with Pillow.

FFmpeg reads GIF but not animated WebP (this build's webp decoder refuses ANIM chunks), and neither
has a seek index, so both go through Pillow: each frame's duration gives its timestamp, frames are
visited in order (GIF frames are deltas of the one before) and only the sampled ones are converted,
downscaled by the video's rule and scaler (`MediaLimits.decoded_frame_size`, FFmpeg's swscale). That
takes two walks: one over every frame for the times (WebP gives a frame's duration only once it is
decoded), then one from the first frame to the last sampled one.
Work is bounded like a video's: the canvas is checked before any pixel, the frame count and total
duration while walking, and `DecodeControl` before every frame either walk decodes. A GIF frame may
describe an area larger than the screen its header declares, which Pillow allocates while seeking to
it: a GIF's canvas is therefore read from all its frame descriptors (multimodal/gif.py, which walks the
blocks as Pillow's reader does and refuses a file of too many blocks) before Pillow opens it, and
checked again after every seek, before the frame is loaded.
"""

from __future__ import annotations

import io
import itertools

import av
import numpy as np
from PIL import Image

from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.multimodal.decode_control import DecodeControl
from mmserve.multimodal.gif import gif_canvas
from mmserve.multimodal.image import damage, to_rgb
from mmserve.multimodal.limits import MediaLimits

FIELD = "video"
DEFAULT_FRAME_MS = 100  # browsers' rule for a GIF frame that declares no (or a zero) duration


def sniff_animated(head: bytes) -> str | None:
    """"gif" or "webp" when the bytes start like one, else None."""
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return None


def frame_times(image: Image.Image, limits: MediaLimits, control: DecodeControl) -> list[float]:
    """Each frame's start (seconds), by walking the frames' durations. Frames are counted by
    seeking until the end, never by `n_frames` (which would walk a hostile file without a bound)."""
    times, t = [], 0.0
    for index in itertools.count():
        control.check()
        try:
            image.seek(index)
        except EOFError:
            break
        if index >= limits.max_decoded_frames:
            raise LimitExceededError(f"the animation has more than {limits.max_decoded_frames} frames")
        _check_canvas(*image.size, limits)
        image.load()  # WebP sets a frame's duration only once it is loaded
        times.append(t)
        t += (image.info.get("duration") or DEFAULT_FRAME_MS) / 1000.0
        if t > limits.max_video_duration_s:
            raise LimitExceededError(f"the animation lasts more than the limit of {limits.max_video_duration_s:g} s",
                                     "--max-video-duration-s")
    return times + [t]  # the last entry is the end of the last frame: the duration


def open_animation(data: bytes, limits: MediaLimits) -> Image.Image:
    """The opened image, refused by its canvas size before any frame is decoded."""
    if sniff_animated(data) == "gif":
        _check_canvas(*gif_canvas(data, field=FIELD), limits)
    try:   # Pillow's own pixel guard is off (multimodal/image.py): the canvas check below is the limit
        image = Image.open(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - the payload's fault
        raise undecodable(e) from e
    try:
        _check_canvas(*image.size, limits)
    except LimitExceededError:
        image.close()
        raise
    return image


def undecodable(error: Exception) -> InvalidInputError:
    """Our message for Pillow failing on an animation: the kind of damage, not Pillow's text."""
    return InvalidInputError(FIELD, f"cannot decode the animation: {damage(error)}")


def _check_canvas(width: int, height: int, limits: MediaLimits) -> None:
    limits.check_size(width, height, "animation frames are")


def decode_frames(image: Image.Image, indices: list[int], limits: MediaLimits,
                  control: DecodeControl) -> list[np.ndarray]:
    """RGB pixels of the frames at `indices` (ascending), downscaled as a video's frames are.

    Every frame up to the last sampled one is decoded (a GIF frame is a delta of the one before, and
    WebP's decoder composites each frame onto the last), from the image's current frame when the
    first sample is not before it, else from the first frame. They are visited one at a time, each
    loaded here, with `control` checked before each: a seek or load across a gap of frames is work
    no check can stop (two samples at the end, after the frame-times walk, redecoded the whole
    animation past the time limit)."""
    wanted, frames = set(indices), []
    start = image.tell() if image.tell() <= indices[0] else 0
    for index in range(start, indices[-1] + 1):
        control.check()
        image.seek(index)
        _check_canvas(*image.size, limits)
        image.load()
        if index in wanted:
            frames.append(_pixels(image, limits))
    return frames


def _pixels(image: Image.Image, limits: MediaLimits) -> np.ndarray:
    """The loaded frame's RGB pixels, downscaled by the video's rule and scaler."""
    rgb = to_rgb(image)
    width, height = limits.decoded_frame_size(*rgb.size)
    if (width, height) == rgb.size:
        return np.asarray(rgb, dtype=np.uint8)
    return av.VideoFrame.from_image(rgb).to_ndarray(format="rgb24", width=width, height=height)
