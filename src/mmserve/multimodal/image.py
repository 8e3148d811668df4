"""Decode a client's image bytes with Pillow: format and header checks before pixels, RGB out.

Pillow opens any format it has a plugin for (EPS hands the bytes to Ghostscript, TGA/PPM/ICO/...),
whatever the client said. So the format is read from the magic bytes first, only the formats
docs/api.md lists are accepted, and Pillow is told to try that one plugin alone. Pillow's error texts
can carry object reprs; clients get our own sentence instead.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
from PIL import Image

from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.multimodal.gif import gif_canvas
from mmserve.multimodal.limits import MediaLimits

FIELD = "image"
T = TypeVar("T")
# --max-image-pixels, checked from the header before any pixel is decoded (here and for animations),
# is the one pixel limit: Pillow's own decompression-bomb guard (89 M pixels, its warning an error here)
# refused what that flag allows, with a message naming a limit no flag raises.
Image.MAX_IMAGE_PIXELS = None

# Pillow format name -> the magic bytes that start such a file (WebP: RIFF....WEBP, checked apart).
_MAGIC = {"PNG": (b"\x89PNG\r\n\x1a\n",), "JPEG": (b"\xff\xd8\xff",), "GIF": (b"GIF87a", b"GIF89a"), "BMP": (b"BM",)}
ALLOWED_FORMATS = ("PNG", "JPEG", "WebP", "GIF", "BMP")


@dataclass(frozen=True)
class ImageHeader:
    format: str
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


def sniff_format(data: bytes) -> str:
    """The Pillow format name of `data`, from its first bytes; refuses every format not allowed."""
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    for name, magics in _MAGIC.items():
        if data.startswith(magics):
            return name
    raise InvalidInputError(FIELD, f"not a supported image format: send {', '.join(ALLOWED_FORMATS)} "
                                   "(GIF: its first frame)")


def _open(source: bytes | Path, fmt: str) -> Image.Image:
    return Image.open(source if isinstance(source, Path) else io.BytesIO(source), formats=[fmt])


def read_header(source: bytes | Path, limits: MediaLimits) -> ImageHeader:
    """Format and size from the header alone (no pixel is decoded), with the per-image limits checked.
    `source`: the encoded bytes, or the file holding them (an upload: only its start is read, except
    for a GIF, read whole: its first frame's area is found by walking its blocks, multimodal/gif.py)."""
    size = source.stat().st_size if isinstance(source, Path) else len(source)
    if not size:
        raise InvalidInputError(FIELD, "the image payload is empty")
    if size > limits.max_image_bytes:
        raise LimitExceededError(
            f"image is {size} bytes, more than the limit of {limits.max_image_bytes}", "--max-video-bytes")
    if isinstance(source, Path):
        with source.open("rb") as f:
            start = f.read(16)
    else:
        start = source[:16]
    fmt = sniff_format(start)
    if fmt == "GIF":  # Pillow allocates the first frame's area while opening: its size is checked first
        limits.check_size(*gif_canvas(source.read_bytes() if isinstance(source, Path) else source, frames=1),
                          "image is")

    def probe() -> ImageHeader:
        with _open(source, fmt) as img:
            return ImageHeader(fmt, *img.size)

    header = _with_pillow(fmt, probe)
    limits.check_size(header.width, header.height, "image is")
    if header.pixels == 0:
        raise InvalidInputError(FIELD, "the image has no pixels")
    return header


def decode_image(source: bytes | Path, limits: MediaLimits, *,
                 fit: Callable[[int, int], tuple[int, int]] | None = None) -> np.ndarray:
    """Decode `source` (bytes, or an uploaded file) to uint8 HxWx3 (a GIF's first frame). The format
    and header are checked before any pixel is decoded.

    `fit(height, width) -> (height, width)`: resize (bicubic, as the preprocessing does) before the
    pixels leave Pillow, so the full-size image never exists as an array (only Pillow's own buffer)."""
    header = read_header(source, limits)

    def decode() -> np.ndarray:
        with _open(source, header.format) as probe:
            probe.verify()
        # verify() leaves the image unusable; open again to decode.
        with _open(source, header.format) as img:
            img.load()
            rgb = to_rgb(img)
            size = fit(rgb.height, rgb.width) if fit else (rgb.height, rgb.width)
            if size != (rgb.height, rgb.width):
                rgb = rgb.resize((size[1], size[0]), resample=Image.BICUBIC)
            return np.asarray(rgb, dtype=np.uint8)

    return _with_pillow(header.format, decode)


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB with transparency composited on white, as transformers' convert_to_rgb does."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def _with_pillow(fmt: str, work: Callable[[], T]) -> T:
    """Run Pillow work with its failures as ours."""
    try:
        return work()
    except Exception as e:  # noqa: BLE001 - any Pillow failure is the payload's fault
        raise _undecodable(fmt, e) from e


def _undecodable(fmt: str, error: Exception) -> InvalidInputError:
    """Our message for a Pillow failure: the format and the kind of damage, no reprs or paths."""
    return InvalidInputError(FIELD, f"cannot decode the {fmt} image: {damage(error)}")


def damage(error: Exception) -> str:
    """The kind of damage a Pillow failure shows, in our words (its own text can carry reprs)."""
    return "it is truncated" if isinstance(error, EOFError) or "truncated" in str(error) else "it is corrupt"
