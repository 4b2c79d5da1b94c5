"""Shared fixtures: a real kvstored process on a temporary socket, and KV specs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.daemon import arena_name
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

STARTUP_TIMEOUT_S = 30.0


@dataclass
class Daemon:
    process: subprocess.Popen[bytes]
    config_path: Path
    socket_path: Path
    log_path: Path

    @property
    def address(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def arena_path(self) -> Path:
        return Path("/dev/shm") / arena_name(self.socket_path)

    def stub(self) -> pb_grpc.KVStoreStub:
        return pb_grpc.KVStoreStub(grpc.insecure_channel(self.address))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout_s)


def write_config(path: Path, socket_path: Path, **overrides: Any) -> Path:
    config: dict[str, Any] = {
        "log_level": "info",
        "chunk_tokens": 256,
        "server": {"unix_socket": str(socket_path), "grace_s": 2.0},
        "leases": {"ttl_s": 30.0, "reap_interval_s": 0.05},
        "tiers": {"cpu": {"bytes": "64MiB", "slab_bytes": "16MiB"}},
    }
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path.write_text(yaml.safe_dump(config))
    return path


def wait_serving(address: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"kvstored exited with {process.returncode}:\n{log_path.read_text()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"kvstored did not start in {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()}")


def start_daemon(tmp_path: Path, name: str = "kvstored", **overrides: Any) -> Daemon:
    run_dir = tmp_path / name
    run_dir.mkdir(parents=True, exist_ok=True)
    socket_path = run_dir / "kvstored.sock"
    config_path = write_config(run_dir / "kvstored.yaml", socket_path, **overrides)
    return launch_daemon(["--config", str(config_path)], config_path, socket_path, run_dir / "kvstored.log")


def launch_daemon(
    args: list[str], config_path: Path, socket_path: Path, log_path: Path, **popen: Any
) -> Daemon:
    """`python -m kvstore.daemon ARGS` (its output in `log_path`), once it serves at `socket_path`."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvstore.daemon", *args], stdout=log, stderr=subprocess.STDOUT, **popen
        )
    daemon = Daemon(process, config_path, socket_path, log_path)
    try:
        wait_serving(daemon.address, process, log_path)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return daemon


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Starts kvstored processes; each is stopped with SIGTERM at the end and must exit 0, leaving nothing."""
    started: list[Daemon] = []

    def factory(name: str = "kvstored", **overrides: Any) -> Daemon:
        daemon = start_daemon(tmp_path, name, **overrides)
        started.append(daemon)
        return daemon

    yield factory
    for daemon in started:
        if daemon.process.poll() is None:
            code = daemon.stop()
            assert code == 0, daemon.log()
            assert not daemon.socket_path.exists()
            assert not daemon.socket_path.with_name(daemon.socket_path.name + ".local").exists()
            assert not daemon.arena_path.exists()


@pytest.fixture
def daemon(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory()


def wait_flushed(client: Any, timeout_s: float = 30.0) -> dict[str, Any]:
    """The daemon's disk-tier stats once nothing is queued, being written, unsynced or read."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats: dict[str, Any] = client.stats()["tiers"]["disk"]
        if (
            stats["queue_depth"] == 0
            and stats["writing"] == 0
            and stats["unsynced"] == 0
            and stats["reads_queued"] == 0
        ):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def python_env() -> dict[str, str]:
    """Environment for child Python processes that import this checkout."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


class RedisServer:
    """A real redis-server (or valkey-server) on a unix socket of its own, no persistence."""

    def __init__(self, executable: str, directory: Path) -> None:
        self.executable = executable
        self.directory = directory
        self.socket_path = directory / "redis.sock"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                self.executable,
                "--port", "0",
                "--unixsocket", str(self.socket_path),
                "--unixsocketperm", "700",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                if self.client().ping():
                    return
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.executable} did not start on {self.socket_path}") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def client(self) -> Any:
        import redis

        return redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=5)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    import shutil
    import tempfile

    executable = shutil.which("redis-server") or shutil.which("valkey-server")
    if executable is None:
        pytest.skip(
            "needs redis-server or valkey-server on PATH (apt-get install redis-server; .ci/run does)"
        )
    with tempfile.TemporaryDirectory(prefix="kvstore-redis-") as directory:
        server = RedisServer(executable, Path(directory))
        server.start()
        try:
            yield server
        finally:
            server.stop()
