"""The audio flood (#39) against one real `mmserve serve` process serving a tiny random E-model (an
audio tower), as the hostile-input tests do for images and frames (rel_bystander.run_beside): each
hostile request is refused from what its headers declare, before a sample is decoded, while a
bystander (a fresh image, a fresh 1 s clip and text) keeps its tokens, and every refusal comes
before its last token; the serving process's peak RSS grows by about the hostile bytes received,
never by what the headers claim. A header that declares less than the file holds is heard as declared."""

from __future__ import annotations

import asyncio
import io
import struct

import grpc
import numpy as np
import pytest
from audio_clips import encode, tones, wav, wav_declaring
from PIL import Image
from rel_bystander import BYSTANDER_TOKENS, outcome, run_beside
from rel_process import ServeProcess

from mmserve.clients import AsyncClient
from mmserve.clients.messages import audio_part, message, text_part

CONTEXT = 1024            # the tiny checkpoint's max_position_embeddings
HOURS_6 = 6 * 3600.0
REFUSED_RSS_BUDGET = 16 * 2**20   # a refused request holds its message and nothing decoded from it
WORDS = "a red blue green purple tone rises falls high low beep square circle moves up down and the".split()


def fresh() -> int:
    """A seed for a checkpoint, clip or picture the server has not seen (two draws collide ~1 in 2**31),
    from the seeded generator so the salt reproduces it."""
    return int(np.random.randint(2**31))


@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma4_fixtures):
    model = tmp_path_factory.mktemp("e_audio_flood")
    gemma4_fixtures.make_checkpoint(model, config=gemma4_fixtures.e_model_config(), seed=fresh())
    proc = ServeProcess("--port", "0", "--model", str(model), "--device", "cpu", "--dtype", "float32",
                        "--worker-threads", "2", "--kv-cache-bytes", str(16 * 2**20), "--max-num-seqs", "8")
    try:
        proc.wait_ready(300)
        yield proc
    finally:
        proc.stop()


def bystander() -> dict:
    """A normal request: a picture, a 1 s clip and a few dozen words, all new to the server."""
    seed = fresh()
    rng = np.random.default_rng(seed)
    picture = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(picture, format="PNG")
    return dict(prompt=" ".join(rng.choice(WORDS, 40)) + ". What do you see and hear?", image=picture.getvalue(),
                audio=wav(tones(seed, 1.0)), max_tokens=BYSTANDER_TOKENS, ignore_eos=True, temperature=0)


def _once(server, messages) -> None:
    async def send():
        async with AsyncClient(f"127.0.0.1:{server.port}", timeout=120) as client:
            assert await outcome(client, messages) is not None

    asyncio.run(send())


def flac_declaring(seconds: float) -> bytes:
    """A real 1 s FLAC whose STREAMINFO claims `seconds` (its 36-bit total-samples field): the
    duration FFmpeg reads from the header, not our WAV parser."""
    data = bytearray(encode(tones(fresh(), 1.0), fmt="flac", codec="flac"))
    word = int.from_bytes(data[18:26], "big")
    data[18:26] = ((word & ~((1 << 36) - 1)) | int(seconds * 16_000)).to_bytes(8, "big")
    return bytes(data)


def test_many_long_audio_parts_are_refused_from_their_headers(server):
    """16 real 30 s MP3 clips in a request, 4 such requests at once (8 minutes of sound each): their
    headers alone put each prompt past the context, so nothing is decoded. Each request holds its
    message (received and parsed: a few copies of 1.4 MB), never its 31 MB of decoded samples."""
    clips = [encode(tones(fresh(), 30.0), fmt="mp3", codec="libmp3lame") for _ in range(16)]
    hostile = [message("user", *[audio_part(c) for c in clips], text_part("Transcribe all of them."))]
    _once(server, hostile)   # the MP3 demuxer's first use allocates once per process, not per request
    beside = run_beside(server, bystander, hostile, copies=4)
    for e in beside.errors:
        assert e is not None and e.code == grpc.StatusCode.INVALID_ARGUMENT, e
        assert "at least" in e.message and f"context length is {CONTEXT}" in e.message, e.message
    assert beside.ended_before_last_token == 4, "a refusal came after the bystander's last token"
    sent = 4 * sum(len(c) for c in clips)
    assert beside.growth <= 3 * sent + REFUSED_RSS_BUDGET, f"{beside.growth / 2**20:.0f} MiB for {sent / 2**20:.1f} MiB sent"


@pytest.mark.parametrize("kind", ["wav", "flac"])
def test_six_hours_declared_are_refused_before_decoding(server, kind):
    """A lying header: 6 hours declared (a WAV's data size, a FLAC's STREAMINFO) over a moment of real
    sound, 4 parts a request, 8 requests at once: refused by --max-audio-duration-s from the header,
    nothing allocated for the hours."""
    declaring = (lambda: wav_declaring(HOURS_6, 4000)) if kind == "wav" else (lambda: flac_declaring(HOURS_6))
    hostile = [message("user", *[audio_part(declaring()) for _ in range(4)], text_part("What is this?"))]
    beside = run_beside(server, bystander, hostile, copies=8)
    for e in beside.errors:
        assert e is not None and e.code == grpc.StatusCode.INVALID_ARGUMENT, e
        assert "--max-audio-duration-s" in e.message and "21600.0 s" in e.message, e.message
        assert "messages[0].parts[0].audio" in e.message and len(e.message) < 400, e.message
    assert beside.ended_before_last_token == 8, "a refusal came after the bystander's last token"
    assert beside.growth <= REFUSED_RSS_BUDGET, f"{beside.growth / 2**20:.0f} MiB"


def test_a_header_declaring_less_than_it_holds_is_heard_as_declared(server):
    """A WAV whose data chunk says 2 s but that carries 60 s: the same answer and prompt as the
    truthful 2 s clip (nothing past the declared data is decoded)."""
    samples = tones(fresh(), 60.0)
    declared = 2 * 16_000 * 2
    truthful = wav(samples[:2 * 16_000])
    lying = (b"RIFF" + struct.pack("<I", 36 + declared) + b"WAVE" + b"fmt "
             + struct.pack("<IHHIIHH", 16, 1, 1, 16_000, 32_000, 2, 16) + b"data" + struct.pack("<I", declared)
             + samples.tobytes())

    async def both():
        async with AsyncClient(f"127.0.0.1:{server.port}", timeout=120) as client:
            return [await client.generate([message("user", audio_part(clip), text_part("What is it?"))], max_tokens=4,
                                          temperature=0) for clip in (truthful, lying)]

    heard, lied = asyncio.run(both())
    assert lied.token_ids == heard.token_ids and lied.usage.prompt_tokens == heard.usage.prompt_tokens
    assert heard.usage.multimodal_tokens == 50
