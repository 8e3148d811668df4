"""A GIF's canvas size read from its block structure, before Pillow opens the file.

Pillow sizes a GIF's canvas from the screen its header declares and enlarges it when a frame
describes an area reaching past that screen; seeking to such a frame (opening the file seeks to the
first) already allocates the frame's area for its disposal, before any pixel is decoded and before a
caller can look at `size`. A 66-byte GIF can so cost gigabytes (GIF sizes go to 65535x65535). The
pixel limit is therefore checked on this walk, which touches no pixel: it reads the blocks as
Pillow's reader does (extensions and image data as length-prefixed sub-blocks, any other byte
between blocks skipped) and only looks at each frame's descriptor.
"""

from __future__ import annotations

import re

_BLOCK_START = re.compile(rb"[!,;]")  # extension, image descriptor, trailer
_HEADER_BYTES = 13  # signature, screen width and height, flags, background, aspect


def gif_canvas(data: bytes, frames: int | None = None) -> tuple[int, int]:
    """(width, height) of the largest canvas Pillow makes while reading the first `frames` frames
    (None: all of them): the screen, enlarged by every frame that reaches past it."""
    width, height = _u16(data, 6), _u16(data, 8)
    pos = _HEADER_BYTES + _color_table_bytes(data, 10)
    read = 0
    while True:
        block = _BLOCK_START.search(data, pos)
        if block is None or block.group() == b";":
            break
        pos = block.end()
        if block.group() == b"!":
            pos = _after_sub_blocks(data, pos + 1)  # past the label
            continue
        if pos + 9 > len(data):
            break
        left, top, frame_width, frame_height = (_u16(data, pos + 2 * k) for k in range(4))
        width, height = max(width, left + frame_width), max(height, top + frame_height)
        read += 1
        if read == frames:
            break
        pos += 9 + _color_table_bytes(data, pos + 8) + 1  # descriptor, local colour table, LZW code size
        pos = _after_sub_blocks(data, pos)
    return width, height


def _u16(data: bytes, pos: int) -> int:
    return int.from_bytes(data[pos:pos + 2], "little")


def _color_table_bytes(data: bytes, flags_at: int) -> int:
    flags = data[flags_at] if flags_at < len(data) else 0
    return 3 << ((flags & 7) + 1) if flags & 0x80 else 0


def _after_sub_blocks(data: bytes, pos: int) -> int:
    """The position after a run of sub-blocks (a length byte, that many bytes; a zero length ends it)."""
    while pos < len(data) and data[pos]:
        pos += data[pos] + 1
    return pos + 1
