"""Content-addressed spool of uploaded media: one file per content, named by the sha256 of its bytes.

An upload streams into a temporary file under `<root>/.incoming/` while its hash and size are
computed; committing checks what the client declared and renames the file to `<root>/<sha256>`
(atomic on one filesystem), so a reader never sees a partial file and the same bytes uploaded twice,
even at the same time, are stored once. Space is taken as bytes arrive, never for a declared size
alone: a client cannot make the store evict another client's media, or refuse other uploads, with
bytes it has not sent. Requests lease the media they use; media without leases
expire `ttl_s` after their last use.

Each upload belongs to a caller (its API key's digest, `in_flight.caller_key`), and a stored media
to every caller that uploaded those bytes or declared their hash. A caller's uploads in progress and
media together stay within `max_bytes_per_owner`, for which it gives up its own unused media, least
recently used first. When the whole spool would outgrow `max_bytes`, media no caller holds (adopted
from an earlier run) are evicted first, then the caller's own, then those of the caller holding the
most, never of a caller holding no more than the uploader would: one key cannot evict a lighter
key's uploads by filling the spool, nor hold more than its share, and a newcomer is not refused
while heavier keys' unused media fill the spool.

Bookkeeping is under one lock: uploads write from worker threads while the event loop leases and
sweeps.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mmserve.errors import InvalidInputError, LimitExceededError, NotFoundError

logger = logging.getLogger(__name__)

MEDIA_ID = re.compile(r"[0-9a-f]{64}")
INCOMING = ".incoming"
LOCK = ".lock"
RESOURCE_TYPE = "mmserve.v1.Media"


@dataclass
class MediaEntry:
    """One stored content: `id` is the sha256 of the file's bytes; `owners` the callers that uploaded
    it (none for media adopted from an earlier run), each charged its whole size."""

    id: str
    size: int
    mime_type: str
    path: Path
    last_used: float
    leases: int = 0
    owners: set[bytes] = field(default_factory=set)


class MediaStore:
    """The spool under `root` (None or "": a fresh temporary directory, removed by `close()`; a
    given directory is kept, and its media are adopted again by the next store opened on it)."""

    def __init__(self, root: str | Path | None, *, max_bytes: int, max_bytes_per_owner: int, ttl_s: float,
                 max_upload_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        for limit, flag in ((max_bytes, "--media-dir-max-bytes"), (max_bytes_per_owner, "--media-max-bytes-per-client")):
            if max_upload_bytes > limit:
                raise ValueError(f"--max-upload-bytes ({max_upload_bytes}) must not exceed {flag} ({limit}): such "
                                 f"an upload could never be stored")
        self._owned = not root
        self.root = Path(tempfile.mkdtemp(prefix="mmserve-media-")) if self._owned else Path(root)
        self.max_bytes = max_bytes
        self.max_bytes_per_owner = max_bytes_per_owner
        self.ttl_s = ttl_s
        self.max_upload_bytes = max_upload_bytes
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, MediaEntry] = {}
        self._reserved: dict[bytes, int] = {}  # bytes of uploads still arriving, by owner
        self._incoming = self.root / INCOMING
        self._incoming.mkdir(parents=True, exist_ok=True)
        self._lock_file = self._claim()
        self._adopt()

    def _claim(self):
        """One server per directory: a second would delete the first's uploads in progress and
        evict its media behind its back (e.g. replicas sharing a ReadWriteMany volume)."""
        lock_file = open(self.root / LOCK, "a")  # noqa: SIM115 - held until close()
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock_file.close()
            raise ValueError(f"--media-dir {self.root} is in use by another mmserve server; give each server "
                             f"its own directory") from None
        return lock_file

    def _adopt(self) -> None:
        """Forget half-received uploads of an earlier run; keep its committed media."""
        for leftover in self._incoming.iterdir():
            leftover.unlink(missing_ok=True)
        now = self.clock()
        for path in self.root.iterdir():
            if path.is_file() and MEDIA_ID.fullmatch(path.name):
                self._entries[path.name] = MediaEntry(path.name, path.stat().st_size, "", path, now)
        if self._entries:
            logger.info("media store %s: adopted %d media (%d bytes)", self.root, len(self._entries), self.used_bytes)

    @property
    def used_bytes(self) -> int:
        """Bytes of committed media plus uploads in progress."""
        return sum(e.size for e in self._entries.values()) + sum(self._reserved.values())

    def owned_bytes(self, owner: bytes) -> int:
        """Bytes charged to `owner`: its media (shared ones too) plus its uploads in progress."""
        return self._holdings().get(owner, 0)

    def _holdings(self) -> dict[bytes, int]:
        """`owned_bytes` of every owner."""
        held = dict(self._reserved)
        for e in self._entries.values():
            for o in e.owners:
                held[o] = held.get(o, 0) + e.size
        return held

    def __len__(self) -> int:
        return len(self._entries)

    # ---- uploads -------------------------------------------------------------------------------

    def begin(self, owner: bytes, *, mime_type: str = "", declared_size: int | None = None,
              declared_sha256: str | None = None) -> Upload:
        """Start receiving `owner`'s upload. A declared size is checked against the limit but takes no
        space: space is reserved chunk by chunk as the bytes arrive."""
        if declared_size is not None and declared_size > self.max_upload_bytes:
            raise LimitExceededError(f"the upload declares {declared_size} bytes, more than the limit of "
                                     f"{self.max_upload_bytes}", "--max-upload-bytes")
        return Upload(self, owner, mime_type, declared_size, declared_sha256)

    def _reserve(self, owner: bytes, num_bytes: int) -> None:
        """Make room for `num_bytes` more of `owner`'s, in its share and then in the spool."""
        with self._lock:
            self._sweep_locked()
            self._fit_share_locked(owner, num_bytes)
            while self.used_bytes + num_bytes > self.max_bytes:
                victim = self._eviction_locked(owner, self.owned_bytes(owner) + num_bytes)
                if victim is None:
                    raise LimitExceededError(
                        f"the media store is full: {self.used_bytes} of {self.max_bytes} bytes hold media in use, "
                        f"uploads in progress, or media of API keys holding no more than this one would",
                        "--media-dir-max-bytes", retryable=True)
                self._remove_locked(victim, "evicted (least recently used)")
            self._reserved[owner] = self._reserved.get(owner, 0) + num_bytes

    def _eviction_locked(self, owner: bytes, holding: int) -> MediaEntry | None:
        """The unused media to evict so that `owner` (then `holding` bytes) fits the spool: media no
        caller holds first, then its own, then those of the caller holding the most, and only of
        callers holding more than `holding` (a fair share: a light user's media never make room
        for a heavier one's), least recently used first within each."""
        held = self._holdings()
        ranked = []
        for e in self._entries.values():
            others = e.owners - {owner}
            if e.leases or any(held[o] <= holding for o in others):
                continue
            rank = 0 if not e.owners else 1 if not others else 2
            ranked.append((rank, -max((held[o] for o in others), default=0), e.last_used, e))
        return min(ranked, key=lambda r: r[:3])[3] if ranked else None

    def _fit_share_locked(self, owner: bytes, num_bytes: int) -> None:
        """Give up `owner`'s claim on its unused media, least recently used first, until `num_bytes`
        more fit its share; a media is deleted when no owner is left to hold it."""
        if self.max_bytes_per_owner >= self.max_bytes:
            return   # what one owner holds is in the spool: the spool's limit is the one that binds
        while (held := self.owned_bytes(owner)) + num_bytes > self.max_bytes_per_owner:
            idle = [e for e in self._entries.values() if e.leases == 0 and owner in e.owners]
            if not idle:
                raise LimitExceededError(
                    f"this API key holds {held} of its {self.max_bytes_per_owner} bytes of the media store in "
                    f"media in use by running requests or uploads in progress", "--media-max-bytes-per-client",
                    retryable=True)
            entry = min(idle, key=lambda e: e.last_used)
            entry.owners.discard(owner)
            if not entry.owners:
                self._remove_locked(entry, "evicted (least recently used of its API key's share)")

    def _unreserve(self, owner: bytes, num_bytes: int) -> None:
        with self._lock:
            if left := self._reserved.get(owner, 0) - num_bytes:
                self._reserved[owner] = left
            else:
                self._reserved.pop(owner, None)

    def _commit(self, temp: Path, digest: str, size: int, mime_type: str, owner: bytes) -> tuple[MediaEntry, bool]:
        """Store the verified file under its digest, held by `owner` too; (entry, False) when that
        content was already here (its bytes took `owner`'s share as they arrived)."""
        with self._lock:
            entry = self._entries.get(digest)
            if entry is not None:
                entry.last_used = self.clock()
                entry.owners.add(owner)
                temp.unlink(missing_ok=True)
                return entry, False
            path = self.root / digest
            os.replace(temp, path)
            entry = self._entries[digest] = MediaEntry(digest, size, mime_type, path, self.clock(), owners={owner})
            return entry, True

    # ---- use -------------------------------------------------------------------------------------

    def hold(self, media_id: str, owner: bytes) -> MediaEntry | None:
        """The live entry for `media_id`, now held by `owner` too (a declared hash of stored bytes: its
        TTL restarts and it takes `owner`'s share as an upload of it would), or None when unknown or
        expired."""
        with self._lock:
            self._sweep_locked()
            entry = self._entries.get(media_id)
            if entry is not None:
                if owner not in entry.owners:
                    self._fit_share_locked(owner, entry.size)
                    entry.owners.add(owner)
                entry.last_used = self.clock()
            return entry

    def acquire(self, media_id: str) -> MediaEntry:
        """Lease `media_id` for a request: it is neither evicted nor expired until `release`."""
        with self._lock:
            self._sweep_locked()
            entry = self._entries.get(media_id)
            if entry is None:
                raise NotFoundError(
                    f"no media with id {media_id} on this server: it expired (--media-ttl-s {self.ttl_s:g}), was "
                    f"evicted, or was uploaded to another replica; upload it again", resource_type=RESOURCE_TYPE,
                    resource_name=media_id)
            entry.leases += 1
            entry.last_used = self.clock()
            return entry

    def release(self, media_id: str) -> None:
        with self._lock:
            entry = self._entries[media_id]
            entry.leases -= 1
            entry.last_used = self.clock()

    def sweep(self) -> int:
        """Delete expired, unleased media. Returns how many went."""
        with self._lock:
            return self._sweep_locked()

    def _sweep_locked(self) -> int:
        cutoff = self.clock() - self.ttl_s
        expired = [e for e in self._entries.values() if e.leases == 0 and e.last_used < cutoff]
        for entry in expired:
            self._remove_locked(entry, "expired")
        return len(expired)

    def _remove_locked(self, entry: MediaEntry, why: str) -> None:
        del self._entries[entry.id]
        entry.path.unlink(missing_ok=True)
        logger.info("media %s (%d bytes) %s", entry.id, entry.size, why)

    def close(self) -> None:
        """Let another server have the directory; remove it if this store created it."""
        self._lock_file.close()
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)


class Upload:
    """One upload being received: `write` chunks (from any thread), then `commit` or `abort`.

    Limits are checked as bytes arrive, so an oversize upload fails at the chunk that crosses the
    limit, not after everything was received; `abort` (idempotent) leaves no file behind."""

    def __init__(self, store: MediaStore, owner: bytes, mime_type: str, declared_size: int | None,
                 declared_sha256: str | None) -> None:
        self._store = store
        self.owner = owner
        self.mime_type = mime_type
        self.declared_size = declared_size
        self.declared_sha256 = declared_sha256
        self.size = 0
        self._reserved = 0
        self._hash = hashlib.sha256()
        self._lock = threading.Lock()
        self._done = False
        self.path = store._incoming / f"{uuid.uuid4().hex}.part"
        self._file = open(self.path, "xb")  # closed by commit or abort

    def _reserve(self, num_bytes: int) -> None:
        self._store._reserve(self.owner, num_bytes)
        self._reserved += num_bytes

    def write(self, chunk: bytes) -> None:
        with self._lock:
            if self._done:
                raise RuntimeError("write after the upload ended")
            size = self.size + len(chunk)
            if size > self._store.max_upload_bytes:
                raise LimitExceededError(f"the upload is more than {self._store.max_upload_bytes} bytes",
                                         "--max-upload-bytes")
            if self.declared_size is not None and size > self.declared_size:
                raise InvalidInputError("metadata.size_bytes", f"more bytes arrived than the {self.declared_size} "
                                        f"declared")
            if size > self._reserved:
                self._reserve(size - self._reserved)
            self._file.write(chunk)
            self._hash.update(chunk)
            self.size = size

    def commit(self) -> tuple[MediaEntry, bool]:
        """Verify the declared size and hash, then store. Returns (entry, whether it is new)."""
        with self._lock:
            self._file.close()
            if self.size == 0:
                raise InvalidInputError("chunk", "the upload holds no bytes")
            if self.declared_size is not None and self.size != self.declared_size:
                raise InvalidInputError("metadata.size_bytes", f"{self.declared_size} bytes declared, "
                                        f"{self.size} received")
            digest = self._hash.hexdigest()
            if self.declared_sha256 and digest != self.declared_sha256:
                raise InvalidInputError("metadata.sha256", f"the bytes received hash to {digest}, not to the "
                                        f"declared {self.declared_sha256}")
            result = self._store._commit(self.path, digest, self.size, self.mime_type, self.owner)
            self._finish()
            return result

    def abort(self) -> None:
        """Drop what arrived (safe to call after commit, and more than once)."""
        with self._lock:
            if not self._done:
                self._file.close()
                self.path.unlink(missing_ok=True)
                self._finish()

    def _finish(self) -> None:
        self._done = True
        self._store._unreserve(self.owner, self._reserved)
        self._reserved = 0
