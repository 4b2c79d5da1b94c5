"""Disk tier: records round-trip byte-identical, survive clean and unclean stops, never serve bad bytes.

Every scenario runs the real tier on a real filesystem (a temporary directory, or a small
tmpfs for ENOSPC) and reads the pages back to compare bytes.
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.config.root import ConfigError, DiskTierConfig, parse_config
from kvstore.server.progress import progress_reporter
from kvstore.tiers import disk_io
from kvstore.tiers.codec import Codec, compress
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_files import INDEX_NAME, record_path
from kvstore.tiers.records import HEADER_BYTES, CorruptRecord, pack_header, unpack_header

KIB, MIB = 1 << 10, 1 << 20
NS = bytes(range(16))
REPO_ROOT = Path(__file__).resolve().parents[1]


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def page(i: int, size: int = 96 * KIB, compressible: bool = False) -> bytes:
    """Page i's bytes, the same in every process; compressible ones are half zeros."""
    data = random.Random(i).randbytes(size)
    return bytes(size // 2) + data[size // 2 :] if compressible else data


class Completions:
    """Collects `done` callbacks of submitted writes; `wait` blocks until `count` have come."""

    def __init__(self) -> None:
        self.results: dict[int, bool] = {}
        self._cond = threading.Condition()

    def callback(self, i: int) -> Callable[[bool], None]:
        def done(durable: bool) -> None:
            with self._cond:
                self.results[i] = durable
                self._cond.notify_all()

        return done

    def wait(self, count: int, timeout_s: float = 10.0) -> dict[int, bool]:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.results) >= count, timeout_s):
                raise TimeoutError(f"{len(self.results)} of {count} writes completed")
            return dict(self.results)


@pytest.fixture
def open_tier(tmp_path: Path) -> Iterator[Callable[..., DiskTier]]:
    """Opens and recovers tiers on tmp_path/disk (or a given path); closes them at the end."""
    opened: list[DiskTier] = []

    def open_(path: Path | None = None, **overrides: Any) -> DiskTier:
        settings: dict[str, Any] = dict(
            enabled=True,
            path=str(path or tmp_path / "disk"),
            bytes=64 * MIB,
            fsync="never",
            threads=2,
            queue_bytes=16 * MIB,
        )
        tier = DiskTier(DiskTierConfig(**(settings | overrides)))
        tier.recover()
        opened.append(tier)
        return tier

    yield open_
    for tier in opened:
        tier.close()


def drop_cache(root: Path) -> None:
    """Writes back and drops every cached page of the files under root (cold reads follow)."""
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def has_o_direct(directory: Path) -> bool:
    probe = directory / "o_direct_probe"
    probe.write_bytes(bytes(4096))
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def in_page_cache(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        return disk_io._cached(fd, path.stat().st_size)
    finally:
        os.close(fd)


def write_pages(tier: DiskTier, pages: dict[int, bytes]) -> dict[int, bool]:
    done = Completions()
    for i, data in pages.items():
        assert tier.submit_write(NS, key(i), data, done.callback(i))
    return done.wait(len(pages))


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["lz4", "none"])
def test_many_pages_round_trip_byte_identical(open_tier: Callable[..., DiskTier], codec: str) -> None:
    tier = open_tier(codec=codec)
    pages = {
        i: page(i, size=random.Random(-i).randrange(1, 160) * KIB, compressible=i % 2 == 0)
        for i in range(200)
    }

    assert write_pages(tier, pages) == {i: True for i in pages}

    assert all(tier.read(NS, key(i)) == data for i, data in pages.items())
    stats = tier.stats()
    assert stats["pages"] == stats["written"] == 200 and stats["dropped_writes"] == 0
    assert stats["promotions"] == 200 and stats["corrupted_records"] == 0
    if codec == "lz4":  # the half-zero pages shrink; the random ones are stored raw
        assert 1.2 < stats["compression_ratio"] < 2.0
    else:
        assert stats["compression_ratio"] < 1.0  # headers only
    assert tier.read(NS, key(999)) is None and tier.stats()["read_misses"] == 1


@pytest.mark.parametrize("compressible", [False, True])
def test_submit_read_into_a_buffer_calls_back_on_a_worker(
    open_tier: Callable[..., DiskTier], compressible: bool
) -> None:
    tier = open_tier()
    data = page(7, compressible=compressible)
    write_pages(tier, {7: data})
    target = memoryview(bytearray(b"\xee" * len(data)))
    got: list[Any] = []
    finished = threading.Event()

    def done(result: Any) -> None:
        got.append((result, threading.current_thread().name))
        finished.set()

    assert tier.submit_read(NS, key(7), done, into=target)
    assert finished.wait(5)

    result, thread = got[0]
    assert result is target and bytes(target) == data
    assert thread.startswith("kvstore-disk-")
    assert not tier.submit_read(NS, key(8), done)  # not on disk: a miss, no callback
    # A record whose header gives another page size than the slot is not this page: corrupt, dropped.
    assert not tier.submit_read(NS, key(7), done, into=memoryview(bytearray(10)))
    assert tier.stats()["corrupted_records"] == 1 and not tier.contains(NS, key(7))


def test_a_page_still_queued_is_read_from_the_queue(open_tier: Callable[..., DiskTier]) -> None:
    tier = open_tier(threads=1)
    pages = {i: page(i, size=512 * KIB) for i in range(20)}
    for i, data in pages.items():
        assert tier.submit_write(NS, key(i), data)

    assert tier.contains(NS, key(19))
    assert tier.read(NS, key(19)) == pages[19]  # served from the queue or the file: same bytes
    assert all(tier.read(NS, key(i)) == data for i, data in pages.items())


def test_a_write_under_way_counts_as_writing_until_its_record_is_in_the_index(
    open_tier: Callable[..., DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queue empty is not flushed: a page a worker took off the queue is `writing` until indexed."""
    from kvstore.tiers import disk_workers

    release, entered = threading.Event(), threading.Event()
    real_write = disk_workers.write_record

    def slow_write(*args: Any, **kwargs: Any) -> None:
        entered.set()
        assert release.wait(10)
        real_write(*args, **kwargs)

    monkeypatch.setattr(disk_workers, "write_record", slow_write)
    tier = open_tier(threads=1)
    assert tier.submit_write(NS, key(7), page(7))
    assert entered.wait(10)

    held = tier.stats()
    assert (held["queue_depth"], held["writing"], held["pages"]) == (0, 1, 0)
    release.set()
    deadline = time.monotonic() + 10
    while tier.stats()["writing"] and time.monotonic() < deadline:
        time.sleep(0.01)
    done = tier.stats()
    assert (done["queue_depth"], done["writing"], done["pages"]) == (0, 0, 1)
    assert tier.read(NS, key(7)) == page(7)


def test_writing_a_page_twice_keeps_one_record(open_tier: Callable[..., DiskTier]) -> None:
    tier = open_tier()
    write_pages(tier, {1: page(1)})
    done = Completions()

    assert tier.submit_write(NS, key(1), page(1), done.callback(1))
    assert done.wait(1) == {1: True}
    assert tier.stats()["written"] == 1 and tier.stats()["duplicate_writes"] == 1


# --- recovery ---------------------------------------------------------------------------------


def test_a_clean_close_leaves_an_index_that_reloads_without_a_scan(
    tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    tier = open_tier()
    pages = {i: page(i, compressible=i % 3 == 0) for i in range(50)}
    write_pages(tier, pages)
    tier.touch(NS, [key(0)])  # most recent now: saved last in the index
    tier.close()
    assert (tmp_path / "disk" / INDEX_NAME).exists()

    again = DiskTier(tier.config)
    records = again.recover()
    try:
        assert not (tmp_path / "disk" / INDEX_NAME).exists()  # a crash from now on must scan
        assert [r.key for r in records][-1] == key(0)
        assert {r.key for r in records} == {key(i) for i in pages}
        assert all(again.read(NS, key(i)) == data for i, data in pages.items())
        assert again.stats()["skipped_on_recovery"] == 0
    finally:
        again.close()


def test_torn_and_truncated_records_are_skipped_and_counted(
    tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    tier = open_tier()
    pages = {i: page(i) for i in range(10)}
    write_pages(tier, pages)
    tier.close()
    (tmp_path / "disk" / INDEX_NAME).unlink()  # as after a crash
    truncated = record_path(tmp_path / "disk", NS, key(3))
    truncated.write_bytes(truncated.read_bytes()[: HEADER_BYTES + 100])
    torn = truncated.with_name(f".{key(11).hex()}.0.tmp")
    torn.write_bytes(b"half a record")

    again = open_tier()

    stats = again.stats()
    assert stats["torn_records"] == 1 and stats["corrupted_records"] == 1
    assert stats["skipped_on_recovery"] == 2 and stats["pages"] == 9
    assert not torn.exists() and not truncated.exists()
    assert again.read(NS, key(3)) is None
    assert all(again.read(NS, key(i)) == data for i, data in pages.items() if i != 3)


def test_after_kill_9_every_flushed_page_reads_back_and_no_bytes_are_wrong(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    writer = textwrap.dedent(f"""
        import os, time
        from kvstore.config.root import DiskTierConfig
        from kvstore.tiers.disk import DiskTier
        from tests.test_disk_tier import NS, key, page
        tier = DiskTier(DiskTierConfig(enabled=True, path={str(path)!r}, fsync="never", threads=2))
        tier.recover()
        def flushed(i):
            return lambda ok: ok and os.write(1, b"%d\\n" % i)  # one write: threads do not interleave
        i = 0
        while True:  # a heavy stream: the parent kills it mid-write
            if tier.submit_write(NS, key(i), page(i, size=256 * 1024, compressible=i % 2 == 0), flushed(i)):
                i += 1
            else:
                time.sleep(0.001)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", writer],
        stdout=subprocess.PIPE,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert proc.stdout is not None
    flushed = [int(proc.stdout.readline()) for _ in range(60)]
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    tier = DiskTier(DiskTierConfig(enabled=True, path=str(path), fsync="never", threads=2))
    records = tier.recover()
    try:
        keys = {r.key for r in records}
        assert {key(i) for i in flushed} <= keys
        for record in records:  # every record served is the exact page, flushed or not
            i = int.from_bytes(record.key, "big")
            assert tier.read(NS, record.key) == page(i, size=256 * 1024, compressible=i % 2 == 0)
        assert tier.stats()["corrupted_records"] == 0
    finally:
        tier.close()


# --- corruption -------------------------------------------------------------------------------


def test_one_flipped_byte_makes_that_page_a_miss_and_is_counted(
    tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    tier = open_tier()
    pages = {i: page(i) for i in range(3)}
    write_pages(tier, pages)
    tier.close()
    victim = record_path(tmp_path / "disk", NS, key(1))
    raw = bytearray(victim.read_bytes())
    raw[HEADER_BYTES + 5000] ^= 0x01
    victim.write_bytes(raw)

    again = open_tier()  # the clean-shutdown index: the flip is found on read

    assert again.read(NS, key(0)) == pages[0]
    assert again.read(NS, key(1)) is None
    assert again.read(NS, key(2)) == pages[2]
    assert again.stats()["corrupted_records"] == 1
    assert not again.contains(NS, key(1)) and not victim.exists()


def test_a_flipped_header_byte_is_found_by_the_recovery_scan(
    tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    tier = open_tier()
    write_pages(tier, {0: page(0), 1: page(1)})
    tier.close()
    (tmp_path / "disk" / INDEX_NAME).unlink()
    victim = record_path(tmp_path / "disk", NS, key(1))
    raw = bytearray(victim.read_bytes())
    raw[40] ^= 0x80  # inside the key
    victim.write_bytes(raw)

    again = open_tier()

    assert again.stats()["skipped_on_recovery"] == 1 and again.stats()["corrupted_records"] == 1
    assert again.read(NS, key(0)) == page(0) and again.read(NS, key(1)) is None


def test_every_single_bit_flip_in_a_record_is_caught() -> None:
    data = page(5, size=4 * KIB, compressible=True)
    codec, payload = compress(Codec.LZ4, data)
    header = pack_header(NS, key(5), codec, len(data), payload)
    assert codec is Codec.LZ4 and unpack_header(header).decode(payload) == data
    for bit in range(HEADER_BYTES * 8):
        flipped = bytearray(header)
        flipped[bit // 8] ^= 1 << bit % 8
        with pytest.raises(CorruptRecord):
            unpack_header(flipped)
    for position in range(0, len(payload), 7):
        flipped = bytearray(payload)
        flipped[position] ^= 0x10
        with pytest.raises(CorruptRecord):
            unpack_header(header).decode(flipped)


# --- the read path: page cache, O_DIRECT, buffered ---------------------------------------------


@pytest.mark.parametrize("compressible", [False, True])
@pytest.mark.parametrize(
    "size", [1, 4096 - HEADER_BYTES, 4096, 4 * MIB - HEADER_BYTES, 4 * MIB, 4 * MIB + 5000, 9 * MIB + 3]
)
def test_a_record_reads_back_identical_cold_cached_direct_or_buffered(
    tmp_path: Path, size: int, compressible: bool
) -> None:
    """Sizes around the 4 KiB alignment and the 4 MiB O_DIRECT chunk; into a slot and not."""
    data = page(size, size=size, compressible=compressible)
    codec, payload = compress(Codec.LZ4, data)
    assert codec is (Codec.LZ4 if compressible and size > 1 else Codec.NONE)
    path = tmp_path / "record.kvr"
    path.write_bytes(pack_header(NS, key(1), codec, size, payload) + bytes(payload))
    stored = HEADER_BYTES + len(payload)
    for direct, cold in itertools.product([True, False], [True, False]):
        if cold:
            drop_cache(tmp_path)
        else:
            path.read_bytes()
        tally: Counter[str] = Counter()
        slot = memoryview(bytearray(b"\xee" * size))

        assert disk_io.read_record(path, NS, key(1), stored, slot, direct, tally) is slot
        assert bytes(slot) == data
        assert sum(tally.values()) == stored
        assert bytes(disk_io.read_record(path, NS, key(1), stored, None, direct)) == data
        if not direct:
            assert tally["read_bytes_buffered"] == stored
        elif cold and has_o_direct(tmp_path):
            assert tally["read_bytes_direct"] == stored


def test_cold_pages_are_read_around_the_page_cache_and_cached_ones_from_it(
    tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    if not has_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}: no O_DIRECT on this filesystem")
    tier = open_tier(codec="none")
    pages = {i: page(i, size=(i + 1) * 700 * KIB) for i in range(6)}
    write_pages(tier, pages)
    records = {i: record_path(tier.root, NS, key(i)) for i in pages}
    stored = sum(path.stat().st_size for path in records.values())
    drop_cache(tier.root)

    assert all(tier.read(NS, key(i)) == data for i, data in pages.items())
    stats = tier.stats()
    assert stats["read_bytes_direct"] == stored and stats.get("read_bytes_buffered", 0) == 0
    assert not any(in_page_cache(path) for path in records.values())  # not cached a second time

    for path in records.values():
        path.read_bytes()  # as a recent write or read leaves them
    if not in_page_cache(records[0]):
        pytest.skip("no cachestat(2) on this kernel: every read goes around the page cache")
    assert all(tier.read(NS, key(i)) == data for i, data in pages.items())
    assert tier.stats()["read_bytes_cached"] == stored
    assert tier.stats()["read_bytes_direct"] == stored  # unchanged


def test_reads_are_buffered_where_o_direct_is_refused(
    open_tier: Callable[..., DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem without O_DIRECT refuses it with EINVAL, at fcntl or at the read."""
    tier = open_tier(codec="none")
    pages = {i: page(i, size=300 * KIB) for i in range(4)}
    write_pages(tier, pages)
    real_fcntl = disk_io.fcntl.fcntl

    def refuse_o_direct(fd: int, command: int, arg: int = 0) -> int:
        if command == disk_io.fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_fcntl(fd, command, arg)

    monkeypatch.setattr(disk_io.fcntl, "fcntl", refuse_o_direct)
    drop_cache(tier.root)

    assert all(tier.read(NS, key(i)) == data for i, data in pages.items())
    stored = sum(record_path(tier.root, NS, key(i)).stat().st_size for i in pages)
    stats = tier.stats()
    assert stats["read_bytes_buffered"] == stored and stats["promotions"] == 4


def test_a_flipped_byte_in_a_cold_record_is_caught_on_the_direct_path(
    tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    tier = open_tier(codec="none")
    pages = {i: page(i, size=5 * MIB + 11) for i in range(2)}
    write_pages(tier, pages)
    victim = record_path(tier.root, NS, key(1))
    with open(victim, "r+b") as file:  # in the second O_DIRECT chunk
        file.seek(HEADER_BYTES + 4 * MIB + 100)
        flipped = file.read(1)[0] ^ 0x20
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([flipped]))
    drop_cache(tier.root)

    assert tier.read(NS, key(0)) == pages[0]
    assert tier.read(NS, key(1)) is None
    assert tier.stats()["corrupted_records"] == 1 and not victim.exists()


def test_lz4_stores_pages_it_cannot_shrink_raw() -> None:
    data = page(1)
    assert compress(Codec.LZ4, data) == (Codec.NONE, data)


# --- space and the queue ----------------------------------------------------------------------


def test_a_full_tier_evicts_the_least_recently_used_records(open_tier: Callable[..., DiskTier]) -> None:
    size = 100 * KIB
    tier = open_tier(bytes=5 * (size + HEADER_BYTES), threads=1)
    write_pages(tier, {i: page(i, size) for i in range(5)})
    tier.touch(NS, [key(0), key(1)])  # 0 and 1 are used again, 0 last

    write_pages(tier, {i: page(i, size) for i in range(5, 8)})

    assert sorted(tier.take_evicted()) == [(NS, key(2)), (NS, key(3)), (NS, key(4))]
    assert tier.take_evicted() == []
    assert [i for i in range(8) if tier.contains(NS, key(i))] == [0, 1, 5, 6, 7]
    assert all(tier.read(NS, key(i)) == page(i, size) for i in (0, 1, 5, 6, 7))
    stats = tier.stats()
    assert stats["evicted"] == 3
    assert stats["bytes_used"] == 5 * (size + HEADER_BYTES) == stats["bytes_capacity"]
    assert not record_path(tier.root, NS, key(2)).exists()


def test_a_page_larger_than_the_tier_is_rejected(open_tier: Callable[..., DiskTier]) -> None:
    tier = open_tier(bytes=64 * KIB, codec="none")
    assert write_pages(tier, {1: page(1, 100 * KIB)}) == {1: False}
    assert tier.stats()["rejected_writes"] == 1 and not tier.contains(NS, key(1))


def test_a_full_queue_drops_pages_and_never_blocks_the_caller(open_tier: Callable[..., DiskTier]) -> None:
    tier = open_tier(queue_bytes=2 * MIB, threads=1, fsync="always")
    pages = {i: page(i, 256 * KIB) for i in range(64)}
    done = Completions()
    accepted, slowest = [], 0.0
    for i, data in pages.items():
        began = time.perf_counter()
        if tier.submit_write(NS, key(i), data, done.callback(i)):
            accepted.append(i)
        slowest = max(slowest, time.perf_counter() - began)

    dropped = len(pages) - len(accepted)
    assert dropped > 0 and tier.stats()["dropped_writes"] == dropped
    assert slowest < 0.05  # a copy and a few dict operations; never a disk write
    assert done.wait(len(accepted)) == {i: True for i in accepted}
    assert all(tier.read(NS, key(i)) == pages[i] for i in accepted)


def test_removed_pages_are_gone_whether_written_or_queued(open_tier: Callable[..., DiskTier]) -> None:
    tier = open_tier(threads=1)
    write_pages(tier, {1: page(1)})
    tier.remove(NS, key(1))
    many = {i: page(i, 512 * KIB) for i in range(2, 12)}
    for i, data in many.items():
        tier.submit_write(NS, key(i), data)
    tier.remove(NS, key(11))  # most likely still queued; or being written

    tier.close()
    assert not tier.contains(NS, key(1)) and not record_path(tier.root, NS, key(1)).exists()
    assert not record_path(tier.root, NS, key(11)).exists()
    again = DiskTier(tier.config)
    keys = {r.key for r in again.recover()}
    again.close()
    assert keys == {key(i) for i in range(2, 11)}


@pytest.mark.parametrize("fsync", ["always", "batch"])
def test_pages_are_reported_durable_once_synced(open_tier: Callable[..., DiskTier], fsync: str) -> None:
    tier = open_tier(fsync=fsync, fsync_interval_s=0.05)
    assert write_pages(tier, {i: page(i) for i in range(10)}) == {i: True for i in range(10)}
    assert all(tier.flushed(NS, key(i)) for i in range(10))


# --- faults -----------------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs; skipped where this process may not mount one (it needs root on Linux)."""
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs to fill up ({result.stderr.strip()}); needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_turns_the_tier_off_and_nothing_blocks(
    small_fs: Path, open_tier: Callable[..., DiskTier]
) -> None:
    tier = open_tier(path=small_fs / "disk", bytes=64 * MIB, codec="none")
    results = write_pages(tier, {i: page(i, 512 * KIB) for i in range(8)})  # 4 MiB into 2 MiB

    assert any(results.values()) and not all(results.values())  # some fit, then the disk filled
    stats = tier.stats()
    assert stats["enabled"] == 0 and stats["errors"] == 1
    assert tier.error is not None and "No space left" in tier.error
    assert not tier.submit_write(NS, key(100), page(100))
    assert not tier.contains(NS, key(0)) and tier.read(NS, key(0)) is None
    assert not list(small_fs.rglob("*.tmp"))  # the failed write left no temp file


def test_a_write_error_turns_the_tier_off(tmp_path: Path, open_tier: Callable[..., DiskTier]) -> None:
    """A directory removed under the tier: the write fails (ENOENT), as a dead disk's would (EIO)."""
    tier = open_tier(threads=1)
    write_pages(tier, {1: page(1)})
    shutil.rmtree(tmp_path / "disk")

    assert write_pages(tier, {2: page(2)}) == {2: False}
    assert tier.stats()["enabled"] == 0 and tier.stats()["errors"] == 1


def test_two_tiers_cannot_share_a_directory(open_tier: Callable[..., DiskTier]) -> None:
    tier = open_tier()
    with pytest.raises(RuntimeError, match="in use by another kvstored"):
        DiskTier(tier.config)


def test_a_closed_tier_refuses_work(open_tier: Callable[..., DiskTier]) -> None:
    tier = open_tier()
    write_pages(tier, {1: page(1)})
    tier.close()

    assert not tier.submit_write(NS, key(1), page(1)) and not tier.submit_write(NS, key(2), page(2))
    assert not tier.submit_read(NS, key(1), lambda page: None)


def test_the_tier_must_recover_before_use(tmp_path: Path) -> None:
    tier = DiskTier(DiskTierConfig(enabled=True, path=str(tmp_path / "disk")))
    try:
        with pytest.raises(RuntimeError, match="recover"):
            tier.submit_write(NS, key(1), page(1))
    finally:
        tier.close()


# --- config -----------------------------------------------------------------------------------


def test_disk_config_defaults_and_checks() -> None:
    disk = parse_config({}).tiers.disk
    assert disk == DiskTierConfig() and not disk.enabled
    assert (disk.write, disk.fsync, disk.codec, disk.bytes) == ("behind", "batch", "lz4", 64 << 30)
    custom = parse_config({"tiers": {"disk": {"fsync": "ALWAYS", "bytes": "1TiB"}}}).tiers.disk
    assert (custom.fsync, custom.bytes) == ("always", 1 << 40)
    with pytest.raises(ConfigError, match="tiers.disk.path: expected an absolute path"):
        parse_config({"tiers": {"disk": {"path": "relative/dir"}}})
    with pytest.raises(ConfigError, match="tiers.disk.codec: expected one of lz4, none"):
        parse_config({"tiers": {"disk": {"codec": "zstd"}}})


def test_random_operations_never_serve_wrong_bytes(open_tier: Callable[..., DiskTier]) -> None:
    """Writes, removals, reads and touches racing the workers and eviction; the books must balance."""
    size = 64 * KIB
    tier = open_tier(bytes=20 * (size + HEADER_BYTES), queue_bytes=4 * MIB, threads=3)
    write_pages(tier, {i: page(i, size) for i in range(30)})  # full, and evicting
    rng = random.Random(3)
    wrong: list[int] = []
    reads = Completions()
    read_ids = itertools.count()

    def check(i: int) -> Callable[[Any], None]:
        def done(result: Any) -> None:
            if result is not None and bytes(result) != page(i, size):
                wrong.append(i)
            reads.callback(next(read_ids))(True)

        return done

    submitted = 0
    for _ in range(3000):
        i = rng.randrange(60)
        action = rng.random()
        if action < 0.5:
            tier.submit_write(NS, key(i), page(i, size))
        elif action < 0.65:
            tier.remove(NS, key(i))
        elif action < 0.95:
            submitted += tier.submit_read(NS, key(i), check(i))
        else:
            tier.touch(NS, [key(j) for j in range(i, min(i + 5, 60))])
    reads.wait(submitted)
    tier.close()

    assert wrong == []
    on_disk = list(tier.root.rglob("*.kvr"))
    indexed = [record_path(tier.root, NS, key(i)) for i in range(60) if tier.contains(NS, key(i))]
    assert sorted(on_disk) == sorted(indexed)
    stats = tier.stats()
    assert stats["bytes_used"] == sum(path.stat().st_size for path in on_disk) <= stats["bytes_capacity"]
    assert not list(tier.root.rglob("*.tmp")) and stats["corrupted_records"] == 0 and stats["errors"] == 0
    assert stats["evicted"] > 0 and stats["promotions"] > 0


def test_the_recovery_scan_reports_progress(tmp_path: Path, open_tier: Callable[..., DiskTier]) -> None:
    tier = open_tier()
    write_pages(tier, {i: page(i, 4 * KIB) for i in range(300)})
    tier.close()
    (tmp_path / "disk" / INDEX_NAME).unlink()
    calls: list[tuple[int, int]] = []

    again = DiskTier(tier.config)
    again.recover(progress=lambda done, total: calls.append((done, total)))
    again.close()

    assert calls == [(256, 300), (300, 300)]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_log_lines_elsewhere(caplog: pytest.LogCaptureFixture) -> None:
    screen = Terminal()
    report = progress_reporter("disk tier recovery", screen)
    report(3, 10)
    report(10, 10)
    assert screen.getvalue().endswith(f"\rdisk tier recovery [{'#' * 30}] 10/10\n")
    assert f"[{'#' * 9}{'.' * 21}] 3/10" in screen.getvalue()

    with caplog.at_level(logging.INFO, logger="kvstored"):
        report = progress_reporter("disk tier recovery", io.StringIO(), interval_s=3600)
        for done in range(1, 11):
            report(done, 10)
    assert [r.getMessage() for r in caplog.records] == [
        "disk tier recovery: 1 of 10 (10%)",
        "disk tier recovery: 10 of 10 (100%)",
    ]


def test_a_lowered_capacity_evicts_the_oldest_records_at_recovery(open_tier: Callable[..., DiskTier]) -> None:
    size = 50 * KIB
    tier = open_tier(threads=1)
    for i in range(6):  # one at a time: record ages follow i
        write_pages(tier, {i: page(i, size)})
    tier.close()

    smaller = open_tier(bytes=4 * (size + HEADER_BYTES))

    assert [i for i in range(6) if smaller.contains(NS, key(i))] == [2, 3, 4, 5]
    assert sorted(smaller.take_evicted()) == [(NS, key(0)), (NS, key(1))]
    assert smaller.stats()["bytes_used"] == 4 * (size + HEADER_BYTES)
    assert len(list(smaller.root.rglob("*.kvr"))) == 4


def test_clear_removes_one_namespace_or_all(open_tier: Callable[..., DiskTier]) -> None:
    tier = open_tier()
    other = bytes(16)
    write_pages(tier, {i: page(i, 8 * KIB) for i in range(5)})
    assert tier.submit_write(other, key(1), page(1, 8 * KIB))

    assert tier.clear(NS) == 5
    tier.close()

    assert [tier.contains(NS, key(i)) for i in range(5)] == [False] * 5
    assert tier.contains(other, key(1))
    assert [p.parent.parent.name for p in tier.root.rglob("*.kvr")] == [other.hex()]
