"""TLS and mutual TLS with certificates generated per test session, on a real loopback server."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rel_certs import Pki, make_pki
from rel_engine import ServerThread, engine_config, read_stream, text_request
from rel_server import serve

from mmserve.api.mmserve.v1 import generation_pb2 as pb
from mmserve.api.mmserve.v1 import generation_pb2_grpc as pb_grpc
from mmserve.config import ServerConfig
from mmserve.server.auth import build_auth_interceptor
from mmserve.server.tls import TLSConfigError, server_credentials

HEALTH = health_pb2.HealthCheckRequest()
SECURITY_DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _check(target: str, creds: grpc.ChannelCredentials | None, metadata=None) -> grpc.StatusCode:
    """Health Check over a fresh channel; the status code it ends with."""
    channel = grpc.aio.secure_channel(target, creds) if creds else grpc.aio.insecure_channel(target)
    async with channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(HEALTH, timeout=5, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            return e.code()
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return grpc.StatusCode.OK


def test_tls(pki):
    cfg = ServerConfig(port=0, tls_cert=str(pki.server_cert_file), tls_key=str(pki.server_key_file))

    async def scenario():
        async with serve(cfg) as port:
            target = f"localhost:{port}"
            assert await _check(target, grpc.ssl_channel_credentials(pki.ca.cert_pem)) == grpc.StatusCode.OK
            # A plaintext client and a client that trusts another CA never reach the service.
            assert await _check(target, None) == grpc.StatusCode.UNAVAILABLE
            wrong_root = grpc.ssl_channel_credentials(pki.client_ca.cert_pem)
            assert await _check(target, wrong_root) == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_mutual_tls_with_api_key(pki, tmp_path, monkeypatch):
    monkeypatch.delenv("MMSERVE_API_KEYS", raising=False)
    key = secrets.token_urlsafe(16)
    (tmp_path / "keys").write_text(key + "\n")
    cfg = ServerConfig(port=0, tls_cert=str(pki.server_cert_file), tls_key=str(pki.server_key_file),
                       tls_client_ca=str(pki.client_ca_file), api_keys_file=str(tmp_path / "keys"),
                       auth_health=True)

    def client(pair=None) -> grpc.ChannelCredentials:
        if pair is None:
            return grpc.ssl_channel_credentials(pki.ca.cert_pem)
        return grpc.ssl_channel_credentials(pki.ca.cert_pem, pair.key_pem, pair.cert_pem)

    async def scenario():
        async with serve(cfg, [build_auth_interceptor(cfg)]) as port:
            target = f"localhost:{port}"
            bearer = (("authorization", f"Bearer {key}"),)
            assert await _check(target, client(pki.client), bearer) == grpc.StatusCode.OK
            # The certificate opens the transport; the API key is still required on top.
            assert await _check(target, client(pki.client)) == grpc.StatusCode.UNAUTHENTICATED
            # No client certificate, or one from a CA the server does not trust: refused in the handshake.
            assert await _check(target, client(), bearer) == grpc.StatusCode.UNAVAILABLE
            assert await _check(target, client(pki.stranger), bearer) == grpc.StatusCode.UNAVAILABLE
            assert await _check(target, None, bearer) == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_tls_config_errors(pki, tmp_path):
    cert, key, ca = str(pki.server_cert_file), str(pki.server_key_file), str(pki.client_ca_file)
    missing = str(tmp_path / "nope.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(secrets.token_bytes(64))
    cases = [
        (ServerConfig(tls_cert=cert), "needs both --tls-cert and --tls-key"),
        (ServerConfig(tls_key=key), "needs both --tls-cert and --tls-key"),
        (ServerConfig(tls_client_ca=ca), "--tls-client-ca needs --tls-cert"),
        (ServerConfig(tls_cert=cert, tls_key=missing), f"--tls-key '{missing}' is unreadable"),
        (ServerConfig(tls_cert=missing, tls_key=key), f"--tls-cert '{missing}' is unreadable"),
        (ServerConfig(tls_cert=cert, tls_key=str(garbage)), "--tls-key .* is not a PEM file"),
        (ServerConfig(tls_cert=cert, tls_key=cert), "--tls-key .* holds no PEM private key"),
        (ServerConfig(tls_cert=cert, tls_key=key, tls_client_ca=missing), "--tls-client-ca .* is unreadable"),
    ]
    for cfg, message in cases:
        with pytest.raises(TLSConfigError, match=message):
            server_credentials(cfg)
    assert server_credentials(ServerConfig()) is None
    assert server_credentials(ServerConfig(tls_cert=cert, tls_key=key, tls_client_ca=ca)) is not None


def test_real_server_over_mtls_with_api_key(pki, tmp_path, monkeypatch, tiny_checkpoint):
    """The whole app (engine included) behind mutual TLS and an API key."""
    monkeypatch.delenv("MMSERVE_API_KEYS", raising=False)
    key = secrets.token_urlsafe(16)
    (tmp_path / "keys").write_text(f"# ops\n{key}\n")
    cfg = ServerConfig(port=0, worker_threads=1, tls_cert=str(pki.server_cert_file), tls_key=str(pki.server_key_file),
                       tls_client_ca=str(pki.client_ca_file), api_keys_file=str(tmp_path / "keys"))
    server = ServerThread(engine_config(tiny_checkpoint), cfg).start()
    creds = grpc.ssl_channel_credentials(pki.ca.cert_pem, pki.client.key_pem, pki.client.cert_pem)

    async def scenario():
        async with grpc.aio.secure_channel(f"localhost:{server.port}", creds) as ch:
            stub = pb_grpc.GenerationStub(ch)
            ok = await read_stream(stub.Generate(text_request("tls-1", 3), metadata=(("authorization", f"Bearer {key}"),)))
            assert ok.code is None and len(ok.token_ids) == 3
            denied = await read_stream(stub.Generate(text_request("tls-2", 3)))
            assert denied.code == grpc.StatusCode.UNAUTHENTICATED and not denied.token_ids
            # Uploads go through the same credentials and key check.
            upload = [pb.UploadMediaRequest(metadata=pb.UploadMetadata()), pb.UploadMediaRequest(chunk=b"bytes")]
            ref = await stub.UploadMedia(iter(upload), metadata=(("authorization", f"Bearer {key}"),))
            assert ref.id == hashlib.sha256(b"bytes").hexdigest()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.UploadMedia(iter(upload))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        target = f"localhost:{server.port}"
        assert await _check(target, creds) == grpc.StatusCode.OK  # probes need no key
        assert await _check(target, grpc.ssl_channel_credentials(pki.ca.cert_pem)) == grpc.StatusCode.UNAVAILABLE

    try:
        asyncio.run(scenario())
        run = _security_doc_grpcurl(pki, tmp_path, server.port)
        answered, refused = run(key), run("not-" + key)
        assert answered.returncode == 0 and '"final"' in answered.stdout, answered.stderr
        assert refused.returncode != 0 and "Unauthenticated" in refused.stderr, refused
        server.assert_nothing_leaked()
    finally:
        server.stop()


def _security_doc_grpcurl(pki: Pki, directory: Path, port: int):
    """docs/security.md's grpcurl example as written, in a directory holding the files it names, the
    address it dials replaced by the server's and the client certificate added, as the doc says to
    for mutual TLS. Returns a function running it with a KEY."""
    (command,) = re.findall(r"^grpcurl .*?mmserve\.v1\.Generation/Generate$", SECURITY_DOC.read_text(), re.M | re.S)
    command = command.replace("grpcurl ", "grpcurl -cert client.crt -key client.key ", 1)
    command, dialled = re.subn(r"\S+:50051", f"localhost:{port}", command)
    assert dialled == 1, command
    for name, pem in (("ca.crt", pki.ca.cert_pem), ("client.crt", pki.client.cert_pem),
                      ("client.key", pki.client.key_pem)):
        (directory / name).write_bytes(pem)
    grpcurl = shutil.which("grpcurl") or str(Path(sys.executable).with_name("grpcurl"))
    script = f'grpcurl() {{ "{grpcurl}" "$@"; }}\n{command}'
    return lambda key: subprocess.run(["bash", "-c", script], cwd=directory, capture_output=True, text=True,
                                      timeout=120, env=dict(os.environ, KEY=key))
