"""Huge pages under the arena: hugetlbfs and tmpfs `huge=advise|always|within_size` found from the
mount table (and memfd arenas from the kernel's shmem setting), a hugetlbfs arena whose size or
slabs are not whole pages refused naming the key, an arena on an advising tmpfs reserved by
faulting through its mapping; real kvstoreds on a hugetlbfs mount and on a huge=always tmpfs
(where this machine lets the test mount them, as root; else skipped saying why) report their
pages in Stats and the log and store every byte."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvstore.config.root import ConfigError, parse_config
from kvstore.ctl.cli import arena_pages_line
from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared import hugepages
from kvstore.shared.wire import stats_to_dict
from kvstore.tiers.cpu import Arena
from kvstore_client import KVStoreClient
from tests.harness import Daemon
from tests.test_client import assert_blocks_equal, empty_cache, make_spec, random_cache, tokens_of

MiB = 1 << 20


@pytest.fixture
def mounts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A mount table where tmp_path/huge is hugetlbfs (2 MiB pages), tmp_path/thp an advising tmpfs
    and tmp_path/plain a tmpfs with no huge pages; tmp_path itself is on /."""
    for name in ("huge", "thp", "plain"):
        (tmp_path / name).mkdir()
    table = tmp_path / "mounts"
    table.write_text(
        "rootfs / ext4 rw,relatime 0 0\n"
        f"hugetlbfs {tmp_path}/huge hugetlbfs rw,relatime,pagesize=2M 0 0\n"
        f"tmpfs {tmp_path}/thp tmpfs rw,relatime,size=1g,huge=advise 0 0\n"
        f"tmpfs {tmp_path}/plain tmpfs rw,relatime,size=1g 0 0\n"
        "tmpfs /dev/shm tmpfs rw,nosuid,nodev,huge=advise 0 0\n"
    )
    monkeypatch.setattr(hugepages, "MOUNTS_FILE", str(table))
    return tmp_path


def test_the_mount_table_names_each_directory_s_huge_pages(mounts: Path) -> None:
    assert hugepages.hugetlbfs_page_bytes(str(mounts / "huge")) == 2 * MiB
    assert hugepages.hugetlbfs_page_bytes(str(mounts / "thp")) is None
    assert hugepages.hugetlbfs_page_bytes(str(mounts)) is None
    assert hugepages.thp_advised(str(mounts / "thp"))
    assert not hugepages.thp_advised(str(mounts / "plain"))
    assert not hugepages.thp_advised(str(mounts / "huge"))
    mount = hugepages.mount_of(str(mounts / "thp"))
    assert mount is not None and (mount.fstype, mount.options["huge"]) == ("tmpfs", "advise")


@pytest.mark.parametrize(
    ("cpu", "key", "got"),
    [
        ({"bytes": "9MiB", "slab_bytes": "2MiB"}, "tiers.cpu.bytes", "9MiB"),
        ({"bytes": "64MiB", "slab_bytes": "3MiB"}, "tiers.cpu.slab_bytes", "3MiB"),
    ],
)
def test_a_hugetlbfs_arena_of_part_pages_is_refused_naming_the_key(
    mounts: Path, cpu: dict[str, str], key: str, got: str
) -> None:
    shm_dir = str(mounts / "huge")
    with pytest.raises(ConfigError) as info:
        parse_config({"tiers": {"cpu": {**cpu, "shm_dir": shm_dir}}})
    assert str(info.value) == (
        f"{key}: tiers.cpu.shm_dir {shm_dir} is on hugetlbfs with 2MiB pages: "
        f"expected a multiple of 2MiB, got {got}"
    )
    config = parse_config({"tiers": {"cpu": {"bytes": "64MiB", "slab_bytes": "4MiB", "shm_dir": shm_dir}}})
    assert config.tiers.cpu.slab_bytes == 4 * MiB
    parse_config({"tiers": {"cpu": {**cpu, "shm_dir": str(mounts / "plain")}}})  # tmpfs: any size


def test_an_arena_on_an_advising_tmpfs_asks_for_huge_pages_and_reserves_through_its_mapping(
    mounts: Path,
) -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("needs /dev/shm")
    arena = Arena(Path("/dev/shm") / f"kvstore-test-huge-{os.getpid()}", 8 * MiB, prefault=True)
    try:
        assert arena.huge_advised  # the table above says huge=advise for /dev/shm
        assert os.stat(arena.path).st_blocks == 0
        arena.reserve(2 * MiB, 4 * MiB)
        assert os.stat(arena.path).st_blocks * 512 == 4 * MiB
        arena.view[2 * MiB : 2 * MiB + 3] = b"abc"
        assert bytes(arena.view[2 * MiB : 2 * MiB + 3]) == b"abc"
    finally:
        arena.close()
    plain = Arena(mounts / "plain" / "arena", 4 * MiB, prefault=True)  # on /: fallocate reserves
    try:
        assert not plain.huge_advised
        plain.reserve(0, 4 * MiB)
        assert os.stat(plain.path).st_blocks * 512 >= 4 * MiB
    finally:
        plain.close()


def test_which_pages_an_arena_gets_follows_the_mount_and_the_kernel(
    mounts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = mounts / "mounts"
    table.write_text(
        table.read_text()
        + f"tmpfs {mounts}/always tmpfs rw,huge=always 0 0\n"
        + f"tmpfs {mounts}/sized tmpfs rw,huge=within_size 0 0\n"
    )
    assert hugepages.arena_pages(str(mounts / "huge"), advised=False) == ("hugetlbfs", 2 * MiB)
    assert hugepages.arena_pages(str(mounts / "always"), advised=False) == ("thp", 2 * MiB)
    assert hugepages.arena_pages(str(mounts / "sized"), advised=False) == ("thp", 2 * MiB)
    assert hugepages.arena_pages(str(mounts / "thp"), advised=True) == ("thp", 2 * MiB)
    assert hugepages.arena_pages(str(mounts / "thp"), advised=False).kind == "none"  # the advice refused
    assert hugepages.arena_pages(str(mounts / "plain"), advised=False) == ("none", hugepages.SMALL_PAGE)
    shmem = mounts / "shmem_enabled"
    monkeypatch.setattr(hugepages, "SHMEM_THP_FILE", str(shmem))
    for text, kind in [
        ("always within_size [advise] never deny force\n", "thp"),
        ("[never] advise\n", "none"),
    ]:
        shmem.write_text(text)
        assert hugepages.arena_pages(None, advised=True).kind == kind  # a memfd arena (a tenant's)
    assert hugepages.ArenaPages("hugetlbfs", 2 * MiB).figures() == {
        "arena_huge_pages": 2,
        "arena_page_bytes": 2 * MiB,
    }


def _free_huge_pages() -> int:
    with open("/proc/meminfo") as file:
        fields = dict(line.split(":", 1) for line in file)
    return int(fields["HugePages_Free"].split()[0])


@pytest.fixture
def hugetlbfs(tmp_path: Path) -> Iterator[Path]:
    """A hugetlbfs mount of 2 MiB pages with 16 free ones (set aside for the test and given back),
    or a skip saying why this machine cannot have one."""
    if os.geteuid() != 0:
        pytest.skip("mounting hugetlbfs needs root")
    point = tmp_path / "hugetlbfs"
    point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(point)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount hugetlbfs here: {mounted.stderr.decode().strip()}")
    nr = Path("/proc/sys/vm/nr_hugepages")
    before = int(nr.read_text())
    try:
        if _free_huge_pages() < 16:
            nr.write_text(str(before + 16 - _free_huge_pages()))
        if _free_huge_pages() < 16:
            pytest.skip("the kernel could not set 16 huge pages aside (memory too fragmented)")
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)
        nr.write_text(str(before))


def test_an_arena_on_hugetlbfs_says_so_and_stores_every_byte(
    hugetlbfs: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    daemon = daemon_factory(tiers__cpu={"bytes": "16MiB", "slab_bytes": "4MiB", "shm_dir": str(hugetlbfs)})
    until_reserved(daemon)
    counters = stats_to_dict(daemon.stub().Stats(pb.StatsRequest()))["counters"]
    assert arena_pages_line(counters) == "arena pages: 2 MiB huge pages (hugetlbfs)"
    assert "of 2 MiB huge pages (hugetlbfs)" in daemon.log()
    (arena,) = hugetlbfs.iterdir()
    assert os.stat(arena).st_size == 16 * MiB
    check_bytes(daemon)


def test_an_arena_on_a_tmpfs_with_huge_always_says_thp(
    tmp_path: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    point = tmp_path / "thp"
    point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m,huge=always", "none", str(point)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs with huge=always here: {mounted.stderr.decode().strip()}")
    daemon = None
    try:
        daemon = daemon_factory(tiers__cpu={"bytes": "16MiB", "slab_bytes": "4MiB", "shm_dir": str(point)})
        counters = stats_to_dict(daemon.stub().Stats(pb.StatsRequest()))["counters"]
        assert arena_pages_line(counters) == "arena pages: 2 MiB huge pages (thp)"
        check_bytes(daemon)
    finally:
        if daemon is not None and daemon.process.poll() is None:
            assert daemon.stop() == 0
        subprocess.run(["umount", str(point)], check=True)
    plain = daemon_factory(
        "plain", tiers__cpu={"bytes": "16MiB", "slab_bytes": "4MiB", "shm_dir": str(tmp_path)}
    )
    counters = stats_to_dict(plain.stub().Stats(pb.StatsRequest()))["counters"]
    assert counters["arena_huge_pages"] == 0 and counters["arena_page_bytes"] == hugepages.SMALL_PAGE


def until_reserved(daemon: Daemon) -> None:
    deadline = time.monotonic() + 30
    while True:
        stats = stats_to_dict(daemon.stub().Stats(pb.StatsRequest()))
        if stats["counters"]["arena_reserved_bytes"] >= stats["tiers"]["cpu"]["bytes_capacity"]:
            return
        assert time.monotonic() < deadline, "the arena was not reserved"
        time.sleep(0.01)


def check_bytes(daemon: Daemon) -> None:
    """A prompt stored through the mapped arena and loaded back, byte for byte."""
    spec = make_spec()
    source = random_cache(spec, 128, seed=81)
    tokens = tokens_of(8 * 256, seed=82)
    blocks = torch.randperm(128, generator=torch.Generator().manual_seed(83))
    with KVStoreClient.connect(daemon.address, spec, shared_memory=True) as client:
        assert client.store(tokens, source, blocks) == 8
        target = empty_cache(spec, 128)
        assert client.load(tokens, target, blocks) == 8 * 256
        assert_blocks_equal(target, blocks, source, blocks)
