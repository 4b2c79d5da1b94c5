"""Disk tier file layout: one file per page (temp + rename) against append-only segment files.

Plain file I/O, no tier: what each layout costs on this disk, next to one raw sequential file.
For each page size, `--total-mib` of distinct random pages are written and read back:
- raw: one file, written sequentially (fdatasync per page with fsync=always), read cold
  with one thread.
- file-per-page: each page in a temp file renamed into one of 256 directories (fdatasync
  of the file and fsync of its directory with fsync=always), by 1..4 writer threads; read
  cold (open, one read, close) by 1 or 4 threads.
- segment: pages appended to 256 MiB files by one writer (fdatasync per page with
  fsync=always, every 64 MiB with batch); read cold with pread by 1 or 4 threads.
Writes are timed until the bytes are on disk (a final sync for every policy); reads after
sync + POSIX_FADV_DONTNEED on every file. Figures are the median of `--repeats` runs.

    python bench/disk_layout.py [--dir /var/tmp] [--total-mib 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import print_table, write_results  # noqa: E402

SEGMENT_BYTES = 256 << 20
BATCH_BYTES = 64 << 20


def drop_cache(root: Path) -> None:
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)


class Case:
    """Pages of one size under `root`, written and read by each layout."""

    def __init__(self, root: Path, page_bytes: int, total_bytes: int) -> None:
        self.root = root
        self.page_bytes = page_bytes
        self.count = total_bytes // page_bytes
        self.pages = [os.urandom(page_bytes) for _ in range(min(self.count, 8))]

    def page(self, i: int) -> bytes:
        return self.pages[i % len(self.pages)]

    # raw ------------------------------------------------------------------
    def write_raw(self, fsync: str, threads: int) -> None:
        fd = os.open(self.root / "raw", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for i in range(self.count):
            os.write(fd, self.page(i))
            if fsync == "always":
                os.fdatasync(fd)
        os.fdatasync(fd)
        os.close(fd)

    def read_raw(self, threads: int) -> None:
        fd = os.open(self.root / "raw", os.O_RDONLY)
        buf = bytearray(self.page_bytes)
        while os.readv(fd, [buf]):
            pass
        os.close(fd)

    # file per page ----------------------------------------------------------
    def _page_path(self, i: int) -> Path:
        return self.root / f"{i % 256:02x}" / f"{i}.kvr"

    def write_files(self, fsync: str, threads: int) -> None:
        for sub in range(256):
            (self.root / f"{sub:02x}").mkdir(exist_ok=True)

        def one(i: int) -> None:
            final = self._page_path(i)
            temp = final.with_suffix(".tmp")
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, self.page(i))
            if fsync == "always":
                os.fdatasync(fd)
            os.close(fd)
            os.rename(temp, final)
            if fsync == "always":
                fsync_dir(final.parent)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(self.count)))
        os.sync()

    def read_files(self, threads: int) -> None:
        def one(i: int) -> None:
            fd = os.open(self._page_path(i), os.O_RDONLY)
            os.readv(fd, [bytearray(self.page_bytes)])
            os.close(fd)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(self.count)))

    # segments -------------------------------------------------------------
    def write_segments(self, fsync: str, threads: int) -> None:
        per_segment = SEGMENT_BYTES // self.page_bytes
        fd, since_sync = -1, 0
        for i in range(self.count):
            if i % per_segment == 0:
                if fd >= 0:
                    os.fdatasync(fd)
                    os.close(fd)
                segment = self.root / f"{i // per_segment:06d}.seg"
                fd = os.open(segment, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.write(fd, self.page(i))
            since_sync += self.page_bytes
            if fsync == "always" or (fsync == "batch" and since_sync >= BATCH_BYTES):
                os.fdatasync(fd)
                since_sync = 0
        os.fdatasync(fd)
        os.close(fd)

    def read_segments(self, threads: int) -> None:
        per_segment = SEGMENT_BYTES // self.page_bytes
        fds = [os.open(path, os.O_RDONLY) for path in sorted(self.root.glob("*.seg"))]

        def one(i: int) -> None:
            offset = (i % per_segment) * self.page_bytes
            os.preadv(fds[i // per_segment], [bytearray(self.page_bytes)], offset)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(self.count)))
        for fd in fds:
            os.close(fd)


Writer = Callable[[Case, str, int], None]
Reader = Callable[[Case, int], None]
LAYOUTS: list[tuple[str, Writer, Reader, list[tuple[str, int]], list[int]]] = [
    # name, writer, reader, (fsync, writer threads) cases, reader thread counts
    ("raw", Case.write_raw, Case.read_raw, [("never", 1), ("always", 1)], [1]),
    (
        "file-per-page",
        Case.write_files,
        Case.read_files,
        [("never", 1), ("never", 4), ("always", 1), ("always", 4)],
        [1, 4],
    ),
    ("segment", Case.write_segments, Case.read_segments, [("never", 1), ("batch", 1), ("always", 1)], [1, 4]),
]


def run(base: Path, page_bytes: int, total_bytes: int, repeats: int) -> list[dict[str, Any]]:
    samples: dict[tuple[str, str, str, int], list[float]] = {}
    for _ in range(repeats):
        for name, write, read, write_cases, read_threads in LAYOUTS:
            for fsync, threads in write_cases:
                root = base / "case"
                root.mkdir()
                case = Case(root, page_bytes, total_bytes)
                began = time.perf_counter()
                write(case, fsync, threads)
                samples.setdefault((name, "write", fsync, threads), []).append(
                    case.count * page_bytes / (time.perf_counter() - began)
                )
                if (fsync, threads) == write_cases[0]:
                    for reading in read_threads:
                        drop_cache(root)
                        began = time.perf_counter()
                        read(case, reading)
                        samples.setdefault((name, "read", "-", reading), []).append(
                            case.count * page_bytes / (time.perf_counter() - began)
                        )
                shutil.rmtree(root)
    return [
        {
            "page_mib": page_bytes >> 20,
            "layout": name,
            "op": op,
            "fsync": fsync,
            "threads": threads,
            "mb_s": statistics.median(values) / 1e6,
            "runs_mb_s": [round(v / 1e6) for v in values],
        }
        for (name, op, fsync, threads), values in samples.items()
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="on the disk under test")
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--page-mib", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="kvstore-layout-", dir=args.dir))
    try:
        results = [
            row for mib in args.page_mib for row in run(base, mib << 20, args.total_mib << 20, args.repeats)
        ]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_table(
        ["page MiB", "layout", "op", "fsync", "threads", "MB/s (median)", "runs"],
        [
            [
                r["page_mib"],
                r["layout"],
                r["op"],
                r["fsync"],
                r["threads"],
                r["mb_s"],
                " ".join(map(str, r["runs_mb_s"])),
            ]
            for r in results
        ],
    )
    payload = {"dir": str(args.dir), "total_mib": args.total_mib, "repeats": args.repeats, "results": results}
    path = write_results("disk-layout", payload)
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
