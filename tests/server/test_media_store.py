"""MediaStore on a real directory: content addressing, verification, limits as bytes arrive, TTL,
LRU eviction, leases, each owner's share, concurrent uploads of the same bytes, and nothing left
behind on failure."""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from mmserve.errors import InvalidInputError, LimitExceededError, NotFoundError
from mmserve.server.media_store import INCOMING, LOCK, MediaStore

ALICE, BOB, CAROL = b"alice", b"bob", b"carol"   # callers (in the server: digests of their API keys)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make_store(tmp_path, clock, **kw) -> MediaStore:
    options = dict(max_bytes=10_000, ttl_s=60.0, max_upload_bytes=5_000)
    options.update(kw)
    options.setdefault("max_bytes_per_owner", options["max_bytes"])
    return MediaStore(tmp_path / "media", clock=clock, **options)


def put(store: MediaStore, data: bytes, chunk: int = 700, owner: bytes = ALICE, **declared):
    upload = store.begin(owner, **declared)
    try:
        for i in range(0, len(data), chunk):
            upload.write(data[i:i + chunk])
        return upload.commit()
    finally:
        upload.abort()


def files(store: MediaStore) -> list[str]:
    """The spool's media and uploads in progress (the lock file aside)."""
    return sorted(set(os.listdir(store.root)) - {LOCK}) + sorted(os.listdir(store.root / INCOMING))


def test_id_is_the_sha256_and_the_file_holds_the_bytes(tmp_path, clock):
    store = make_store(tmp_path, clock)
    data = secrets.token_bytes(3000)
    entry, created = put(store, data, declared_size=3000, declared_sha256=hashlib.sha256(data).hexdigest())
    assert created and entry.id == hashlib.sha256(data).hexdigest()
    assert entry.path.read_bytes() == data and entry.size == 3000
    assert files(store) == [INCOMING, entry.id]


def test_the_same_bytes_twice_are_stored_once(tmp_path, clock):
    store = make_store(tmp_path, clock)
    data = secrets.token_bytes(2000)
    first, created = put(store, data)
    again, created_again = put(store, data, chunk=333)
    assert created and not created_again and again.id == first.id
    assert files(store) == [INCOMING, first.id] and store.used_bytes == 2000


def test_concurrent_uploads_of_the_same_bytes_are_safe(tmp_path, clock):
    store = make_store(tmp_path, clock, max_bytes=300_000, max_upload_bytes=50_000)  # room for all six
    data = secrets.token_bytes(40_000)
    barrier = threading.Barrier(6)

    def upload(_):
        barrier.wait()
        return put(store, data, chunk=1000)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(upload, range(6)))
    assert {entry.id for entry, _ in results} == {hashlib.sha256(data).hexdigest()}
    assert sum(created for _, created in results) == 1
    assert files(store) == [INCOMING, results[0][0].id] and store.used_bytes == 40_000
    assert (store.root / results[0][0].id).read_bytes() == data


@pytest.mark.parametrize("declared,field", [
    ({"declared_size": 2999}, "metadata.size_bytes"),   # more bytes arrive than declared
    ({"declared_size": 3001}, "metadata.size_bytes"),   # fewer
    ({"declared_sha256": "0" * 64}, "metadata.sha256"),
])
def test_a_mismatch_with_what_was_declared_is_refused_and_leaves_nothing(tmp_path, clock, declared, field):
    store = make_store(tmp_path, clock)
    with pytest.raises(InvalidInputError) as e:
        put(store, secrets.token_bytes(3000), **declared)
    assert e.value.field == field
    assert files(store) == [INCOMING] and store.used_bytes == 0


def test_the_upload_limit_fails_at_the_chunk_that_crosses_it(tmp_path, clock):
    store = make_store(tmp_path, clock)
    upload = store.begin(ALICE)
    for _ in range(5):
        upload.write(bytes(1000))
    with pytest.raises(LimitExceededError) as e:
        upload.write(b"x")
    assert e.value.flag == "--max-upload-bytes" and not e.value.retryable
    upload.abort()
    assert files(store) == [INCOMING] and store.used_bytes == 0
    with pytest.raises(LimitExceededError, match="declares 5001 bytes"):
        store.begin(ALICE, declared_size=5001)


def test_an_empty_upload_is_refused(tmp_path, clock):
    store = make_store(tmp_path, clock)
    with pytest.raises(InvalidInputError, match="no bytes"):
        put(store, b"")
    assert files(store) == [INCOMING]


def test_unused_media_expire_and_leased_ones_do_not(tmp_path, clock):
    store = make_store(tmp_path, clock)
    kept, _ = put(store, b"kept" * 100)
    gone, _ = put(store, b"gone" * 100)
    store.acquire(kept.id)
    clock.now += 61
    assert store.sweep() == 1 and files(store) == [INCOMING, kept.id]
    with pytest.raises(NotFoundError) as e:
        store.acquire(gone.id)
    assert e.value.resource_name == gone.id and "--media-ttl-s" in str(e.value)
    store.release(kept.id)  # its TTL starts again at the release
    clock.now += 59
    assert store.hold(kept.id, ALICE) is not None  # holding it (an upload of the same bytes) restarts it too
    clock.now += 59
    assert store.sweep() == 0
    clock.now += 2
    assert store.sweep() == 1 and len(store) == 0


def test_a_full_store_evicts_the_least_recently_used_unleased_media(tmp_path, clock):
    store = make_store(tmp_path, clock, max_bytes=10_000)
    a, _ = put(store, secrets.token_bytes(4000))
    clock.now += 1
    b, _ = put(store, secrets.token_bytes(4000))
    clock.now += 1
    store.hold(a.id, ALICE)  # a is now more recent than b
    c, _ = put(store, secrets.token_bytes(4000))
    assert files(store) == sorted([INCOMING, a.id, c.id]) and store.used_bytes == 8000
    store.acquire(a.id)
    store.acquire(c.id)
    with pytest.raises(LimitExceededError) as e:  # only media in use left: come back later
        put(store, secrets.token_bytes(4000))
    assert e.value.retryable and e.value.flag == "--media-dir-max-bytes"
    assert files(store) == sorted([INCOMING, a.id, c.id])


def test_a_declared_size_takes_no_space_before_its_bytes_arrive(tmp_path, clock):
    """Declaring sizes used to reserve them at once and evict other clients' media for bytes never sent."""
    store = make_store(tmp_path, clock, max_bytes=8000)
    victim, _ = put(store, secrets.token_bytes(3000))
    declared = [store.begin(BOB, declared_size=5000), store.begin(BOB, declared_size=5000)]
    assert store.used_bytes == 3000 and store.hold(victim.id, ALICE) is not None
    declared[0].write(bytes(4000))   # bytes that really arrived do take space (evicting if they must)
    assert store.used_bytes == 7000
    for upload in declared:
        upload.abort()
    assert store.used_bytes == 3000 and files(store) == sorted([INCOMING, victim.id])


def test_uploads_in_progress_count_against_the_limit(tmp_path, clock):
    store = make_store(tmp_path, clock, max_bytes=8000)
    second = store.begin(ALICE)
    second.write(bytes(5000))
    with pytest.raises(LimitExceededError, match="full"):
        put(store, bytes(3001))
    second.abort()
    assert files(store) == [INCOMING]


def test_a_directory_serves_one_store_at_a_time(tmp_path, clock):
    store = make_store(tmp_path, clock)
    with pytest.raises(ValueError, match="in use by another mmserve server"):
        make_store(tmp_path, clock)
    store.close()
    make_store(tmp_path, clock).close()


def test_a_given_directory_is_kept_and_adopted_by_the_next_store(tmp_path, clock):
    store = make_store(tmp_path, clock)
    entry, _ = put(store, b"survives a restart")
    (store.root / INCOMING / "crashed.part").write_bytes(b"half")
    (store.root / "notes.txt").write_text("not ours")
    store.close()
    again = make_store(tmp_path, clock)
    assert again.acquire(entry.id).path.read_bytes() == b"survives a restart"
    assert files(again) == sorted([INCOMING, entry.id, "notes.txt"]) and again.used_bytes == len(b"survives a restart")


def test_a_temporary_store_is_removed_at_close(clock):
    store = MediaStore(None, max_bytes=1000, max_bytes_per_owner=1000, ttl_s=1.0, max_upload_bytes=1000, clock=clock)
    put(store, b"x" * 10)
    root = store.root
    store.close()
    assert not root.exists()


def test_an_upload_limit_above_the_store_size_is_a_configuration_error(tmp_path, clock):
    with pytest.raises(ValueError, match="--max-upload-bytes"):
        make_store(tmp_path, clock, max_bytes=100, max_upload_bytes=101)


def test_an_upload_limit_above_the_share_of_one_owner_is_a_configuration_error(tmp_path, clock):
    with pytest.raises(ValueError, match="--media-max-bytes-per-client"):
        make_store(tmp_path, clock, max_bytes_per_owner=4999)


def test_room_is_made_from_the_owners_own_media_then_only_from_heavier_owners(tmp_path, clock):
    """One owner used to evict every other's unused media by filling the spool (least recently used
    first, whoever held them), and could hold all of it. Now it holds at most its share, makes room
    from its own media, and then only from owners holding more than it would: a newcomer takes
    room from the heaviest, never from a lighter one."""
    store = make_store(tmp_path, clock, max_bytes=10_000, max_bytes_per_owner=6000, max_upload_bytes=3000)
    a1, _ = put(store, secrets.token_bytes(3000), owner=ALICE)
    clock.now += 1
    b1, _ = put(store, secrets.token_bytes(3000), owner=BOB)
    clock.now += 1
    a2, _ = put(store, secrets.token_bytes(3000), owner=ALICE)
    clock.now += 1
    a3, _ = put(store, secrets.token_bytes(3000), owner=ALICE)   # past Alice's share: her oldest goes
    assert files(store) == sorted([INCOMING, b1.id, a2.id, a3.id]) and store.owned_bytes(ALICE) == 6000
    clock.now += 1
    store.hold(b1.id, BOB)   # Bob's is now more recent than Alice's a2
    clock.now += 1
    b2, _ = put(store, secrets.token_bytes(3000), owner=BOB)   # the spool is full: Bob's own media go first
    assert files(store) == sorted([INCOMING, a2.id, a3.id, b2.id])

    for entry in (a2, a3):
        store.acquire(entry.id)
    with pytest.raises(LimitExceededError) as e:   # Alice's share is in use: she may retry once it is not
        put(store, b"x", owner=ALICE)
    assert e.value.retryable and e.value.flag == "--media-max-bytes-per-client"
    assert "holds 6000 of its 6000 bytes" in str(e.value)
    for entry in (a2, a3):
        store.release(entry.id)

    clock.now += 1
    c1, _ = put(store, secrets.token_bytes(3000), owner=CAROL)   # the spool is full: Alice (6000) is the heaviest
    assert files(store) == sorted([INCOMING, a3.id, b2.id, c1.id])
    store.acquire(c1.id)   # Carol's own media in use: her next 3000 would make her hold 6000, more than anyone
    with pytest.raises(LimitExceededError) as e:
        put(store, secrets.token_bytes(3000), owner=CAROL)
    assert e.value.retryable and e.value.flag == "--media-dir-max-bytes"
    assert files(store) == sorted([INCOMING, a3.id, b2.id, c1.id]) and store.owned_bytes(CAROL) == 3000
    store.release(c1.id)
    clock.now += 1
    c2, _ = put(store, secrets.token_bytes(3000), owner=CAROL)   # her own unused media go first
    assert files(store) == sorted([INCOMING, a3.id, b2.id, c2.id])


def test_an_upload_in_progress_counts_against_its_owners_share(tmp_path, clock):
    store = make_store(tmp_path, clock, max_bytes=10_000, max_bytes_per_owner=6000, max_upload_bytes=5000)
    first = store.begin(ALICE)
    first.write(bytes(4000))
    with pytest.raises(LimitExceededError, match="--media-max-bytes-per-client"):
        put(store, bytes(2001), owner=ALICE)
    put(store, secrets.token_bytes(5000), owner=BOB)   # Bob has his own share
    first.abort()
    assert store.owned_bytes(ALICE) == 0 and store.owned_bytes(BOB) == 5000


def test_media_uploaded_by_two_owners_stay_while_either_holds_them(tmp_path, clock):
    """The same bytes are stored once and charged to each owner: one giving them up to make room
    for its own uploads does not take them from the other."""
    store = make_store(tmp_path, clock, max_bytes=10_000, max_bytes_per_owner=5000, max_upload_bytes=5000)
    data = secrets.token_bytes(2000)
    shared, created = put(store, data, owner=ALICE)
    again, created_again = put(store, data, owner=BOB)
    assert created and not created_again and again.id == shared.id
    assert store.owned_bytes(ALICE) == store.owned_bytes(BOB) == 2000 and store.used_bytes == 2000
    clock.now += 1
    mine, _ = put(store, secrets.token_bytes(4000), owner=ALICE)   # Alice gives up the shared media
    assert store.owned_bytes(ALICE) == 4000 and files(store) == sorted([INCOMING, shared.id, mine.id])
    # A declared hash of stored content claims it without its bytes, from the claimant's share.
    assert store.hold(shared.id, CAROL) is shared and store.owned_bytes(CAROL) == 2000
    store.acquire(mine.id)
    with pytest.raises(LimitExceededError, match="--media-max-bytes-per-client"):
        store.hold(shared.id, ALICE)   # 4000 in use + 2000 > 5000
    clock.now += 1
    put(store, secrets.token_bytes(4000), owner=BOB)   # Bob gives it up too; Carol still holds it
    assert store.acquire(shared.id).path.read_bytes() == data


def test_adopted_media_belong_to_no_owner_and_make_room_before_an_owners_own(tmp_path, clock):
    store = make_store(tmp_path, clock, max_bytes=10_000, max_bytes_per_owner=6000, max_upload_bytes=3000)
    old = [put(store, secrets.token_bytes(3000), owner=BOB)[0] for _ in range(2)]
    store.close()
    clock.now += 1
    store = make_store(tmp_path, clock, max_bytes=10_000, max_bytes_per_owner=6000, max_upload_bytes=3000)
    assert store.owned_bytes(BOB) == 0 and store.used_bytes == 6000
    clock.now += 1
    mine, _ = put(store, secrets.token_bytes(3000), owner=ALICE)
    clock.now += 1
    put(store, secrets.token_bytes(3000), owner=ALICE)   # the spool is full: an adopted media goes
    assert len(store) == 3 and mine.id in files(store)
    clock.now += 1
    put(store, secrets.token_bytes(3000), owner=ALICE)   # her share is full: her own goes
    assert len(store) == 3 and mine.id not in files(store) and sum(o.id in files(store) for o in old) == 1
