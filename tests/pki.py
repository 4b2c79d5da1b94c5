"""A throwaway PKI for the TLS tests: a CA, a server's certificate (for 127.0.0.1 and localhost)
and a client's from it, and another CA's, as PEM files in a directory."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def make_pki(directory: Path) -> dict[str, str]:
    """{"ca", "other_ca", "server_cert", "server_key", "client_cert", "client_key"}: file paths."""
    ca_key, other_key = _key(), _key()
    ca, other = _cert("kvstore test CA", ca_key, None), _cert("another CA", other_key, None)
    files = {}
    files["ca"], _ = _write(directory, "ca", ca, ca_key)
    files["other_ca"], _ = _write(directory, "other", other, other_key)
    server_key, client_key = _key(), _key()
    files["server_cert"], files["server_key"] = _write(
        directory, "server", _cert("kvstored", server_key, (ca, ca_key)), server_key
    )
    files["client_cert"], files["client_key"] = _write(
        directory, "client", _cert("worker", client_key, (ca, ca_key)), client_key
    )
    return files


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if issuer is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    else:
        alt = x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        )
        builder = builder.add_extension(alt, critical=False)
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256())


def _write(
    directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> tuple[str, str]:
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_path), str(key_path)
