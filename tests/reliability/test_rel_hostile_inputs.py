"""Hostile inputs (issue #27, findings 3, 4, 5, 10) against one real `mmserve serve` process.

Each test sends the probe's request scaled down, beside a bystander (rel_bystander.run_beside: a
normal stream right after it that must keep its tokens and, where the hostile request is refused,
get its first token only after that refusal: a refusal from headers is cheaper than a prefill; the
fairness test waits until the server's RSS shows the hostile decode running, as in the probe, and
the bystander's first token must come while that decode still runs). Memory is the serving process's peak RSS growth per hostile request,
against the per-request budgets docs/security.md states. On the code before the fix every test
here fails. The audio flood is test_rel_audio_flood.py (a model with an audio tower).
"""

from __future__ import annotations

import asyncio
import functools
import io
import struct
import zlib

import grpc
import numpy as np
import pytest
from PIL import Image
from rel_bystander import BYSTANDER_TOKENS, outcome, run_beside
from rel_process import ServeProcess

from mmserve.clients import AsyncClient
from mmserve.clients.messages import frames_part, image_part, message, text_part

WORKERS = 2
MAX_IMAGES = 16
PIXEL_BUDGET = 256 * 2**20  # room for MAX_IMAGES images of 4096^2
IMAGE_PIXELS = 96 * 2**20   # one image of 12288 x 8192: the fairness test's decode outlasts a bystander's prefill
# A part's wait for a worker counts against this limit: at load 22 (busy loops beside other suites)
# one of the three frames requests waited 24.5 s of the default 30 s and was refused, retryably.
DECODE_TIMEOUT_S = 120
# Per-request RSS budgets (docs/security.md): text is refused before it is tokenized, so it costs
# about its own size (1 MiB here); given frames are decoded one at a time, so a request holds one
# full-size frame (3 bytes a pixel: 12 MiB at 2048^2) and its patches; refused images cost nothing.
TEXT_RSS_BUDGET = 16 * 2**20
FRAMES_RSS_BUDGET = 24 * 2**20
IMAGES_RSS_BUDGET = 16 * 2**20


@pytest.fixture(scope="module")
def server():
    proc = ServeProcess("--port", "0", "--device", "cpu", "--worker-threads", str(WORKERS),
                        "--max-images-per-request", str(MAX_IMAGES), "--max-pixels-per-request", str(PIXEL_BUDGET),
                        "--max-image-pixels", str(IMAGE_PIXELS), "--video-decode-timeout-s", str(DECODE_TIMEOUT_S),
                        "--kv-cache-bytes", str(16 * 2**20), "--max-num-seqs", "8")
    try:
        proc.wait_ready(300)
        yield proc
    finally:
        proc.stop()


def encoded(img: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt)
    return out.getvalue()


@functools.cache
def blank_png(side: int, rows_kept: float = 1.0, height: int | None = None) -> bytes:
    """A real side x side (or side x `height`) RGB PNG of zeros: tiny on the wire, every pixel once
    decoded. `rows_kept` < 1: its pixel data stops short (chunks intact), so it fails late in decoding."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    height = height or side
    row, packer = b"\0" + bytes(3 * side), zlib.compressobj(9)
    rows, part = divmod(int(len(row) * height * rows_kept), len(row))   # cut mid-row, as a truncated file is
    pixels = b"".join(packer.compress(row) for _ in range(rows)) + packer.compress(row[:part]) + packer.flush()
    ihdr = struct.pack(">IIBBBBB", side, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def small_image(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    return encoded(Image.fromarray(pixels))


FRESH = iter(range(1, 10**6))  # bystander prompts never seen before: TTFT includes a real prefill
WORDS = "a red blue green purple white yellow circle square triangle moves up down left right and the".split()


def bystander() -> dict:
    """A normal request: an image and a few hundred tokens of text, both new to the server."""
    seed = next(FRESH)
    words = np.random.default_rng(seed).choice(WORDS, 300)
    return dict(prompt=" ".join(words) + ". Describe the picture.", image=small_image(seed),
                max_tokens=BYSTANDER_TOKENS, ignore_eos=True, temperature=0)


def test_an_oversize_word_is_refused_before_tokenizing(server):
    """Finding 3, scaled from 4 MB to 1 MB: one word far beyond the 1024-token context."""
    word = "triangle" * (2**20 // 8)
    beside = run_beside(server, bystander, [message("user", text_part(word))])
    for e in beside.errors:
        assert e is not None and e.code == grpc.StatusCode.INVALID_ARGUMENT, e
        assert "at least" in e.message and "context length is 1024" in e.message, e.message
    assert beside.ended_before_last_token == 1, "the refusal came after the bystander's last token"
    assert beside.growth <= TEXT_RSS_BUDGET, f"{beside.growth / 2**20:.0f} MiB"


def test_given_frames_are_decoded_one_at_a_time(server):
    """Finding 4: frames of 2048^2 pixels in a few KB each; the request is served, and each of three
    concurrent requests holds about one decoded frame, not all eight."""
    frame = blank_png(2048)
    frames = [message("user", frames_part([frame] * 8, fps=1.0), text_part("Describe the video."))]
    beside = run_beside(server, bystander, frames, copies=3)
    assert beside.errors == [None, None, None]
    assert beside.growth / 3 <= FRAMES_RSS_BUDGET, f"{beside.growth / 3 / 2**20:.0f} MiB per request"


def test_frames_over_the_pixel_budget_are_refused_from_their_headers(server):
    """Finding 4: 17 frames of 4096^2 = 272 Mi pixels, over the 256 Mi budget: refused before any decode."""
    frames = [message("user", frames_part([blank_png(4096)] * 17, fps=1.0), text_part("Describe the video."))]
    beside = run_beside(server, bystander, frames)
    for e in beside.errors:
        assert e is not None and e.code == grpc.StatusCode.INVALID_ARGUMENT, e
        assert "--max-pixels-per-request" in e.message, e.message
    assert beside.ended_before_last_token == 1, "the refusal came after the bystander's last token"
    assert beside.growth <= IMAGES_RSS_BUDGET, f"{beside.growth / 2**20:.0f} MiB"


def test_too_many_images_are_refused_before_decoding(server):
    """Finding 5, scaled from 300 images of 4096^2 pixels to 40 of 2048^2: refused by count, nothing decoded."""
    images = [message("user", *[image_part(blank_png(2048)) for _ in range(40)], text_part("Compare them."))]
    beside = run_beside(server, bystander, images)
    error = beside.errors[0]
    assert error is not None and error.code == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "--max-images-per-request" in error.message
    assert beside.ended_before_last_token == 1, "the refusal came after the bystander's last token"
    assert beside.growth <= IMAGES_RSS_BUDGET, f"{beside.growth / 2**20:.0f} MiB"


def test_one_request_cannot_take_every_decode_worker(server):
    """Finding 5, fairness: a request of two large images (12288 x 8192 each, within the pixel budget), both
    cut short so that the first to fail refuses the request before it reaches the engine, holds one
    of the two workers; the bystander's image gets the other at once, so its first token comes while
    the hostile image is still decoding. Where one request may hold every worker (or the pool is
    first come, first served, or has one worker), the bystander's image waits for a hostile decode
    to end, and the first hostile decode to end fails and refuses the request: the refusal comes
    first. The bystander is sent once the server's RSS shows the decode running (8 MiB of 288).
    Both paths are wall-clock, and CPU priority makes them close on 2 busy cores: decodes run at
    nice +10 (fair_pool.py), so the other test process takes a core from both. At 8192 x 4096 a
    hostile decode took 212-219 ms from the bystander's send and the bystander's first token 219-229
    ms (29 ms alone), three times in a row in cold CI (salt 227848); an image three times larger
    (0.78 s to decode alone here, against 0.26 s) triples the hostile side and leaves the bystander's
    alone. A lost race is still run again, up to three times; the bug loses it every time (the
    bystander cannot start before a worker frees)."""
    cut = blank_png(12288, rows_kept=0.97, height=8192)
    images = [message("user", image_part(cut), image_part(cut), text_part("Compare them."))]
    for _ in range(3):
        beside = run_beside(server, bystander, images, decoding_from_rss=8 * 2**20)
        if beside.ended_before_first_token == 0:
            break
    assert beside.ended_before_first_token == 0, "the bystander's first token waited for the hostile decode"
    error = beside.errors[0]
    assert error is not None and error.code == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "image: cannot decode the PNG image: it is truncated" in error.message, error.message


@pytest.mark.parametrize("name,data", [
    ("eps", b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n"),
    ("tga", encoded(Image.new("RGB", (8, 8)), "TGA")),
    ("ppm", encoded(Image.new("RGB", (8, 8)), "PPM")),
])
def test_formats_outside_the_allow_list_are_refused(server, name, data):
    """Finding 10: only PNG, JPEG, WebP, GIF and BMP reach Pillow; the message names them, no internals."""
    async def send():
        async with AsyncClient(f"127.0.0.1:{server.port}", timeout=60) as client:
            return await outcome(client, [message("user", image_part(data, "image/png"), text_part("What is it?"))])

    error = asyncio.run(send())
    assert error is not None and error.code == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "PNG, JPEG, WebP, GIF, BMP" in error.message and "0x" not in error.message, error.message


def test_a_corrupt_image_message_carries_no_internals(server):
    data = encoded(Image.fromarray(np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)))[:120]

    async def send():
        async with AsyncClient(f"127.0.0.1:{server.port}", timeout=60) as client:
            return await outcome(client, [message("user", image_part(data), text_part("What is it?"))])

    error = asyncio.run(send())
    assert error is not None and error.code == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "cannot decode the PNG image" in error.message, error.message
    assert "0x" not in error.message and "BytesIO" not in error.message, error.message
