"""Decode a client's video bytes with PyAV, in memory, with bounded work.

Two passes over the container: demuxing alone counts the frames cheaply (and checks duration
and packet limits before any pixel is decoded), then decoding converts only the sampled frames
to RGB. Formats are sniffed from magic bytes and the demuxer is forced, so FFmpeg never probes
its way into playlist or concat demuxers that would open URLs or server-side files.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass

import av
import numpy as np

from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.multimodal.limits import MediaLimits

logger = logging.getLogger(__name__)

FIELD = "video"


@dataclass
class DecodedVideo:
    """Sampled RGB frames with their real presentation times (seconds from the first frame)."""

    frames: list[np.ndarray]
    timestamps_s: list[float]
    duration_s: float


def sniff_container(data: bytes) -> str | None:
    """FFmpeg demuxer name for the few containers we accept, or None."""
    head = data[:64]
    if len(head) >= 12 and head[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"):
        return "mov"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    if len(data) >= 3 * 188 and all(data[i * 188] == 0x47 for i in range(3)):
        return "mpegts"
    return None


def sample_indices(total: int, num_frames: int) -> list[int]:
    """Uniform frame indices, the same rule as transformers' default video sampler."""
    n = min(num_frames, total)
    return [i * total // n for i in range(n)]


@dataclass
class _StreamInfo:
    num_frames: int
    duration_s: float
    fps: float


def _open(data: bytes, fmt: str) -> av.container.InputContainer:
    return av.open(io.BytesIO(data), mode="r", format=fmt, options={"enable_drefs": "0"})


def _check_dimensions(width: int, height: int, limits: MediaLimits) -> None:
    if width * height > limits.max_image_pixels:
        raise LimitExceededError(
            f"video frames are {width}x{height} = {width * height} pixels, more than the "
            f"limit of {limits.max_image_pixels}", "--max-image-pixels")


def _check_duration(duration_s: float, limits: MediaLimits) -> None:
    if duration_s > limits.max_video_duration_s:
        raise LimitExceededError(
            f"video lasts {duration_s:.1f} s, longer than the limit of {limits.max_video_duration_s:g} s",
            "--max-video-duration-s")


def _probe(data: bytes, fmt: str, limits: MediaLimits) -> _StreamInfo:
    """Count frames by demuxing only; refuse by metadata before decoding anything."""
    with _open(data, fmt) as container:
        if not container.streams.video:
            raise InvalidInputError(FIELD, "the container has no video stream (audio-only or empty)")
        stream = container.streams.video[0]
        ctx = stream.codec_context
        _check_dimensions(ctx.width, ctx.height, limits)
        tb = float(stream.time_base) if stream.time_base else 0.0
        if stream.duration and tb:
            _check_duration(stream.duration * tb, limits)
        elif container.duration:
            _check_duration(container.duration / av.time_base, limits)
        count, first_pts, last_pts = 0, None, None
        for packet in container.demux(stream):
            if packet.size == 0:
                continue
            count += 1
            if count > limits.max_packets:
                raise LimitExceededError(f"video has more than {limits.max_packets} frames")
            if packet.pts is not None and tb:
                first_pts = packet.pts if first_pts is None else min(first_pts, packet.pts)
                last_pts = packet.pts if last_pts is None else max(last_pts, packet.pts)
                _check_duration((last_pts - first_pts) * tb, limits)
        if count == 0:
            raise InvalidInputError(FIELD, "the video stream holds no frames")
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        if stream.duration and tb:
            duration = stream.duration * tb
        elif container.duration:
            duration = container.duration / av.time_base
        elif last_pts is not None:
            duration = (last_pts - first_pts) * tb + (1.0 / fps if fps else 0.0)
        else:
            duration = count / fps if fps else 0.0
        _check_duration(duration, limits)
        if not fps:
            fps = count / duration if duration > 0 else 1.0
        return _StreamInfo(num_frames=count, duration_s=float(duration), fps=fps)


def _target_size(width: int, height: int, max_pixels: int) -> tuple[int, int] | None:
    if width * height <= max_pixels:
        return None
    scale = math.sqrt(max_pixels / (width * height))
    return max(1, int(width * scale)), max(1, int(height * scale))


def _decode_selected(data: bytes, fmt: str, wanted: list[int], fps: float,
                     limits: MediaLimits) -> tuple[list[np.ndarray], list[float], int]:
    """Decode in order, converting only the wanted indices. Returns frames, times, frames seen."""
    wanted_set = set(wanted)
    last_wanted = max(wanted)
    frames: list[np.ndarray] = []
    times: list[float] = []
    start: float | None = None
    seen = 0
    with _open(data, fmt) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        for frame in container.decode(stream):
            _check_dimensions(frame.width, frame.height, limits)
            t = frame.time if frame.time is not None else seen / fps
            start = t if start is None else start
            if seen in wanted_set:
                size = _target_size(frame.width, frame.height, limits.max_decoded_frame_pixels)
                if size is None:
                    frames.append(frame.to_ndarray(format="rgb24"))
                else:
                    frames.append(frame.to_ndarray(format="rgb24", width=size[0], height=size[1]))
                times.append(max(0.0, float(t - start)))
            seen += 1
            if seen > last_wanted or seen >= limits.max_decoded_frames:
                break
    return frames, times, seen


def decode_video(data: bytes, *, num_frames: int | None = None, fps: float | None = None,
                 limits: MediaLimits) -> DecodedVideo:
    """Decode `data` (a whole mp4/mov, webm/mkv, avi or mpeg-ts file) and sample its frames.

    `num_frames` frames spread uniformly over the clip, or `fps` frames per second of video;
    neither means `limits.default_num_frames`. Either way at most `limits.max_frames_per_video`.
    Raises InvalidInputError for undecodable input and LimitExceededError for limits.
    """
    if num_frames is not None and fps is not None:
        raise InvalidInputError(FIELD, "give num_frames or fps, not both")
    if num_frames is not None and num_frames <= 0:
        raise InvalidInputError(FIELD, f"num_frames must be positive, got {num_frames}")
    if fps is not None and not (fps > 0 and math.isfinite(fps)):
        raise InvalidInputError(FIELD, f"fps must be a positive number, got {fps}")
    if num_frames is not None and num_frames > limits.max_frames_per_video:
        raise LimitExceededError(
            f"asked for {num_frames} frames, more than the limit of {limits.max_frames_per_video} per video",
            "--max-frames-per-video", can_never_fit=True)
    if not data:
        raise InvalidInputError(FIELD, "the video payload is empty")
    if len(data) > limits.max_video_bytes:
        raise LimitExceededError(
            f"video is {len(data)} bytes, more than the limit of {limits.max_video_bytes}", "--max-video-bytes")
    fmt = sniff_container(data)
    if fmt is None:
        raise InvalidInputError(FIELD, "unsupported or unrecognised container (send mp4/mov, webm/mkv, avi or mpeg-ts)")
    try:
        info = _probe(data, fmt, limits)
        if fps is not None:
            wanted_count = max(1, int(info.duration_s * fps))
        else:
            wanted_count = num_frames if num_frames is not None else limits.default_num_frames
        wanted_count = min(wanted_count, limits.max_frames_per_video)
        total = info.num_frames
        frames, times, seen = _decode_selected(data, fmt, sample_indices(total, wanted_count), info.fps, limits)
        if len(frames) < min(wanted_count, total) and 0 < seen < total:
            # Fewer frames decode than packets demuxed (e.g. a decoder drops a damaged frame):
            # resample over what really decodes rather than returning a short, skewed sample.
            logger.debug("video: %d packets but %d decodable frames; resampling", total, seen)
            frames, times, _ = _decode_selected(data, fmt, sample_indices(seen, wanted_count), info.fps, limits)
    except (InvalidInputError, LimitExceededError):
        raise
    except Exception as e:  # noqa: BLE001 - any decoder failure is the payload's fault, never a crash
        raise InvalidInputError(FIELD, f"cannot decode the video: {type(e).__name__}: {e}") from e
    if not frames:
        raise InvalidInputError(FIELD, "no decodable frames in the video")
    return DecodedVideo(frames=frames, timestamps_s=times, duration_s=info.duration_s)
