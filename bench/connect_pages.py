"""The pages under a benchmark's arena: which kind a directory gives, and how much of it was huge.

- `PAGE_KINDS`: the kinds `bench/connect.py --pages` puts an arena on (small: 4 KiB pages; thp: a
  tmpfs that gives transparent huge pages; hugetlbfs: its pool's pages), each with the
  `kvstore.shared.hugepages` kind the daemon reports for it.
- `kind_of(directory)`: the kind an arena in `directory` gets; `unusable(kind, directory)`: why an
  arena there would not get `kind` (None: it would).
- `free_bytes(directory)`: what an arena there may take (a hugetlbfs pool's free pages included).
- `meminfo()`: /proc/meminfo's memory and huge page counts; `huge_bytes(before, after)`: the huge
  page bytes taken between two of them (shmem THP, and hugetlbfs pages at its page size).
- `mapping_pages(address)`: this process's mapping holding `address` (all of its file's mappings),
  by kind of page, from /proc/self/smaps: what a worker's `cudaHostRegister` pinned.
"""

from __future__ import annotations

import os
import shutil

from kvstore.shared.hugepages import arena_pages, hugetlbfs_free_bytes, hugetlbfs_page_bytes

# to kvstore.shared.hugepages.KINDS; "pinned": the daemon pins the arena (tiers.cpu.pinned), no directory
PAGE_KINDS = {"small": "none", "thp": "thp", "hugetlbfs": "hugetlbfs", "pinned": "pinned"}
PINNED_DIR = "(pinned by the daemon)"
MEMINFO_KEYS = (
    "MemTotal",
    "MemAvailable",
    "Shmem",
    "ShmemHugePages",
    "HugePages_Total",
    "HugePages_Free",
    "HugePages_Rsvd",
    "Hugepagesize",
)
SMAPS_KEYS = ("Size", "Rss", "ShmemPmdMapped", "FilePmdMapped", "Shared_Hugetlb", "Private_Hugetlb")


def kind_of(directory: str) -> str:
    pages = arena_pages(directory, advised=True)  # a mount that advises: the daemon's mapping asks
    return next(kind for kind, reported in PAGE_KINDS.items() if reported == pages.kind)


def unusable(kind: str, directory: str) -> str | None:
    if kind == "pinned":
        from kvstore.shared.cuda_vmm import load_vmm

        try:
            load_vmm()
        except RuntimeError as exc:
            return f"the daemon cannot pin memory here: {exc}"
        return None
    if not os.path.isdir(directory):
        return f"{directory} is not a directory"
    pages = arena_pages(directory, advised=True)  # a mount that advises: the daemon's mapping asks
    if pages.kind != PAGE_KINDS[kind]:
        return f"an arena in {directory} gets {pages.describe()}, not {kind}"
    return None


def free_bytes(directory: str) -> int:
    if directory == PINNED_DIR:
        return meminfo().get("MemAvailable", 0)
    huge_page = hugetlbfs_page_bytes(directory)
    if huge_page:  # a mount with no size limit counts no free blocks
        return hugetlbfs_free_bytes(directory, huge_page)
    return shutil.disk_usage(directory).free


def meminfo() -> dict[str, int]:
    """MEMINFO_KEYS in bytes, but the HugePages_* counts, which are pages."""
    figures: dict[str, int] = {}
    with open("/proc/meminfo") as file:
        for line in file:
            key, _, value = line.partition(":")
            if key in MEMINFO_KEYS:
                number, *unit = value.split()
                figures[key] = int(number) << 10 if unit == ["kB"] else int(number)
    return figures


def huge_bytes(before: dict[str, int], after: dict[str, int]) -> int:
    """Huge page bytes taken from `before` to `after`, by shmem (THP) and from the hugetlbfs pool."""
    shmem = after.get("ShmemHugePages", 0) - before.get("ShmemHugePages", 0)
    pool = before.get("HugePages_Free", 0) - after.get("HugePages_Free", 0)
    return shmem + pool * after.get("Hugepagesize", 0)


def mapping_pages(address: int) -> dict[str, int]:
    """SMAPS_KEYS in bytes over this process's mappings of the file mapped at `address` ({} where
    nothing is), and `mappings`, how many there are (a mapping can be split by madvise)."""
    mappings: list[tuple[int, int, str, dict[str, int]]] = []
    with open("/proc/self/smaps") as file:
        for line in file:
            fields = line.split()
            if fields and not fields[0].endswith(":"):  # a mapping's header: range, perms, ..., path
                start, _, end = fields[0].partition("-")
                path = fields[5] if len(fields) > 5 else ""
                mappings.append((int(start, 16), int(end, 16), path, {}))
            elif mappings and fields[0][:-1] in SMAPS_KEYS:
                mappings[-1][3][fields[0][:-1]] = int(fields[1]) << 10
    found = next((path for start, end, path, _ in mappings if start <= address < end), "")
    if not found:
        return {}
    same = [counts for _, _, path, counts in mappings if path == found]
    totals = {key: sum(counts.get(key, 0) for counts in same) for key in SMAPS_KEYS}
    return {**totals, "mappings": len(same)}
