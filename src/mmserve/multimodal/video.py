"""Decode a client's video with PyAV, with bounded work, from bytes in memory or a spooled file.

Frames are sampled by presentation time. Where the container has a seek index (mp4/mov, webm/mkv,
avi), the frame count, rate and duration come from its metadata and each sampled frame is reached
by seeking to the keyframe before it and decoding forward, so the cost grows with the number of
sampled frames, not with the video's length. Where it has none (MPEG-TS), or the metadata or the
seeks cannot be trusted, the stream is scanned instead: demuxing alone counts the frames (checking
duration and packet limits before any pixel is decoded), then decoding from the start converts only
the sampled frames; the log says when that happens. Both ways check a `DecodeControl` between
packets, so a time limit or a cancel stops the work within one packet.

Formats are sniffed from magic bytes and the demuxer is forced, so FFmpeg never probes its way into
playlist or concat demuxers that would open URLs or server-side files; a file is handed to PyAV as
an open Python file, never as a name FFmpeg would parse.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import av
import numpy as np

from mmserve.errors import InvalidInputError, LimitExceededError, RequestAbortedError
from mmserve.multimodal.decode_control import DecodeControl
from mmserve.multimodal.limits import MediaLimits

logger = logging.getLogger(__name__)

FIELD = "video"
VideoSource = bytes | str | os.PathLike
SNIFF_BYTES = 3 * 188  # enough for three MPEG-TS sync bytes
SEEKABLE = frozenset({"mov", "matroska", "avi"})  # demuxers with a seek index
FILE_BUFFER_BYTES = 64 * 1024  # larger buffers cost more per seek (each refills it)
# A seek landing after its target (pts/dts skew at a GOP boundary) is retried this much earlier,
# doubling each time, before the stream is scanned instead.
SEEK_BACKOFF_FRAMES = 16
MAX_SEEK_TRIES = 4


@dataclass
class DecodedVideo:
    """Sampled RGB frames with their real presentation times (seconds from the first frame).
    `method` says how they were reached ("seek" or "scan"); `frames_decoded` counts the work."""

    frames: list[np.ndarray]
    timestamps_s: list[float]
    duration_s: float
    method: str = "scan"
    frames_decoded: int = 0


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
    start_s: float = 0.0


@dataclass(frozen=True)
class _Request:
    num_frames: int | None
    fps: float | None

    def count(self, duration_s: float, limits: MediaLimits) -> int:
        """How many frames to sample from a clip of `duration_s` seconds."""
        if self.fps is not None:
            wanted = max(1, int(duration_s * self.fps))
        else:
            wanted = self.num_frames if self.num_frames is not None else limits.default_num_frames
        return min(wanted, limits.max_frames_per_video)


def _head(source: VideoSource) -> bytes:
    if isinstance(source, bytes):
        return source[:SNIFF_BYTES]
    with open(source, "rb") as f:
        return f.read(SNIFF_BYTES)


@contextlib.contextmanager
def _opened(source: VideoSource, fmt: str) -> Iterator[av.container.InputContainer]:
    with contextlib.ExitStack() as stack:
        if isinstance(source, bytes):
            file, buffer = io.BytesIO(source), 32768
        else:
            file, buffer = stack.enter_context(open(source, "rb")), FILE_BUFFER_BYTES
        yield stack.enter_context(av.open(file, mode="r", format=fmt, options={"enable_drefs": "0"},
                                          buffer_size=buffer))


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


def _video_stream(container: av.container.InputContainer, limits: MediaLimits):
    """The first video stream, refused by its declared size and duration before any decoding."""
    if not container.streams.video:
        raise InvalidInputError(FIELD, "the container has no video stream (audio-only or empty)")
    stream = container.streams.video[0]
    _check_dimensions(stream.codec_context.width, stream.codec_context.height, limits)
    tb = float(stream.time_base) if stream.time_base else 0.0
    if stream.duration and tb:
        _check_duration(stream.duration * tb, limits)
    elif container.duration:
        _check_duration(container.duration / av.time_base, limits)
    stream.codec_context.thread_count = 1
    return stream


def _rgb(frame: av.VideoFrame, limits: MediaLimits) -> np.ndarray:
    """RGB pixels, downscaled while converting when larger than `max_decoded_frame_pixels`."""
    if frame.width * frame.height <= limits.max_decoded_frame_pixels:
        return frame.to_ndarray(format="rgb24")
    scale = math.sqrt(limits.max_decoded_frame_pixels / (frame.width * frame.height))
    width, height = max(1, int(frame.width * scale)), max(1, int(frame.height * scale))
    return frame.to_ndarray(format="rgb24", width=width, height=height)


# ---- seeking ------------------------------------------------------------------------------------


def _metadata(container: av.container.InputContainer, stream) -> _StreamInfo | None:
    """Frame count, rate, duration and start from the container's header and index, or None."""
    rate = stream.average_rate or stream.guessed_rate
    if not rate or not stream.time_base:
        return None
    fps = float(rate)
    if stream.duration:
        duration = float(stream.duration * stream.time_base)
    elif container.duration:
        duration = container.duration / av.time_base
    else:
        return None
    count = stream.frames or round(duration * fps)
    if count <= 0 or duration <= 0:
        return None
    start = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
    return _StreamInfo(num_frames=count, duration_s=duration, fps=fps, start_s=start)


class _Seeker:
    """Reaches each target time by seeking to the keyframe before it, or by decoding on when the
    target lies within one keyframe interval (learnt while decoding) of where decoding stands.

    Once it has decoded as many frames as the whole stream holds, it stops seeking, so a stream
    with sparse keyframes costs at most about twice a full decode, never a full decode per frame.
    """

    def __init__(self, container, stream, info: _StreamInfo, limits: MediaLimits, control: DecodeControl) -> None:
        self.container, self.stream, self.info = container, stream, info
        self.limits, self.control = limits, control
        self.tolerance = 0.5 / info.fps
        self.decoded = 0
        self._frames: Iterator[av.VideoFrame] | None = None
        self._pending: av.VideoFrame | None = None
        self._position: float | None = None  # time of the last frame decoded
        self._interval = 0.0  # keyframe spacing seen so far: nearer targets are decoded to, not sought
        self._last_key: float | None = None

    def _decode_on(self) -> Iterator[av.VideoFrame]:
        for packet in self.container.demux(self.stream):
            self.control.check()
            yield from packet.decode()

    def _pull(self) -> av.VideoFrame | None:
        frame = next(self._frames, None)
        if frame is None:
            return None
        if frame.time is None:
            raise _Imprecise("a frame without a timestamp")
        self.decoded += 1
        if self.decoded > self.limits.max_decoded_frames:
            raise LimitExceededError(f"decoding the video took more than {self.limits.max_decoded_frames} frames")
        _check_dimensions(frame.width, frame.height, self.limits)
        if frame.key_frame:
            if self._last_key is not None:
                self._interval = max(self._interval, frame.time - self._last_key)
            self._last_key = frame.time
        self._position = frame.time
        return frame

    def _next(self) -> av.VideoFrame | None:
        frame, self._pending = self._pending, None
        return frame if frame is not None else self._pull()

    def _seek(self, target: float) -> None:
        """Position decoding at the keyframe at or before `target` (retrying earlier on overshoot)."""
        before = self._position
        offset = target
        for attempt in range(MAX_SEEK_TRIES):
            self.container.seek(max(0, math.floor(offset / self.stream.time_base)), stream=self.stream, backward=True)
            self._frames, self._pending, self._last_key = self._decode_on(), None, None
            first = self._pull()
            if first is None:
                raise _Imprecise(f"seeking to {offset:.3f}s reached the end of the stream")
            if first.time <= target + self.tolerance:
                self._pending = first
                if before is not None and first.time <= before:
                    # Sought back into frames already decoded: keyframes are at least this far apart.
                    self._interval = max(self._interval, target - first.time)
                return
            offset -= SEEK_BACKOFF_FRAMES / self.info.fps * 2**attempt
        raise _Imprecise(f"seeks for {target:.3f}s kept landing after it")

    def sample(self, targets: list[float]) -> list[tuple[np.ndarray, float]]:
        out = []
        for target in targets:
            far = self._position is None or target - self._position > self._interval
            if self._frames is None or (far and self.decoded < self.info.num_frames):
                self._seek(target)
            frame = self._next()
            while frame is not None and frame.time < target - self.tolerance:
                frame = self._next()
            if frame is None:
                raise _Imprecise(f"the stream ended before {target:.3f}s")
            out.append((_rgb(frame, self.limits), frame.time))
        return out


class _Imprecise(Exception):
    """The container's metadata or seeks cannot be trusted for this stream: scan it instead."""


def _sample_by_seeking(source: VideoSource, fmt: str, request: _Request, limits: MediaLimits,
                       control: DecodeControl) -> DecodedVideo | None:
    with _opened(source, fmt) as container:
        stream = _video_stream(container, limits)
        info = _metadata(container, stream)
        if info is None:
            logger.info("video: the %s container declares no frame rate or duration; decoding it from the start", fmt)
            return None
        _check_duration(info.duration_s, limits)
        indices = sample_indices(info.num_frames, request.count(info.duration_s, limits))
        seeker = _Seeker(container, stream, info, limits, control)
        try:
            sampled = seeker.sample([info.start_s + i / info.fps for i in indices])
        except (InvalidInputError, LimitExceededError, RequestAbortedError):
            raise
        except Exception as e:  # noqa: BLE001 - _Imprecise, or a damaged index: the scan may still decode it
            logger.info("video: cannot sample the %s stream by seeking (%s); decoding it from the start", fmt, e)
            return None
    return DecodedVideo(frames=[f for f, _ in sampled], timestamps_s=[max(0.0, t - info.start_s) for _, t in sampled],
                        duration_s=info.duration_s, method="seek", frames_decoded=seeker.decoded)


# ---- scanning -----------------------------------------------------------------------------------


def _probe(source: VideoSource, fmt: str, limits: MediaLimits, control: DecodeControl) -> _StreamInfo:
    """Count frames by demuxing only; refuse by metadata before decoding anything."""
    with _opened(source, fmt) as container:
        stream = _video_stream(container, limits)
        tb = float(stream.time_base) if stream.time_base else 0.0
        count, first_pts, last_pts = 0, None, None
        for packet in container.demux(stream):
            control.check()
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


def _decode_selected(source: VideoSource, fmt: str, wanted: list[int], fps: float, limits: MediaLimits,
                     control: DecodeControl) -> tuple[list[np.ndarray], list[float], int]:
    """Decode in order, converting only the wanted indices. Returns frames, times, frames seen."""
    wanted_set = set(wanted)
    last_wanted = max(wanted)
    frames: list[np.ndarray] = []
    times: list[float] = []
    start: float | None = None
    seen = 0
    with _opened(source, fmt) as container:
        stream = _video_stream(container, limits)
        for packet in container.demux(stream):
            control.check()
            for frame in packet.decode():
                _check_dimensions(frame.width, frame.height, limits)
                t = frame.time if frame.time is not None else seen / fps
                start = t if start is None else start
                if seen in wanted_set:
                    frames.append(_rgb(frame, limits))
                    times.append(max(0.0, float(t - start)))
                seen += 1
                if seen > last_wanted or seen >= limits.max_decoded_frames:
                    return frames, times, seen
    return frames, times, seen


def _sample_by_scanning(source: VideoSource, fmt: str, request: _Request, limits: MediaLimits,
                        control: DecodeControl) -> DecodedVideo:
    info = _probe(source, fmt, limits, control)
    wanted = request.count(info.duration_s, limits)
    total = info.num_frames
    frames, times, seen = _decode_selected(source, fmt, sample_indices(total, wanted), info.fps, limits, control)
    decoded = seen
    if len(frames) < min(wanted, total) and 0 < seen < total:
        # Fewer frames decode than packets demuxed (e.g. a decoder drops a damaged frame):
        # resample over what really decodes rather than returning a short, skewed sample.
        logger.debug("video: %d packets but %d decodable frames; resampling", total, seen)
        frames, times, again = _decode_selected(source, fmt, sample_indices(seen, wanted), info.fps, limits, control)
        decoded += again
    return DecodedVideo(frames=frames, timestamps_s=times, duration_s=info.duration_s, method="scan",
                        frames_decoded=decoded)


# ---- entry point --------------------------------------------------------------------------------


def _check_request(num_frames: int | None, fps: float | None, limits: MediaLimits) -> _Request:
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
    return _Request(num_frames, fps)


def decode_video(source: VideoSource, *, num_frames: int | None = None, fps: float | None = None,
                 limits: MediaLimits, control: DecodeControl | None = None, seek: bool = True) -> DecodedVideo:
    """Decode `source` (the bytes, or the path of a whole mp4/mov, webm/mkv, avi or mpeg-ts file) and
    sample its frames.

    `num_frames` frames spread uniformly over the clip, or `fps` frames per second of video;
    neither means `limits.default_num_frames`. Either way at most `limits.max_frames_per_video`.
    `control` stops the work from another thread; `seek=False` forces the scan (for comparisons).
    Raises InvalidInputError for undecodable input, LimitExceededError for limits and the time
    limit, RequestAbortedError when cancelled.
    """
    request = _check_request(num_frames, fps, limits)
    control = control or DecodeControl()
    if isinstance(source, bytes):
        if not source:
            raise InvalidInputError(FIELD, "the video payload is empty")
        if len(source) > limits.max_video_bytes:
            raise LimitExceededError(
                f"video is {len(source)} bytes, more than the limit of {limits.max_video_bytes}", "--max-video-bytes")
    control.check()
    fmt = sniff_container(_head(source))
    if fmt is None:
        raise InvalidInputError(FIELD, "unsupported or unrecognised container (send mp4/mov, webm/mkv, avi or mpeg-ts)")
    try:
        video = None
        if seek and fmt in SEEKABLE:
            video = _sample_by_seeking(source, fmt, request, limits, control)
        elif seek:
            logger.info("video: %s has no seek index; decoding it from the start", fmt)
        if video is None:
            video = _sample_by_scanning(source, fmt, request, limits, control)
    except (InvalidInputError, LimitExceededError, RequestAbortedError):
        raise
    except Exception as e:  # noqa: BLE001 - any decoder failure is the payload's fault, never a crash
        raise InvalidInputError(FIELD, f"cannot decode the video: {type(e).__name__}: {e}") from e
    if not video.frames:
        raise InvalidInputError(FIELD, "no decodable frames in the video")
    return video
