"""kvstored as a process: start, refuse, recover from a dead predecessor, drain and clean up."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.keys import chunk_keys, pack_keys
from tests.harness import Daemon, python_env, start_daemon, write_config

SPEC = pb.PageSpec(model="test", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16)


def kvstored(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.server.daemon", *args], capture_output=True, text=True, timeout=60
    )


def store_one(daemon: Daemon) -> bytes:
    stub = daemon.stub()
    ns = stub.Connect(pb.ConnectRequest(spec=SPEC)).namespace
    keys = pack_keys(chunk_keys(ns, list(range(16)), 16))
    lease = stub.Reserve(pb.ReserveRequest(namespace=ns, keys=keys)).lease_id
    stub.Commit(pb.LeaseRequest(namespace=ns, lease_id=lease))
    return ns


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly(daemon_factory: Callable[..., Daemon], sig: int) -> None:
    daemon = daemon_factory()
    store_one(daemon)
    assert daemon.socket_path.exists() and daemon.arena_path.exists()
    assert stat.S_IMODE(daemon.arena_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(daemon.socket_path.stat().st_mode) == 0o660
    assert daemon.stop(sig) == 0
    assert not daemon.socket_path.exists()
    assert not daemon.arena_path.exists()
    assert not daemon.socket_path.with_name("kvstored.sock.lock").exists()
    assert "stopped" in daemon.log()


def test_second_daemon_on_the_same_socket_refuses(daemon: Daemon) -> None:
    result = kvstored("--config", str(daemon.config_path))
    assert result.returncode == 1
    assert f"another kvstored (pid {daemon.process.pid}) is serving {daemon.socket_path}" in result.stderr
    assert daemon.stub().Stats(pb.StatsRequest()).tiers[0].pages == 0  # the first one is untouched


def test_stale_socket_and_arena_are_replaced(tmp_path: Path) -> None:
    first = start_daemon(tmp_path)
    store_one(first)
    first.process.kill()
    first.process.wait()
    assert first.socket_path.exists() and first.arena_path.exists()  # left behind by the dead daemon
    second = start_daemon(tmp_path)
    try:
        assert "stale socket" in second.log() and "stale arena" in second.log()
        stats = second.stub().Stats(pb.StatsRequest())
        assert stats.tiers[0].pages == 0 and stats.tiers[0].bytes_used == 0
        store_one(second)
    finally:
        assert second.stop() == 0
    assert not second.arena_path.exists() and not second.socket_path.exists()


def test_in_flight_calls_drain_on_sigterm(daemon: Daemon) -> None:
    """A Get streaming when SIGTERM arrives completes with all its bytes."""
    stub = daemon.stub()
    ns = stub.Connect(pb.ConnectRequest(spec=SPEC)).namespace
    keys = chunk_keys(ns, list(range(16 * 64)), 16)
    reserved = stub.Reserve(pb.ReserveRequest(namespace=ns, keys=pack_keys(keys)))
    payload = os.urandom(64 * 4096)

    def messages():  # type: ignore[no-untyped-def]
        yield pb.PutRequest(header=pb.PutHeader(namespace=ns, lease_id=reserved.lease_id))
        yield pb.PutRequest(data=payload)

    stub.Put(messages())
    stub.Commit(pb.LeaseRequest(namespace=ns, lease_id=reserved.lease_id))
    lease = stub.Lookup(pb.LookupRequest(namespace=ns, keys=pack_keys(keys), lease=True)).lease_id
    stream = stub.Get(pb.LeaseRequest(namespace=ns, lease_id=lease))
    first = next(stream).data
    daemon.process.send_signal(signal.SIGTERM)
    rest = b"".join(m.data for m in stream)
    assert first + rest == payload
    assert daemon.process.wait(30) == 0


def test_check_config(tmp_path: Path) -> None:
    good = write_config(tmp_path / "good.yaml", tmp_path / "s.sock")
    result = kvstored("--check-config", str(good))
    assert result.returncode == 0 and '"socket_path"' in result.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  cpu:\n    bytes: lots\n")
    result = kvstored("--check-config", str(bad))
    assert result.returncode == 1
    assert "tiers.cpu.bytes: expected a size like 8GiB, got 'lots'" in result.stderr
    bad.write_text("chunk_tokns: 256\n")
    result = kvstored("--config", str(bad))
    assert (
        result.returncode == 1 and "chunk_tokns: unknown key (did you mean 'chunk_tokens'?)" in result.stderr
    )
    bad.write_text("eviction:\n  policy: fifo\n")
    result = kvstored("--check-config", str(bad))
    assert result.returncode == 1 and "eviction.policy: unknown policy 'fifo'" in result.stderr
    bad.write_text("server:\n  event_loop: libev\n")
    result = kvstored("--check-config", str(bad))
    assert result.returncode == 1
    assert "server.event_loop: expected one of auto, uvloop, asyncio, got 'libev'" in result.stderr
    bad.write_text(f"tiers:\n  cpu:\n    shm_dir: {tmp_path / 'no-such-dir'}\n")
    result = kvstored("--check-config", str(bad))
    assert result.returncode == 1
    assert f"tiers.cpu.shm_dir: {tmp_path / 'no-such-dir'} is not a directory on this host" in result.stderr
    bad.write_text("server:\n  max_local_connections: 8\n  max_local_connections_per_uid: 16\n")
    result = kvstored("--check-config", str(bad))
    assert result.returncode == 1
    assert "server.max_local_connections_per_uid: expected at most server.max_local_connections (8)" in (
        result.stderr
    )


def test_tcp_listener_needs_a_token(tmp_path: Path, daemon_factory: Callable[..., Daemon]) -> None:
    config = write_config(tmp_path / "tcp.yaml", tmp_path / "t.sock", server__tcp="127.0.0.1:50999")
    result = kvstored("--config", str(config))
    assert result.returncode == 1 and "server.tcp: a TCP listener needs server.auth_token" in result.stderr

    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon = daemon_factory(server__tcp=f"127.0.0.1:{port}", server__auth_token="s3cret-token")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        from kvstore.proto import kvstore_pb2_grpc as pb_grpc

        stub = pb_grpc.KVStoreStub(channel)
        with pytest.raises(grpc.RpcError) as denied:
            stub.Stats(pb.StatsRequest(), timeout=10)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as wrong:
            stub.Stats(pb.StatsRequest(), timeout=10, metadata=(("authorization", "Bearer nope"),))
        assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = stub.Stats(pb.StatsRequest(), timeout=10, metadata=(("authorization", "Bearer s3cret-token"),))
        assert ok.version
        # Health answers without a token (an orchestrator's probe); reflection is not offered on TCP.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert reflection_code(channel) == grpc.StatusCode.UNIMPLEMENTED
    # The unix socket is guarded by its file mode, not the token; reflection is served there.
    assert daemon.stub().Stats(pb.StatsRequest()).version
    with grpc.insecure_channel(daemon.address) as channel:
        assert reflection_code(channel) == grpc.StatusCode.OK
    # kvctl takes the token from a file or the environment, never from its command line.
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    address = f"127.0.0.1:{port}"
    env = python_env()
    assert kvctl(env, "--address", address, "--token-file", str(token_file), "health").returncode == 0
    assert kvctl(env | {"KVSTORE_TOKEN": "s3cret-token"}, "--address", address, "stats").returncode == 0
    assert kvctl(env | {"KVSTORE_TOKEN_FILE": str(token_file)}, "--address", address, "stats").returncode == 0
    denied_run = kvctl(env | {"KVSTORE_TOKEN": "nope"}, "--address", address, "stats")
    assert denied_run.returncode == 1 and "Bearer <token>" in denied_run.stderr
    assert "--token" not in kvctl(env, "--help").stdout.replace("--token-file", "")


def kvctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.ctl.cli", *args], capture_output=True, text=True, timeout=60, env=env
    )


def reflection_code(channel: grpc.Channel) -> grpc.StatusCode:
    """The status of a reflection request on `channel` (OK where the service is offered)."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    try:
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        next(iter(replies))
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_arena_larger_than_shm_fails_at_start(tmp_path: Path) -> None:
    shm = os.statvfs("/dev/shm")
    too_big = shm.f_bavail * shm.f_frsize + (1 << 30)
    config = write_config(
        tmp_path / "big.yaml",
        tmp_path / "b.sock",
        tiers__cpu__bytes=str(too_big),
        tiers__cpu__slab_bytes="256MiB",
    )
    result = kvstored("--config", str(config))
    assert result.returncode == 1
    assert "tiers.cpu.bytes: a " in result.stderr and "does not fit in /dev/shm" in result.stderr
    assert not (tmp_path / "b.sock").exists()
