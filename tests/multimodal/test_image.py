"""decode_image: real encoded images in, RGB out; header-level limits; bad payloads refused."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from gif_clips import EXTRA_RUN_EXTENSIONS, hidden_growing_gif, one_pixel_frame, screen
from media_clips import growing_gif, record_pillow_fills
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.multimodal.image import decode_image
from mmserve.multimodal.limits import MediaLimits

LIMITS = MediaLimits()


def encoded(img: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt)
    return out.getvalue()


def test_png_round_trip_is_exact() -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (23, 41, 3), dtype=np.uint8)
    got = decode_image(encoded(Image.fromarray(pixels), "PNG"), LIMITS)
    assert got.dtype == np.uint8 and np.array_equal(got, pixels)


def test_jpeg_and_greyscale_become_rgb() -> None:
    pixels = np.random.default_rng(1).integers(0, 256, (16, 16), dtype=np.uint8)
    got = decode_image(encoded(Image.fromarray(pixels), "JPEG"), LIMITS)
    assert got.shape == (16, 16, 3)
    assert np.abs(got[..., 0].astype(int) - pixels.astype(int)).mean() < 40


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_matches_transformers(mode: str) -> None:
    rng = np.random.default_rng(2)
    img = Image.fromarray(rng.integers(0, 256, (12, 9, 4), dtype=np.uint8), "RGBA")
    img = img.convert(mode) if mode != "P" else img.convert("RGB").convert("P")
    if mode == "P":
        img.info["transparency"] = 0
    data = encoded(img, "PNG")
    want = np.asarray(convert_to_rgb(Image.open(io.BytesIO(data))))
    assert np.array_equal(decode_image(data, LIMITS), want)


def png_claiming(width: int, height: int) -> bytes:
    """A valid-looking PNG whose header claims width x height; its data is one tiny deflate stream."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b"")


def test_decompression_bomb_refused_from_header() -> None:
    data = png_claiming(100_000, 100_000)
    assert len(data) < 200
    with pytest.raises(LimitExceededError) as e:
        decode_image(data, LIMITS)
    assert e.value.flag == "--max-image-pixels"


def test_pixel_and_byte_limits() -> None:
    data = encoded(Image.new("RGB", (40, 30)), "PNG")
    with pytest.raises(LimitExceededError):
        decode_image(data, MediaLimits(max_image_pixels=40 * 30 - 1))
    with pytest.raises(LimitExceededError):
        decode_image(data, MediaLimits(max_image_bytes=len(data) - 1))
    assert decode_image(data, MediaLimits(max_image_pixels=40 * 30)).shape == (30, 40, 3)


@pytest.mark.parametrize("name,data", [
    ("empty", b""),
    ("garbage", b"not an image at all" * 10),
    ("truncated png", encoded(Image.new("RGB", (64, 64), (1, 2, 3)), "PNG")[:60]),
    ("bad pixel data", png_claiming(64, 64)),
])
def test_bad_images_are_invalid_input(name: str, data: bytes) -> None:
    with pytest.raises(InvalidInputError) as e:
        decode_image(data, LIMITS)
    assert e.value.field == "image"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_every_listed_format_decodes_like_pillow(fmt: str) -> None:
    pixels = np.random.default_rng(np.random.randint(2**31)).integers(0, 256, (20, 28, 3), dtype=np.uint8)
    data = encoded(Image.fromarray(pixels), fmt)
    want = np.asarray(convert_to_rgb(Image.open(io.BytesIO(data))))
    assert np.array_equal(decode_image(data, LIMITS), want)


def test_a_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), color) for color in [(255, 0, 0), (0, 0, 255)]]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    got = decode_image(out.getvalue(), LIMITS)
    assert tuple(got[0, 0]) == (255, 0, 0)


def _eps() -> bytes:
    return b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n0 0 moveto showpage\n%%EOF\n"


@pytest.mark.parametrize("name,data", [
    ("eps", _eps()),
    ("tga", encoded(Image.new("RGB", (8, 8)), "TGA")),
    ("ppm", encoded(Image.new("RGB", (8, 8)), "PPM")),
    ("tiff", encoded(Image.new("RGB", (8, 8)), "TIFF")),
    ("ico", encoded(Image.new("RGB", (16, 16)), "ICO")),
])
def test_formats_outside_the_allow_list_never_reach_pillow(name: str, data: bytes, monkeypatch) -> None:
    """Refused from the magic bytes: Pillow's open (which would pick any plugin, EPS's Ghostscript
    included) is never called. The spy only records calls; the real open still runs if reached."""
    opened = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda *a, **k: opened.append(a) or real_open(*a, **k))
    with pytest.raises(InvalidInputError) as e:
        decode_image(data, LIMITS)
    assert "PNG, JPEG, WebP, GIF, BMP" in str(e.value) and not opened


def test_bytes_claiming_one_format_are_decoded_by_that_plugin_only() -> None:
    """PNG magic in front of a PostScript body: Pillow is told 'PNG' only, so the EPS plugin cannot
    claim it; the message is ours, without Pillow's reprs."""
    with pytest.raises(InvalidInputError) as e:
        decode_image(b"\x89PNG\r\n\x1a\n" + _eps(), LIMITS)
    assert str(e.value) == "image: cannot decode the PNG image: it is corrupt"


@pytest.mark.parametrize("cut", [30, 60, 200])
def test_damaged_images_are_described_without_internals(cut: int) -> None:
    data = encoded(Image.fromarray(np.random.default_rng(cut).integers(0, 256, (32, 32, 3), dtype=np.uint8)), "PNG")
    with pytest.raises(InvalidInputError) as e:
        decode_image(data[:cut], LIMITS)
    message = str(e.value)
    assert message.startswith("image: cannot decode the PNG image: it is ")
    assert "0x" not in message and "BytesIO" not in message and "<" not in message


def test_fit_resizes_while_decoding_exactly_as_preprocessing_does() -> None:
    from mmserve.multimodal.preprocess import _resize

    pixels = np.random.default_rng(np.random.randint(2**31)).integers(0, 256, (97, 61, 3), dtype=np.uint8)
    got = decode_image(encoded(Image.fromarray(pixels), "PNG"), LIMITS, fit=lambda h, w: (48, 32))
    assert np.array_equal(got, _resize(pixels, 48, 32))


def test_the_pixel_limit_that_refuses_an_image_is_the_flag_that_raises_it() -> None:
    """A 120 M-pixel header was refused by Pillow's own bomb guard ("more pixels than Pillow decodes
    safely", naming --max-image-pixels, which could not raise it). Now --max-image-pixels alone decides,
    from the header, before any pixel is decoded."""
    from mmserve.multimodal.image import read_header

    data = png_claiming(12_000, 10_000)
    with pytest.raises(LimitExceededError, match="120000000 pixels, more than the limit of 16777216") as e:
        read_header(data, MediaLimits())
    assert e.value.flag == "--max-image-pixels"
    assert read_header(data, MediaLimits(max_image_pixels=120_000_000)).pixels == 120_000_000


def test_a_gif_whose_first_frame_outgrows_its_screen_is_refused_before_pillow_allocates_it(monkeypatch) -> None:
    """Pillow opens a GIF by seeking to its first frame, which enlarges the canvas to the frame's
    area and allocates it for the disposal: a 66-byte GIF claiming a 20000x20000 frame cost 380 MiB
    before the size check saw it. The frame's area is now read from its descriptor first."""
    from mmserve.multimodal.image import read_header

    limits = MediaLimits(max_image_pixels=32 * 32)
    data = growing_gif(16, [64, 16])
    fills = record_pillow_fills(monkeypatch)
    with pytest.raises(LimitExceededError, match="64x64 = 4096 pixels, more than the limit of 1024") as e:
        read_header(data, limits)
    assert e.value.flag == "--max-image-pixels" and max(fills, default=0) <= limits.max_image_pixels
    assert read_header(data, MediaLimits(max_image_pixels=64 * 64)).pixels == 64 * 64


@pytest.mark.parametrize("extension", EXTRA_RUN_EXTENSIONS.values(), ids=EXTRA_RUN_EXTENSIONS.keys())
def test_a_first_frame_hidden_behind_an_extension_pillow_reads_further_is_refused(monkeypatch, extension) -> None:
    """Pillow reads one more run of sub-blocks after an empty extension (or an empty NETSCAPE2.0
    loop block) than the GIF specification says. A walker that followed the specification took the
    ';' starting that run for the trailer and passed a 101-byte GIF as 16x16, while Pillow opened its
    20000x20000 first frame (630 MiB peak)."""
    from mmserve.multimodal.image import read_header

    limits = MediaLimits(max_image_pixels=32 * 32)
    data = hidden_growing_gif(extension, 64, first=True)
    fills = record_pillow_fills(monkeypatch)
    with pytest.raises(LimitExceededError, match="64x64 = 4096 pixels, more than the limit of 1024") as e:
        read_header(data, limits)
    assert e.value.flag == "--max-image-pixels" and max(fills, default=0) <= limits.max_image_pixels
    assert read_header(data, MediaLimits(max_image_pixels=64 * 64)).pixels == 64 * 64


def test_a_gif_of_more_blocks_than_the_walk_reads_is_refused(monkeypatch) -> None:
    """The canvas walk steps through every block in Python: a 48 MiB GIF of 3-byte extensions took
    5 s of CPU. It stops past MAX_BLOCKS blocks (made small here), before Pillow sees the file."""
    from mmserve.multimodal import gif
    from mmserve.multimodal.image import read_header

    monkeypatch.setattr(gif, "MAX_BLOCKS", 100)
    storm = screen(16, 16) + b"!\xfe\x00" * 60 + one_pixel_frame(0, 0, 1, 1) + b";"
    with pytest.raises(InvalidInputError, match="image: the GIF has more than 100 blocks"):
        read_header(storm, LIMITS)
    assert read_header(screen(16, 16) + b"!\xfe\x00" * 45 + one_pixel_frame(0, 0, 1, 1) + b";", LIMITS).pixels == 256


def test_a_gif_of_stray_bytes_before_its_frame_is_refused_before_pillow_reads_them(monkeypatch) -> None:
    """Pillow steps over bytes that start no block one read at a time: 47.5 MiB of zeros before the
    first frame held one decode_image 7.7 s (three opens), and no decode timeout stops a Pillow call. The walk counts them
    with the blocks (MAX_BLOCKS made small here) and refuses the file before Pillow opens it."""
    from mmserve.multimodal import gif
    from mmserve.multimodal.image import read_header

    monkeypatch.setattr(gif, "MAX_BLOCKS", 100)
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("Pillow opened the GIF"))
    with pytest.raises(InvalidInputError, match="image: the GIF has more than 100 blocks and stray bytes between "
                                                r"them \(encoders write 255-byte sub-blocks and no stray bytes\): "
                                                "re-encode it"):
        read_header(screen(16, 16) + b"\x00" * 100 + one_pixel_frame(0, 0, 1, 1) + b";", LIMITS)
    monkeypatch.undo()
    monkeypatch.setattr(gif, "MAX_BLOCKS", 100)
    assert read_header(screen(16, 16) + b"\x00" * 99 + one_pixel_frame(0, 0, 1, 1) + b";", LIMITS).pixels == 256


@pytest.mark.parametrize("width,height", [(2**24, 1), (1, 2**24)])
def test_an_extreme_aspect_ratio_is_refused_from_the_header(width: int, height: int) -> None:
    """A 1x16Mi PNG (49 KB) is within the pixel limit, but Pillow's bicubic resize of it peaked at
    811 MiB: a side over 32768 is refused from the header, before any pixel is decoded."""
    from mmserve.multimodal.image import read_header

    data = png_claiming(width, height)
    assert width * height == LIMITS.max_image_pixels
    with pytest.raises(LimitExceededError, match=f"image is {width}x{height}, a side longer than the limit of "
                                                 "32768 pixels for any aspect ratio"):
        read_header(data, LIMITS)
    assert read_header(png_claiming(32768, 512), LIMITS).pixels == 32768 * 512
