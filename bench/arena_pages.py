"""What huge pages buy the arena: reserving it, and faulting in a second mapping of it.

For each directory given (a tmpfs, a tmpfs mounted with `huge=advise`, a hugetlbfs mount), a
`kvstore.tiers.cpu.Arena` of `--gib` is created there and reserved slab by slab as the daemon
does (`fallocate`, or faulting through its mapping where the mount advises huge pages); then
the file is mapped again and faulted in whole (`MADV_POPULATE_WRITE`), the part of a worker's
`cudaHostRegister` that touches every page. `--repeats` rounds per directory, interleaved;
`ShmemHugePages` from /proc/meminfo says whether the pages were huge.

    mount -t tmpfs -o size=3g tmpfs /mnt/plain; mount -t tmpfs -o size=3g,huge=advise tmpfs /mnt/thp
    python bench/arena_pages.py /mnt/plain /mnt/thp --gib 2
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table  # noqa: E402
from kvstore.shared.hugepages import advise_huge, thp_advised  # noqa: E402
from kvstore.tiers.cpu import MADV_POPULATE_WRITE, Arena  # noqa: E402

SLAB = 256 << 20


def shmem_huge_bytes() -> int:
    with open("/proc/meminfo") as file:
        for line in file:
            if line.startswith("ShmemHugePages:"):
                return int(line.split()[1]) << 10
    return 0


def round_on(directory: str, size: int) -> list[object]:
    arena = Arena(Path(directory) / f"kvstore-bench-{os.getpid()}", size, prefault=True)
    try:
        started = time.perf_counter()
        for start in range(0, size, SLAB):
            arena.reserve(start, min(SLAB, size - start))
        reserve_s = time.perf_counter() - started
        huge = shmem_huge_bytes()
        fd = os.open(arena.path, os.O_RDWR)
        mapping = mmap.mmap(fd, size)
        os.close(fd)
        if thp_advised(directory):
            advise_huge(mapping)
        started = time.perf_counter()
        mapping.madvise(MADV_POPULATE_WRITE, 0, size)
        populate_s = time.perf_counter() - started
        mapping.close()
    finally:
        arena.close()
    return [directory, reserve_s, populate_s, "yes" if arena.huge_advised else "no", huge >> 20]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directories", nargs="+")
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    size = int(args.gib * (1 << 30)) // SLAB * SLAB
    rows = [round_on(d, size) for _ in range(args.repeats) for d in args.directories]
    print(f"an arena of {size >> 20} MiB (s)")
    print_table(["directory", "reserve", "populate a 2nd mapping", "advised", "ShmemHugePages MiB"], rows)


if __name__ == "__main__":
    main()
