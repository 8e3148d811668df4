"""Server transport security: TLS from PEM files, mutual TLS when a client CA is given.

grpc reports a bad certificate path or a key that is not PEM only as an opaque failure deep in
`add_secure_port`; reading and sanity-checking the files here turns that into a message naming
the flag and the file.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from mmserve.config import ServerConfig

log = logging.getLogger(__name__)


class TLSConfigError(ValueError):
    """A TLS option is inconsistent or names a file that cannot be used."""


def _read_pem(flag: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TLSConfigError(f"{flag} {path!r} is unreadable: {e.strerror or e}") from e
    if b"-----BEGIN " not in data:
        raise TLSConfigError(f"{flag} {path!r} is not a PEM file (no '-----BEGIN' line)")
    return data


def server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    """Credentials for `cfg`, or None for plaintext. Mutual TLS requires client certificates."""
    if not (cfg.tls_cert or cfg.tls_key):
        if cfg.tls_client_ca:
            raise TLSConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS runs over TLS)")
        return None
    if not (cfg.tls_cert and cfg.tls_key):
        raise TLSConfigError("TLS needs both --tls-cert and --tls-key")
    chain = _read_pem("--tls-cert", cfg.tls_cert)
    key = _read_pem("--tls-key", cfg.tls_key)
    if b"PRIVATE KEY-----" not in key:
        raise TLSConfigError(f"--tls-key {cfg.tls_key!r} holds no PEM private key")
    client_ca = _read_pem("--tls-client-ca", cfg.tls_client_ca) if cfg.tls_client_ca else None
    log.info("TLS on%s", " with client certificates required (mTLS)" if client_ca else "")
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def bind(server: grpc.aio.Server, address: str, creds: grpc.ServerCredentials | None) -> int:
    """Listen on `address` (TLS when `creds` is given) and return the bound port (port 0 = any free).

    Create the server with option ("grpc.so_reuseport", 0): grpc enables SO_REUSEPORT by default,
    so a second server on a busy port would silently share its traffic instead of failing here.
    """
    try:
        return server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError as e:  # grpc says only "Failed to bind"; the cause is nearly always one of these
        raise OSError(f"cannot listen on {address}: port in use or not a local address") from e
