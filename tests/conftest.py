"""Fixtures over the shared harness (`tests.harness`): real kvstored processes, a real redis-server."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Before gRPC is imported: the tests fork children that use raw sockets only, after this process
# has used gRPC, and gRPC's fork handlers can hang the fork itself (seen in a fresh clone's run:
# `os.fork()` waiting in cygrpc's handler for good). Off, a fork is a plain fork.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest  # noqa: E402

from tests.harness import Daemon, RedisServer, start_daemon  # noqa: E402


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
