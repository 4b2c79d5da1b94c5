"""The processes `bench/connect.py` drives beside a kvstored of `bench.common.running_daemon`.

- `workers(address, arguments)`: fresh `bench/connect_worker.py` processes started at once; each
  one's figures (its JSON line).
- `ReserveWatch(daemon, since)`: the seconds until the daemon's arena is all reserved.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvstore.proto import kvstore_pb2 as pb
from tests.harness import Daemon, python_env

WORKER = Path(__file__).with_name("connect_worker.py")


def workers(address: str, arguments: list[list[str]]) -> list[dict[str, Any]]:
    """Fresh worker processes started at once, one per argument list; each one's figures."""
    started = [
        subprocess.Popen(
            [sys.executable, str(WORKER), address, *extra],
            stdout=subprocess.PIPE,
            text=True,
            env=python_env(),
        )
        for extra in arguments
    ]
    results = []
    for process in started:
        out, _ = process.communicate(timeout=900)
        if process.returncode != 0:
            for other in started:
                other.kill()
            raise RuntimeError(f"a worker failed (exit {process.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


class ReserveWatch:
    """Polls the daemon's stats from a thread until its arena is all reserved; `seconds` after
    `since` (None: not yet)."""

    def __init__(self, daemon: Daemon, since: float) -> None:
        self.seconds: float | None = None
        self._stub, self._since = daemon.stub(), since
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            reply = self._stub.Stats(pb.StatsRequest())
            capacity = next(t.bytes_capacity for t in reply.tiers if t.name == "cpu")
            if reply.counters["arena_reserved_bytes"] >= capacity:
                self.seconds = time.perf_counter() - self._since
                return
            time.sleep(0.05)

    def wait(self, timeout_s: float) -> float | None:
        self._thread.join(timeout_s)
        self._stop.set()
        return self.seconds
