"""The client over TLS with an API key against a real server (certificates made in the test)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from mmserve.clients import Client, ClientError
from mmserve.server.health import GENERATION_SERVICE

RELIABILITY = Path(__file__).parents[1] / "reliability"


def _make_pki(directory: Path):
    pytest.importorskip("cryptography", reason="certificates for the test are made with `cryptography`")
    if "rel_certs" not in sys.modules:
        spec = importlib.util.spec_from_file_location("rel_certs", RELIABILITY / "rel_certs.py")
        sys.modules["rel_certs"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["rel_certs"])
    return sys.modules["rel_certs"].make_pki(directory)


def test_tls_and_api_key(start_server, served_model, tmp_path):
    pki = _make_pki(tmp_path)
    keys = tmp_path / "keys.txt"
    keys.write_text("# test keys\nkey-one\nkey-two\n")
    server = start_server(served_model, server_overrides=dict(
        tls_cert=str(pki.server_cert_file), tls_key=str(pki.server_key_file), api_keys_file=str(keys)))
    with Client(server.address, root_certificates=pki.ca.cert_pem, api_key="key-two", timeout=60) as client:
        assert client.health(GENERATION_SERVICE) == "SERVING"
        assert client.generate(prompt="hi", max_tokens=2, temperature=0).usage.completion_tokens >= 1
    with Client(server.address, root_certificates=pki.ca.cert_pem, timeout=60) as keyless:
        assert keyless.health() == "SERVING"  # probes need no key
        with pytest.raises(ClientError) as refused:
            keyless.generate(prompt="hi", max_tokens=2)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    with Client(server.address, timeout=10) as plaintext:  # a plaintext client cannot talk to a TLS server
        with pytest.raises(ClientError) as info:
            plaintext.health()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE

    # the `mmserve generate` command over TLS, with and without a valid key
    ca = tmp_path / "ca.pem"
    ca.write_bytes(pki.ca.cert_pem)
    args = [sys.executable, "-m", "mmserve.cli", "generate", "--server", server.address, "--prompt", "hi",
            "--max-tokens", "2", "--temperature", "0", "--tls-ca", str(ca), "--json"]
    ok = subprocess.run(args + ["--api-key", "key-one"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    denied = subprocess.run(args + ["--api-key", "wrong"], capture_output=True, text=True, timeout=120)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
