"""GetTokenizer: the checkpoint's tokenizer files as one zip, streamed in chunks, sha256 on the last.

A gateway builds its tokenizer and chat template from this, so it needs no copy of the checkpoint
and never looks a model id up off the machine. The archive is built once, in a worker thread (file
I/O and deflate must not stall the event loop), and served from memory after.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from pathlib import Path

from smg_grpc_proto.generated import common_pb2

# What a gateway reads to tokenize, render the chat template and recognise the model.
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
         "merges.txt", "tokenizer.model", "chat_template.json", "config.json", "generation_config.json",
         "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
PATTERNS = ("*.jinja",)
CHUNK_BYTES = 64 * 1024


def archive_members(model_dir: Path) -> list[Path]:
    """The files the archive holds, sorted by name."""
    found = {model_dir / name for name in FILES if (model_dir / name).is_file()}
    found.update(p for pattern in PATTERNS for p in model_dir.glob(pattern) if p.is_file())
    return sorted(found, key=lambda p: p.name)


def build_archive(model_dir: Path) -> tuple[bytes, str]:
    """(zip bytes, their sha256 hex)."""
    members = archive_members(model_dir)
    if not any(p.name == "tokenizer.json" for p in members):
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in members:
            zf.write(path, path.name)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


class TokenizerArchive:
    """The archive of one checkpoint directory, built on first use."""

    def __init__(self, model_dir: str | Path) -> None:
        self._dir = Path(model_dir)
        self._built: asyncio.Future | None = None

    async def chunks(self) -> list[common_pb2.GetTokenizerChunk]:
        if self._built is None or (self._built.done() and self._built.exception() is not None):
            self._built = asyncio.ensure_future(asyncio.to_thread(build_archive, self._dir))
        data, digest = await asyncio.shield(self._built)
        pieces = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
        return [common_pb2.GetTokenizerChunk(data=piece, sha256=digest if i == len(pieces) - 1 else "")
                for i, piece in enumerate(pieces)]
