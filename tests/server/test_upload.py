"""UploadMedia on a real server: chunked upload, generation by media id (the same answer as inline),
one stored copy per content, and every bad input ending with a clear status and no file left behind.

The server runs with small media limits so each one is cheap to hit."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from loopback_server import LoopbackServer, engine_config
from PIL import Image

from mmserve.api import pb, pb_grpc
from mmserve.clients import Client, ClientError, MediaRef
from mmserve.config import ServerConfig
from mmserve.server.media_store import INCOMING, LOCK

MAX_UPLOAD = 300_000
STORE_BYTES = 600_000
INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture(scope="module")
def server(served_model):
    config = ServerConfig(host="127.0.0.1", port=0, worker_threads=2, max_message_bytes=2**20,
                          max_upload_bytes=MAX_UPLOAD, media_dir_max_bytes=STORE_BYTES)
    server = LoopbackServer(engine_config(served_model), config).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=60) as client:
        yield client


def store(server):
    return server.app.media.store


def metadata(**fields) -> pb.UploadMediaRequest:
    return pb.UploadMediaRequest(metadata=pb.UploadMetadata(**fields))


def chunked(data: bytes, size: int = 1000, **declared) -> list[pb.UploadMediaRequest]:
    return [metadata(**declared), *(pb.UploadMediaRequest(chunk=data[i:i + size]) for i in range(0, len(data), size))]


def status(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def incoming(server) -> list[str]:
    return os.listdir(store(server).root / INCOMING)


def stored(server) -> set[str]:
    return set(os.listdir(store(server).root)) - {INCOMING, LOCK}


def test_model_info_advertises_the_inline_and_upload_limits(client):
    info = client.model_info()
    assert info.max_inline_media_bytes == 2**20 - 64 * 2**10  # the message limit leaves room for text
    assert info.max_upload_bytes == MAX_UPLOAD and info.max_upload_chunk_bytes == 2**20


def test_a_chunked_upload_answers_like_the_same_video_inline(server, stub, client, make_video):
    clip = make_video(seed=21, num_frames=8)
    ref = stub.UploadMedia(iter(chunked(clip, 700, mime_type="video/mp4", size_bytes=len(clip),
                                        sha256=hashlib.sha256(clip).hexdigest())))
    assert ref.id == hashlib.sha256(clip).hexdigest() and ref.size_bytes == len(clip)
    assert ref.mime_type == "video/mp4" and ref.ttl_s == store(server).ttl_s
    assert (store(server).root / ref.id).read_bytes() == clip
    asked = dict(prompt="Describe the video.", num_frames=4, max_tokens=8, temperature=0)
    by_id = client.generate(video=MediaRef(ref.id), **asked)
    inline = client.generate(video=clip, **asked)
    assert by_id.token_ids == inline.token_ids
    # The same frames, so the same content hashes: the inline request reuses the upload's KV.
    assert inline.usage == dataclasses.replace(by_id.usage, cached_tokens=inline.usage.cached_tokens)
    assert by_id.usage.num_frames == 4 and inline.usage.cached_tokens > 0


def test_an_uploaded_image_answers_like_the_same_image_inline(stub, client):
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(np.random.randint(2**31)).integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(png, format="PNG")
    data = png.getvalue()
    ref = stub.UploadMedia(iter(chunked(data, 500, mime_type="image/png")))
    asked = dict(prompt="What is this?", max_tokens=6, temperature=0)
    assert client.generate(image=MediaRef(ref.id), **asked).token_ids == client.generate(image=data, **asked).token_ids


def test_the_same_bytes_uploaded_twice_get_the_same_id_and_one_copy(server, stub):
    data = secrets.token_bytes(50_000)
    first = stub.UploadMedia(iter(chunked(data, 4096)))
    used = store(server).used_bytes
    second = stub.UploadMedia(iter(chunked(data, 3000)))  # no hash declared: received, hashed, dropped
    assert first.id == second.id == hashlib.sha256(data).hexdigest()
    assert store(server).used_bytes == used and first.id in stored(server)
    assert wait_until(lambda: not incoming(server))


def test_concurrent_uploads_of_the_same_bytes_store_one_copy(server, stub):
    data = secrets.token_bytes(90_000)
    together = threading.Barrier(4)

    def upload(_):
        def requests():
            yield metadata(size_bytes=len(data))
            yield pb.UploadMediaRequest(chunk=data[:1000])
            together.wait(20)  # all four are mid-upload before any of them finishes
            yield pb.UploadMediaRequest(chunk=data[1000:])
        return stub.UploadMedia(requests(), timeout=30).id

    used = store(server).used_bytes
    with ThreadPoolExecutor(4) as pool:
        ids = set(pool.map(upload, range(4)))
    assert ids == {hashlib.sha256(data).hexdigest()}
    assert (store(server).root / ids.pop()).read_bytes() == data
    assert store(server).used_bytes <= used + len(data) and wait_until(lambda: not incoming(server))


def test_declared_content_already_stored_is_answered_without_its_bytes(server, stub):
    data = secrets.token_bytes(20_000)
    digest = hashlib.sha256(data).hexdigest()
    stub.UploadMedia(iter(chunked(data)))
    release = threading.Event()

    def metadata_then_wait():
        yield metadata(sha256=digest, size_bytes=len(data))
        release.wait(30)  # the chunks never come: the server must not need them

    try:
        ref = stub.UploadMedia(metadata_then_wait(), timeout=20)
    finally:
        release.set()
    assert ref.id == digest and ref.size_bytes == len(data)


def _bad_uploads(clip: bytes) -> dict[str, tuple[list, grpc.StatusCode, list[str]]]:
    return {
        "no messages": ([], INVALID, ["metadata: the first UploadMediaRequest must carry metadata"]),
        "chunk first": ([pb.UploadMediaRequest(chunk=clip)], INVALID, ["must carry metadata"]),
        "metadata twice": ([metadata(), metadata()], INVALID, ["only the first UploadMediaRequest"]),
        "mime type": (chunked(clip, mime_type="text/html"), INVALID, ["metadata.mime_type", "'text/html'"]),
        "malformed sha256": (chunked(clip, sha256="abc"), INVALID, ["metadata.sha256", "64 hex digits"]),
        "size mismatch": (chunked(clip, size_bytes=len(clip) + 1), INVALID,
                          ["metadata.size_bytes", f"{len(clip) + 1} bytes declared, {len(clip)} received"]),
        "hash mismatch": (chunked(clip, sha256="ab" * 32), INVALID,
                          ["metadata.sha256", f"hash to {hashlib.sha256(clip).hexdigest()}"]),
        "empty": ([metadata()], INVALID, ["chunk: the upload holds no bytes"]),
        "declared too large": (chunked(clip, size_bytes=MAX_UPLOAD + 1), INVALID,
                               [f"declares {MAX_UPLOAD + 1} bytes", "--max-upload-bytes"]),
        "chunk too large": ([metadata(), pb.UploadMediaRequest(chunk=bytes(2**20 + 1))], INVALID,
                            [f"{2**20 + 1} bytes is more than the limit of {2**20}", f"chunks of {2**20}"]),
    }


@pytest.mark.parametrize("case", list(_bad_uploads(b"")))
def test_bad_uploads_get_a_clear_status_and_leave_nothing(server, stub, make_video, case):
    before = stored(server)
    requests, code, needles = _bad_uploads(make_video(seed=22, num_frames=3))[case]
    got, details = status(lambda: stub.UploadMedia(iter(requests), timeout=30))
    assert got == code, details
    for needle in needles:
        assert needle in details
    assert stored(server) == before and wait_until(lambda: not incoming(server))


def test_the_upload_limit_refuses_as_soon_as_it_is_crossed(server, stub):
    sent = itertools.count()

    def endless():
        yield metadata()
        for _ in range(1000):  # 100 MB, 333 times the limit
            next(sent)
            yield pb.UploadMediaRequest(chunk=bytes(100_000))

    got, details = status(lambda: stub.UploadMedia(endless(), timeout=30))
    assert got == INVALID and f"more than {MAX_UPLOAD} bytes" in details and "--max-upload-bytes" in details
    assert next(sent) < 250, "the server waited for far more than the limit before refusing"
    assert wait_until(lambda: not incoming(server))


def test_a_spool_that_cannot_take_the_upload_ends_internal_not_unknown(server, stub):
    """A real OSError from the spool (its incoming directory gone, as a full or broken disk would
    fail) leaves as INTERNAL naming the error, and the next upload is stored once it is back."""
    spool = store(server).root / INCOMING
    spool.rmdir()
    try:
        got, details = status(lambda: stub.UploadMedia(iter(chunked(b"x" * 10)), timeout=30))
    finally:
        spool.mkdir()
    assert got == grpc.StatusCode.INTERNAL and "FileNotFoundError" in details, (got, details)
    assert stub.UploadMedia(iter(chunked(secrets.token_bytes(10))), timeout=30).size_bytes == 10


@pytest.mark.parametrize("declared_size", [100_000, 0], ids=["size declared", "size not declared"])
@pytest.mark.parametrize("ending", ["cancel", "deadline"])
def test_an_upload_cut_off_midway_leaves_no_file(server, stub, ending, declared_size):
    before = stored(server)
    sent, release = threading.Event(), threading.Event()

    def stalls():
        yield metadata(size_bytes=declared_size)
        for _ in range(5):
            yield pb.UploadMediaRequest(chunk=secrets.token_bytes(5000))
        sent.set()
        release.wait(30)

    try:
        future = stub.UploadMedia.future(stalls(), timeout=None if ending == "cancel" else 1.5)
        assert sent.wait(10) and wait_until(lambda: incoming(server)), "the upload never started"
        if ending == "cancel":
            future.cancel()
        with pytest.raises(grpc.FutureCancelledError if ending == "cancel" else grpc.RpcError):
            future.result(timeout=30)
    finally:
        release.set()
    assert wait_until(lambda: not incoming(server)), incoming(server)
    assert stored(server) == before, (stored(server) - before, before - stored(server))


def test_an_upload_still_arriving_at_its_max_duration_is_dropped(server, stub, monkeypatch):
    """A trickle, a byte before each --upload-idle-timeout-s, used to hold its spool space for as long
    as it went on; the whole upload now has --upload-max-duration-s (on the store's clock, pushed past
    it here while the stream is still sending)."""
    media = store(server)
    skew = [0.0]
    monkeypatch.setattr(media, "clock", lambda: time.monotonic() + skew[0])
    pushed = threading.Event()

    def trickle():
        yield metadata()
        yield pb.UploadMediaRequest(chunk=secrets.token_bytes(5000))
        pushed.wait(30)
        yield pb.UploadMediaRequest(chunk=b"x")   # still sending: never idle

    try:
        future = stub.UploadMedia.future(trickle(), timeout=30)
        assert wait_until(lambda: incoming(server)), "the upload never started"
        skew[0] = server.server_config.upload_max_duration_s + 1
        pushed.set()
        got, details = status(future.result)
    finally:
        pushed.set()
    assert got == EXHAUSTED and "--upload-max-duration-s" in details and "retry after" in details, (got, details)
    assert wait_until(lambda: not incoming(server))


def test_a_store_full_of_media_in_use_asks_to_retry(server, stub):
    """Media leased by running requests are never evicted; the uploader is told to come back."""
    media = store(server)
    held = [stub.UploadMedia(iter(chunked(secrets.token_bytes(250_000), 50_000))).id for _ in range(2)]
    for media_id in held:
        media.acquire(media_id)
    try:
        with pytest.raises(ClientError) as e:
            Client(server.address).upload(io.BytesIO(secrets.token_bytes(200_000)), progress=False)
        assert e.value.code == EXHAUSTED and e.value.retry_delay_s and "--media-dir-max-bytes" in e.value.message
    finally:
        for media_id in held:
            media.release(media_id)
    stub.UploadMedia(iter(chunked(secrets.token_bytes(200_000), 50_000)))  # now evicts the oldest
    assert held[0] not in stored(server)


def test_unknown_and_expired_ids_are_not_found(server, stub, client):
    unknown = hashlib.sha256(b"never uploaded").hexdigest()
    with pytest.raises(ClientError) as e:
        client.generate(prompt="Describe the video.", video=MediaRef(unknown), max_tokens=2)
    assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.resource_name == unknown
    assert e.value.message.startswith("messages[0].parts[0].video.media_id: no media with id")
    ref = stub.UploadMedia(iter(chunked(secrets.token_bytes(5000))))
    media = store(server)
    ttl, media.ttl_s = media.ttl_s, 0.05
    try:
        time.sleep(0.1)
        with pytest.raises(ClientError) as e:
            client.generate(prompt="What is this?", image=MediaRef(ref.id), max_tokens=2)
    finally:
        media.ttl_s = ttl
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "image.media_id" in e.value.message
    assert ref.id not in stored(server)


def test_a_malformed_media_id_is_invalid(client):
    with pytest.raises(ClientError) as e:
        client.generate(prompt="Describe the video.", video=MediaRef("../../etc/passwd"), max_tokens=2)
    assert e.value.code == INVALID and e.value.field == "messages[0].parts[0].video.media_id"


def test_an_upload_that_is_no_video_fails_when_used_like_an_inline_one(stub, client):
    junk = secrets.token_bytes(6000)
    ref = stub.UploadMedia(iter(chunked(junk)))  # accepted: bytes are bytes until decoded
    errors = []
    for video in (MediaRef(ref.id), junk):
        with pytest.raises(ClientError) as e:
            client.generate(prompt="Describe the video.", video=video, max_tokens=2)
        errors.append((e.value.code, e.value.field, e.value.message))
    assert errors[0] == errors[1]
    assert errors[0][0] == INVALID and "unsupported or unrecognised container" in errors[0][2]
