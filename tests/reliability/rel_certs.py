"""Throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1/localhost, client certificates."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class KeyPair:
    cert_pem: bytes
    key_pem: bytes
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> KeyPair:
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), key_pem, cert, key)


def make_ca(common_name: str) -> KeyPair:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return _pem(cert, key)


def issue(ca: KeyPair, common_name: str, *, server: bool) -> KeyPair:
    """A leaf certificate signed by `ca`; server ones are valid for localhost and 127.0.0.1."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca.cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return _pem(builder.sign(ca.key, hashes.SHA256()), key)


@dataclass
class Pki:
    """Files a server reads plus the PEM bytes a client needs."""

    ca: KeyPair
    server: KeyPair
    client_ca: KeyPair
    client: KeyPair
    stranger: KeyPair  # signed by a CA the server does not trust
    server_cert_file: Path
    server_key_file: Path
    client_ca_file: Path


def make_pki(directory: Path) -> Pki:
    ca, client_ca, other_ca = make_ca("mmserve test CA"), make_ca("mmserve client CA"), make_ca("untrusted CA")
    server = issue(ca, "localhost", server=True)
    paths = {name: directory / name for name in ("server.crt", "server.key", "client_ca.crt")}
    paths["server.crt"].write_bytes(server.cert_pem)
    paths["server.key"].write_bytes(server.key_pem)
    paths["client_ca.crt"].write_bytes(client_ca.cert_pem)
    return Pki(ca, server, client_ca, issue(client_ca, "client", server=False), issue(other_ca, "stranger", server=False),
               paths["server.crt"], paths["server.key"], paths["client_ca.crt"])
