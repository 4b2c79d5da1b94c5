"""Huge pages under the arena: what the file system of `tiers.cpu.shm_dir` offers.

- `mount_of(directory)`: the mount holding `directory` (`Mount`: point, type, options), from
  `MOUNTS_FILE`, or None.
- `hugetlbfs_page_bytes(directory)`: the huge page size where `directory` is on hugetlbfs
  (every arena there is made of such pages; its size and slabs must be multiples), else None.
- `thp_advised(directory)`: whether a tmpfs arena there gets transparent huge pages only where
  its mapping asks (`madvise(MADV_HUGEPAGE)`): the mount's `huge=advise`, or, for memfd arenas
  (`directory` None), the kernel's shmem setting `advise`.
- `advise_huge(mapping)`: asks for transparent huge pages on a mapping.

What each buys is measured with `bench/connect.py` (see the README's "Huge pages").
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import NamedTuple

log = logging.getLogger(__name__)

MOUNTS_FILE = "/proc/self/mounts"
SHMEM_THP_FILE = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class Mount(NamedTuple):
    point: str
    fstype: str
    options: dict[str, str]


def mount_of(directory: str) -> Mount | None:
    """The mount that holds `directory` (the longest mount point above its real path)."""
    try:
        with open(MOUNTS_FILE) as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    path = os.path.realpath(directory)
    best: Mount | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        holds = path == point or path.startswith(point.rstrip("/") + "/")
        if holds and (best is None or len(point) >= len(best.point)):  # the last mount there wins
            options = dict(option.partition("=")[::2] for option in fields[3].split(","))
            best = Mount(point, fields[2], options)
    return best


def _size(text: str) -> int:
    unit = text[-1:].upper() if text[-1:].isalpha() else ""
    return int(text[: len(text) - len(unit)]) * _UNITS.get(unit, 1)


def hugetlbfs_page_bytes(directory: str) -> int | None:
    mount = mount_of(directory)
    if mount is None or mount.fstype != "hugetlbfs":
        return None
    if "pagesize" in mount.options:
        return _size(mount.options["pagesize"])
    return os.statvfs(directory).f_bsize  # hugetlbfs reports its page size as the block size


def thp_advised(directory: str | None) -> bool:
    if directory is not None:
        mount = mount_of(directory)
        return mount is not None and mount.fstype == "tmpfs" and mount.options.get("huge") == "advise"
    try:
        with open(SHMEM_THP_FILE) as file:
            return "[advise]" in file.read()
    except OSError:
        return False


def advise_huge(mapping: mmap.mmap) -> bool:
    """Asks for transparent huge pages on `mapping`; whether the kernel took the advice."""
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
        return True
    except (OSError, AttributeError) as exc:
        log.debug("MADV_HUGEPAGE refused: %s", exc)
        return False
