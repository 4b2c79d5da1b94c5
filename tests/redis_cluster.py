"""A real Redis (or Valkey) Cluster on localhost for the remote tier's tests: three masters with
one replica each, made by `redis-cli --cluster create`, as an operator makes one.

- `RedisCluster(directory).start()`, `.stop()`; `.seed_url`: a URL of one node.
- `.masters() -> {port: node id}`, `.slot_owner(slot) -> port`, `.client(port)`.
- `.kill(port)`: SIGKILL; `.wait_failover(port)`: until a replica serves its slots.
- `.reshard(source, target, slots)`: `redis-cli --cluster reshard`, as a subprocess.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

NODES = 6  # three masters, one replica each
NODE_TIMEOUT_MS = 1000  # a master unreachable this long is failed over


def cluster_tools() -> tuple[str, str] | None:
    server = shutil.which("redis-server") or shutil.which("valkey-server")
    cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
    return (server, cli) if server and cli else None


def free_ports(count: int) -> list[int]:
    """Ports p with p and p + 10000 (its cluster bus) free."""
    ports: list[int] = []
    candidate = 21000 + (time.monotonic_ns() // 1000) % 20000
    while len(ports) < count:
        candidate = 21000 + (candidate - 21000 + 7) % 30000
        if all(_free(port) for port in (candidate, candidate + 10000)):
            ports.append(candidate)
    return ports


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class RedisCluster:
    def __init__(self, directory: Path, tls: dict[str, str] | None = None) -> None:
        """`tls`: `tests.pki.make_pki`'s files; then every node, the cluster bus and replication
        speak TLS only."""
        tools = cluster_tools()
        assert tools is not None
        self.server, self.cli = tools
        self.directory = directory
        self.ports = free_ports(NODES)
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.tls = tls

    @property
    def url(self) -> str:
        """A seed node's URL, as `tiers.remote.url` of a cluster (`tiers.remote.cluster: true`)."""
        return self.seed_url

    @property
    def seed_url(self) -> str:
        if self.tls:
            return f"rediss://127.0.0.1:{self.ports[0]}?ssl_ca_certs={self.tls['ca']}"
        return f"redis://127.0.0.1:{self.ports[0]}"

    def start(self) -> None:
        for port in self.ports:
            self._launch(port)
        for port in self.ports:
            self._wait(lambda port=port: self.client(port).ping(), f"node {port} to answer")
        subprocess.run(
            [self.cli, *self._cli_tls(), "--cluster", "create", *(f"127.0.0.1:{port}" for port in self.ports)]
            + ["--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self._wait(self._settled, "the cluster to settle")

    def _launch(self, port: int) -> None:
        directory = self.directory / str(port)
        directory.mkdir(exist_ok=True)
        listen = ["--port", str(port)]
        if self.tls:
            listen = [
                "--port", "0",
                "--tls-port", str(port),
                "--tls-cluster", "yes",
                "--tls-replication", "yes",
                "--tls-cert-file", self.tls["server_cert"],
                "--tls-key-file", self.tls["server_key"],
                "--tls-ca-cert-file", self.tls["ca"],
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        self.processes[port] = subprocess.Popen(
            [
                self.server,
                *listen,
                "--bind", "127.0.0.1",
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--cluster-require-full-coverage", "no",
                # A replica shows in CLUSTER SLOTS once its master has pinged it (by default every
                # 10 s) after a sync that waits 5 s for more replicas: a cluster settles in 2-3 s
                # instead of 10.
                "--repl-ping-replica-period", "1",
                "--repl-diskless-sync-delay", "0",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def _settled(self) -> bool:
        """Every node sees state ok, and three slot ranges, each with a master and a replica."""
        for port in self.ports:
            client = self.client(port)
            if b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                return False
            ranges = client.execute_command("CLUSTER", "SLOTS")
            if len(ranges) != 3 or any(len(entry) < 4 for entry in ranges):
                return False
        return True

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()

    def client(self, port: int) -> Any:
        import redis

        tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": self.tls["ca"]} if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, **tls)

    def _cli_tls(self) -> list[str]:
        return ["--tls", "--cacert", self.tls["ca"]] if self.tls else []

    def slots(self) -> list[tuple[int, int, int]]:
        """(first, last, master port) of each range, asked of a live node."""
        for port, process in self.processes.items():
            if process.poll() is None:
                reply = self.client(port).execute_command("CLUSTER", "SLOTS")
                return [(int(first), int(last), int(master[1])) for first, last, master, *_ in reply]
        raise RuntimeError("no node of the cluster is running")

    def slot_owner(self, slot: int) -> int:
        return next(port for first, last, port in self.slots() if first <= slot <= last)

    def masters(self) -> dict[int, str]:
        return {
            port: self.client(port).execute_command("CLUSTER", "MYID").decode()
            for port in sorted({port for _, _, port in self.slots()})
        }

    def replicate(self) -> None:
        """Waits until every master's replica has what the master holds (WAIT)."""
        for port in self.masters():
            assert self.client(port).execute_command("WAIT", 1, 5000) >= 1

    def kill(self, port: int) -> None:
        self.processes[port].send_signal(signal.SIGKILL)
        self.processes[port].wait()

    def wait_failover(self, port: int, timeout_s: float = 30.0) -> None:
        self._wait(
            lambda: port not in {owner for _, _, owner in self.slots()}, f"{port}'s failover", timeout_s
        )

    def reshard(self, source: int, target: int, slots: int) -> subprocess.Popen[bytes]:
        masters = self.masters()
        return subprocess.Popen(
            [self.cli, *self._cli_tls(), "--cluster", "reshard", f"127.0.0.1:{target}"]
            + ["--cluster-from", masters[source], "--cluster-to", masters[target]]
            + ["--cluster-slots", str(slots), "--cluster-yes", "--cluster-pipeline", "10"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    @staticmethod
    def _wait(ready: Any, what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if ready():
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.1)
