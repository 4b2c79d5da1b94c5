"""Huge pages under the arena: what the file system of `tiers.cpu.shm_dir` offers.

- `mount_of(directory)`: the mount holding `directory` (`Mount`: point, type, options), from
  `MOUNTS_FILE`, or None.
- `hugetlbfs_page_bytes(directory)`: the huge page size where `directory` is on hugetlbfs
  (every arena there is made of such pages; its size and slabs must be multiples), else None.
- `hugetlbfs_free_bytes(directory, page_bytes)`: what an arena may still take there.
- `thp_mode(directory)`: the transparent-huge-page setting a tmpfs arena there gets: the mount's
  `huge=` option, or, for memfd arenas (`directory` None), the kernel's shmem setting
  (`SHMEM_THP_FILE`); "never" where there is none.
- `thp_advised(directory)`: whether that arena gets them only where its mapping asks
  (`madvise(MADV_HUGEPAGE)`): the mode `advise`.
- `advise_huge(mapping)`: asks for transparent huge pages on a mapping.
- `arena_pages(directory, advised)`: which pages an arena there gets (`ArenaPages`: kind and
  page size), as the daemon logs it and reports it in Stats (`figures()`).

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
HUGEPAGES_DIR = "/sys/kernel/mm/hugepages"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


THP_GIVEN = ("always", "within_size", "force")  # tmpfs gives huge pages without being asked
# ArenaPages.kind, as Stats numbers them (arena_huge_pages); "pinned": allocated pinned by the
# daemon through CUDA (`kvstore.tiers.pinned`), in the driver's granules
KINDS = ("none", "thp", "hugetlbfs", "pinned")
SMALL_PAGE = mmap.PAGESIZE
THP_BYTES = 2 << 20  # a PMD on x86-64 and on 4 KiB-page arm64


class ArenaPages(NamedTuple):
    kind: str  # one of KINDS
    page_bytes: int

    def figures(self) -> dict[str, int]:
        """Stats counters: `arena_huge_pages` (the index in KINDS) and `arena_page_bytes`."""
        return {"arena_huge_pages": KINDS.index(self.kind), "arena_page_bytes": self.page_bytes}

    def describe(self) -> str:
        if self.kind == "none":
            return f"{self.page_bytes >> 10} KiB pages (no huge pages: see the README's Huge pages)"
        if self.kind == "pinned":
            return f"memory pinned by the daemon through CUDA, in {self.page_bytes >> 20} MiB granules"
        return f"{self.page_bytes >> 20} MiB huge pages ({self.kind})"


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


def hugetlbfs_free_bytes(directory: str, page_bytes: int) -> int:
    """Bytes an arena may still take on the hugetlbfs mount at `directory`: its size limit's free
    space, or, on a mount with none (statvfs then counts no blocks), the pool's free pages."""
    fs = os.statvfs(directory)
    if fs.f_blocks:
        return fs.f_bavail * fs.f_frsize
    try:
        with open(f"{HUGEPAGES_DIR}/hugepages-{page_bytes >> 10}kB/free_hugepages") as file:
            return int(file.read()) * page_bytes
    except (OSError, ValueError):
        return 0


def thp_mode(directory: str | None) -> str:
    if directory is not None:
        mount = mount_of(directory)
        if mount is None or mount.fstype != "tmpfs":
            return "never"
        return mount.options.get("huge", "never")
    try:
        with open(SHMEM_THP_FILE) as file:
            text = file.read()
    except OSError:
        return "never"
    chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else ""
    return chosen or "never"


def thp_advised(directory: str | None) -> bool:
    return thp_mode(directory) == "advise"


def arena_pages(directory: str | None, advised: bool) -> ArenaPages:
    """The pages of an arena in `directory` (None: a memfd), whose mapping asked for huge pages
    (`advised`, where the mode is advise)."""
    if directory is not None:
        huge = hugetlbfs_page_bytes(directory)
        if huge:
            return ArenaPages("hugetlbfs", huge)
    mode = thp_mode(directory)
    if mode in THP_GIVEN or (mode == "advise" and advised):
        return ArenaPages("thp", THP_BYTES)
    return ArenaPages("none", SMALL_PAGE)


def advise_huge(mapping: mmap.mmap) -> bool:
    """Asks for transparent huge pages on `mapping`; whether the kernel took the advice."""
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
        return True
    except (OSError, AttributeError) as exc:
        log.debug("MADV_HUGEPAGE refused: %s", exc)
        return False
