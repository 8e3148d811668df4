"""Decode a client's video with PyAV, with bounded work, from bytes in memory or a spooled file.

Frames are sampled by presentation time. Where the container has a seek index (mp4/mov, webm/mkv,
avi), the frame count, rate and duration come from its metadata and each sampled frame is reached
by seeking to the keyframe before it and decoding forward, so the cost grows with the number of
sampled frames, not with the video's length. Where it has none (MPEG-TS), or the metadata or the
seeks cannot be trusted, the stream is scanned instead: demuxing alone counts the frames (checking
duration and packet limits before any pixel is decoded), then decoding from the start converts only
the sampled frames; the log says when that happens. Both ways check a `DecodeControl` between
packets, so a time limit or a cancel stops the work within one packet.

Frames reach the model as a viewer shows them: a stream whose display matrix rotates it (phones
record portrait video as landscape plus a 90 degree matrix) is turned upright, and a frame the
bitstream flags as interlaced is deinterlaced first (FFmpeg's yadif, on that frame alone: when
seeking, its neighbours are not decoded, so the fields are interpolated spatially). A request may
name a window (`start_s`, `end_s`): only frames inside it are sampled, reached by seeking, and
their timestamps stay measured from the clip's first frame. Animated GIF and WebP go to
`multimodal/animated.py`.

Formats are sniffed from magic bytes and the demuxer is forced (multimodal/container.py).
"""

from __future__ import annotations

import bisect
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np

from mmserve.errors import InvalidInputError, LimitExceededError, RequestAbortedError
from mmserve.multimodal import animated
from mmserve.multimodal.audio import audio_stream, check_duration, read_track
from mmserve.multimodal.container import MediaSource, declared_length_s, open_container, read_head
from mmserve.multimodal.decode_control import DecodeControl
from mmserve.multimodal.limits import MediaLimits

logger = logging.getLogger(__name__)

FIELD = "video"
VideoSource = MediaSource
SNIFF_BYTES = 3 * 188  # enough for three MPEG-TS sync bytes
SEEKABLE = frozenset({"mov", "matroska", "avi"})  # demuxers with a seek index
# A seek landing after its target (pts/dts skew at a GOP boundary) is retried this much earlier,
# doubling each time, before the stream is scanned instead.
SEEK_BACKOFF_FRAMES = 16
MAX_SEEK_TRIES = 4
DEINTERLACE = "mode=send_frame:parity=auto:deint=all"  # yadif's options: one frame out per frame in


@dataclass
class DecodedVideo:
    """Sampled RGB frames, upright, with their real presentation times (seconds from the first
    frame, also inside a window). `method` says how they were reached ("seek", "scan" or
    "animation"); `frames_decoded` counts the work; `rotation_deg` is the counterclockwise turn
    applied (the display matrix's), `deinterlaced` whether any sampled frame was interlaced."""

    frames: list[np.ndarray]
    timestamps_s: list[float]
    duration_s: float
    method: str = "scan"
    frames_decoded: int = 0
    rotation_deg: int = 0
    deinterlaced: bool = False
    # use_audio_in_video: the window's sound, mono float32 at the rate asked, from `soundtrack_start_s`
    # (seconds from the first frame: the window's start)
    soundtrack: np.ndarray | None = None
    soundtrack_start_s: float = 0.0


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
    times_s: list[float] = field(default_factory=list)  # scan only: every frame's time, from the first


@dataclass(frozen=True)
class _Request:
    """What to sample: `num_frames`, or `fps` per second of the window, or the default; the window
    is [start_s, end_s) in seconds from the first frame (end_s None = to the end)."""

    num_frames: int | None
    fps: float | None
    start_s: float = 0.0
    end_s: float | None = None

    def count(self, window_s: float, limits: MediaLimits) -> int:
        """How many frames to ask of a window `window_s` seconds long: fps gives at most the
        per-video maximum (then spread uniformly over the window)."""
        if self.fps is not None:
            wanted = max(1, int(window_s * self.fps + 1e-9))
        else:
            wanted = self.num_frames if self.num_frames is not None else limits.default_num_frames
        return min(wanted, limits.max_frames_per_video)

    def window(self, duration_s: float, fps: float) -> tuple[float, float]:
        """The window inside a clip of `duration_s`, refused when it lies past the clip's end. An
        end at or past the clip's is infinite: the last frame may start at the declared duration."""
        if self.start_s >= duration_s:
            raise InvalidInputError(FIELD, f"start_s {self.start_s:g} is at or past the end of the video, which "
                                    f"lasts {duration_s:.3f} s")
        end = duration_s if self.end_s is None else self.end_s
        if end > duration_s + 1.0 / fps:  # one frame of slack: container durations round
            raise InvalidInputError(FIELD, f"end_s {end:g} is past the end of the video, which lasts "
                                    f"{duration_s:.3f} s; leave end_s at 0 to mean the end")
        return self.start_s, math.inf if end >= duration_s else end


def _window_indices(times, window: tuple[float, float], count: int) -> list[int]:
    """`count` indices spread uniformly over the frames (times in seconds, ascending) inside `window`."""
    first = bisect.bisect_left(times, window[0] - 1e-6)
    stop = bisect.bisect_left(times, window[1] - 1e-6)
    if stop <= first:
        raise InvalidInputError(FIELD, f"the window [{window[0]:g} s, {window[1]:g} s) holds no frame")
    return [first + i for i in sample_indices(stop - first, count)]


def _window_s(window: tuple[float, float], duration_s: float) -> float:
    return min(window[1], duration_s) - window[0]


def _read(path: str | os.PathLike, limits: MediaLimits) -> bytes:
    """A spooled file's bytes (for Pillow), refused by size first."""
    size = os.path.getsize(path)
    if size > limits.max_video_bytes:
        raise LimitExceededError(f"video is {size} bytes, more than the limit of {limits.max_video_bytes}",
                                 "--max-video-bytes")
    with open(path, "rb") as f:
        return f.read()


def _check_dimensions(width: int, height: int, limits: MediaLimits) -> None:
    limits.check_size(width, height, "video frames are")


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
    if stream.codec_context is None:
        raise InvalidInputError(FIELD, "unsupported video codec: no decoder for it here")
    _check_dimensions(stream.codec_context.width, stream.codec_context.height, limits)
    tb = float(stream.time_base) if stream.time_base else 0.0
    if stream.duration and tb:
        _check_duration(stream.duration * tb, limits)
    elif (length := declared_length_s(container)) is not None:
        _check_duration(length, limits)
    stream.codec_context.thread_count = 1
    return stream


def _deinterlaced(frame: av.VideoFrame) -> av.VideoFrame:
    """The frame with its two fields merged by yadif (spatially: it sees no neighbour frames)."""
    graph = av.filter.Graph()
    source = graph.add_buffer(width=frame.width, height=frame.height, format=frame.format.name,
                              time_base=frame.time_base or Fraction(1, 1000))
    yadif, sink = graph.add("yadif", DEINTERLACE), graph.add("buffersink")
    source.link_to(yadif)
    yadif.link_to(sink)
    graph.configure()
    graph.push(frame)
    graph.push(None)
    return graph.pull()


def _quarter_turns(frame: av.VideoFrame) -> int:
    """Counterclockwise quarter turns that show the frame upright (its display matrix, rounded)."""
    return round((frame.rotation or 0) / 90) % 4


def _rgb(frame: av.VideoFrame, limits: MediaLimits) -> tuple[np.ndarray, bool]:
    """Upright RGB pixels, deinterlaced when the frame is interlaced (and whether it was),
    downscaled while converting when larger than `max_decoded_frame_pixels`."""
    turns = _quarter_turns(frame)
    deinterlaced = False
    if frame.interlaced_frame:
        try:
            frame, deinterlaced = _deinterlaced(frame), True
        except (av.FFmpegError, ValueError) as e:  # a pixel format yadif lacks: combed beats refused
            logger.warning("video: cannot deinterlace a %s frame (%s); using it as it is", frame.format.name, e)
    width, height = limits.decoded_frame_size(frame.width, frame.height)
    rgb = frame.to_ndarray(format="rgb24", width=width, height=height)
    return (np.ascontiguousarray(np.rot90(rgb, turns)) if turns else rgb), deinterlaced


@dataclass
class _Converted:
    """Converts the sampled frames, remembering what it did (reported on DecodedVideo)."""

    limits: MediaLimits
    rotation_deg: int = 0
    deinterlaced: bool = False

    def __call__(self, frame: av.VideoFrame) -> np.ndarray:
        self.rotation_deg = _quarter_turns(frame) * 90
        rgb, deinterlaced = _rgb(frame, self.limits)
        self.deinterlaced |= deinterlaced
        return rgb

    def video(self, frames: list[np.ndarray], times: list[float], duration_s: float, method: str,
              decoded: int) -> DecodedVideo:
        return DecodedVideo(frames=frames, timestamps_s=times, duration_s=duration_s, method=method,
                            frames_decoded=decoded, rotation_deg=self.rotation_deg, deinterlaced=self.deinterlaced)


# ---- the soundtrack (use_audio_in_video) -------------------------------------------------------


@dataclass
class _Soundtrack:
    """The window's sound, read from the container the frames come from (opened once): its audio
    stream is found, and the window's length checked against the audio limit, before any frame is
    decoded; its samples are read after the frames, from the window's start on the container clock."""

    container: av.container.InputContainer
    stream: av.audio.AudioStream
    window: tuple[float, float]
    limits: MediaLimits
    rate: int

    @classmethod
    def open(cls, container, window: tuple[float, float], duration_s: float, limits: MediaLimits,
             rate: int | None) -> _Soundtrack | None:
        if rate is None:
            return None
        stream = audio_stream(container, limits, "video (use_audio_in_video)")
        check_duration(_window_s(window, duration_s), limits, "video's soundtrack window")
        return cls(container, stream, window, limits, rate)

    def read(self, first_frame_s: float, control: DecodeControl) -> np.ndarray:
        """The window's samples; `first_frame_s` is the first frame's time on the container clock
        (the window counts from it)."""
        begin, end = self.window
        return read_track(self.container, self.stream, rate=self.rate, begin_s=first_frame_s + begin,
                          end_s=None if math.isinf(end) else first_frame_s + end, limits=self.limits, control=control,
                          rewind=True)


# ---- seeking ------------------------------------------------------------------------------------


def _metadata(container: av.container.InputContainer, stream) -> _StreamInfo | None:
    """Frame count, rate, duration and start from the container's header and index, or None."""
    rate = stream.average_rate or stream.guessed_rate
    if not rate or not stream.time_base:
        return None
    fps = float(rate)
    if stream.duration:
        duration = float(stream.duration * stream.time_base)
    elif (length := declared_length_s(container)) is not None:
        duration = length
    else:
        return None
    count = stream.frames or round(duration * fps)
    if count <= 0 or duration <= 0:
        return None
    start = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
    return _StreamInfo(num_frames=count, duration_s=duration, fps=fps, start_s=start)


class _ConstantRate:
    """Frame i's time at a constant rate, as a sequence (for bisect) without a list of them all."""

    def __init__(self, count: int, fps: float) -> None:
        self.count, self.fps = count, fps

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> float:
        return i / self.fps


class _Seeker:
    """Reaches each target time by seeking to the keyframe before it, or by decoding on when the
    target lies within one keyframe interval (learnt while decoding) of where decoding stands.

    Once it has decoded as many frames as the whole stream holds, it stops seeking, so a stream
    with sparse keyframes costs at most about twice a full decode, never a full decode per frame.
    """

    def __init__(self, container, stream, info: _StreamInfo, limits: MediaLimits, control: DecodeControl,
                 convert: _Converted) -> None:
        self.container, self.stream, self.info = container, stream, info
        self.limits, self.control, self.convert = limits, control, convert
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

    def close(self) -> None:
        """End the suspended decode: its generator's frame holds this seeker, which holds it (a
        cycle holding the container, its file and the video's bytes until a full collection)."""
        if self._frames is not None:
            self._frames.close()
        self._frames = self._pending = None

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
            out.append((self.convert(frame), frame.time))
        return out


class _Imprecise(Exception):
    """The container's metadata or seeks cannot be trusted for this stream: scan it instead."""


def _sample_by_seeking(source: VideoSource, fmt: str, request: _Request, limits: MediaLimits,
                       control: DecodeControl, audio_rate: int | None = None) -> DecodedVideo | None:
    with open_container(source, fmt) as container:
        stream = _video_stream(container, limits)
        info = _metadata(container, stream)
        if info is None:
            logger.info("video: the %s container declares no frame rate or duration; decoding it from the start", fmt)
            return None
        _check_duration(info.duration_s, limits)
        window = request.window(info.duration_s, info.fps)
        sound = _Soundtrack.open(container, window, info.duration_s, limits, audio_rate)
        times = _ConstantRate(info.num_frames, info.fps)
        indices = _window_indices(times, window, request.count(_window_s(window, info.duration_s), limits))
        convert = _Converted(limits)
        seeker = _Seeker(container, stream, info, limits, control, convert)
        try:
            sampled = seeker.sample([info.start_s + i / info.fps for i in indices])
        except (InvalidInputError, LimitExceededError, RequestAbortedError):
            raise
        except Exception as e:  # noqa: BLE001 - _Imprecise, or a damaged index: the scan may still decode it
            logger.info("video: cannot sample the %s stream by seeking (%s); decoding it from the start", fmt, e)
            return None
        finally:
            seeker.close()
        video = convert.video([f for f, _ in sampled], [max(0.0, t - info.start_s) for _, t in sampled],
                              info.duration_s, "seek", seeker.decoded)
        if sound is not None:
            video.soundtrack, video.soundtrack_start_s = sound.read(info.start_s, control), window[0]
    return video


# ---- scanning -----------------------------------------------------------------------------------


def _probe(source: VideoSource, fmt: str, limits: MediaLimits, control: DecodeControl) -> _StreamInfo:
    """Count frames by demuxing only; refuse by metadata before decoding anything."""
    with open_container(source, fmt) as container:
        stream = _video_stream(container, limits)
        tb = float(stream.time_base) if stream.time_base else 0.0
        count, first_pts, last_pts, pts = 0, None, None, []
        for packet in container.demux(stream):
            control.check()
            if packet.size == 0:
                continue
            count += 1
            if count > limits.max_packets:
                raise LimitExceededError(f"video has more than {limits.max_packets} frames")
            if packet.pts is not None and tb:
                pts.append(packet.pts)
                first_pts = packet.pts if first_pts is None else min(first_pts, packet.pts)
                last_pts = packet.pts if last_pts is None else max(last_pts, packet.pts)
                _check_duration((last_pts - first_pts) * tb, limits)
        if count == 0:
            raise InvalidInputError(FIELD, "the video stream holds no frames")
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        if stream.duration and tb:
            duration = stream.duration * tb
        elif (length := declared_length_s(container)) is not None:
            duration = length
        elif last_pts is not None:
            duration = (last_pts - first_pts) * tb + (1.0 / fps if fps else 0.0)
        else:
            duration = count / fps if fps else 0.0
        _check_duration(duration, limits)
        if not fps:
            fps = count / duration if duration > 0 else 1.0
        # Presentation order is pts order; without a pts on every packet, assume a constant rate.
        times = sorted(float((p - first_pts) * tb) for p in pts) if len(pts) == count else [i / fps for i in range(count)]
        return _StreamInfo(num_frames=count, duration_s=float(duration), fps=fps, times_s=times)


def _decode_selected(source: VideoSource, fmt: str, wanted: list[int], fps: float, limits: MediaLimits,
                     control: DecodeControl, convert: _Converted, sound: tuple | None = None
                     ) -> tuple[list[np.ndarray], list[float], int, np.ndarray | None]:
    """Decode in order, converting only the wanted indices. Returns frames, times, frames seen and,
    given `sound` (_Soundtrack.open's arguments after the container), the window's soundtrack, read
    from the same container after the frames."""
    wanted_set = set(wanted)
    last_wanted = max(wanted)
    frames: list[np.ndarray] = []
    times: list[float] = []
    start: float | None = None
    seen = 0
    with open_container(source, fmt) as container:
        stream = _video_stream(container, limits)
        track = _Soundtrack.open(container, *sound) if sound else None
        done = False
        for packet in container.demux(stream):
            control.check()
            for frame in packet.decode():
                _check_dimensions(frame.width, frame.height, limits)
                t = frame.time if frame.time is not None else seen / fps
                start = t if start is None else start
                if seen in wanted_set:
                    frames.append(convert(frame))
                    times.append(max(0.0, float(t - start)))
                seen += 1
                done = seen > last_wanted or seen >= limits.max_decoded_frames
                if done:
                    break
            if done:
                break
        soundtrack = None if track is None else track.read(start or 0.0, control)
    return frames, times, seen, soundtrack


def _sample_by_scanning(source: VideoSource, fmt: str, request: _Request, limits: MediaLimits,
                        control: DecodeControl, audio_rate: int | None = None) -> DecodedVideo:
    info = _probe(source, fmt, limits, control)
    window = request.window(info.duration_s, info.fps)
    wanted = request.count(_window_s(window, info.duration_s), limits)
    indices = _window_indices(info.times_s, window, wanted)
    total = info.num_frames
    convert = _Converted(limits)
    sound = (window, info.duration_s, limits, audio_rate) if audio_rate else None
    frames, times, seen, soundtrack = _decode_selected(source, fmt, indices, info.fps, limits, control, convert, sound)
    decoded = seen
    if len(frames) < len(indices) and 0 < seen < total and window == (0.0, math.inf):
        # Fewer frames decode than packets demuxed (e.g. a decoder drops a damaged frame):
        # resample over what really decodes rather than returning a short, skewed sample.
        logger.debug("video: %d packets but %d decodable frames; resampling", total, seen)
        frames, times, again, _ = _decode_selected(source, fmt, sample_indices(seen, wanted), info.fps, limits, control,
                                                   convert)
        decoded += again
    video = convert.video(frames, times, info.duration_s, "scan", decoded)
    video.soundtrack, video.soundtrack_start_s = soundtrack, window[0]
    return video


# ---- animations ---------------------------------------------------------------------------------


def _sample_animation(data: bytes, request: _Request, limits: MediaLimits, control: DecodeControl) -> DecodedVideo:
    with animated.open_animation(data, limits) as image:
        times = animated.frame_times(image, limits, control)
        duration, times = times[-1], times[:-1]
        window = request.window(duration, len(times) / duration if duration > 0 else 1.0)
        indices = _window_indices(times, window, request.count(_window_s(window, duration), limits))
        frames = animated.decode_frames(image, indices, limits, control)
    return DecodedVideo(frames=frames, timestamps_s=[times[i] for i in indices], duration_s=duration,
                        method="animation", frames_decoded=indices[-1] + 1)


# ---- entry point --------------------------------------------------------------------------------


def _check_request(num_frames: int | None, fps: float | None, start_s: float, end_s: float | None,
                   limits: MediaLimits) -> _Request:
    if not (math.isfinite(start_s) and start_s >= 0):
        raise InvalidInputError(FIELD, f"start_s must be a number of seconds >= 0, got {start_s}")
    if end_s is not None and not (math.isfinite(end_s) and end_s > start_s):
        raise InvalidInputError(FIELD, f"end_s must come after start_s ({start_s:g} s), got {end_s}")
    if num_frames is not None and fps is not None:
        raise InvalidInputError(FIELD, "give num_frames or fps, not both")
    if num_frames is not None and num_frames <= 0:
        raise InvalidInputError(FIELD, f"num_frames must be positive, got {num_frames}")
    if fps is not None and not (fps > 0 and math.isfinite(fps)):
        raise InvalidInputError(FIELD, f"fps must be a positive number, got {fps}")
    if num_frames is not None and num_frames > limits.max_frames_per_video:
        raise LimitExceededError(
            f"asked for {num_frames} frames, more than the limit of {limits.max_frames_per_video} per video",
            "--max-frames-per-video")
    return _Request(num_frames, fps, start_s, end_s)


def decode_video(source: VideoSource, *, num_frames: int | None = None, fps: float | None = None,
                 start_s: float = 0.0, end_s: float | None = None, limits: MediaLimits,
                 control: DecodeControl | None = None, seek: bool = True,
                 audio_rate: int | None = None) -> DecodedVideo:
    """Decode `source` (the bytes, or the path of a whole mp4/mov, webm/mkv, avi, mpeg-ts file, or an
    animated GIF/WebP) and sample its frames inside the window [start_s, end_s) (None = to the end).

    The sampling rule: `num_frames` frames spread uniformly over the window's frames, or `fps`
    frames per second of the window, or neither: `limits.default_num_frames`. Never more than
    `limits.max_frames_per_video` (an fps asking more gets that many, spread uniformly; a
    `num_frames` above it is refused) and never more than the window holds (a 1-frame clip gives 1).
    `control` stops the work from another thread; `seek=False` forces the scan (for comparisons).
    `audio_rate` (use_audio_in_video): also read the window's soundtrack from the same container,
    mono at that rate (`DecodedVideo.soundtrack`); a video without an audio stream is refused.
    Raises InvalidInputError for undecodable input, LimitExceededError for limits and the time
    limit, RequestAbortedError when cancelled.
    """
    request = _check_request(num_frames, fps, start_s, end_s, limits)
    control = control or DecodeControl()
    if isinstance(source, bytes):
        if not source:
            raise InvalidInputError(FIELD, "the video payload is empty")
        if len(source) > limits.max_video_bytes:
            # The same words through both doors (mmserve.v1 and vLLM's, tests/gateway): the UploadMedia
            # advice is in the request-size refusal (server/admission.py) and in docs/api.md.
            raise LimitExceededError(
                f"video is {len(source)} bytes, more than the limit of {limits.max_video_bytes}", "--max-video-bytes")
    control.check()
    head = read_head(source, SNIFF_BYTES)
    if animated.sniff_animated(head):
        if audio_rate:
            raise InvalidInputError(FIELD, "an animated GIF/WebP has no soundtrack (use_audio_in_video)")
        try:
            return _sample_animation(source if isinstance(source, bytes) else _read(source, limits), request, limits,
                                     control)
        except (InvalidInputError, LimitExceededError, RequestAbortedError):
            raise
        except Exception as e:  # noqa: BLE001 - a damaged animation is the payload's fault
            raise animated.undecodable(e) from e
    fmt = sniff_container(head)
    if fmt is None:
        raise InvalidInputError(FIELD, "unsupported or unrecognised container (send mp4/mov, webm/mkv, avi, "
                                "mpeg-ts, or an animated GIF/WebP)")
    try:
        video = None
        if seek and fmt in SEEKABLE:
            video = _sample_by_seeking(source, fmt, request, limits, control, audio_rate)
        elif seek:
            logger.info("video: %s has no seek index; decoding it from the start", fmt)
        if video is None:
            video = _sample_by_scanning(source, fmt, request, limits, control, audio_rate)
    except (InvalidInputError, LimitExceededError, RequestAbortedError):
        raise
    except Exception as e:  # noqa: BLE001 - any decoder failure is the payload's fault, never a crash
        raise InvalidInputError(FIELD, f"cannot decode the video: {type(e).__name__}: {e}") from e
    if not video.frames:
        raise InvalidInputError(FIELD, "no decodable frames in the video")
    return video
