"""Disk tier: pages kept as checksummed records in files, written behind, recovered at start.

The store hands the tier the pages it drops from memory (`tiers.disk.write: behind`) or
every committed page (`through`); worker threads compress and write them, and read them
back when a lookup promotes them. No call waits on the disk: each takes the index lock
for a few dict operations and queues the work. What the threads do: `disk_workers.py`;
records: `records.py`; files and recovery: `disk_files.py`; the index: `disk_index.py`;
claiming the directory and reading it back at start: `disk_start.py`; why one file per page:
bench/NOTES-disk.md.

Primitives (any thread; the store calls them from its event loop):
- `DiskTier(config)`: claims (`kvstore.config.claim.claim_private_directory`: created 0700, or a
  directory of this user or root that no one else can write, else a ConfigError naming
  `tiers.disk.path`) and locks the directory; reads nothing yet. Every file operation after
  that goes through the claimed descriptor (`base`, `/proc/self/fd/<fd>`), never the path
  again, and opens files with O_NOFOLLOW; a file there that is not a regular file of this
  user is corrupt, never data.
- `recover(progress) -> list[RecordInfo]`: rebuilds the index from the clean-shutdown
  index, or else from the record headers (torn and corrupt files removed, counted); then
  starts the workers. Call it once, before anything else.
- `submit_write(ns, key, page, done) -> bool`: queues a copy of `page` (bytes are kept, not
  copied). False, counted in `dropped_writes`, when the queue is full or the tier is off.
  True when queued or already on disk: `done(durable)` then runs once on a tier thread.
- `submit_read(ns, key, done, into) -> bool`: False (a miss) when the page is not here.
  True: `done(page | None)` runs once on a worker thread; None when the record could not
  be read or failed its checksum (counted). With `into` (a writable buffer of the page's
  size, e.g. its CPU-tier slot) the page is read into it and `done` gets `into` back; it
  must not be reused before `done` runs. Reads go before queued writes.
- `read(ns, key)`: the same, blocking; for tests and tools.
- `contains`, `present(ns, keys)` (how many leading keys are here),
  `flushed` (on disk and synced per `tiers.disk.fsync`), `touch(ns, keys)`
  (marks them used, keys[0] most recent, so a chain's head outlives its tail), `remove`,
  `clear(ns)`.
- `take_evicted()`: pages evicted for space since the last call.
- `stats()`, `close(timeout_s)`: drains the queue, syncs, writes the clean-shutdown index.

Space: a write that does not fit evicts the least recently used records that no read is
using, all or none. `ENOSPC`/`EIO` (any error writing, syncing or scanning) turns the
tier off: an error log, `enabled` 0 in stats, queued work dropped; memory tiers go on.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstore.config.root import DiskTierConfig
from kvstore.shared.domain import Tier
from kvstore.tiers import disk_files as files
from kvstore.tiers.codec import CODECS, Buffer
from kvstore.tiers.disk_files import Progress, RecordInfo
from kvstore.tiers.disk_index import DiskIndex, Ident, Record
from kvstore.tiers.disk_jobs import Read, ReadDone, Write, WriteDone
from kvstore.tiers.disk_start import open_directory, read_records, warn_if_small
from kvstore.tiers.disk_workers import DiskWorkers

log = logging.getLogger(__name__)


class DiskTier(DiskWorkers):
    name = "disk"
    medium = Tier.DISK

    def __init__(self, config: DiskTierConfig) -> None:
        self.config = config
        self.root = Path(config.path)
        self.capacity = config.bytes
        self.write_through = config.write == "through"
        self._codec = CODECS[config.codec]
        self._root_fd = open_directory(self.root)
        self.base = Path(f"/proc/self/fd/{self._root_fd}")  # the claimed directory, whatever its path
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._index = DiskIndex(config.bytes)
        self._pending: dict[Ident, Write] = {}  # queued or being written
        self._written = threading.Condition(self._lock)  # notified as a write leaves _pending
        self._writes: deque[Write] = deque()
        self._reads: deque[Read] = deque()
        self._calls: deque[Callable[[], None]] = deque()  # callbacks due on a tier thread
        self._busy: Counter[Ident] = Counter()  # file removals in flight: a new write waits to rename
        self._unsynced: list[tuple[Ident, WriteDone | None]] = []  # fsync: batch
        self._evicted: list[Ident] = []
        self._queued_bytes = 0
        self._serial = itertools.count()
        self._threads: list[threading.Thread] = []
        self._dirs: set[Path] = set()
        self._stopping = threading.Event()
        self._idle = threading.Event()  # fsync: batch; the last queued write is done: sync now
        self._deadline = float("inf")  # close(): queued writes left after it are dropped
        self._started = self._closed = self._warned_drop = False
        self.counters: Counter[str] = Counter()
        self.enabled = True
        self.error: str | None = None

    # -- start --------------------------------------------------------------

    def recover(self, progress: Progress | None = None) -> list[RecordInfo]:
        """Rebuilds the index from the directory and starts the workers; returns the records kept."""
        if self._started or self._closed:
            raise RuntimeError("DiskTier.recover() runs once, before any other call")
        self._started = True
        began = time.perf_counter()
        try:
            records, source = read_records(self.base, progress, self.counters)
        except OSError as exc:
            self._turn_off(exc, f"recovering {self.root}")
            return []
        with self._lock:
            for info in records:
                record = Record(info.codec, info.raw_length, info.stored_bytes, durable=True)
                self._index.add((info.namespace, info.key), record, reserved=False)
            over = self._evict_for(0) or []  # tiers.disk.bytes was lowered since
        for ident in over:
            self._unlink(ident)
        warn_if_small(self.base, self.root, self.capacity, self._index.bytes_used)
        workers = [self._work] * self.config.threads
        if self.config.fsync == "batch":
            workers.append(self._sync_loop)
        for i, target in enumerate(workers):
            thread = threading.Thread(target=target, name=f"kvstore-disk-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info(
            "disk tier %s: %d pages, %d MiB of %d MiB, from the %s in %.2f s (%d torn, %d corrupt removed)",
            self.root,
            len(self._index),
            self._index.bytes_used >> 20,
            self.capacity >> 20,
            source,
            time.perf_counter() - began,
            self.counters["torn_records"],
            self.counters["skipped_on_recovery"] - self.counters["torn_records"],
        )
        return [info for info in records if (info.namespace, info.key) in self._index]

    # -- the store's calls --------------------------------------------------

    def submit_write(self, namespace: bytes, key: bytes, page: Buffer, done: WriteDone | None = None) -> bool:
        """Queues the page for writing; never waits. False (a drop) when full or off."""
        size = len(page)
        if not self._has_room(size):  # a cheap early answer, before the copy
            return self._drop_write(size)
        data = page if isinstance(page, bytes) else bytes(page)
        ident = (namespace, key)
        with self._lock:
            self._check_started()
            present = self._index.get(ident)
            queued = self._pending.get(ident)
            if (
                not self.enabled
                or self._closed
                or (present is None and (queued is None or queued.cancelled) and not self._has_room(size))
            ):
                return self._drop_write(size)
            if present is not None or (queued is not None and not queued.cancelled):
                self.counters["duplicate_writes"] += 1
                if done is not None:
                    self._on_stored(ident, present, queued, done)
                return True
            job = Write(namespace, key, data, done)
            self._pending[ident] = job
            self._writes.append(job)
            self._queued_bytes += size
            self._wake.notify()
        return True

    def _has_room(self, size: int) -> bool:
        return self.enabled and not self._closed and self._queued_bytes + size <= self.config.queue_bytes

    def _drop_write(self, size: int) -> bool:
        self.counters["dropped_writes"] += 1
        if self.enabled and not self._warned_drop:
            self._warned_drop = True
            log.warning(
                "disk tier: write-behind queue full (%d MiB queued, a %d KiB page dropped): the disk is "
                "slower than eviction; pages are dropped, never waited for (dropped_writes in stats); "
                "raise tiers.disk.queue_bytes or tiers.disk.threads",
                self._queued_bytes >> 20,
                size >> 10,
            )
        return False

    def _on_stored(self, ident: Ident, present: Record | None, queued: Write | None, done: WriteDone) -> None:
        """`done` for a page already on disk or queued: when it is durable."""
        if queued is not None:
            queued.dones.append(done)
        elif present is not None and not present.durable:
            self._unsynced.append((ident, done))
        else:
            self._calls.append(lambda: done(True))
            self._wake.notify()

    def submit_read(
        self, namespace: bytes, key: bytes, done: ReadDone, into: memoryview | None = None
    ) -> bool:
        """Queues a read of the page; False (a miss) when it is not in this tier."""
        ident = (namespace, key)
        with self._lock:
            self._check_started()
            queued = self._pending.get(ident)
            if queued is not None and queued.cancelled:
                queued = None
            record = None if queued is not None else self._index.get(ident)
            if not self.enabled or self._closed or (queued is None and record is None):
                self.counters["read_misses"] += 1
                return False
            raw_length = len(queued.page) if queued is not None else record.raw_length  # type: ignore[union-attr]
            if into is not None and len(into) != raw_length:
                if record is None:
                    raise ValueError(
                        f"into: expected a buffer of the page's {raw_length} bytes, got {len(into)}"
                    )
                # A record's length comes from its header: one that does not fit the slot is not this page.
                self.counters["corrupted_records"] += 1
                self.counters["read_misses"] += 1
                if self._forget(ident, "lost") is not None:
                    self._calls.append(lambda: self._unlink(ident))
                    self._wake.notify()
                return False
            if record is not None:
                record.readers += 1
            page = queued.page if queued is not None else None
            self._reads.append(Read(namespace, key, record, page, done, into))
            self.counters["reads"] += 1
            self._wake.notify()
        return True

    def read(self, namespace: bytes, key: bytes) -> bytes | None:
        """The page, or None (missing, unreadable or corrupt); blocks on the disk."""
        result: list[Buffer | None] = []
        finished = threading.Event()

        def done(page: Buffer | None) -> None:
            result.append(page)
            finished.set()

        if not self.submit_read(namespace, key, done):
            return None
        finished.wait()
        page = result[0]
        return None if page is None else bytes(page)

    def listen(self, told: Callable[[bool, tuple[bytes, bytes], str], None]) -> None:
        """`told(stored, (namespace, key), reason)` for every record indexed (True) or dropped
        (False): those recovered at start now ("recovered"), then each as it comes or goes (the
        store makes them KV events)."""
        with self._lock:
            for ident in self._index.idents():
                told(True, ident, "recovered")
            self._index.listener = told

    def contains(self, namespace: bytes, key: bytes) -> bool:
        ident = (namespace, key)
        with self._lock:
            queued = self._pending.get(ident)
            return self.enabled and (ident in self._index or (queued is not None and not queued.cancelled))

    def present(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """How many leading `keys` are in this tier."""
        found = 0
        with self._lock:
            if not self.enabled:
                return 0
            for key in keys:
                ident = (namespace, key)
                queued = self._pending.get(ident)
                if ident not in self._index and (queued is None or queued.cancelled):
                    break
                found += 1
        return found

    def wait_written(self, timeout_s: float = 60.0) -> bool:
        """Waits until no write is queued or in progress (each written and indexed, or dropped);
        False if some still are after `timeout_s`. A replay does this after each request, so
        what the tier holds does not depend on how fast its thread writes."""
        with self._lock:
            return self._written.wait_for(lambda: not self._pending, timeout_s)

    def flushed(self, namespace: bytes, key: bytes) -> bool:
        """The page is in its record file, synced as `tiers.disk.fsync` asks."""
        with self._lock:
            record = self._index.get((namespace, key))
            return self.enabled and record is not None and record.durable

    def touch(self, namespace: bytes, keys: Sequence[bytes]) -> None:
        """Marks the pages used now, keys[0] the most recent (a chain's head is evicted last)."""
        with self._lock:
            self._index.touch((namespace, key) for key in reversed(keys))

    def remove(self, namespace: bytes, key: bytes) -> None:
        ident = (namespace, key)
        with self._lock:
            queued = self._pending.get(ident)
            if queued is not None and not queued.cancelled:
                queued.cancelled = True
                if queued.started:
                    self._busy[ident] += 1  # its writer removes the file it renames
                else:
                    self._queued_bytes -= len(queued.page)
                    del self._pending[ident]
                    self._written.notify_all()
            elif self._forget(ident) is not None:
                self._calls.append(lambda: self._unlink(ident))
                self._wake.notify()

    def clear(self, namespace: bytes | None = None) -> int:
        """Removes every page of `namespace` (of all namespaces when None); returns how many."""
        with self._lock:
            idents = [ident for ident in self._index.idents() if namespace in (None, ident[0])]
            idents += [
                ident
                for ident, write in self._pending.items()
                if namespace in (None, ident[0]) and not write.cancelled
            ]
        for ident in idents:
            self.remove(*ident)
        return len(idents)

    def take_evicted(self) -> list[tuple[bytes, bytes]]:
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    def _check_started(self) -> None:
        if not self._started:
            raise RuntimeError("DiskTier: call recover() before using the tier")

    # -- figures and shutdown -----------------------------------------------

    def stats(self) -> dict[str, float]:
        with self._lock:
            figures: dict[str, float] = dict(self.counters)
            figures.update(
                enabled=float(self.enabled),
                bytes_used=self._index.bytes_used,
                bytes_capacity=self.capacity,
                pages=len(self._index),
                raw_bytes=self._index.raw_bytes,
                compression_ratio=self._index.compression_ratio,
                queue_depth=len(self._writes),
                writing=sum(1 for write in self._pending.values() if write.started),
                queue_bytes=self._queued_bytes,
                reads_queued=len(self._reads),
                unsynced=len(self._unsynced),
            )
        for name in (
            "dropped_writes",
            "written",
            "promotions",
            "read_misses",
            "corrupted_records",
            "skipped_on_recovery",
            "evicted",
            "errors",
            "outages",
        ):
            figures.setdefault(name, 0)
        return figures

    def close(self, timeout_s: float = 10.0) -> None:
        """Writes what is queued (for at most `timeout_s`), syncs, and leaves a clean-shutdown index."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._deadline = time.monotonic() + timeout_s
            self._stopping.set()
            self._idle.set()
            self._wake.notify_all()
        for thread in self._threads:
            thread.join(max(0.0, self._deadline - time.monotonic()) + 1.0)
        stuck = [thread.name for thread in self._threads if thread.is_alive()]
        if self.config.fsync == "batch" and not stuck:
            self._sync_batch()
        try:
            if stuck:
                log.warning("disk tier: %s still busy at close; the next start scans the records", stuck)
            elif self.enabled and self._started:
                with self._lock:
                    records = self._index.records()
                files.save_index(self.base, records)
        except OSError as exc:
            log.error("disk tier: cannot write the clean-shutdown index: %s; the next start scans", exc)
        finally:
            os.close(self._root_fd)
