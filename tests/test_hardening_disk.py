"""Issue #30, items 1 and 2, as attacks on a real kvstored: another user's disk directory, a
symlink planted where the clean shutdown writes its index, and a record that decompresses to far
more than its page. Each is refused (or a counted miss), and the victim's own pages load back
byte-identical after it."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import lz4.frame
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.tiers.codec import Codec, compress, decompress
from kvstore.tiers.disk_files import INDEX_NAME, TEMP_SUFFIX, record_path, temp_path
from kvstore.tiers.disk_io import write_record
from kvstore.tiers.records import CorruptRecord, pack_header, unpack_header
from kvstore_client import KVStoreClient
from tests.harness import Daemon, python_env, wait_flushed, write_config
from tests.test_disk_daemon import (
    CHUNK,
    SPEC,
    cache_for,
    disk_overrides,
    disk_stats,
    load_and_compare,
    prompt,
)

NOBODY = 65534
PAGE_BYTES = 8 << 10  # SPEC's page
BOMB_BYTES = 256 << 20
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to act as another user (CI runs as root)"
)


def as_user(uid: int, work: Callable[[], Any]) -> Any:
    """`work()` in a forked child running as `uid` (no groups); its result comes back through a pipe.
    The child imports nothing new (this interpreter's files are root's): `work` uses what is loaded."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with os.fdopen(write_end, "wb") as out:
                out.write(pickle.dumps(work()))
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the attacker's child failed"
    return pickle.loads(data)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory like /tmp (1777) that the attacker can reach: pytest's tmp_path is root's 0700."""
    path = Path(tempfile.mkdtemp(prefix="kvstore-hardening-", dir="/tmp"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", str(path)], check=False)


def refused(config: Path) -> str:
    """Runs kvstored on `config`, which must refuse to start; its stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.server.daemon", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=python_env(),
    )
    assert result.returncode == 1, result.stderr
    return result.stderr


def plant_record(root: Path, namespace: bytes, key: bytes, page: bytes) -> Path:
    """A record as the disk tier writes one (header, checksums, lz4 where it shrinks), renamed into place."""
    codec, payload = compress(Codec.LZ4, page)
    header = pack_header(namespace, key, codec, len(page), payload)
    final = record_path(root, namespace, key)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_path(final, 0)
    write_record(temp, header, payload, sync=False)
    os.rename(temp, final)
    return final


def learn_keys(daemon_factory: Callable[..., Daemon], tmp_path: Path) -> tuple[bytes, list[bytes]]:
    """The victim's namespace and the keys of prompt 0 (anyone can compute them: keys are public)."""
    daemon = daemon_factory("scout", **disk_overrides(tmp_path / "scout-disk"))
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        return client.namespace, client.keys(prompt(0, 4))


def store_and_check(client: KVStoreClient, i: int, chunks: int, again: bool = False) -> None:
    """Stores prompt i, loads it whole and compares bytes. `again`: some chunks are still stored
    (on disk), which a store skips."""
    stored = client.store(prompt(i, chunks), cache_for(i, chunks), torch.arange(chunks))
    assert 0 < stored <= chunks if again else stored == chunks
    assert load_and_compare(client, i, chunks) == chunks * CHUNK


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM in /proc status")


def health_latency(daemon: Daemon) -> float:
    with grpc.insecure_channel(daemon.address) as channel:
        began = time.perf_counter()
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5.0)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        return time.perf_counter() - began


# -- 1. the disk directory ---------------------------------------------------------------------


@needs_root
def test_a_disk_directory_another_user_made_first_is_refused_and_its_record_never_served(
    tmp_path: Path, shared_tmp: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    """Refused rather than worked around with a private subdirectory: the operator named that path,
    and its owner could rename any subdirectory the daemon made there and slip its own in."""
    namespace, keys = learn_keys(daemon_factory, tmp_path)
    disk = shared_tmp / "kvstore-disk"
    victim = tmp_path / "victim"
    victim.mkdir()
    root_file = victim / "root-owned"
    root_file.write_bytes(b"root's file\n")
    forged = bytes(PAGE_BYTES)  # zeros where the victim's first chunk should be

    def attack() -> list[str]:
        disk.mkdir(mode=0o755)
        plant_record(disk, namespace, keys[0], forged)
        (disk / (INDEX_NAME + TEMP_SUFFIX)).symlink_to(root_file)
        return sorted(str(p.relative_to(disk)) for p in disk.rglob("*"))

    planted = as_user(NOBODY, attack)
    config = write_config(victim / "kvstored.yaml", victim / "kvstored.sock", **disk_overrides(disk))
    stderr = refused(config)

    assert "tiers.disk.path" in stderr and f"belongs to uid {NOBODY}" in stderr, stderr
    assert sorted(str(p.relative_to(disk)) for p in disk.rglob("*")) == planted  # left as it was
    assert root_file.read_bytes() == b"root's file\n"
    # The operator names a directory of the daemon's own: the victim stores and loads its own bytes.
    daemon = daemon_factory("victim", **disk_overrides(shared_tmp / "own-disk"))
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        store_and_check(client, 0, 4)


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775])
def test_a_disk_directory_others_can_write_is_refused(
    tmp_path: Path, mode: int, daemon_factory: Callable[..., Daemon]
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    disk.chmod(mode)
    config = write_config(tmp_path / "kvstored.yaml", tmp_path / "kvstored.sock", **disk_overrides(disk))
    stderr = refused(config)
    assert "tiers.disk.path" in stderr and "writable by its group or by others" in stderr, stderr
    assert list(disk.iterdir()) == []
    disk.chmod(0o700)  # fixed as the error says: the daemon serves, byte for byte
    daemon = daemon_factory(**disk_overrides(disk))
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        store_and_check(client, 1, 3)


def test_a_disk_directory_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    config = write_config(
        tmp_path / "kvstored.yaml", tmp_path / "kvstored.sock", **disk_overrides(tmp_path / "link")
    )
    stderr = refused(config)
    assert "tiers.disk.path" in stderr and "is a symlink" in stderr, stderr
    assert list(real.iterdir()) == []


def test_a_missing_disk_directory_is_created_private(
    shared_tmp: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    """Under a shared /tmp-like directory: made 0700 by the daemon, so no one else can write it."""
    disk = shared_tmp / "new" / "disk"
    daemon = daemon_factory(**disk_overrides(disk))
    assert disk.stat().st_mode & 0o777 == 0o700 and disk.stat().st_uid == os.geteuid()
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        store_and_check(client, 2, 3)


def test_a_symlink_planted_at_the_index_temp_file_leaves_its_target_unchanged(
    tmp_path: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    """Whoever put it there (the directory is the daemon's own now), the clean shutdown never
    follows it: it is replaced by a new file (O_EXCL|O_NOFOLLOW), and the index still reloads."""
    disk = tmp_path / "disk"
    root_file = tmp_path / "root-owned"
    root_file.write_bytes(b"root's file\n")
    daemon = daemon_factory(**disk_overrides(disk, write="through"))
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        store_and_check(client, 3, 4)
        assert wait_flushed(client)["pages"] == 4
    (disk / (INDEX_NAME + TEMP_SUFFIX)).symlink_to(root_file)
    assert daemon.stop() == 0, daemon.log()

    assert root_file.read_bytes() == b"root's file\n"
    assert not (disk / (INDEX_NAME + TEMP_SUFFIX)).is_symlink() and (disk / INDEX_NAME).is_file()
    restarted = daemon_factory("restarted", **disk_overrides(disk, write="through"))
    assert "from the clean-shutdown index" in restarted.log()
    with KVStoreClient.connect(restarted.address, SPEC) as client:
        assert load_and_compare(client, 3, 4) == 4 * CHUNK  # from disk: the arena is new


def test_a_record_file_that_is_a_symlink_is_a_miss_never_followed(
    tmp_path: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    disk = tmp_path / "disk"
    daemon = daemon_factory(**disk_overrides(disk, write="through"))
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        store_and_check(client, 4, 4)
        wait_flushed(client)
        namespace, keys = client.namespace, client.keys(prompt(4, 4))
    assert daemon.stop() == 0
    # A copy of chunk 2's valid record elsewhere, linked in its place: never read through the link.
    record = record_path(disk, namespace, keys[2])
    elsewhere = tmp_path / "elsewhere.kvr"
    elsewhere.write_bytes(record.read_bytes())
    record.unlink()
    record.symlink_to(elsewhere)
    (disk / INDEX_NAME).unlink()  # a scan, as after a crash

    restarted = daemon_factory("restarted", **disk_overrides(disk, write="through"))
    with KVStoreClient.connect(restarted.address, SPEC) as client:
        assert load_and_compare(client, 4, 4) == 2 * CHUNK  # chunks 0 and 1; 2 is gone
        assert disk_stats(client)["skipped_on_recovery"] == 1
        store_and_check(client, 4, 4, again=True)
    assert elsewhere.is_file()


# -- 2. decompression bombs --------------------------------------------------------------------


def lz4_bomb() -> bytes:
    """About 1 MiB of lz4 frame that decodes to 256 MiB of zeros, its size left out of the frame."""
    return lz4.frame.compress(bytes(BOMB_BYTES), block_size=lz4.frame.BLOCKSIZE_MAX4MB, store_size=False)


def test_the_decode_refuses_a_bomb_before_decompressing_it() -> None:
    bomb = lz4_bomb()
    assert len(bomb) < 2 << 20
    header = unpack_header(pack_header(bytes(16), bytes(16), Codec.LZ4, PAGE_BYTES, bomb))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptRecord, match="more than the 8192 bytes"):
            header.decode(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # At most a copy of the payload (the decompressor keeps the input it did not use) and a page;
    # today's decode allocates the 256 MiB.
    assert peak < len(bomb) + (1 << 20), f"{peak} bytes allocated to refuse it"
    # A frame that declares its size is refused before a byte is decoded; a good page still decodes.
    declared = lz4.frame.compress(bytes(BOMB_BYTES))
    with pytest.raises(ValueError, match="declares 268435456 bytes"):
        decompress(Codec.LZ4, declared, PAGE_BYTES)
    page = bytes(PAGE_BYTES // 2) + os.urandom(PAGE_BYTES // 2)
    codec, payload = compress(Codec.LZ4, page)
    assert codec is Codec.LZ4 and decompress(codec, payload, PAGE_BYTES) == page
    for bad in (payload[:-4], bytes(payload) + b"x", lz4.frame.compress(page[:-1])):
        with pytest.raises(ValueError):
            decompress(Codec.LZ4, bad, PAGE_BYTES)


@pytest.mark.parametrize("raw_length", ["page", "bomb"], ids=["header-says-page", "header-says-256MiB"])
def test_a_record_that_decompresses_to_256_mib_is_a_corrupt_miss(
    tmp_path: Path, daemon_factory: Callable[..., Daemon], raw_length: str
) -> None:
    """Its header and payload checksums are valid; only its size is a lie (or a true 256 MiB)."""
    disk = tmp_path / "disk"
    daemon = daemon_factory(**disk_overrides(disk, write="through"))
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        store_and_check(client, 5, 4)
        wait_flushed(client)
        namespace, keys = client.namespace, client.keys(prompt(5, 4))
    assert daemon.stop() == 0
    bomb = lz4_bomb()
    record = record_path(disk, namespace, keys[2])
    record.unlink()
    length = PAGE_BYTES if raw_length == "page" else BOMB_BYTES
    record.write_bytes(pack_header(namespace, keys[2], Codec.LZ4, length, bomb) + bomb)
    (disk / INDEX_NAME).unlink()  # the record scan reads its header, as after a crash

    restarted = daemon_factory("restarted", **disk_overrides(disk, write="through"))
    with KVStoreClient.connect(restarted.address, SPEC) as client:
        before = peak_rss(restarted.pid)
        assert load_and_compare(client, 5, 4) == 2 * CHUNK  # chunk 2 is a miss: the prefix ends there
        assert disk_stats(client)["corrupted_records"] == 1
        grown = peak_rss(restarted.pid) - before
        assert grown < 64 << 20, f"the daemon's peak RSS grew by {grown >> 20} MiB"
        assert health_latency(restarted) < 1.0
        assert not record.exists()  # dropped with its index entry
        store_and_check(client, 5, 4, again=True)  # chunk 2 stored again, all load byte for byte
