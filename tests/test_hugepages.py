"""Huge pages under the arena: hugetlbfs and tmpfs `huge=advise` found from the mount table, a
hugetlbfs arena whose size or slabs are not whole pages refused naming the key, and an arena on
an advising tmpfs reserved by faulting through its mapping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore import hugepages
from kvstore.config import ConfigError, parse_config
from kvstore.tiers.cpu import Arena

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
