"""The disk tier behind the CPU tier: demotion, promotion, crashes, corruption, ENOSPC."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.tiers.disk_files import record_path
from kvstore_client import KVSpec, KVStoreClient
from tests.harness import Daemon, python_env, start_daemon, wait_flushed

CHUNK = 16
SPEC = KVSpec(
    model="disk-test",
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    dtype=torch.float16,
    block_size=16,
    chunk_tokens=CHUNK,
)  # 8 KiB pages
CPU_PAGES = 100


def disk_overrides(path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "chunk_tokens": CHUNK,
        "tiers__cpu__bytes": f"{CPU_PAGES * 8}KiB",
        "tiers__cpu__slab_bytes": f"{CPU_PAGES * 8}KiB",
        "tiers__disk__enabled": True,
        "tiers__disk__path": str(path),
        "tiers__disk__bytes": "64MiB",
        **{f"tiers__disk__{k}": v for k, v in extra.items()},
    }


def prompt(i: int, chunks: int) -> list[int]:
    return [i * 1000 + t for t in range(chunks * CHUNK)]


def cache_for(i: int, chunks: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(i)
    return [torch.randn(2, chunks, 16, 2, 32, generator=gen).half() for _ in range(2)]


def disk_stats(client: KVStoreClient) -> dict[str, Any]:
    stats: dict[str, Any] = client.stats()["tiers"]["disk"]
    return stats


def load_and_compare(client: KVStoreClient, i: int, chunks: int) -> int:
    """Tokens loaded for prompt i; every loaded block equals what was stored."""
    target = [torch.full((2, chunks, 16, 2, 32), -9.0).half() for _ in range(2)]
    loaded = client.load(prompt(i, chunks), target, torch.arange(chunks))
    blocks = loaded // 16
    for got, want in zip(target, cache_for(i, chunks), strict=True):
        assert torch.equal(got[:, :blocks].view(torch.uint8), want[:, :blocks].view(torch.uint8)), (
            f"prompt {i}"
        )
    return loaded


def test_a_thousand_pages_through_a_hundred_page_cpu_tier(
    tmp_path: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    daemon = daemon_factory(**disk_overrides(tmp_path / "disk"))
    prompts, chunks = 100, 10  # 1,000 pages
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        for i in range(prompts):
            assert client.store(prompt(i, chunks), cache_for(i, chunks), torch.arange(chunks)) == chunks
        flushed = wait_flushed(client)
        assert flushed["dropped_writes"] == 0
        for i in range(prompts):
            assert load_and_compare(client, i, chunks) == chunks * CHUNK
        stats = client.stats()
        assert stats["tiers"]["cpu"]["pages"] <= CPU_PAGES
        assert stats["counters"]["promoted_chunks"] >= 900  # most came back from disk
        assert stats["counters"].get("promotion_failures", 0) == 0


def test_a_flipped_byte_is_a_miss_and_the_prefix_still_loads(
    tmp_path: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    disk_path = tmp_path / "disk"
    daemon = daemon_factory(**disk_overrides(disk_path))
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        victim, chunks = 0, 10
        for i in range(30):  # 300 pages: prompt 0 is pushed out to disk
            client.store(prompt(i, chunks), cache_for(i, chunks), torch.arange(chunks))
        wait_flushed(client)
        keys = client.keys(prompt(victim, chunks))
        assert client.stats()["counters"]["demoted_chunks"] >= chunks
        record = record_path(disk_path, client.namespace, keys[6])
        data = bytearray(record.read_bytes())
        data[-100] ^= 0xFF
        record.write_bytes(bytes(data))
        assert load_and_compare(client, victim, chunks) == 6 * CHUNK  # chunks 0..5 load, 6 is a miss
        disk = disk_stats(client)
        assert disk["corrupted_records"] == 1


CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[2])
    from tests.test_disk_daemon import SPEC, prompt, cache_for
    from kvstore_client import KVStoreClient
    with KVStoreClient.connect(sys.argv[1], SPEC) as client:
        i = 1000
        while client.store(prompt(i, 10), cache_for(i, 10), torch.arange(10)):  # 0 once the daemon is gone
            i += 1
""")


def test_kill_9_mid_stream_loses_nothing_flushed(tmp_path: Path) -> None:
    disk_path = tmp_path / "disk"
    overrides = disk_overrides(disk_path, write="through", fsync="always")
    first = start_daemon(tmp_path, **overrides)
    flushed_prompts = range(20)
    try:
        with KVStoreClient.connect(first.address, SPEC) as client:
            for i in flushed_prompts:
                client.store(prompt(i, 10), cache_for(i, 10), torch.arange(10))
            assert wait_flushed(client)["pages"] >= 200  # reported flushed: on disk and synced
        writer = subprocess.Popen(
            [sys.executable, "-c", CHILD, first.address, str(Path(__file__).parents[1])],
            env=python_env(),
            stderr=subprocess.DEVNULL,
        )
        time.sleep(2.0)  # a heavy store stream is under way
        first.process.send_signal(signal.SIGKILL)
        first.process.wait()
        writer.wait(30)  # the client sees the daemon die: a store fails or stores nothing
    finally:
        if first.process.poll() is None:
            first.process.kill()
    second = start_daemon(tmp_path, **overrides)
    try:
        with KVStoreClient.connect(second.address, SPEC) as client:
            for i in flushed_prompts:
                assert load_and_compare(client, i, 10) == 10 * CHUNK
            for i in range(1000, 1040):  # what was in flight: whatever loads has the right bytes
                load_and_compare(client, i, 10)
    finally:
        assert second.stop() == 0


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    return result.returncode == 0


def test_a_full_disk_leaves_the_cpu_tier_serving(
    tmp_path: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    mount = tmp_path / "small"
    if not mount_tmpfs(mount, "256k"):
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    try:  # a directory of the daemon's own in it: the tmpfs's root is world-writable (1777)
        daemon = daemon_factory(**disk_overrides(mount / "disk"))
        with KVStoreClient.connect(daemon.address, SPEC) as client:
            for i in range(60):  # 600 pages of 8 KiB: far more than 256 KiB of disk
                client.store(prompt(i, 10), cache_for(i, 10), torch.arange(10))
            deadline = time.monotonic() + 30
            while disk_stats(client)["enabled"] and time.monotonic() < deadline:
                client.store(prompt(500, 10), cache_for(500, 10), torch.arange(10))
                time.sleep(0.05)
            disk = disk_stats(client)
            assert disk["enabled"] == 0 and disk["errors"] >= 1
            # The daemon keeps serving from memory: a new prompt stores and loads byte for byte.
            assert client.store(prompt(700, 10), cache_for(700, 10), torch.arange(10)) == 10
            assert load_and_compare(client, 700, 10) == 10 * CHUNK
        assert "disk tier" in daemon.log()
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_kvctl_stats_shows_the_disk_tier(tmp_path: Path, daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(**disk_overrides(tmp_path / "disk"))
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        for i in range(15):  # 150 pages: 50 or more go to disk
            client.store(prompt(i, 10), cache_for(i, 10), torch.arange(10))
        wait_flushed(client)
        load_and_compare(client, 0, 10)
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.ctl.cli", "--address", daemon.address, "stats"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    disk_row = next(line for line in lines if line.startswith("disk "))
    assert int(disk_row.split()[-1]) >= 50  # pages on disk
    ratio = next(line for line in lines if line.startswith("compression_ratio"))
    assert float(ratio.split()[-1]) > 0
