"""Uploading media for the clients: UploadMedia requests read from a file chunk by chunk, a progress
bar, which `video=`/`image=` arguments must be uploaded first (larger than the server takes in one
message), and the rule for uploading again when a server no longer has the media a request names.

The file is hashed first (one read, in constant memory), so the server can check what arrived and,
when it already holds that content, answer at once without receiving the bytes again. Then the
metadata and 1 MiB chunks stream out; the whole file is never in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import grpc
from tqdm import tqdm

from mmserve.api import pb
from mmserve.clients.types import ClientError, MediaRef

CHUNK_BYTES = 2**20  # the size the server recommends (ModelInfo.max_upload_chunk_bytes is the most)
MEDIA_KWARGS = ("video", "image", "audio")
UploadSource = str | os.PathLike | BinaryIO


@dataclass
class OpenedSource:
    """An upload's bytes: the open file, where it came from, and (when seekable) size and sha256."""

    file: BinaryIO
    name: str
    path: Path | None
    size: int | None
    sha256: str


@contextlib.contextmanager
def opened(source: UploadSource) -> Iterator[OpenedSource]:
    """Open a path (closed afterwards) or take an open binary file from its current position."""
    if isinstance(source, str | os.PathLike):
        path = Path(source)
        with open(path, "rb") as f:
            yield _described(f, path.name, path)
        return
    yield _described(source, getattr(source, "name", "upload"), None)


def _described(file: BinaryIO, name, path: Path | None) -> OpenedSource:
    if not file.seekable():
        return OpenedSource(file, str(name), path, None, "")
    start = file.tell()
    digest, size = hashlib.sha256(), 0
    while chunk := file.read(CHUNK_BYTES):  # from the position on (hashlib.file_digest would hash a
        digest.update(chunk)                # BytesIO's whole buffer)
        size += len(chunk)
    file.seek(start)
    return OpenedSource(file, os.path.basename(str(name)), path, size, digest.hexdigest())


def progress_bar(source: OpenedSource, enabled: bool) -> tqdm:
    """Bytes sent, on stderr; shown only when enabled and stderr is a terminal."""
    return tqdm(total=source.size, desc=f"upload {source.name}", unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, disable=None if enabled else True)


def _metadata(source: OpenedSource, mime_type: str) -> pb.UploadMediaRequest:
    return pb.UploadMediaRequest(metadata=pb.UploadMetadata(mime_type=mime_type, size_bytes=source.size or 0,
                                                            sha256=source.sha256))


def upload_requests(source: OpenedSource, mime_type: str, chunk_bytes: int, bar: tqdm) -> Iterator[pb.UploadMediaRequest]:
    yield _metadata(source, mime_type)
    while chunk := source.file.read(chunk_bytes):
        yield pb.UploadMediaRequest(chunk=chunk)
        bar.update(len(chunk))


async def upload_requests_async(source: OpenedSource, mime_type: str, chunk_bytes: int,
                                bar: tqdm) -> AsyncIterator[pb.UploadMediaRequest]:
    """The same, reading the file off the event loop."""
    yield _metadata(source, mime_type)
    while chunk := await asyncio.to_thread(source.file.read, chunk_bytes):
        yield pb.UploadMediaRequest(chunk=chunk)
        bar.update(len(chunk))


def media_ref(response: pb.MediaRef, source: OpenedSource, bar: tqdm) -> MediaRef:
    """The client's MediaRef for the server's answer; the bar shows the upload complete (also when
    the server already held the bytes and needed none of them)."""
    bar.update(response.size_bytes - bar.n)
    return MediaRef(id=response.id, size_bytes=response.size_bytes, mime_type=response.mime_type,
                    ttl_s=response.ttl_s, source=source.path)


def local_media(kwargs: dict) -> Iterator[tuple[str, Path | bytes, int]]:
    """The `video=`/`image=`/`audio=` arguments given as bytes or a path: (key, the bytes or Path, size)."""
    for key in MEDIA_KWARGS:
        value = kwargs.get(key)
        if value is None or isinstance(value, MediaRef):
            continue
        if isinstance(value, bytes | bytearray | memoryview):
            yield key, bytes(value), len(value)
        elif isinstance(value, str | os.PathLike):
            yield key, Path(value), os.path.getsize(value)
        else:
            raise TypeError(f"{key}= takes bytes, a path or a MediaRef, not {type(value).__name__}")


def upload_source(value: Path | bytes) -> UploadSource:
    return io.BytesIO(value) if isinstance(value, bytes) else value


def names_uploaded_media(request: pb.GenerateRequest) -> bool:
    """Whether the request refers to uploaded media (and so must reach the replica holding them)."""
    for message in request.messages:
        for part in message.parts:
            kind = part.WhichOneof("content")
            if kind in ("video", "image", "audio") and getattr(part, kind).media_id:
                return True
    return False


def lost_media(error: ClientError, kwargs: dict) -> str | None:
    """Which of the request's `video=`/`image=` arguments the server reported NOT_FOUND, when that
    MediaRef remembers its file and so can be uploaded again; else None."""
    if error.code != grpc.StatusCode.NOT_FOUND:
        return None
    for key in MEDIA_KWARGS:
        ref = kwargs.get(key)
        if isinstance(ref, MediaRef) and ref.id == error.resource_name and ref.source is not None:
            return key
    return None
