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


def read_head(source: MediaSource, size: int) -> bytes:
    """The first `size` bytes, for sniffing the format."""
    if isinstance(source, bytes):
        return source[:size]
    with open(source, "rb") as f:
        return f.read(size)
