"""Client.upload / AsyncClient.upload, MediaRefs in generate, the automatic re-upload when a server has
lost the media, and the `mmserve upload` / `mmserve generate --video` commands, on a real server
whose inline limit is tiny (so a small clip already needs an upload)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import secrets
import subprocess
import sys
import time

import grpc
import pytest
from loopback_server import LoopbackServer, engine_config

from mmserve.clients import AsyncClient, Client, ClientError, MediaRef, user_message
from mmserve.config import ServerConfig

INLINE_LIMIT = 1000
ASK = dict(prompt="Describe the video.", num_frames=4, max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def server(served_model):
    server = LoopbackServer(engine_config(served_model, max_video_bytes=INLINE_LIMIT),
                            ServerConfig(host="127.0.0.1", port=0, worker_threads=2)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def clip(tmp_path_factory, make_video):
    path = tmp_path_factory.mktemp("upload") / "clip.mp4"
    path.write_bytes(make_video(seed=31, num_frames=8))
    assert path.stat().st_size > INLINE_LIMIT
    return path


@pytest.fixture(scope="module")
def inline_answer(mmserve_server, clip):
    """The same request with the clip inline, on a server that takes it inline."""
    with Client(mmserve_server.address, timeout=120) as client:
        return client.generate(video=clip.read_bytes(), **ASK)


def expire(server, media_id: str) -> None:
    """Let `media_id` expire on the server (its TTL, shortened for a moment)."""
    store = server.app.media.store
    ttl, store.ttl_s = store.ttl_s, 0.01
    try:
        time.sleep(0.05)
        store.sweep()
    finally:
        store.ttl_s = ttl
    assert not (store.root / media_id).exists()


def test_upload_a_path_then_generate_with_its_ref(server, clip, inline_answer):
    with Client(server.address, timeout=60) as client:
        ref = client.upload(clip, mime_type="video/mp4")
        assert ref.id == str(ref) == hashlib.sha256(clip.read_bytes()).hexdigest()
        assert (ref.size_bytes, ref.mime_type, ref.source) == (clip.stat().st_size, "video/mp4", clip)
        assert ref.ttl_s == server.server_config.media_ttl_s
        assert client.generate(video=ref, **ASK).token_ids == inline_answer.token_ids
        with pytest.raises(ClientError) as e:  # the inline route is refused above the limit
            client.generate([user_message(ASK["prompt"], video=clip.read_bytes(), num_frames=4)], max_tokens=6)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "--max-video-bytes" in e.value.message


@pytest.mark.parametrize("given", ["path", "str", "bytes"])
def test_generate_uploads_what_does_not_fit_inline(server, clip, inline_answer, given):
    """Client.generate(video=...) with a path or bytes above ModelInfo.max_inline_media_bytes
    uploads first (as `mmserve generate` does) and answers as the inline request does."""
    video = {"path": clip, "str": str(clip), "bytes": clip.read_bytes()}[given]
    media_id = hashlib.sha256(clip.read_bytes()).hexdigest()
    expire(server, media_id)  # so only this call's upload can bring it back
    with Client(server.address, timeout=60) as client:
        assert clip.stat().st_size > client.model_info().max_inline_media_bytes
        assert client.generate(video=video, **ASK).token_ids == inline_answer.token_ids
    assert (server.app.media.store.root / media_id).is_file()  # it went by UploadMedia


def test_async_generate_uploads_what_does_not_fit_inline(server, clip, inline_answer):
    async def ask():
        async with AsyncClient(server.address, timeout=60) as client:
            return await client.generate(video=clip, **ASK)

    assert asyncio.run(ask()).token_ids == inline_answer.token_ids


def test_upload_an_open_file_from_its_position(server, clip):
    data = clip.read_bytes()
    with Client(server.address, timeout=60) as client:
        source = io.BytesIO(b"header to skip" + data)
        source.seek(len(b"header to skip"))
        ref = client.upload(source, progress=False)
    assert ref.id == hashlib.sha256(data).hexdigest() and ref.source is None


def test_a_lost_upload_is_uploaded_again_once(server, clip, inline_answer):
    with Client(server.address, timeout=60) as client:
        ref = client.upload(clip)
        expire(server, ref.id)
        assert client.generate(video=ref, **ASK).token_ids == inline_answer.token_ids
        assert (server.app.media.store.root / ref.id).is_file()  # it is back
        unseekable = client.upload(io.BytesIO(clip.read_bytes()))
        expire(server, unseekable.id)
        with pytest.raises(ClientError) as e:  # no file to upload from: the caller must
            client.generate(video=unseekable, **ASK)
        assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.resource_name == unseekable.id


def test_async_client_uploads_and_re_uploads_the_same_way(server, clip, inline_answer):
    async def scenario():
        async with AsyncClient(server.address, timeout=60) as client:
            ref = await client.upload(clip)
            first = await client.generate(video=ref, **ASK)
            expire(server, ref.id)
            again = [d async for d in client.stream(video=ref, **ASK)]
            return ref, first, again

    ref, first, again = asyncio.run(scenario())
    assert ref.id == hashlib.sha256(clip.read_bytes()).hexdigest()
    assert first.token_ids == inline_answer.token_ids
    assert tuple(t for d in again for t in d.token_ids) == inline_answer.token_ids


def test_the_progress_bar_counts_the_bytes_on_a_terminal(server, tmp_path, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    fresh = tmp_path / "fresh.bin"
    fresh.write_bytes(secrets.token_bytes(300_000))
    with Client(server.address, timeout=60) as client:
        client.upload(fresh, chunk_bytes=1024)
        shown = terminal.getvalue()
        client.upload(fresh, progress=False)
    assert "upload fresh.bin" in shown and "100%" in shown and "293k/293k" in shown
    assert terminal.getvalue() == shown


def mmserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmserve.cli", "--log-level", "WARNING", *args],
                          capture_output=True, text=True, timeout=180)


def test_mmserve_upload_prints_the_id(server, clip, tmp_path):
    out = mmserve("upload", "--server", server.address, str(clip))
    assert out.returncode == 0, out.stderr
    assert out.stdout == hashlib.sha256(clip.read_bytes()).hexdigest() + "\n"
    as_json = json.loads(mmserve("upload", "--server", server.address, "--json", str(clip)).stdout)
    assert as_json["id"] == out.stdout.strip() and as_json["size_bytes"] == clip.stat().st_size
    missing = mmserve("upload", "--server", server.address, str(tmp_path / "nope.mp4"))
    assert missing.returncode == 2 and "nope.mp4" in missing.stderr
    bad = mmserve("upload", "--server", server.address, "--mime-type", "text/plain", str(clip))
    assert bad.returncode == 2 and "INVALID_ARGUMENT" in bad.stderr and "metadata.mime_type" in bad.stderr


def test_mmserve_generate_uploads_a_video_too_large_to_send_inline(server, clip, inline_answer):
    digest = hashlib.sha256(clip.read_bytes()).hexdigest()
    if (server.app.media.store.root / digest).is_file():
        expire(server, digest)  # so that only an upload by the command can bring it back
    out = mmserve("generate", "--server", server.address, "--video", str(clip), "--prompt", ASK["prompt"],
                  "--num-frames", "4", "--max-tokens", "6", "--temperature", "0", "--json")
    assert out.returncode == 0, out.stderr
    assert tuple(json.loads(out.stdout)["token_ids"]) == inline_answer.token_ids
    assert (server.app.media.store.root / digest).is_file()


def test_a_media_ref_without_a_source_on_another_server_is_not_found(mmserve_server):
    ref = MediaRef(hashlib.sha256(b"elsewhere").hexdigest())
    with Client(mmserve_server.address, timeout=60) as client, pytest.raises(ClientError) as e:
        client.generate(video=ref, **ASK)
    assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.resource_name == ref.id
