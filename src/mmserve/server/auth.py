"""API-key authentication: a grpc.aio server interceptor checking `authorization: Bearer <key>`.

Keys come from a file (one per line, `#` comments and blank lines ignored) and/or the
comma-separated env var MMSERVE_API_KEYS. The check hashes both sides and compares every key with
`hmac.compare_digest`, so timing reveals neither which key matched nor a key's length. Health and
reflection stay open by default because Kubernetes gRPC probes cannot send credentials.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import grpc

from mmserve.config import ServerConfig
from mmserve.server.handlers import rejecting_handler

log = logging.getLogger(__name__)

API_KEYS_ENV = "MMSERVE_API_KEYS"
# Method-name prefixes that probes and grpcurl need; open unless `auth_health` is set.
OPEN_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
_BEARER = "bearer "


def parse_api_keys(text: str) -> list[str]:
    """Keys from a key file's text: one per line, blank lines and `#` comment lines skipped."""
    keys = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return keys


def load_api_keys(path: str = "", env: str | None = None) -> list[str]:
    """All configured keys: the file at `path` (if given) plus the env var MMSERVE_API_KEYS.

    Raises ValueError with the flag to fix when the file is unreadable or names no key, so a typo
    never silently turns authentication off.
    """
    keys: list[str] = []
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-keys-file {path!r} is unreadable: {e}") from e
        file_keys = parse_api_keys(text)
        if not file_keys:
            raise ValueError(f"--api-keys-file {path!r} holds no API key (one per line, '#' starts a comment)")
        keys += file_keys
    env = os.environ.get(API_KEYS_ENV, "") if env is None else env
    keys += [k.strip() for k in env.split(",") if k.strip()]
    return keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without a valid `authorization: Bearer <key>` with UNAUTHENTICATED."""

    def __init__(self, keys: Iterable[str], *, protect_health: bool = False):
        self._digests = [_digest(k) for k in keys]
        if not self._digests:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self._open_prefixes = () if protect_health else OPEN_PREFIXES

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """None when `metadata` carries a valid key, else the reason to send back."""
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        if value is None:
            return "missing API key: send the gRPC metadata 'authorization: Bearer <key>'"
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if not value.lower().startswith(_BEARER):
            return "malformed authorization metadata: expected 'Bearer <key>'"
        given = _digest(value[len(_BEARER):].strip())
        ok = False
        for digest in self._digests:  # no early exit: every key costs the same
            ok |= hmac.compare_digest(digest, given)
        return None if ok else "invalid API key"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(self._open_prefixes):
            return handler
        reason = self.check(details.invocation_metadata)
        if reason is None:
            return handler
        log.info("rejected %s: %s", details.method, reason)
        return rejecting_handler(handler, grpc.StatusCode.UNAUTHENTICATED, reason)


def build_auth_interceptor(cfg: ServerConfig) -> ApiKeyInterceptor | None:
    """The interceptor for `cfg`, or None when no key is configured (authentication off)."""
    keys = load_api_keys(cfg.api_keys_file)
    if not keys:
        return None
    log.info("API-key authentication on (%d keys; health/reflection %s)", len(keys),
             "protected" if cfg.auth_health else "open")
    return ApiKeyInterceptor(keys, protect_health=cfg.auth_health)
