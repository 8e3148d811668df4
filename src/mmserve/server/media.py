"""Uploaded media on the server: the UploadMedia RPC, media ids in Generate, what GetModelInfo says.

Uploads stream into the `MediaStore` chunk by chunk (file writes and hashing run off the event
loop), in the caller's share of it (its API key's, --media-max-bytes-per-client), with every limit
checked as the bytes arrive and each message awaited at most --upload-idle-timeout-s (a stalled
stream would hold its spool space and a call slot forever), the whole upload at most
--upload-max-duration-s (a trickle, a byte before each idle timeout, would too); any failure,
cancel, stall or deadline drops the partial file. A Generate naming media ids leases them for as
long as it runs, so a running request's media are never evicted or expired, and the decoder reads
the spooled file, never a copy in memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

import grpc

from mmserve.api import pb
from mmserve.config import EngineConfig, ServerConfig
from mmserve.engine.input.processor import AudioInput, ImageInput, InputMessage, VideoInput
from mmserve.errors import (
    InvalidInputError,
    LimitExceededError,
    MMServeError,
    NotFoundError,
    RequestAbortedError,
)
from mmserve.server.in_flight import caller_key
from mmserve.server.media_store import MEDIA_ID, MediaEntry, MediaStore
from mmserve.server.status import end_with
from mmserve.server.validation import IMAGE_MIME_TYPES, VIDEO_MIME_TYPES

logger = logging.getLogger(__name__)

RECOMMENDED_CHUNK_BYTES = 2**20
MAX_CHUNK_BYTES = 4 * 2**20
# An UploadMediaRequest's bytes beyond its chunk (field tag and length; the metadata message is small).
UPLOAD_FRAMING_BYTES = 2**10
# Room left in a Generate message for everything but the media (text, sampling, framing).
MESSAGE_HEADROOM_BYTES = 64 * 2**10
UPLOAD_MIME_TYPES = VIDEO_MIME_TYPES | IMAGE_MIME_TYPES
# An upload of undeclared size ends when its stream does, and grpc.aio ends a cancelled call's
# request stream the same way as a finished one: wait this long for the cancel before storing.
UNDECLARED_END_GRACE_S = 0.2


class MediaLeases:
    """The media one request holds, and its messages with each media part's spooled `path` filled in."""

    def __init__(self, store: MediaStore, messages: tuple[InputMessage, ...]) -> None:
        self._store = store
        self._held: list[str] = []
        try:
            self.messages = tuple(InputMessage(m.role, tuple(self._resolve(p, f"messages[{i}].parts[{j}]")
                                                             for j, p in enumerate(m.parts)))
                                  for i, m in enumerate(messages))
        except BaseException:
            self.release()
            raise

    def _resolve(self, part, where: str):
        if not isinstance(part, ImageInput | VideoInput | AudioInput) or not part.media_id:
            return part
        try:
            entry = self._store.acquire(part.media_id)
        except NotFoundError as e:
            kind = {ImageInput: "image", VideoInput: "video", AudioInput: "audio"}[type(part)]
            raise NotFoundError(f"{where}.{kind}.media_id: {e}", resource_type=e.resource_type,
                                resource_name=e.resource_name) from None
        self._held.append(entry.id)
        return dataclasses.replace(part, path=str(entry.path))

    def release(self) -> None:
        """Let the media expire again (idempotent)."""
        held, self._held = self._held, []
        for media_id in held:
            self._store.release(media_id)


class MediaService:
    """The server's side of uploaded media; owns the store."""

    def __init__(self, store: MediaStore, server_config: ServerConfig, engine_config: EngineConfig) -> None:
        self.store = store
        self.max_chunk_bytes = min(MAX_CHUNK_BYTES, server_config.max_message_bytes)
        self.idle_timeout_s = server_config.upload_idle_timeout_s
        self.max_duration_s = server_config.upload_max_duration_s
        self.max_inline_bytes = max(0, min(engine_config.max_video_bytes,
                                           server_config.max_message_bytes - MESSAGE_HEADROOM_BYTES))

    @classmethod
    def from_config(cls, server_config: ServerConfig, engine_config: EngineConfig, *, api_keys: bool) -> MediaService:
        store = MediaStore(server_config.media_dir or None, max_bytes=server_config.media_dir_max_bytes,
                           max_bytes_per_owner=client_share(server_config, api_keys=api_keys),
                           ttl_s=server_config.media_ttl_s, max_upload_bytes=server_config.max_upload_bytes)
        logger.info("uploaded media go to %s (at most %d bytes, %d per API key, kept %gs after last use)", store.root,
                    store.max_bytes, store.max_bytes_per_owner, store.ttl_s)
        return cls(store, server_config, engine_config)

    def lease(self, messages: tuple[InputMessage, ...]) -> MediaLeases:
        """Lease every media id the messages name; NotFoundError (NOT_FOUND) for one that is gone."""
        return MediaLeases(self.store, messages)

    def describe(self, info: pb.ModelInfo) -> None:
        """Fill in what clients need to choose between inline media and an upload."""
        info.max_inline_media_bytes = self.max_inline_bytes
        info.max_upload_bytes = self.store.max_upload_bytes
        info.max_upload_chunk_bytes = self.max_chunk_bytes

    async def upload(self, requests: AsyncIterator[pb.UploadMediaRequest],
                     context: grpc.aio.ServicerContext) -> pb.MediaRef:
        try:
            return self._ref(await self._receive(requests, context))
        # The spool's disk full is INTERNAL (logged), never a bare UNKNOWN. Not every exception: a
        # refused message has already ended the call (admission's context.abort), and that stands.
        except (MMServeError, OSError) as e:
            end_with(context, e)   # not abort_with: its error, kept by grpc, would hold the upload in a cycle
            return pb.MediaRef()   # not sent: the call ends with the status just set

    async def _receive(self, requests: AsyncIterator[pb.UploadMediaRequest],
                       context: grpc.aio.ServicerContext) -> MediaEntry:
        requests, owner = aiter(requests), caller_key(context)
        deadline = self.store.clock() + self.max_duration_s
        first = await self._next(requests, deadline)
        if first is None or first.WhichOneof("kind") != "metadata":
            raise InvalidInputError("metadata", "the first UploadMediaRequest must carry metadata (mime_type, "
                                    "optional size_bytes and sha256); the chunks follow")
        meta = first.metadata
        _check_mime(meta.mime_type)
        sha256 = _sha256(meta.sha256)
        if sha256 and (entry := self.store.hold(sha256, owner)) is not None:
            logger.info("upload of media %s: already stored, no bytes needed", sha256)
            return entry
        upload = self.store.begin(owner, mime_type=meta.mime_type, declared_size=meta.size_bytes or None,
                                  declared_sha256=sha256 or None)
        try:
            while (message := await self._next(requests, deadline)) is not None:
                if message.WhichOneof("kind") != "chunk":
                    raise InvalidInputError("metadata", "only the first UploadMediaRequest may carry metadata")
                if len(message.chunk) > self.max_chunk_bytes:
                    raise LimitExceededError(f"an upload chunk of {len(message.chunk)} bytes is more than the "
                                             f"limit of {self.max_chunk_bytes}; send chunks of "
                                             f"{RECOMMENDED_CHUNK_BYTES} bytes")
                await asyncio.to_thread(upload.write, message.chunk)
            # A client cancel or an expired deadline also ends the request stream, as if the upload
            # were complete. With a declared size, a cut-off upload fails its size check. Without,
            # the cancel (pending by now, at most a poll of the completion queue away) lands at this
            # await and a deadline shows in the time left. Nothing is awaited after this.
            await asyncio.sleep(0 if upload.declared_size else UNDECLARED_END_GRACE_S)
            if (left := context.time_remaining()) is not None and left <= 0:
                raise RequestAbortedError("the upload's deadline passed before it was complete")
            entry, created = upload.commit()
        finally:
            upload.abort()  # a no-op after commit; otherwise nothing of the upload stays behind
        logger.info("upload of media %s (%d bytes): %s", entry.id, entry.size, "stored" if created else "already stored")
        return entry

    async def _next(self, requests: AsyncIterator[pb.UploadMediaRequest],
                    deadline: float) -> pb.UploadMediaRequest | None:
        """The stream's next message (None at its end), waiting at most the idle timeout for it and
        never past the upload's `deadline` (on the store's clock)."""
        wait = min(self.idle_timeout_s, deadline - self.store.clock())
        if wait > 0:
            try:   # asyncio.timeout, not wait_for: 3.11's wait_for can swallow the client's cancel
                async with asyncio.timeout(wait):
                    return await anext(requests, None)
            except TimeoutError:
                if wait == self.idle_timeout_s:
                    raise LimitExceededError(f"no upload message arrived for {self.idle_timeout_s:g}s; the upload "
                                             f"was dropped: send it again", "--upload-idle-timeout-s",
                                             retryable=True) from None
        raise LimitExceededError(f"the upload was still arriving {self.max_duration_s:g}s after it began; it was "
                                 f"dropped: send it again, faster", "--upload-max-duration-s", retryable=True)

    def _ref(self, entry: MediaEntry) -> pb.MediaRef:
        return pb.MediaRef(id=entry.id, size_bytes=entry.size, mime_type=entry.mime_type, ttl_s=self.store.ttl_s)

    async def sweep_forever(self) -> None:
        """Delete expired media every so often (also done lazily on each store operation)."""
        while True:
            await asyncio.sleep(min(60.0, max(self.store.ttl_s / 2, 0.05)))
            self.store.sweep()

    def close(self) -> None:
        self.store.close()


def client_share(config: ServerConfig, *, api_keys: bool) -> int:
    """--media-max-bytes-per-client, or its default: with API keys a quarter of the spool, so that
    one key cannot fill it, yet room for the largest upload; without, the whole spool (every caller
    is the same client)."""
    if config.media_max_bytes_per_client:
        return config.media_max_bytes_per_client
    if not api_keys:
        return config.media_dir_max_bytes
    return max(config.media_dir_max_bytes // 4, config.max_upload_bytes)


def _check_mime(mime_type: str) -> None:
    if mime_type and mime_type.lower() not in UPLOAD_MIME_TYPES:
        raise InvalidInputError("metadata.mime_type", f"unsupported mime type {mime_type!r}; use a video or image "
                                f"type ({', '.join(sorted(UPLOAD_MIME_TYPES))}) or leave it empty")


def _sha256(value: str) -> str:
    digest = value.lower()
    if digest and not MEDIA_ID.fullmatch(digest):
        raise InvalidInputError("metadata.sha256", "must be the 64 hex digits of the bytes' sha256, or empty")
    return digest
