"""What the disk tier's threads do: write, read, evict, sync, and turn the tier off on a disk error.

`DiskWorkers` is the thread half of `DiskTier` (`disk.py` holds the calls the store makes):
both halves share one lock and the state declared here; every method here runs on a tier
thread, or under the lock where its docstring says so.

- A write: compress, make room (evicting least recently used records, all or nothing),
  write a temp file, wait for any older file of the same key to be gone, rename, index.
- A read: into the caller's buffer, checked; a corrupt or vanished record becomes a miss.
  Uncached bytes come through O_DIRECT (`disk_io.py` says why).
- `_busy` counts file removals in flight per key, so a rename never races an unlink.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path

from kvstore.config.root import DiskTierConfig
from kvstore.tiers import disk_files as files
from kvstore.tiers.codec import Buffer, Codec, compress
from kvstore.tiers.disk_files import record_path
from kvstore.tiers.disk_index import DiskIndex, Ident, Record
from kvstore.tiers.disk_io import read_record, write_record
from kvstore.tiers.disk_jobs import Read, Write, WriteDone
from kvstore.tiers.records import CorruptRecord, pack_header

log = logging.getLogger("kvstore.tiers.disk")


class DiskWorkers:
    config: DiskTierConfig
    root: Path  # as configured: for messages
    base: Path  # the claimed directory's descriptor: for every file operation
    enabled: bool
    error: str | None
    counters: Counter[str]
    _codec: Codec
    _root_fd: int
    _lock: threading.Lock
    _wake: threading.Condition
    _index: DiskIndex
    _pending: dict[Ident, Write]
    _written: threading.Condition
    _writes: deque[Write]
    _reads: deque[Read]
    _calls: deque[Callable[[], None]]
    _busy: Counter[Ident]
    _unsynced: list[tuple[Ident, WriteDone | None]]
    _evicted: list[Ident]
    _queued_bytes: int
    _serial: itertools.count[int]
    _dirs: set[Path]
    _stopping: threading.Event
    _idle: threading.Event
    _deadline: float

    # -- workers ------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._lock:
                while not (self._calls or self._reads or self._writes or self._stopping.is_set()):
                    self._wake.wait()
                if self._calls:
                    job: Callable[[], None] = self._calls.popleft()
                elif self._reads:
                    job = functools.partial(self._run_read, self._reads.popleft())
                elif self._writes:
                    write = self._writes.popleft()
                    job = self._take_write(write)
                else:
                    return  # closing, and nothing is left
            try:
                job()
            except Exception:  # a bug must not take a worker away
                self.counters["errors"] += 1
                log.exception("disk tier: a worker job failed")

    def _take_write(self, write: Write) -> Callable[[], None]:
        """What a worker does with the next queued write (called under the lock)."""
        if write.cancelled:  # remove() already took it off the books
            return lambda: self._complete(write.dones, False)
        self._queued_bytes -= len(write.page)
        if time.monotonic() > self._deadline:  # close() ran out of time
            self._release(write)
            self.counters["dropped_writes"] += 1
            return lambda: self._complete(write.dones, False)
        write.started = True
        return lambda: self._run_write(write)

    def _release(self, write: Write) -> None:
        ident = (write.namespace, write.key)
        if self._pending.get(ident) is write:
            del self._pending[ident]
            self._written.notify_all()

    def _complete(self, dones: list[WriteDone], durable: bool) -> None:
        for done in dones:
            try:
                done(durable)
            except Exception:
                log.exception("disk tier: a write completion callback failed")

    def _run_write(self, write: Write) -> None:
        ident = (write.namespace, write.key)
        codec, payload = compress(self._codec, write.page)
        header = pack_header(write.namespace, write.key, codec, len(write.page), payload)
        size = len(header) + len(payload)
        with self._lock:
            victims = self._evict_for(size) if self.enabled and not write.cancelled else None
            if victims is None:
                self._abandon(write, rejected=self.enabled and not write.cancelled)
                return self._complete(write.dones, False)
        for victim in victims:
            self._unlink(victim)
        final = record_path(self.base, write.namespace, write.key)
        temp = files.temp_path(final, next(self._serial))
        always = self.config.fsync == "always"
        try:
            self._make_dir(final.parent)
            write_record(temp, header, payload, sync=always)
            with self._lock:
                while self._busy[ident] and not write.cancelled:  # an old file of this key is going
                    self._wake.wait()
                renamed = not write.cancelled
            if renamed:
                os.rename(temp, final)
                if always:
                    files.fsync_dir(final.parent)
            else:
                temp.unlink()
        except OSError as exc:
            with self._lock:
                self._index.unreserve(size)
                self._abandon(write, rejected=False)
            self._turn_off(exc, f"writing {self._shown(ident)}")
            return self._complete(write.dones, False)
        batch = self.config.fsync == "batch"
        with self._lock:
            self._release(write)
            cancelled = write.cancelled  # final: remove() cancels only writes still pending
            kept = self.enabled and not cancelled
            if kept:
                self._index.add(ident, Record(codec, len(write.page), size, durable=not batch))
                self.counters["written"] += 1
                self.counters["written_bytes"] += size
                if batch:
                    self._unsynced.extend((ident, done) for done in write.dones)
                    if not self._writes:
                        self._idle.set()
            else:
                self._index.unreserve(size)
        if cancelled:  # remove() counted this key busy until its file is gone
            if renamed:
                self._unlink(ident)
            else:
                self._settle(ident)
        if not kept:
            self._complete(write.dones, False)
        elif not batch:
            self._complete(write.dones, True)

    def _abandon(self, write: Write, rejected: bool) -> None:
        """A started write that leaves no record (called under the lock)."""
        self._release(write)
        if write.cancelled:
            self._settle_locked((write.namespace, write.key))
        if rejected:
            self.counters["rejected_writes"] += 1  # larger than the tier, or all of it is being read

    def _make_dir(self, directory: Path) -> None:
        if directory in self._dirs:
            return
        directory.mkdir(parents=True, exist_ok=True)
        if self.config.fsync == "always":
            files.fsync_dir(directory.parent)
            files.fsync_dir(directory.parent.parent)
        self._dirs.add(directory)

    def _run_read(self, read: Read) -> None:
        ident = (read.namespace, read.key)
        page: Buffer | None = read.page
        tally: Counter[str] = Counter()
        try:
            if page is not None:  # still queued for writing: served from memory
                if read.into is not None:
                    read.into[:] = page
                    page = read.into
            elif read.record is not None:
                path = record_path(self.base, read.namespace, read.key)
                stored, raw = read.record.stored_bytes, read.record.raw_length
                page = read_record(
                    path, read.namespace, read.key, stored, read.into, tally=tally, raw_length=raw
                )
        except FileNotFoundError:
            self._lost(ident, read.record, "missing_records", "its file is gone")
        except CorruptRecord as exc:
            self._lost(ident, read.record, "corrupted_records", str(exc))
        except OSError as exc:
            self._turn_off(exc, f"reading {self._shown(ident)}")
        finally:
            with self._lock:
                if read.record is not None:
                    read.record.readers -= 1
                self.counters["promotions" if page is not None else "failed_reads"] += 1
                self.counters.update(tally)
        try:
            read.done(page)
        except Exception:
            log.exception("disk tier: a read completion callback failed")

    def _lost(self, ident: Ident, record: Record | None, counter: str, why: str) -> None:
        """A record that could not be read: a miss now, gone from the index and the disk.

        A record removed while it was being read is no loss: it just misses.
        """
        with self._lock:
            current = self._index.get(ident) is record
            if current or counter == "corrupted_records":
                self.counters[counter] += 1
            forgotten = current and self._forget(ident, "lost") is not None
        if current:
            log.warning("disk tier: page %s/%s is a miss: %s", ident[0].hex()[:12], ident[1].hex(), why)
        if forgotten:
            self._unlink(ident)

    # -- space --------------------------------------------------------------

    def _evict_for(self, size: int) -> list[Ident] | None:
        """Room for `size` more bytes (under the lock): the evicted records, whose files must go."""
        victims = self._index.reserve(size)
        if victims:
            self._busy.update(victims)
            self._evicted.extend(victims)
            self.counters["evicted"] += len(victims)
        return victims

    def _forget(self, ident: Ident, reason: str = "cleared") -> Record | None:
        """Drops a record from the index; its file must then go through `_unlink` (under the lock)."""
        record = self._index.pop(ident, reason)
        if record is not None:
            self._busy[ident] += 1
        return record

    def _unlink(self, ident: Ident) -> None:
        try:
            record_path(self.base, *ident).unlink(missing_ok=True)
        except OSError as exc:
            self._turn_off(exc, f"removing {self._shown(ident)}")
        self._settle(ident)

    def _shown(self, ident: Ident) -> Path:
        """The record's path as the operator named the directory."""
        return record_path(self.root, *ident)

    def _settle(self, ident: Ident) -> None:
        with self._lock:
            self._settle_locked(ident)

    def _settle_locked(self, ident: Ident) -> None:
        """One file operation on `ident` is over; writers waiting to rename may go on."""
        self._busy[ident] -= 1
        if self._busy[ident] <= 0:
            del self._busy[ident]
        self._wake.notify_all()

    # -- faults and durability ----------------------------------------------

    def _turn_off(self, exc: OSError, doing: str) -> None:
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
            self.error = f"{doing}: {exc.strerror or exc}"
            self.counters["errors"] += 1
            self.counters["outages"] += 1
            writes = [write for write in self._writes if not write.cancelled]
            reads = list(self._reads)
            unsynced, self._unsynced = self._unsynced, []
            self._writes.clear()
            self._reads.clear()
            for write in writes:
                self._release(write)
            self._queued_bytes = 0
            self.counters["dropped_writes"] += len(writes)
            for read in reads:
                if read.record is not None:
                    read.record.readers -= 1
        log.error(
            "disk tier turned off: %s; the daemon goes on serving from memory. Free space on or replace "
            "the disk under %s, then restart kvstored",
            self.error,
            self.root,
        )
        for write in writes:
            self._complete(write.dones, False)
        self._complete([done for _, done in unsynced if done is not None], False)
        for read in reads:
            read.done(None)

    def _sync_loop(self) -> None:
        """Group commit: one sync once the write queue runs dry, and at least every interval."""
        while not self._stopping.is_set():
            self._idle.wait(self.config.fsync_interval_s)
            self._idle.clear()
            self._sync_batch()

    def _sync_batch(self) -> None:
        """fsync: batch. One filesystem sync makes every record written before it durable."""
        with self._lock:
            batch, self._unsynced = self._unsynced, []
        if not batch:
            return
        try:
            files.sync_filesystem(self._root_fd)
        except OSError as exc:
            self._turn_off(exc, f"syncing {self.root}")
            return self._complete([done for _, done in batch if done is not None], False)
        durable: list[tuple[WriteDone, bool]] = []
        with self._lock:
            for ident, done in batch:
                record = self._index.get(ident)
                if record is not None:
                    record.durable = True
                if done is not None:
                    durable.append((done, record is not None))
            self.counters["sync_batches"] += 1
        for done, ok in durable:
            self._complete([done], ok)
