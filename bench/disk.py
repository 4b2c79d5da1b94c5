"""Disk tier throughput: write-behind and promotion against raw sequential I/O of the same bytes.

For each page size (`--page-mib`) and fsync policy (`--fsync`), `--total-mib` of KV pages
go through a real `DiskTier` (`--threads` workers) in a temporary directory on the disk
under test (`--dir`), once per codec (none, lz4), and through one plain file (raw):
- write-behind: every page submitted with `submit_write` (the driver retries a page the
  full queue refused, where a store would drop it); MB/s of page bytes from the first
  submit to the last completion, which comes once the page is durable as the policy says.
- promotion: sync + POSIX_FADV_DONTNEED on every record file (cold cache), then every page
  read with `submit_read(into=...)` into its own slot of one destination buffer, as the
  store reads into CPU-tier slots; MB/s of page bytes until the last completion. Every
  page is compared byte for byte.
- raw write / raw read: the same bytes written to one file sequentially with the same
  policy (fdatasync per page for always, every fsync_interval_s for batch, none for
  never), then, cold the same way, read back sequentially by one thread into the same
  destination slots.
The destination is touched before the first round, as a daemon's long-lived CPU-tier arena
is: neither side pays first-touch page faults (2.5 GB/s on the 2-core VM, as slow as the disk).
Rounds are interleaved (raw, none, lz4, in a rotating order, `--repeats` times) so that
the disk's drift hits every side alike; the table gives medians, and promotion / raw read is
the median of each repeat's ratio to the raw read of the same repeat, with its min-max.
Target: promotion >= 0.8 x raw read.

Pages are KV of a random-weight transformers Llama (`bench/disk_codecs.py`) when
transformers is installed, else bf16 values of a normal distribution.

    python bench/disk.py [--dir /var/tmp] [--total-mib 512] [--page-mib 2 32] [--fsync batch always]
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import print_table, write_results  # noqa: E402
from bench.disk_layout import drop_cache  # noqa: E402
from kvstore.config.root import DiskTierConfig  # noqa: E402
from kvstore.tiers.disk import DiskTier  # noqa: E402

NS = bytes(16)
FSYNC_INTERVAL_S = 1.0
FSYNC_POLICIES = ("never", "batch", "always")
CODECS = ("none", "lz4")


def kv_pool() -> tuple[bytes, str]:
    """32 MiB of bf16 KV to cut pages from, and where it came from."""
    try:
        from bench.disk_codecs import kv_pages

        return b"".join(kv_pages("bfloat16")), "random-weight transformers Llama, bf16"
    except ImportError:
        values = np.random.default_rng(0).normal(0, 0.5, 16 << 20).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes(), "normal(0, 0.5) as bf16"


def make_pages(pool: bytes, page_bytes: int, count: int) -> list[bytes]:
    """Distinct pages: the pool read from a different offset for each, wrapping around."""
    doubled = pool + pool
    pages = []
    for i in range(count):
        start = (i * 1_048_583) % len(pool)
        page = doubled[start : start + page_bytes]
        pages.append(page if len(page) == page_bytes else (page * (page_bytes // len(page) + 1))[:page_bytes])
    return pages


class Countdown:
    def __init__(self, count: int) -> None:
        self.left = count
        self.failed = 0
        self._lock = threading.Lock()
        self.finished = threading.Event()

    def done(self, ok: object) -> None:
        with self._lock:
            self.failed += not ok
            self.left -= 1
            if self.left == 0:
                self.finished.set()


def destination(pages: list[bytes]) -> list[memoryview]:
    """One slot per page in one buffer, every memory page of it touched once."""
    total = sum(map(len, pages))
    target = bytearray(total)
    target[:: mmap.PAGESIZE] = b"\x01" * len(range(0, total, mmap.PAGESIZE))
    views, offset, whole = [], 0, memoryview(target)
    for page in pages:
        views.append(whole[offset : offset + len(page)])
        offset += len(page)
    return views


def check(views: list[memoryview], pages: list[bytes], who: str) -> None:
    if any(v != p for v, p in zip(views, pages, strict=True)):
        raise RuntimeError(f"{who} lost or changed pages")
    for view in views:
        view[:1] = b"\xee"  # the next round must write every slot again


def tier_round(
    root: Path, pages: list[bytes], views: list[memoryview], fsync: str, codec: str, threads: int
) -> dict[str, float]:
    total = sum(map(len, pages))
    config = DiskTierConfig(
        enabled=True, path=str(root), bytes=2 * total + (64 << 20), fsync=fsync,
        fsync_interval_s=FSYNC_INTERVAL_S, codec=codec, threads=threads,
    )  # fmt: skip
    tier = DiskTier(config)
    tier.recover()
    try:
        written = Countdown(len(pages))
        began = time.perf_counter()
        for i, page in enumerate(pages):
            while not tier.submit_write(NS, i.to_bytes(16, "big"), page, written.done):
                time.sleep(0.0005)
        written.finished.wait()
        write_s = time.perf_counter() - began
        stats = tier.stats()
        drop_cache(root)
        read = Countdown(len(pages))
        began = time.perf_counter()
        for i, view in enumerate(views):
            if not tier.submit_read(NS, i.to_bytes(16, "big"), read.done, into=view):
                raise RuntimeError(f"page {i} is not on disk")
        read.finished.wait()
        read_s = time.perf_counter() - began
        if written.failed or read.failed:
            raise RuntimeError("the disk tier lost pages")
        check(views, pages, "the disk tier")
        after = tier.stats()
    finally:
        tier.close()
        shutil.rmtree(root, ignore_errors=True)
    direct = after.get("read_bytes_direct", 0) - stats.get("read_bytes_direct", 0)
    return {
        "write_mb_s": total / write_s / 1e6,
        "promotion_mb_s": total / read_s / 1e6,
        "ratio": stats["compression_ratio"],
        "read_direct_share": direct / after["bytes_used"],
    }


def raw_round(root: Path, pages: list[bytes], views: list[memoryview], fsync: str) -> dict[str, float]:
    root.mkdir()
    path = root / "raw"
    total = sum(map(len, pages))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    began = last_sync = time.perf_counter()
    for page in pages:
        os.write(fd, page)
        if fsync == "always" or (fsync == "batch" and time.perf_counter() - last_sync >= FSYNC_INTERVAL_S):
            os.fdatasync(fd)
            last_sync = time.perf_counter()
    if fsync != "never":
        os.fdatasync(fd)
    write_s = time.perf_counter() - began
    os.close(fd)
    drop_cache(root)
    fd = os.open(path, os.O_RDONLY)
    began = time.perf_counter()
    for view in views:
        if os.readv(fd, [view]) != len(view):
            raise RuntimeError("the raw file came back short")
    read_s = time.perf_counter() - began
    os.close(fd)
    check(views, pages, "the raw file")
    shutil.rmtree(root)
    return {"write_mb_s": total / write_s / 1e6, "read_mb_s": total / read_s / 1e6}


def median_of(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}


def case(
    base: Path, pages: list[bytes], views: list[memoryview], fsync: str, threads: int, repeats: int
) -> list[dict[str, Any]]:
    """Interleaved repeats of raw and both codecs; one result row per codec."""
    raws: list[dict[str, float]] = []
    tiers: dict[str, list[dict[str, float]]] = {codec: [] for codec in CODECS}
    sides = ["raw", *CODECS]
    for repeat in range(repeats):
        for side in sides[repeat % 3 :] + sides[: repeat % 3]:
            if side == "raw":
                raws.append(raw_round(base / "raw", pages, views, fsync))
            else:
                tiers[side].append(tier_round(base / "tier", pages, views, fsync, side, threads))
    raw = median_of(raws)
    rows = []
    for codec, rounds in tiers.items():
        ratios = [t["promotion_mb_s"] / r["read_mb_s"] for t, r in zip(rounds, raws, strict=True)]
        writes = [t["write_mb_s"] / r["write_mb_s"] for t, r in zip(rounds, raws, strict=True)]
        tier = median_of(rounds)
        rows.append({
            "page_mib": len(pages[0]) >> 20, "fsync": fsync, "codec": codec, "pages": len(pages), **tier,
            "raw_write_mb_s": raw["write_mb_s"], "raw_read_mb_s": raw["read_mb_s"],
            "promotion_vs_raw_read": statistics.median(ratios),
            "promotion_vs_raw_read_min": min(ratios), "promotion_vs_raw_read_max": max(ratios),
            "write_vs_raw_write": statistics.median(writes),
            "runs": {
                "promotion_mb_s": [t["promotion_mb_s"] for t in rounds],
                "raw_read_mb_s": [r["read_mb_s"] for r in raws],
                "write_mb_s": [t["write_mb_s"] for t in rounds],
                "raw_write_mb_s": [r["write_mb_s"] for r in raws],
            },
        })  # fmt: skip
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="on the disk under test")
    parser.add_argument("--total-mib", type=int, default=512, help="page bytes per round")
    parser.add_argument("--page-mib", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--fsync", nargs="+", default=["batch", "always"], choices=FSYNC_POLICIES)
    parser.add_argument("--threads", type=int, default=4, help="the tier's worker threads")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds per case; medians")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    # The driver retries pages the full queue refuses, on purpose: the tier's warning is expected.
    logging.getLogger("kvstore.tiers.disk").setLevel(logging.ERROR)
    pool, source = kv_pool()
    base = Path(tempfile.mkdtemp(prefix="kvstore-disk-bench-", dir=args.dir))
    results: list[dict[str, Any]] = []
    began = time.time()
    try:
        for page_mib in args.page_mib:
            pages = make_pages(pool, page_mib << 20, max(1, (args.total_mib << 20) // (page_mib << 20)))
            views = destination(pages)
            for fsync in args.fsync:
                results += case(base, pages, views, fsync, args.threads, args.repeats)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_table(
        ["page MiB", "fsync", "codec", "ratio", "write-behind MB/s", "raw write MB/s", "promotion MB/s",
         "raw read MB/s", "promo/raw (min-max)", ">= 0.8"],
        [[r["page_mib"], r["fsync"], r["codec"], round(r["ratio"], 3), r["write_mb_s"], r["raw_write_mb_s"],
          r["promotion_mb_s"], r["raw_read_mb_s"],
          f"{r['promotion_vs_raw_read']:.2f} ({r['promotion_vs_raw_read_min']:.2f}-"
          f"{r['promotion_vs_raw_read_max']:.2f})",
          r["promotion_vs_raw_read"] >= 0.8] for r in results],
    )  # fmt: skip
    path = write_results("disk", {
        "dir": str(args.dir), "pages_from": source, "total_mib": args.total_mib, "threads": args.threads,
        "repeats": args.repeats, "seconds": round(time.time() - began, 1), "results": results,
    })  # fmt: skip
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
