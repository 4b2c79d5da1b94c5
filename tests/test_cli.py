"""kvctl against the real daemon: stats, health, ls, clear; tables for people, JSON for scripts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import torch

from kvstore_client import KVSpec, KVStoreClient
from tests.harness import Daemon


def kvctl(daemon: Daemon | None, *args: str, address: str | None = None) -> subprocess.CompletedProcess[str]:
    target = address or (daemon.address if daemon else "")
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "--address", target, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def fill(daemon: Daemon, model: str, tokens: int) -> KVStoreClient:
    spec = KVSpec(model=model, num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, block_size=16)
    client = KVStoreClient.connect(daemon.address, spec)
    cache = [torch.randn(2, tokens // 16, 16, 2, 16).half() for _ in range(2)]
    client.store(list(range(tokens)), cache, torch.arange(tokens // 16))
    return client


def test_stats_table_and_json(daemon: Daemon) -> None:
    with fill(daemon, "model-a", 1024) as client:
        client.lookup(list(range(1024)) + [1] * 512)
        result = kvctl(daemon, "stats", "--json")
        assert result.returncode == 0, result.stderr
        stats = json.loads(result.stdout)
        page = client.page_bytes
        assert stats["tiers"]["cpu"]["pages"] == 4
        assert stats["tiers"]["cpu"]["bytes_used"] == 4 * page
        assert stats["tiers"]["cpu"]["bytes_capacity"] == 64 << 20
        assert stats["counters"]["hit_chunks"] == 4 and stats["counters"]["missed_chunks"] == 2
        assert stats["counters"]["stored_chunks"] == 4 and stats["counters"]["active_leases"] == 0
        assert stats["namespaces"] == [
            {
                "namespace": client.namespace.hex(),
                "model": "model-a",
                "pages": 4,
                "bytes": 4 * page,
                "page_bytes": page,
            }
        ]
        table = kvctl(daemon, "stats")
        assert table.returncode == 0
        lines = table.stdout.splitlines()
        cpu_row = next(line for line in lines if line.startswith("cpu "))
        assert cpu_row.split()[-1] == "4" and "64.0 MiB" in cpu_row
        assert any(line.startswith("chunk_hit_ratio") and line.endswith("0.667") for line in lines)
        assert any(client.namespace.hex() in line and "model-a" in line for line in lines)


def test_health_ls_and_clear(daemon: Daemon) -> None:
    health = kvctl(daemon, "health")
    assert health.returncode == 0 and health.stdout.strip() == "SERVING"
    assert kvctl(daemon, "ls").stdout.strip() == "no namespaces"
    with fill(daemon, "model-a", 512) as a, fill(daemon, "model-b", 1024) as b:
        listing = json.loads(kvctl(daemon, "ls", "--json").stdout)
        assert {(n["model"], n["pages"]) for n in listing} == {("model-a", 2), ("model-b", 4)}
        cleared = kvctl(daemon, "clear", "--namespace", a.namespace.hex())
        assert cleared.returncode == 0 and cleared.stdout.startswith("cleared 2 pages")
        assert a.lookup(list(range(512))) == 0 and b.lookup(list(range(1024))) == 1024
        assert kvctl(daemon, "clear").stdout.strip() == "cleared 4 pages"
        assert b.lookup(list(range(1024))) == 0
        assert json.loads(kvctl(daemon, "stats", "--json").stdout)["tiers"]["cpu"]["bytes_used"] == 0


def test_errors_are_one_clear_line(daemon: Daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad_ns = kvctl(daemon, "clear", "--namespace", "zz")
    assert bad_ns.returncode == 1 and "--namespace: expected 32 hex digits" in bad_ns.stderr
    unknown = kvctl(daemon, "clear", "--namespace", "00" * 16)
    assert unknown.returncode == 1 and "is not registered" in unknown.stderr and "NOT_FOUND" in unknown.stderr
    down = kvctl(None, "stats", address=f"unix://{tmp_path}/nothing.sock")
    assert down.returncode == 1 and down.stderr.startswith("kvctl: Stats:") and "UNAVAILABLE" in down.stderr
    assert "Traceback" not in down.stderr


def test_version_and_a_frame_of_top(daemon: Daemon) -> None:
    from kvstore import __version__

    version = kvctl(None, "--version")
    assert version.returncode == 0 and version.stdout.strip() == f"kvctl {__version__}"
    with fill(daemon, "model-top", 1024) as client:
        assert client.lookup(list(range(1024)) + [5] * 256) == 1024  # 4 hits, 1 miss
        top = kvctl(daemon, "top", "--once", "--interval", "0.2")
    assert top.returncode == 0, top.stderr
    assert f"kvstored {__version__}" in top.stdout and "hit ratio 80.0%" in top.stdout
    lines = top.stdout.splitlines()
    cpu = next(line for line in lines if line.strip("│ ").startswith("cpu"))
    assert "64.0 MiB" in cpu and cpu.split("│")[5].strip() == "4"  # capacity, pages
    assert any("model-top" in line and "│ 4 " in line for line in lines)


def test_json_logs_are_one_object_per_line(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(log_format="json")
    assert kvctl(daemon, "health").returncode == 0
    daemon.stop()
    lines = [json.loads(line) for line in daemon.log().splitlines()]
    assert lines and all({"time", "level", "logger", "message", "pid"} <= line.keys() for line in lines)
    assert any(line["message"].startswith("kvstored ") and "serving on" in line["message"] for line in lines)
    assert {line["level"] for line in lines} <= {"debug", "info", "warning", "error"}
