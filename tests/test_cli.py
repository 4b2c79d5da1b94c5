"""kvctl against the real daemon: stats, health, ls, clear; tables for people, JSON for scripts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvstore_client import KVSpec, KVStoreClient
from tests.harness import Daemon, RedisServer


def kvctl(daemon: Daemon | None, *args: str, address: str | None = None) -> subprocess.CompletedProcess[str]:
    target = address or (daemon.address if daemon else "")
    return subprocess.run(
        [sys.executable, "-m", "kvstore.ctl.cli", "--address", target, *args],
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
    assert f"kvstored {__version__}" in top.stdout and "80.0% since start" in top.stdout
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


def imported_by(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Runs kvctl ARGS as its entry point does, in a fresh interpreter; returns what it printed and
    the modules it had imported by the end (the last line of its stderr)."""
    code = (
        "import sys\n"
        "from kvstore.ctl.cli import main\n"
        "try:\n"
        f"    code = main({list(args)!r})\n"
        "except SystemExit as exit:\n"
        "    code = exit.code\n"
        "print(' '.join(sorted(sys.modules)), file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return result, set(result.stderr.splitlines()[-1].split())


def loaded(modules: set[str], *names: str) -> set[str]:
    return {m for m in modules if any(m == name or m.startswith(name + ".") for name in names)}


def test_version_imports_neither_grpc_nor_numpy_nor_the_store() -> None:
    from kvstore import __version__

    result, modules = imported_by("--version")
    assert result.returncode == 0 and result.stdout == f"kvctl {__version__}\n"
    assert loaded(modules, "grpc", "numpy", "torch", "google", "yaml", "rich") == set()
    assert {m for m in modules if m.startswith("kvstore")} == {
        "kvstore",
        "kvstore.ctl",
        "kvstore.ctl.cli",
        "kvstore.shared",
        "kvstore.shared.paths",
    }


def test_stats_imports_no_store_replay_config_or_rich(daemon: Daemon) -> None:
    result, modules = imported_by("--address", daemon.address, "stats", "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["tiers"]["cpu"]["pages"] == 0
    unwanted = (
        "torch",
        "yaml",
        "rich",
        "kvstore.store.store",
        "kvstore.ctl.replay",
        "kvstore.ctl.fleet",
        "kvstore.config.root",
    )
    assert loaded(modules, *unwanted) == set()
    assert loaded(modules, "kvstore.server.handlers", "kvstore.server.local", "kvstore.store.policy") == set()
    # Over the local channel: neither gRPC nor numpy (most of a call's start-up on a busy machine).
    assert loaded(modules, "grpc", "numpy", "kvstore.shared.keys") == set()


def test_top_without_a_terminal_prints_one_plain_frame(daemon: Daemon) -> None:
    idle = kvctl(daemon, "top", "--interval", "0.1")  # no --once: stdout is a pipe
    assert idle.returncode == 0, idle.stderr
    assert "\x1b[" not in idle.stdout  # no colours or cursor movement
    assert idle.stdout.count("kvstored ") == 1 and "hit ratio - (no lookups since start)" in idle.stdout
    with fill(daemon, "model-top", 1024) as client:
        assert client.lookup(list(range(1024)) + [5] * 256) == 1024  # 4 hits, 1 miss, before the frame
        top = kvctl(daemon, "top", "--interval", "0.1")
    assert top.returncode == 0, top.stderr
    line = next(line for line in top.stdout.splitlines() if "hit ratio" in line)
    assert re.fullmatch(
        r"lookups 0\.0/s  hit ratio - over the last \d+\.\d s \(no lookups\), 80\.0% since start", line
    ), line


def test_top_labels_the_interval_and_the_ratio_since_start() -> None:
    from kvstore.ctl.top import activity, hit_ratio_line

    def stats(hits: int, misses: int, lookups: int) -> dict[str, Any]:
        return {"counters": {"hit_chunks": hits, "missed_chunks": misses, "lookups": lookups}}

    busy = activity(stats(10, 30, 5), stats(16, 32, 7), 2.0)  # 6 hits, 2 misses in 2 s
    assert (busy["lookups_per_s"], busy["hit_ratio"], busy["hit_ratio_since_start"]) == (1.0, 0.75, 16 / 48)
    assert hit_ratio_line(busy, 2.0) == "hit ratio 75.0% over the last 2.0 s, 33.3% since start"
    quiet = activity(stats(16, 32, 7), stats(16, 32, 7), 1.0)
    assert hit_ratio_line(quiet, 1.0) == "hit ratio - over the last 1.0 s (no lookups), 33.3% since start"
    never = activity(stats(0, 0, 0), stats(0, 0, 0), 1.0)
    assert (never["hit_ratio"], never["hit_ratio_since_start"]) == (None, None)
    assert hit_ratio_line(never, 1.0) == "hit ratio - (no lookups since start)"


def test_a_remote_tier_without_maxmemory_has_no_limit(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer
) -> None:
    redis_server.client().config_set("maxmemory", 0)
    daemon = daemon_factory(tiers__remote__enabled=True, tiers__remote__url=redis_server.url)
    stats = json.loads(kvctl(daemon, "stats", "--json").stdout)
    assert stats["tiers"]["remote"]["bytes_capacity"] == 0 and stats["tiers"]["remote"]["bytes_used"] > 0
    table = kvctl(daemon, "stats")
    assert table.returncode == 0, table.stderr
    remote = next(line for line in table.stdout.splitlines() if line.startswith("remote "))
    assert remote.split()[-4:] == ["no", "limit", "-", "0"]  # capacity, use, pages
    top = kvctl(daemon, "top", "--once", "--interval", "0.1")
    row = next(line for line in top.stdout.splitlines() if line.strip("│ ").startswith("remote"))
    assert [cell.strip() for cell in row.split("│")[3:6]] == ["no limit", "-", "0"]


def test_clear_unpins_and_stats_tells_pins_now_from_pins_since_start(daemon: Daemon, tmp_path: Path) -> None:
    with fill(daemon, "model-pin", 1024) as client:
        tokens = tmp_path / "prompt.json"
        tokens.write_text(json.dumps(list(range(1024))))
        pinned = kvctl(daemon, "pin", client.namespace.hex(), "--tokens", str(tokens), "--ttl", "60")
        assert pinned.returncode == 0 and pinned.stdout.startswith("pinned 4 chunks"), pinned.stderr
        assert kvctl(daemon, "clear").stdout.strip() == "cleared 4 pages"
        assert client.lookup(list(range(1024))) == 0
        counters = json.loads(kvctl(daemon, "stats", "--json").stdout)["counters"]
        assert (counters["pinned_pages"], counters["pinned_bytes"]) == (0, 0)
        assert (counters["pinned_chunks"], counters["cleared_chunks"]) == (4, 4)  # since start
        lines = kvctl(daemon, "stats").stdout.splitlines()
    row = {line.split("  ")[0]: i for i, line in enumerate(lines)}  # a table's first column
    assert row["now"] < row["pinned_pages"] < row["since start"] < row["pinned_chunks"]
