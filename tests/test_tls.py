"""TLS on the TCP listener: a client with the right CA and token is served (and its pages load back
byte-identical); plain TCP, a wrong CA, a wrong token, or (mutual TLS) no client certificate are
refused. Certificates are made here, for 127.0.0.1, by a throwaway CA."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch

from kvstore.config.root import ConfigError, parse_config
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.shared.errors import Unavailable
from kvstore_client import ClientTls, KVSpec, KVStoreClient
from tests.harness import Daemon, python_env
from tests.pki import make_pki

TOKEN = "tls-token"
SPEC = KVSpec(model="tls", num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, block_size=16)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, the daemon's certificate and a client's from it, and another CA's."""
    return make_pki(tmp_path_factory.mktemp("pki"))


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
        [
            sys.executable,
            "-m",
            "kvstore.ctl.cli",
            "--address",
            address,
            "--tls-ca",
            pki["ca"],
            "stats",
            "--json",
        ],
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
