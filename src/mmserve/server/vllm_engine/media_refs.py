"""A gateway's `media_refs` -> our engine-level image/video/audio inputs, before any decoding.

The gateway forwards each OpenAI `image_url`/`video_url` verbatim, and an `input_audio` part as a
`data:audio/<format>;base64,...` URL (SMG 1.13.0, observed). This server fetches nothing:
`data:<mime>;base64,...` is decoded here, `file://` is read only inside `--allowed-local-media-path`
(resolved, so neither `..` nor a symlink leaves it), and every other scheme (http, https, ...) is
refused with INVALID_ARGUMENT naming the item. The bytes then take exactly the `mmserve.v1` path
(engine/input/processor.py), so the same limits and statuses apply.
"""

from __future__ import annotations

import binascii
import os
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from mmserve.engine.input.processor import AudioInput, ImageInput, VideoInput
from mmserve.engine.types import SampledVideo
from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.server.validation import AUDIO_MIME_TYPES, IMAGE_MIME_TYPES, VIDEO_MIME_TYPES

WHERE = "media_refs.items"
MAX_URL_PREVIEW = 48
# A data: URL is decoded in pieces of this many base64 characters (a multiple of 4): each piece holds
# the GIL for a millisecond or so, so the event loop's thread gets it between them; one 47 MiB call held
# it for ~0.3 s (4 such URLs stalled every other call for 1.2 s).
DECODE_CHUNK_CHARS = 2**20
# Each modality served: its name in messages, the MIME types a data: URL may declare, our input type.
KINDS = {common_pb2.IMAGE: ("image", IMAGE_MIME_TYPES, ImageInput),
         common_pb2.VIDEO: ("video", VIDEO_MIME_TYPES, VideoInput),
         common_pb2.AUDIO: ("audio", AUDIO_MIME_TYPES, AudioInput)}


def frames_per_item(videos: Sequence[SampledVideo]) -> dict[int, int]:
    """`media_refs.items` index -> frames sampled, for each item that decoded to frames (a video, an
    animated image), from the request's sampled videos (parts named `media_refs.items[i]`)."""
    return {int(v.part[len(WHERE) + 1:-1]): len(v.timestamps_s) for v in videos}


def schemes(allowed_local_media_path: str) -> str:
    """GetServerInfo.mm_media_ref_schemes."""
    return "data,file" if allowed_local_media_path else "data"


def media_inputs(refs: vpb.MediaRefs, *, max_bytes: int,
                 allowed_local_media_path: str) -> list[ImageInput | VideoInput | AudioInput]:
    """One input per item, in order; raises InvalidInputError / LimitExceededError naming the item.
    Decodes data: URLs: call it on a worker thread, never on the event loop."""
    root = Path(allowed_local_media_path).resolve() if allowed_local_media_path else None
    return [_item(item, f"{WHERE}[{i}]", max_bytes, root) for i, item in enumerate(refs.items)]


def _item(item: vpb.MediaRef, where: str, max_bytes: int, root: Path | None) -> ImageInput | VideoInput | AudioInput:
    if item.modality not in KINDS:
        # An open enum: a value newer than our stubs has no name (Modality.Name would raise ValueError).
        name = common_pb2.Modality.DESCRIPTOR.values_by_number.get(item.modality)
        raise InvalidInputError(f"{where}.modality", f"{name.name if name else item.modality} is not "
                                                     "served here: send images, videos or audio")
    kind, mime_types, make = KINDS[item.modality]
    url = item.url
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        mime, data = _data_url(url, f"{where}.url", max_bytes, kind)
        if mime and mime not in mime_types:
            raise InvalidInputError(f"{where}.url", f"unsupported {kind} type {_preview(mime)!r}; use one of "
                                                    f"{', '.join(sorted(mime_types))}")
        return make(data=data, mime_type=mime)
    if scheme == "file":
        path = _local_file(url, f"{where}.url", root, max_bytes, kind)
        return make(path=str(path))
    raise InvalidInputError(f"{where}.url", f"{scheme[:16] or 'a URL without a'} scheme refused ({_preview(url)!r}): this server "
                                            "fetches nothing; send the media inline as a data: URL (base64)")


def _preview(text: str) -> str:
    return text[:MAX_URL_PREVIEW] + ("..." if len(text) > MAX_URL_PREVIEW else "")


def _data_url(url: str, where: str, max_bytes: int, kind: str) -> tuple[str, bytes]:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise InvalidInputError(where, "a data: URL must be data:<mime type>;base64,<bytes>")
    # Bound the work before decoding: the size base64 decodes to, without decoding it.
    size = len(payload) * 3 // 4 - payload[-2:].count("=")
    if size > max_bytes:
        raise LimitExceededError(f"{kind} is {size} bytes, more than the limit of {max_bytes}", "--max-video-bytes")
    try:
        data = _b64decode(payload)
    except (binascii.Error, ValueError) as e:   # UnicodeEncodeError is a ValueError
        raise InvalidInputError(where, f"the data: URL's payload is not valid base64 ({str(e)[:80]})") from None
    if not data:
        raise InvalidInputError(where, f"empty {kind} bytes")
    return header[len("data:"):-len(";base64")].split(";", 1)[0].strip().lower(), data


def _b64decode(payload: str) -> bytes:
    """Strict base64 (no whitespace, padding only at the end), decoded piece by piece (see
    DECODE_CHUNK_CHARS). Each piece is checked alone, and padding may end a piece: so padding is
    refused anywhere but the last two characters first."""
    if payload.find("=", 0, max(0, len(payload) - 2)) >= 0:
        raise ValueError("padding ('=') before the end")
    out = bytearray()
    for start in range(0, len(payload), DECODE_CHUNK_CHARS):
        out += binascii.a2b_base64(payload[start:start + DECODE_CHUNK_CHARS].encode("ascii"), strict_mode=True)
    return bytes(out)


def _local_file(url: str, where: str, root: Path | None, max_bytes: int, kind: str) -> Path:
    if root is None:
        raise InvalidInputError(where, "file:// URLs are refused: this server was started without "
                                       "--allowed-local-media-path; send the media as a data: URL")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidInputError(where, f"file:// URL names host {_preview(parts.netloc)!r}; only local files are read")
    spelled = unquote(parts.path)
    if "\0" in spelled:   # resolve() would raise ValueError, which no status maps
        raise InvalidInputError(where, "the file:// path holds a NUL byte")
    # Messages quote the path as the client spelled it (bounded), never as resolved: that would show
    # where a symlink points, the server's working directory or the allowed directory itself.
    path = Path(spelled).resolve()
    if not path.is_relative_to(root):
        raise InvalidInputError(where, f"{_preview(spelled)!r} is outside the directory this server reads media "
                                       "from (--allowed-local-media-path)")
    if not path.is_file():
        raise InvalidInputError(where, f"{_preview(spelled)!r} is not a file")
    size = os.path.getsize(path)
    if size > max_bytes:
        raise LimitExceededError(f"{kind} is {size} bytes, more than the limit of {max_bytes}", "--max-video-bytes")
    return path
