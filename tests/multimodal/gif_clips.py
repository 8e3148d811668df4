"""GIFs crafted at the block level, for the canvas walker (multimodal/gif.py) and its agreement with Pillow."""

from __future__ import annotations

import struct

# After each of these extensions Pillow reads one more run of sub-blocks than the GIF specification
# says: a non-comment extension whose first sub-block is empty, and a NETSCAPE2.0 block before the
# first frame whose second sub-block is empty. The run that follows starts with ';' (59, a length to
# Pillow; the trailer to a reader that follows the specification), which hides the frame after it.
EXTRA_RUN_EXTENSIONS = {
    "empty extension": b"!\x01\x00",
    "empty NETSCAPE2.0 loop": b"!\xff\x0bNETSCAPE2.0\x00",
}
_HIDDEN_BY_SEMICOLON = b";" + b"\x00" * 59 + b"\x00"
_DISPOSE_TO_BACKGROUND = b"!\xf9\x04\x08\x00\x00\x00\x00"


def screen(width: int, height: int) -> bytes:
    """A GIF89a header with no global colour table."""
    return b"GIF89a" + struct.pack("<HHBBB", width, height, 0, 0, 0)


def one_pixel_frame(left: int, top: int, width: int, height: int) -> bytes:
    """An image descriptor for the area, and one pixel of LZW data."""
    return b"," + struct.pack("<HHHHB", left, top, width, height, 0) + b"\x02\x02\x44\x01\x00"


def hidden_growing_gif(extension: bytes, side: int, first: bool) -> bytes:
    """A 16x16 screen and, behind `extension` and the run Pillow reads after it, a `side`-square
    frame disposed to the background: the first frame (`first`), or the second after a 1x1 one."""
    before = b"" if first else one_pixel_frame(0, 0, 1, 1)
    return (screen(16, 16) + before + extension + _HIDDEN_BY_SEMICOLON + _DISPOSE_TO_BACKGROUND
            + one_pixel_frame(0, 0, side, side) + b";")
