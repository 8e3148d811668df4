"""A live session's encoded stream (MPEG-TS or fragmented MP4), decoded as its chunks arrive.

A camera or an encoder (`ffmpeg ... -f mpegts -`) sends one continuous stream cut into arbitrary
chunks. FFmpeg's demuxers read from a file, so the chunks go into a bounded pipe that a decoding
thread reads from, blocking until the next chunk; the thread demuxes and decodes with PyAV, samples
frames at `fps` by their presentation times (FpsSampler) and hands each sampled frame, upright RGB
as decode_video converts it, to `on_frame` with its time in seconds. Sizes are checked before
decoding: the stream's declared frame size at open, the codec's before each packet, every frame's
before it is converted. One thread per stream: a stream's packets decode in order, and live sessions
are bounded by --live-max-sessions.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

import av
import numpy as np

from mmserve.errors import InvalidInputError, LimitExceededError, MMServeError
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.video import SNIFF_BYTES, _check_dimensions, _rgb, _video_stream, sniff_container

logger = logging.getLogger(__name__)

FIELD = "stream_chunk"
STREAM_FORMATS = {"mpegts": "MPEG-TS", "mov": "fragmented MP4"}   # demuxers that read a stream as it comes
# Open as soon as the stream's header is in: probing further would wait for data that comes in real time.
OPEN_OPTIONS = {"enable_drefs": "0", "probesize": "32", "analyzeduration": "0"}
READ_BYTES = 4096   # the demuxer's read size: a small chunk is decoded without waiting for more
# Bytes the demuxer may read past the last decoded frame before the stream counts as damaged: a
# compressed frame is at most about its raw size (3 bytes a pixel bounds 4:2:0 at any quality), times
# the frames the decoder holds back to reorder, plus this slack for the audio and metadata packets
# between frames. The MPEG-TS demuxer skips what is not a packet while it hunts for the next sync
# byte (and now and then takes random bytes for a packet that decodes to nothing), so without a bound
# garbage after valid data would end the session only at its idle timeout.
FRAME_SLACK_BYTES = 256 * 1024
# How far a frame's time may fall behind the last kept frame's before the stream counts as restarted
# (an encoder restart, two streams back to back, a PTS wrap): the sampler would skip every frame until
# the clock caught up again, so the session would go silent until its idle timeout. Less than this is
# jitter, and those frames are skipped as the sampler skips them.
MAX_CLOCK_STEP_BACK_S = 1.0


class FpsSampler:
    """Frames at `fps` by presentation time: the first, then the first at or after each 1/fps step from
    it (0 = every frame). On a constant-rate stream, frame i * rate/fps, as decode_video's fps sampling
    picks from a finished file."""

    def __init__(self, fps: float):
        self.fps = fps
        self._first: float | None = None
        self._taken = 0

    def keep(self, time_s: float) -> bool:
        self._first = time_s if self._first is None else self._first
        if not self.fps:
            return True
        if time_s - self._first < self._taken / self.fps - 1e-6:
            return False
        self._taken = math.floor((time_s - self._first) * self.fps + 1e-6) + 1
        return True


class _Pipe:
    """Chunks fed on one thread, read as a file by the demuxer on another; at most `max_bytes` wait."""

    def __init__(self, max_bytes: int):
        self._buffer = bytearray()
        self._cond = threading.Condition()
        self._ended = False
        self.max_bytes = max_bytes
        self.read_bytes = 0             # bytes the demuxer has taken
        self.cutoff = float("inf")      # read_bytes past which reads end the file (set by the decoder)
        self.overran = False            # whether they did

    def feed(self, data: bytes) -> None:
        with self._cond:
            if len(self._buffer) + len(data) > self.max_bytes:
                raise LimitExceededError(
                    f"{len(self._buffer) + len(data)} bytes of the stream are waiting to be decoded, more than "
                    f"{self.max_bytes}: it arrives faster than the server decodes it", "--live-max-stream-buffer-bytes",
                    retryable=True)   # may pass later, on a less loaded server
            self._buffer += data
            self._cond.notify_all()

    def end(self) -> None:
        """No more chunks: the demuxer reads what is left, then end of file."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def discard(self) -> None:
        """Stop now: the demuxer's next read is the end of file."""
        with self._cond:
            self._buffer.clear()
            self._ended = True
            self._cond.notify_all()

    def read(self, size: int = -1) -> bytes:
        with self._cond:
            self._cond.wait_for(lambda: self._buffer or self._ended)
            if self.read_bytes >= self.cutoff:
                self.overran = True
                return b""
            size = len(self._buffer) if size < 0 else size
            data = bytes(self._buffer[:size])
            del self._buffer[:size]
            self.read_bytes += len(data)
            return data


class StreamDecoder:
    """Decode one stream fed with `feed(chunk)`; `on_frame(rgb, time_s)` and `on_error(error)` are
    called on the decoding thread. `close()` stops it at its next read or frame (a call it is in
    finishes: the receiver ignores what arrives after it closed)."""

    def __init__(self, *, fps: float, limits: MediaLimits, max_buffered_bytes: int,
                 on_frame: Callable[[np.ndarray, float], None], on_error: Callable[[BaseException], None]):
        self.fps, self.limits = fps, limits
        self._on_frame, self._on_error = on_frame, on_error
        self._pipe = _Pipe(max_buffered_bytes)
        self._head = bytearray()   # the first bytes, until they say which container this is
        self._thread: threading.Thread | None = None
        self._closed = False
        self._last_frame_end = 0   # the pipe's read_bytes when the last frame came out

    def feed(self, data: bytes) -> None:
        """Queue a chunk; raises when the container is not one we stream, or too much is waiting."""
        if self._thread is None:
            self._head += data
            fmt = sniff_container(bytes(self._head))
            if fmt is None and len(self._head) < SNIFF_BYTES:
                return   # too little yet to tell
            if fmt not in STREAM_FORMATS:
                raise InvalidInputError(FIELD, "a live stream must be " + " or ".join(STREAM_FORMATS.values()) +
                                        f"; these bytes {'are ' + fmt if fmt else 'are not a container we read'}")
            data, self._head = bytes(self._head), bytearray()
            self._thread = threading.Thread(target=self._run, args=(fmt,), name="mmserve-live-stream", daemon=True)
            self._thread.start()
        self._pipe.feed(data)

    def close(self) -> None:
        self._closed = True
        self._pipe.discard()

    def _run(self, fmt: str) -> None:
        try:
            with av.open(self._pipe, mode="r", format=fmt, options=OPEN_OPTIONS, buffer_size=READ_BYTES) as container:
                self._decode(container)
            if self._pipe.overran:
                self._fail(self._overrun(fmt))
        except MMServeError as e:
            self._fail(e)
        except Exception as e:  # noqa: BLE001 - whatever FFmpeg makes of a damaged stream is the stream's fault
            self._fail(self._overrun(fmt) if self._pipe.overran else   # the cut-off's end of file, not the cause
                       InvalidInputError(FIELD, f"cannot decode the {STREAM_FORMATS[fmt]} stream: {type(e).__name__}: {e}"[:500]))

    def _overrun(self, fmt: str) -> InvalidInputError:
        return InvalidInputError(FIELD, f"{self._pipe.read_bytes - self._last_frame_end} bytes of the stream after its "
                                        f"last frame held none: it is damaged or no longer {STREAM_FORMATS[fmt]}")

    def _decode(self, container) -> None:
        stream = _video_stream(container, self.limits)   # its declared frame size, checked before decoding
        codec = stream.codec_context
        sampler = FpsSampler(self.fps)
        last_time = float("-inf")   # the last kept frame's time
        self._expect_frame(codec)
        for packet in container.demux(stream):
            if self._closed:
                return
            if codec.width and codec.height:
                _check_dimensions(codec.width, codec.height, self.limits)
            for frame in packet.decode():
                self._expect_frame(codec)
                if frame.time is None:
                    continue
                _check_dimensions(frame.width, frame.height, self.limits)
                if frame.time < last_time - MAX_CLOCK_STEP_BACK_S:
                    raise InvalidInputError(FIELD, f"the stream's clock went back from {last_time:.3f} s to "
                                            f"{frame.time:.3f} s; open a new session for a new stream")
                if not sampler.keep(frame.time):
                    continue
                rgb, _ = _rgb(frame, self.limits)
                if self._closed:
                    return
                last_time = frame.time
                self._on_frame(rgb, frame.time)

    def _expect_frame(self, codec) -> None:
        """The next frame must come within the bytes the frames the decoder may hold back can take."""
        pixels = codec.width * codec.height if codec.width and codec.height else self.limits.max_image_pixels
        self._last_frame_end = self._pipe.read_bytes
        self._pipe.cutoff = self._pipe.read_bytes + 3 * pixels * (1 + codec.has_b_frames) + FRAME_SLACK_BYTES

    def _fail(self, error: BaseException) -> None:
        if not self._closed:
            self._on_error(error)
