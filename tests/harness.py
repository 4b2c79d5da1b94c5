"""The harness that tests and benchmarks share: a real kvstored process, and a real redis-server.

- `start_daemon(tmp_path, name="kvstored", **overrides)`: a daemon in `tmp_path/name` on the
  tests' small default config (`daemon_config`; `overrides` set dotted keys written with `__`,
  `tiers__cpu__bytes="1GiB"`), once it serves.
- `running_daemon(config)`: a daemon on `config` (the YAML's shape) in a temporary directory,
  stopped with SIGTERM on exit (a non-zero exit status is an error) and its directory removed.
- `launch_daemon(args, config_path, socket_path, log_path, **popen)`: `python -m kvstore.server.daemon
  ARGS` once it serves. A benchmark's daemon (`running_daemon`) gets SIGTERM when the process
  that started it dies (even by SIGKILL), so it still removes its socket and arena.
- `Daemon`: `address`, `pid`, `arena_path`, `stub()`, `log()`, `cpu_seconds()`, `stop(sig)`.
- `python_env()`: the environment of a child Python process that imports this checkout.
- `wait_flushed(client)`: the disk tier's stats once nothing is queued or in flight.
- `RedisServer`: a redis-server (or valkey-server) on a unix socket of its own.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server.daemon import arena_name
from kvstore.shared.channel import LocalChannel

REPO_ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1


@dataclass
class Daemon:
    process: subprocess.Popen[bytes]
    config_path: Path
    socket_path: Path
    log_path: Path
    run_dir: Path | None = None  # removed at `stop()`: the harness made it

    @property
    def address(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def arena_path(self) -> Path:
        return Path("/dev/shm") / arena_name(self.socket_path)

    def stub(self) -> pb_grpc.KVStoreStub:
        return pb_grpc.KVStoreStub(grpc.insecure_channel(self.address))

    @property
    def local_path(self) -> Path:
        return self.socket_path.with_name(self.socket_path.name + ".local")

    def admin(self) -> LocalChannel:
        """The local channel, where this process (root, on CI) is known by its uid: an admin."""
        return LocalChannel(str(self.local_path), 10.0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def cpu_seconds(self) -> float:
        """User + system CPU time the daemon has used so far (Linux /proc)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Sends `sig` and returns the exit status; a daemon that outlives `timeout_s` is killed
        (RuntimeError with its log)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise RuntimeError(f"kvstored did not stop {timeout_s} s after {sig}:\n{self.log()}") from None
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return code


def python_env() -> dict[str, str]:
    """Environment for child Python processes that import this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def daemon_config(socket_path: Path, **overrides: Any) -> dict[str, Any]:
    """The tests' config: a 64 MiB CPU tier, chunks of 256 tokens, leases reaped every 50 ms."""
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
    return config


def write_config(path: Path, socket_path: Path, **overrides: Any) -> Path:
    """`daemon_config` written as YAML at `path`."""
    path.write_text(yaml.safe_dump(daemon_config(socket_path, **overrides)))
    return path


def wait_serving(address: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"kvstored exited with {process.returncode}:\n{log_path.read_text()}")
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.05)
    raise TimeoutError(
        f"kvstored did not report SERVING within {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()}"
    )


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that has Linux send the daemon SIGTERM when its parent dies; None where prctl
    is not available."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # resolved before the fork: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def launch_daemon(
    args: list[str],
    config_path: Path,
    socket_path: Path,
    log_path: Path,
    run_dir: Path | None = None,
    die_with_parent: bool = False,
    **popen: Any,
) -> Daemon:
    """`die_with_parent` runs a preexec function in the forked child: a benchmark's choice (one
    process, few threads), not the test suite's (many threads, hundreds of daemons)."""
    popen.setdefault("env", python_env())
    popen.setdefault("cwd", REPO_ROOT)
    if die_with_parent:
        popen["preexec_fn"] = _die_with_parent()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvstore.server.daemon", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            **popen,
        )
    daemon = Daemon(process, config_path, socket_path, log_path, run_dir)
    try:
        wait_serving(daemon.address, process, log_path)
    except BaseException:
        process.kill()
        process.wait()
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return daemon


def start_daemon(tmp_path: Path, name: str = "kvstored", **overrides: Any) -> Daemon:
    run_dir = tmp_path / name
    run_dir.mkdir(parents=True, exist_ok=True)
    socket_path = run_dir / "kvstored.sock"
    config_path = write_config(run_dir / "kvstored.yaml", socket_path, **overrides)
    return launch_daemon(["--config", str(config_path)], config_path, socket_path, run_dir / "kvstored.log")


@contextlib.contextmanager
def running_daemon(config: dict[str, Any]) -> Iterator[Daemon]:
    """A daemon on `config` (its socket in a temporary directory unless `server.unix_socket`
    names one), stopped with SIGTERM on exit; a non-zero exit status is an error."""
    run_dir = Path(tempfile.mkdtemp(prefix="kvstore-"))
    config = copy.deepcopy(config)
    server = config.setdefault("server", {})
    server.setdefault("unix_socket", str(run_dir / "kvstored.sock"))
    config_path = run_dir / "kvstored.yaml"
    config_path.write_text(yaml.safe_dump(config))
    socket_path = Path(server["unix_socket"])
    daemon = launch_daemon(
        ["--config", str(config_path)], config_path, socket_path, run_dir / "kvstored.log", run_dir
    )
    try:
        yield daemon
    finally:
        log = daemon.log()
        code = daemon.stop()
        if code != 0:
            raise RuntimeError(f"kvstored exited with {code} after SIGTERM:\n{log}")


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
