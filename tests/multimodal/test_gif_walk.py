"""The GIF canvas walk (multimodal/gif.py) against the Pillow installed: the walk mirrors Pillow's
reader, so it is compared with it on mutated GIFs rather than with the GIF specification.
pyproject allows pillow>=10; 10.0, 10.4, 11.3, 12.0 and 13.0 were checked with this comparison
(30,000 cases each, none past the walk) and the GIF tests of test_image.py and test_video_zoo.py.
Their readers differ only where 10.0 raises on an empty block that 10.4 and later step over: such a
file is refused as corrupt there (a positive control of test_image.py's hidden-frame test fails on
10.0 for that reason), never read further."""

from __future__ import annotations

import io
import random
import struct

import numpy as np
from gif_clips import EXTRA_RUN_EXTENSIONS, screen
from PIL import Image

from mmserve.errors import InvalidInputError
from mmserve.multimodal.gif import gif_canvas

CASES = 1000
LARGEST_FILL = 2**22   # pixels; a case reaching further stops there (its size is recorded first)
# Bytes that start blocks or end runs, and extension labels: the mutations that move the block structure
STRUCTURE = [0x00, 0x21, 0x2C, 0x3B, 0xF9, 0xFE, 0xFF]


class _TooLarge(Exception):
    pass


def pillow_canvases(data: bytes, frames: int | None, monkeypatch) -> list[tuple[int, int]]:
    """Every canvas size Pillow takes while opening `data` and reading its first `frames` frames (None:
    all): its own bomb check sees each size before the area is allocated."""
    sizes: list[tuple[int, int]] = []

    def record(size):
        sizes.append(tuple(size))
        if size[0] * size[1] > LARGEST_FILL:
            raise _TooLarge

    monkeypatch.setattr(Image, "_decompression_bomb_check", record)
    try:
        with Image.open(io.BytesIO(data), formats=["GIF"]) as image:
            for index in range(1, 64 if frames is None else frames):
                image.load()
                image.seek(index)
    except Exception:  # noqa: BLE001 - a damaged file stops Pillow; what it reached is recorded
        pass
    return sizes


def pillow_made(rng: random.Random) -> bytes:
    frames = [Image.fromarray(np.random.randint(0, 256, (rng.randint(1, 40), rng.randint(1, 40)), dtype=np.uint8),
                              rng.choice(["L", "P"])) for _ in range(rng.randint(1, 4))]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=rng.randint(10, 200),
                   loop=rng.choice([0, 1]), disposal=rng.randint(0, 3), comment=b"c" * rng.randint(0, 2),
                   optimize=rng.random() < 0.5)
    return out.getvalue()


def mutated(data: bytes, rng: random.Random) -> bytes:
    """A few edits where they move the block structure: a structure byte written or inserted, bytes
    cut, a 16-bit size made large, an extension Pillow reads one more run after, the file truncated."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 5)):
        at, edit = rng.randrange(13, len(out) + 1), rng.random()
        if edit < 0.3:
            out[at:at + 1] = bytes([rng.choice(STRUCTURE + [rng.randrange(256)])])
        elif edit < 0.5:
            out[at:at] = bytes(rng.choice(STRUCTURE) for _ in range(rng.randint(1, 3)))
        elif edit < 0.6:
            del out[at:at + rng.randint(1, 3)]
        elif edit < 0.75:
            out[at:at + 2] = struct.pack("<H", rng.choice([5000, 40000, 65535]))
        elif edit < 0.9:
            out[at:at] = rng.choice(list(EXTRA_RUN_EXTENSIONS.values())) + b";" + bytes(rng.randint(0, 70))
        else:
            del out[at:]
    return bytes(out)


def run(rng: random.Random) -> bytes:
    """A run of sub-blocks, their bytes those that start blocks, and its terminator."""
    sub_blocks = b""
    for _ in range(rng.randint(0, 3)):
        length = rng.choice([1, 2, 11, 44, 59, 255])
        sub_blocks += bytes([length]) + bytes(rng.choice(STRUCTURE) for _ in range(length))
    return sub_blocks + b"\x00"


def block_soup(rng: random.Random) -> bytes:
    """A small screen, then blocks in any order: frames of any area (past the screen too), extensions
    (empty ones, NETSCAPE2.0 loop blocks, comments), stray structure bytes; a trailer or none."""
    out = screen(rng.choice([1, 16]), rng.choice([1, 16]))
    for _ in range(rng.randint(1, 8)):
        kind = rng.random()
        if kind < 0.4:
            width, height = (rng.choice([1, 16, 64, 3000, rng.randrange(65536)]) for _ in range(2))
            out += b"," + struct.pack("<HHHHB", rng.choice([0, 0, 100]), 0, width, height, 0) + b"\x02" + run(rng)
        elif kind < 0.55:
            out += b"!\xff\x0bNETSCAPE2.0" + rng.choice([b"\x00", b"\x03\x01\x00\x00\x00", run(rng)])
        elif kind < 0.85:
            out += b"!" + bytes([rng.choice([0x01, 0xF9, 0xFE, 0xFF])]) + rng.choice([b"\x00", run(rng)])
        else:
            out += bytes(rng.choice(STRUCTURE) for _ in range(rng.randint(1, 3)))
    return out + rng.choice([b";", b""])


def test_the_walk_reaches_every_canvas_pillow_reaches(monkeypatch):
    """On mutated Pillow-made GIFs and block soups, no canvas Pillow takes reading all frames (a video) or the first
    (an image) may be wider or taller than the walk's: the pixel limit is checked on the walk's."""
    rng = random.Random(random.getrandbits(64))
    past = []
    for _ in range(CASES):
        data = mutated(pillow_made(rng), rng) if rng.random() < 0.5 else block_soup(rng)
        for frames in (None, 1):
            try:
                width, height = gif_canvas(data, frames)
            except InvalidInputError:
                continue
            beyond = [s for s in pillow_canvases(data, frames, monkeypatch) if s[0] > width or s[1] > height]
            if beyond:
                past.append((frames, (width, height), beyond[0], data.hex()))
    assert not past, f"{len(past)} cases where Pillow's canvas passed the walk's, e.g. {past[0]}"
