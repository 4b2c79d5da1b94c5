"""TLS on the TCP listener: a client with the right CA and token is served (and its pages load back
byte-identical); plain TCP, a wrong CA, a wrong token, or (mutual TLS) no client certificate are
refused. Certificates are made here, for 127.0.0.1, by a throwaway CA."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvstore.config import ConfigError, parse_config
from kvstore.errors import Unavailable
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore_client import ClientTls, KVSpec, KVStoreClient
from tests.harness import Daemon, python_env

TOKEN = "tls-token"
SPEC = KVSpec(model="tls", num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, block_size=16)


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


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, the daemon's certificate and a client's from it, and another CA's."""
    directory = tmp_path_factory.mktemp("pki")
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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def tls_daemon(factory: Callable[..., Daemon], pki: dict[str, str], mutual: bool) -> str:
    port = free_port()
    overrides = {
        "server__tcp": f"127.0.0.1:{port}",
        "server__auth_token": TOKEN,
        "server__tls__cert_file": pki["server_cert"],
        "server__tls__key_file": pki["server_key"],
    }
    if mutual:
        overrides["server__tls__client_ca_file"] = pki["ca"]
    factory(**overrides)
    return f"127.0.0.1:{port}"


def stats_code(channel: grpc.Channel, token: str = TOKEN) -> grpc.StatusCode:
    try:
        pb_grpc.KVStoreStub(channel).Stats(
            pb.StatsRequest(), timeout=10, metadata=(("authorization", f"Bearer {token}"),)
        )
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def credentials(pki: dict[str, str], ca: str = "ca", client: bool = False) -> grpc.ChannelCredentials:
    read = lambda name: Path(pki[name]).read_bytes()  # noqa: E731
    if client:
        return grpc.ssl_channel_credentials(read(ca), read("client_key"), read("client_cert"))
    return grpc.ssl_channel_credentials(read(ca))


def test_the_right_ca_and_token_are_served_and_everything_else_refused(
    daemon_factory: Callable[..., Daemon], pki: dict[str, str]
) -> None:
    address = tls_daemon(daemon_factory, pki, mutual=False)
    with grpc.secure_channel(address, credentials(pki)) as channel:
        assert stats_code(channel) == grpc.StatusCode.OK
        assert stats_code(channel, "wrong") == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(address) as channel:  # plain TCP to a TLS listener
        assert stats_code(channel) == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(address, credentials(pki, ca="other_ca")) as channel:
        assert stats_code(channel) == grpc.StatusCode.UNAVAILABLE
    tokens = list(range(512))
    cache = [torch.randn(2, 32, 16, 2, 16).half() for _ in range(2)]
    tls = ClientTls(pki["ca"])
    with KVStoreClient.connect(address, SPEC, token=TOKEN, tls=tls, shared_memory=False) as client:
        assert not client.shared_memory  # the page bytes cross the TLS connection
        assert client.store(tokens, cache, torch.arange(32)) == 2
        target = [torch.full_like(t, 3.0) for t in cache]
        assert client.load(tokens, target, torch.arange(32)) == 512
        assert all(torch.equal(a, b) for a, b in zip(target, cache, strict=True))
    with pytest.raises(Unavailable):
        KVStoreClient.connect(address, SPEC, token=TOKEN, tls=ClientTls(pki["other_ca"]), timeout_s=3)
    env = python_env() | {"KVSTORE_TOKEN": TOKEN}
    ok = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "--address", address, "--tls-ca", pki["ca"], "stats", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert ok.returncode == 0, ok.stderr
    assert '"tls"' in ok.stdout  # the namespace the client stored


def test_mutual_tls_needs_a_client_certificate_of_the_ca(
    daemon_factory: Callable[..., Daemon], pki: dict[str, str]
) -> None:
    address = tls_daemon(daemon_factory, pki, mutual=True)
    with grpc.secure_channel(address, credentials(pki)) as channel:  # no client certificate
        assert stats_code(channel) == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(address, credentials(pki, client=True)) as channel:
        assert stats_code(channel) == grpc.StatusCode.OK
    tls = ClientTls(pki["ca"], pki["client_cert"], pki["client_key"])
    with KVStoreClient.connect(address, SPEC, token=TOKEN, tls=tls) as client:
        assert client.lookup(list(range(256))) == 0


@pytest.mark.parametrize(
    ("server", "message"),
    [
        (
            {"tcp": "0.0.0.0:50051", "auth_token": TOKEN},
            "server.tls: a TCP listener on 0.0.0.0 needs server.tls.cert_file and key_file",
        ),
        ({"tls": {"cert_file": "/x.crt", "key_file": "/x.key"}}, "server.tls: TLS is for the TCP listener"),
        (
            {"tcp": "127.0.0.1:50051", "auth_token": TOKEN, "tls": {"cert_file": "/x.crt"}},
            "server.tls.key_file: set server.tls.cert_file and key_file together",
        ),
        (
            {"tcp": "127.0.0.1:50051", "auth_token": TOKEN, "tls": {"client_ca_file": "/ca.crt"}},
            "server.tls.client_ca_file: needs server.tls.cert_file and key_file too",
        ),
    ],
)
def test_tls_settings_are_checked(server: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"server": server})
    assert message in str(caught.value)
