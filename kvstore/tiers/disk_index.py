"""The disk tier's index: which records are on disk, in use order, and the space they take.

Not thread-safe: the tier's lock guards every call.
- `reserve(size)`: room for a record about to be written, made by evicting the least
  recently used records that no read is using, all or nothing: the victims, or None.
- `add(ident, record)` (after `reserve`), `pop(ident)`, `get(ident)`, `touch(idents)`.
  The capacity may be overrun by records found at recovery; `reserve(0)` evicts down to it.
- `records()`: `RecordInfo`s, least recently used first (the clean-shutdown index's order).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvstore.tiers.codec import Codec
from kvstore.tiers.disk_files import RecordInfo

Ident = tuple[bytes, bytes]  # (namespace, key)


class Record:
    __slots__ = ("codec", "raw_length", "stored_bytes", "readers", "durable")

    def __init__(self, codec: Codec, raw_length: int, stored_bytes: int, durable: bool) -> None:
        self.codec = codec
        self.raw_length = raw_length
        self.stored_bytes = stored_bytes
        self.readers = 0  # reads in flight: not evictable
        self.durable = durable  # synced as tiers.disk.fsync asks


class DiskIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # Told of every record added (True) or dropped (False), with why: the KV events.
        self.listener: Callable[[bool, Ident, str], None] | None = None
        self._records: OrderedDict[Ident, Record] = OrderedDict()  # least recently used first
        self.bytes_used = 0  # records, plus room reserved for writes in progress
        self.stored_bytes = 0  # records only
        self.raw_bytes = 0  # the pages they hold

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, ident: Ident) -> bool:
        return ident in self._records

    def get(self, ident: Ident) -> Record | None:
        return self._records.get(ident)

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def reserve(self, size: int) -> list[Ident] | None:
        need = self.bytes_used + size - self.capacity
        victims: list[Ident] = []
        if need > 0:
            for ident, record in self._records.items():
                if record.readers:
                    continue
                victims.append(ident)
                need -= record.stored_bytes
                if need <= 0:
                    break
            else:
                return None
        for ident in victims:
            self.pop(ident, "evicted")
        self.bytes_used += size
        return victims

    def unreserve(self, size: int) -> None:
        self.bytes_used -= size

    def add(self, ident: Ident, record: Record, reserved: bool = True) -> None:
        """Indexes a record whose room `reserve` made (or, at recovery, one that was on disk)."""
        if not reserved:
            self.bytes_used += record.stored_bytes
        self._records[ident] = record
        self.stored_bytes += record.stored_bytes
        self.raw_bytes += record.raw_length
        if self.listener is not None:
            self.listener(True, ident, "written" if reserved else "recovered")

    def pop(self, ident: Ident, reason: str = "cleared") -> Record | None:
        record = self._records.pop(ident, None)
        if record is not None:
            self.bytes_used -= record.stored_bytes
            self.stored_bytes -= record.stored_bytes
            self.raw_bytes -= record.raw_length
            if self.listener is not None:
                self.listener(False, ident, reason)
        return record

    def idents(self) -> list[Ident]:
        return list(self._records)

    def touch(self, idents: Iterable[Ident]) -> None:
        """Marks the records used now, the last one given the most recently."""
        for ident in idents:
            if ident in self._records:
                self._records.move_to_end(ident)

    def records(self) -> list[RecordInfo]:
        return [
            RecordInfo(ns, key, record.codec, record.raw_length, record.stored_bytes)
            for (ns, key), record in self._records.items()
        ]
