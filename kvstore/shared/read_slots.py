"""Read slots: whether a read of lent blocks still holds its lend, readable by the reader in shared
memory, so that a reader learns it without a round trip once its copy is done.

The daemon keeps one table per local-channel connection that reads lent blocks (`ReadSlots`: a
sealed memfd of `SLOTS` little-endian u64 words, which only the daemon writes) and hands the
table's descriptor to that connection once (SCM_RIGHTS with a lent Lookup's reply that asks for it).
A lent read takes a slot: the daemon writes the read's id there before it answers the Lookup, and
writes 0 there before anything that lets the lender reuse the blocks (a revoke answered, the
lender's connection seen closed, a Clear), and when the read is returned or lapses. So a reader
that finds its read's id in its slot after its copy completed knows the lend still held then:
whatever ends the lend later cannot touch bytes already copied. The reader also checks what the
daemon cannot write: its own clock against the read's TTL, and that its connection is still open
(a daemon that died writes nothing more). Ids are random and never reused by a daemon run, so a
slot given to a later read never matches an earlier one's id.

- `ReadSlots` (daemon): `take(read_id)` -> slot index or None (the table is full: that reader
  waits for Returned's answer instead), `free(index)` (0, and the slot free again), `close()`.
- `SlotView` (worker): the table mapped read-only; `holds(index, read_id)`.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct

SLOTS = 512  # reads in flight of one connection that can be checked in place (4 KiB)
_WORD = struct.Struct("<Q")
_SIZE = SLOTS * _WORD.size
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_FUTURE_WRITE = 0x0010  # F_SEAL_FUTURE_WRITE (Linux 5.1): no new writable mapping, only the daemon's


class ReadSlots:
    """One connection's table, on the daemon's side."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("kvstore-read-slots", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, _SIZE)
            self._map = mmap.mmap(self.fd, _SIZE)
            try:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS | _FUTURE_WRITE)
            except OSError:  # a kernel before 5.1: a reader could write its own slots, no one else's
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
        except BaseException:
            os.close(self.fd)
            raise
        self._free = list(range(SLOTS - 1, -1, -1))
        self.closed = False

    def take(self, read_id: int) -> int | None:
        if self.closed or not self._free:
            return None
        index = self._free.pop()
        _WORD.pack_into(self._map, index * _WORD.size, read_id)
        return index

    def free(self, index: int) -> None:
        """The read no longer holds its lend (written before the lender may reuse the blocks)."""
        if not self.closed:
            _WORD.pack_into(self._map, index * _WORD.size, 0)
            self._free.append(index)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._map.close()
            os.close(self.fd)


class SlotView:
    """A connection's table, mapped read-only in the worker (from the descriptor the daemon sent)."""

    def __init__(self, fd: int) -> None:
        try:
            if os.fstat(fd).st_size != _SIZE:
                raise ValueError(f"read slots: a table of {os.fstat(fd).st_size} bytes, expected {_SIZE}")
            self._map = mmap.mmap(fd, _SIZE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def holds(self, index: int, read_id: int) -> bool:
        return 0 <= index < SLOTS and _WORD.unpack_from(self._map, index * _WORD.size)[0] == read_id

    def close(self) -> None:
        self._map.close()
