"""A GIF's canvas size read from its block structure, before Pillow opens the file.

Pillow sizes a GIF's canvas from the screen its header declares and enlarges it when a frame
describes an area reaching past that screen; seeking to such a frame (opening the file seeks to the
first) already allocates the frame's area for its disposal, before any pixel is decoded and before a
caller can look at `size`. A 66-byte GIF can so cost gigabytes (GIF sizes go to 65535x65535). The
pixel limit is therefore checked on this walk, which touches no pixel: it reads the blocks as Pillow's
reader (GifImagePlugin._seek, alike in this from Pillow 10.0, pyproject's floor, to 13.0) does, quirks
included, and only looks at each frame's descriptor. A walk that read the blocks as the GIF
specification says would lose step with Pillow on a crafted file (see `_Walk.extension`) and check a
frame other than the one Pillow sizes.

The walk is Python, one step per block: it stops past `MAX_BLOCKS` blocks, so a 48 MiB file of
3-byte extensions costs a fraction of a second, not seconds, whoever asked for it. Bytes between
blocks that start none (a zero after a run's terminator, say) count as blocks too: Pillow steps over
them one `read(1)` at a time, in a seek no decode timeout can cut short (47.5 MiB of zeros before or
between frames held a decode 5-8 s), while the walk finds the next block with one search. Encoders
write no such bytes.
"""

from __future__ import annotations

import re

from mmserve.errors import InvalidInputError

_BLOCK_START = re.compile(rb"[!,;]")  # extension, image descriptor, trailer
_HEADER_BYTES = 13  # signature, screen width and height, flags, background, aspect
_COMMENT, _APPLICATION = 0xFE, 0xFF
# Extensions, frames, data sub-blocks and stray bytes between blocks together. A 48 MiB GIF at the
# frame limit (100,000 frames of an extension, a descriptor and data in 255-byte sub-blocks) has
# under 700,000.
MAX_BLOCKS = 2**20


def gif_canvas(data: bytes, frames: int | None = None, field: str = "image") -> tuple[int, int]:
    """(width, height) of the largest canvas Pillow makes while reading the first `frames` frames
    (None: all of them): the screen, enlarged by every frame that reaches past it. A file of more
    than `MAX_BLOCKS` blocks and stray bytes is refused (InvalidInputError on `field`)."""
    walk = _Walk(data, field)
    width, height = _u16(data, 6), _u16(data, 8)
    walk.pos = _HEADER_BYTES + _color_table_bytes(data, 10)
    read = 0
    while True:
        block = _BLOCK_START.search(data, walk.pos)
        walk.count((len(data) if block is None else block.start()) - walk.pos)   # stray bytes, read to the end
        if block is None or block.group() == b";":
            break
        walk.pos = block.end()
        walk.count()
        if block.group() == b"!":
            walk.extension(first_frame=read == 0)
            continue
        pos = walk.pos
        if pos + 8 > len(data):  # Pillow takes the area from a cut descriptor too (then fails on its flags)
            break
        left, top, frame_width, frame_height = (_u16(data, pos + 2 * k) for k in range(4))
        width, height = max(width, left + frame_width), max(height, top + frame_height)
        read += 1
        if read == frames:
            break
        walk.pos = pos + 9 + _color_table_bytes(data, pos + 8) + 1  # descriptor, colour table, LZW code size
        walk.sub_blocks()
    return width, height


class _Walk:
    """A position in the file and the number of blocks (and stray bytes) read so far."""

    def __init__(self, data: bytes, field: str) -> None:
        self.data, self.field = data, field
        self.pos = 0
        self.blocks = 0

    def count(self, blocks: int = 1) -> None:
        self.blocks += blocks
        if self.blocks > MAX_BLOCKS:
            raise InvalidInputError(self.field, f"the GIF has more than {MAX_BLOCKS} blocks and stray bytes between "
                                                "them (encoders write 255-byte sub-blocks and no stray bytes): re-encode it")

    def sub_block(self) -> bool:
        """Step past one sub-block (a length byte, that many bytes); False when it was empty: the
        terminator of a run, or the end of the file."""
        length = self.data[self.pos] if self.pos < len(self.data) else 0
        self.count()
        self.pos += 1 + length
        return length > 0

    def sub_blocks(self) -> None:
        """Step past a run of sub-blocks, its empty terminator included."""
        while self.sub_block():
            pass

    def extension(self, first_frame: bool) -> None:
        """Step past an extension (pos: its label) as Pillow does: it reads one sub-block, then on
        until an empty one. So when the first sub-block is already the terminator, the next run of
        sub-blocks is read as part of the extension too. A comment is read as one run. An application
        block before the first frame named NETSCAPE2.0 has its name read apart, then the same rule
        applies to the sub-blocks after it."""
        label = self.data[self.pos] if self.pos < len(self.data) else None
        self.pos += 1
        if label == _COMMENT:
            self.sub_blocks()
            return
        length = self.data[self.pos] if self.pos < len(self.data) else 0
        if label == _APPLICATION and first_frame \
                and self.data.startswith(b"NETSCAPE2.0", self.pos + 1, self.pos + 1 + length):
            self.sub_block()
        self.sub_block()
        self.sub_blocks()


def _u16(data: bytes, pos: int) -> int:
    return int.from_bytes(data[pos:pos + 2], "little")


def _color_table_bytes(data: bytes, flags_at: int) -> int:
    flags = data[flags_at] if flags_at < len(data) else 0
    return 3 << ((flags & 7) + 1) if flags & 0x80 else 0
