"""UploadMedia between API keys on a real server: each key holds at most its share of the spool
(--media-max-bytes-per-client, here its default: a quarter of --media-dir-max-bytes), room for a
key's upload is made from its own media only, and a key whose share is in use is told to retry.

Found by a read-only review: one key sending about --media-dir-max-bytes evicted every other key's
idle uploads (their Generates got NOT_FOUND), and could hold the whole spool."""

from __future__ import annotations

import hashlib
import io
import secrets

import grpc
import numpy as np
import pytest
from loopback_server import LoopbackServer, engine_config
from PIL import Image

from mmserve.clients import Client, ClientError, MediaRef
from mmserve.config import ServerConfig
from mmserve.server.media_store import INCOMING, LOCK

KEYS = {"a": secrets.token_urlsafe(16), "b": secrets.token_urlsafe(16)}
STORE_BYTES = 600_000
MAX_UPLOAD = 100_000
SHARE = STORE_BYTES // 4   # the default share with API keys
UPLOAD = 90_000            # one fits a key's share, two do not


@pytest.fixture(scope="module")
def server(served_model, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("\n".join(KEYS.values()) + "\n")
    config = ServerConfig(host="127.0.0.1", port=0, worker_threads=2, api_keys_file=str(keys),
                          max_upload_bytes=MAX_UPLOAD, media_dir_max_bytes=STORE_BYTES)
    server = LoopbackServer(engine_config(served_model), config).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def clients(server):
    with Client(server.address, api_key=KEYS["a"], timeout=60) as a, \
            Client(server.address, api_key=KEYS["b"], timeout=60) as b:
        yield a, b


def store(server):
    return server.app.media.store


def stored(server) -> set[str]:
    return {path.name for path in store(server).root.iterdir()} - {INCOMING, LOCK}


def held(server, key: str) -> int:
    """Bytes the store charges to `key` (the server knows a key by its authorization header's digest)."""
    return store(server).owned_bytes(hashlib.sha256(f"Bearer {KEYS[key]}".encode()).digest())


def upload(client: Client, data: bytes) -> str:
    return client.upload(io.BytesIO(data), progress=False).id


def png() -> bytes:
    out = io.BytesIO()
    pixels = np.random.default_rng(np.random.randint(2**31)).integers(0, 256, (24, 24, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


ASK = dict(prompt="What is this?", max_tokens=4, temperature=0)


def test_one_key_sending_more_than_the_spool_evicts_only_its_own_uploads(server, clients):
    a, b = clients
    image = png()
    victim = upload(b, image)
    flood = [upload(a, secrets.token_bytes(UPLOAD)) for _ in range(STORE_BYTES // UPLOAD + 2)]
    # Key b's idle image is still there, and answers as the same image inline.
    assert b.generate(image=MediaRef(victim), **ASK).token_ids == b.generate(image=image, **ASK).token_ids
    assert held(server, "a") <= SHARE and flood[-1] in stored(server)
    assert not set(flood[:-1]) & stored(server)   # each upload of a's made room from a's own


def test_a_key_whose_share_is_in_use_is_told_to_retry_and_others_are_not(server, clients):
    a, b = clients
    in_use = upload(a, secrets.token_bytes(UPLOAD))
    store(server).acquire(in_use)   # as a running request leases it
    try:
        with pytest.raises(ClientError) as e:
            upload(a, secrets.token_bytes(UPLOAD))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.retry_delay_s
        assert "--media-max-bytes-per-client" in e.value.message and f"of its {SHARE} bytes" in e.value.message
        upload(b, secrets.token_bytes(UPLOAD))   # b's share is its own
    finally:
        store(server).release(in_use)
    upload(a, secrets.token_bytes(UPLOAD))   # once it is free, a's upload makes room from it
    assert in_use not in stored(server) and held(server, "a") <= SHARE


def test_content_two_keys_uploaded_stays_while_either_holds_it(server, clients):
    """The same bytes are stored once: key a making room for its own uploads gives up its claim on
    them, and key b, which sent their hash only, still has them."""
    a, b = clients
    image = png()
    shared = upload(a, image)
    assert upload(b, image) == shared   # declared by hash, answered without the bytes
    for _ in range(STORE_BYTES // UPLOAD + 2):
        upload(a, secrets.token_bytes(UPLOAD))
    assert held(server, "a") <= SHARE and held(server, "b") >= len(image)
    assert b.generate(image=MediaRef(shared), **ASK).token_ids == b.generate(image=image, **ASK).token_ids
