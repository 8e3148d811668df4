"""Opening a client's media container with PyAV, safely: the demuxer is forced (sniffed from magic
bytes by the caller), so FFmpeg never probes its way into playlist or concat demuxers that would
open URLs or server-side files, and a file is handed over as an open Python file, never as a name
FFmpeg would parse. Shared by video (multimodal/video.py) and audio (multimodal/audio.py)."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator

import av

MediaSource = bytes | str | os.PathLike
FILE_BUFFER_BYTES = 64 * 1024  # larger buffers cost more per seek (each refills it)


@contextlib.contextmanager
def open_container(source: MediaSource, fmt: str) -> Iterator[av.container.InputContainer]:
    with contextlib.ExitStack() as stack:
        if isinstance(source, bytes):
            file, buffer = io.BytesIO(source), 32768
        else:
            file, buffer = stack.enter_context(open(source, "rb")), FILE_BUFFER_BYTES
        yield stack.enter_context(av.open(file, mode="r", format=fmt, options={"enable_drefs": "0"},
                                          buffer_size=buffer))


def declared_length_s(container: av.container.InputContainer) -> float | None:
    """How long the container says it lasts, or None. Matroska declares its segment's duration, which
    is measured from the segment's time 0: a file whose first frame is at 5 h (cut from a recording,
    or remuxed keeping its timestamps) declares 5 h more than it lasts, so its start is taken off."""
    if not container.duration:
        return None
    seconds = container.duration / av.time_base
    if "matroska" in container.format.name and container.start_time:
        seconds -= container.start_time / av.time_base
    return seconds if seconds > 0 else None


def read_head(source: MediaSource, size: int) -> bytes:
    """The first `size` bytes, for sniffing the format."""
    if isinstance(source, bytes):
        return source[:size]
    with open(source, "rb") as f:
        return f.read(size)
