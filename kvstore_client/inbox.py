"""The inboxes of pushed hand-overs (`KVStoreClient.expect` and `deliver`): where a sender's GPU
tells the receiving worker that the pages it pushed into the receiver's KV cache have all landed.

A receiving process owns one inbox: a memfd of `HEADER` bytes and `SLOTS` slots, each eight
little-endian u64 words:

- `nonce`: the receipt's, written by the receiver when it posts the receipt (0: the slot is free);
- `pid`, `start`: the sender that claimed the slot (its pid and start time, for the log), written
  by the sender under the slot's lock before it enqueues anything;
- `done`: written by the sender's GPU, in stream order after its last copy: the nonce plus the
  chunks delivered. Nothing else writes it, so a receiver that reads `nonce + n` knows that the
  first `n` chunks are whole;
- `digest` (four words): the BLAKE2b-256 of the whole receipt, written at post; a sender claims
  only a receipt whose bytes hash to it, so a receipt altered on its way (other keys, other block
  ids, another cache's descriptor) is refused before anything moves.

A sender reaches the inbox through `/proc/<receiver pid>/fd/<fd>`: the kernel lets only a process
that may read the receiver's memory open it (the same user, one pid namespace); the path must be a
regular file of the inbox's size before it is opened, and the receipt's inode number and random
inbox id tell a reused pid or fd from the receiver's. A sender opens each inbox (each inode) once.

Locks are open-file-description locks (`F_OFD_SETLK`): they conflict between two opens even in
one process, and closing another descriptor of the file does not drop them. Claims and cancels
take the slot's lock (and a thread lock within one process): a receipt is delivered at most
once, and a cancelled one never.

When the receiver may reuse the blocks of a receipt it gave up on: at once if no sender claimed it
(the slot's nonce is cleared under the lock, so no sender can claim it after); else only once the
claim's `done` landed or the claiming process is gone (its CUDA context, and with it any copy not
yet run, went with it). A sender holds a shared lock on its slot's byte past the end of the file
(`ALIVE`) from before its claim until its copy has run, counted per slot (two deliveries of one
slot in flight hold it until the second ends); the kernel drops it when the process dies,
whatever pid namespace either side is in, so a receiver that can take that byte's lock knows that
no copy of that claim can still land. A sender alive and never finishing (a hung GPU) keeps the
blocks held.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import secrets
import stat
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.shared.peers import process_start_time

MAGIC = b"kvstore-inbox-02"
HEADER = 4096  # the magic and the inbox id, then nothing: the slots start on their own page
SLOTS = 1024
SLOT_BYTES = 64
SIZE = HEADER + SLOTS * SLOT_BYTES
NONCE, PID, START, DONE = range(4)  # a slot's words; 4..7: the receipt's digest
MAX_OPEN = 64  # receivers' inboxes a sender keeps open (more while all have deliveries in flight)
ALIVE = SIZE  # a slot's liveness lock: byte ALIVE + slot (past the end: no byte of the file)
_FLOCK = struct.Struct("hh4xqqi4x")  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0)


def digest(receipt: bytes) -> np.ndarray:
    """A receipt's digest, as the slot's four words hold it."""
    return np.frombuffer(hashlib.blake2b(receipt, digest_size=32).digest(), dtype="<u8")


class InboxFull(RuntimeError):
    """Every slot holds a receipt not yet delivered or cancelled."""


class Inbox:
    """This process's inbox (the receiver's side)."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("kvstore-inbox", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, SIZE)
            self._map = mmap.mmap(self.fd, SIZE)
        except BaseException:
            os.close(self.fd)
            raise
        self.pid, self.inode, self.id = os.getpid(), os.fstat(self.fd).st_ino, secrets.token_bytes(16)
        self._map[: len(MAGIC) + 16] = MAGIC + self.id
        self._words = np.frombuffer(self._map, dtype="<u8", count=SLOTS * 8, offset=HEADER).reshape(SLOTS, 8)
        self._free = list(range(SLOTS - 1, -1, -1))
        self._dropped: list[tuple[int, int, int]] = []  # receipts given up unread (`drop`)
        self._lock = threading.Lock()

    def address(self) -> tuple[int, int, int, bytes]:
        """What a receipt names the inbox by: (pid, fd, inode, id)."""
        return self.pid, self.fd, self.inode, self.id

    def post(self, nonce: int, make: Callable[[int], bytes]) -> tuple[int, bytes]:
        """(a free slot, the receipt `make(slot)` made for it), posted there: a sender may claim
        it now. InboxFull where no slot is free; what `make` raises, with the slot left free."""
        self._reap()
        with self._lock:
            if not self._free:
                raise InboxFull(f"all {SLOTS} hand-over slots of this process await their senders")
            slot = self._free[-1]
            receipt = make(slot)
            with _locked(self.fd, slot):
                self._words[slot, 4:] = digest(receipt)
                self._words[slot, :4] = (nonce, 0, 0, 0)
            self._free.pop()
        return slot, receipt

    def delivered(self, slot: int, nonce: int, chunks: int) -> int | None:
        """The chunks delivered into `slot` (at most `chunks`), None while nothing has landed."""
        got = (int(self._words[slot, DONE]) - nonce) % (1 << 64)
        return got if got <= chunks and self._words[slot, NONCE] == nonce else None

    def cancel(self, slot: int, nonce: int, chunks: int) -> bool | None:
        """Gives up `slot`'s receipt: True where its blocks are free now (no sender claimed it, or
        the one that did is gone: the slot is free again), False where a delivery landed (the
        slot stays until `release`), None while a live sender's may still land."""
        with self._lock, _locked(self.fd, slot):
            row = self._words[slot]
            if int(row[NONCE]) != nonce:
                return True  # freed before
            if self.delivered(slot, nonce, chunks) is not None:
                return False  # read it (`delivered`), then `release`
            if row[PID] and (int(row[PID]) == self.pid or _held(self.fd, ALIVE + slot)):
                return None  # claimed by a sender that runs: its copy may be in flight
            row[NONCE] = 0  # a sender that reads it now finds the receipt stale
            self._free.append(slot)
            return True

    def drop(self, slot: int, nonce: int, chunks: int) -> None:
        """`slot`'s receipt is given up unread (its handle collected): cancelled by a later `post`,
        once nothing can land (no lock is taken here: a collection may run inside any call)."""
        self._dropped.append((slot, nonce, chunks))

    def _reap(self) -> None:
        while self._dropped:
            slot, nonce, chunks = self._dropped.pop()
            done = self.cancel(slot, nonce, chunks)
            if done is None:  # a sender's copy may still land: asked again at the next post
                self._dropped.insert(0, (slot, nonce, chunks))
                return
            if done is False:  # landed, unread
                self.release(slot, nonce)

    def release(self, slot: int, nonce: int) -> None:
        """`slot` is done with (its delivery read): free for another receipt."""
        with self._lock, _locked(self.fd, slot):
            if int(self._words[slot, NONCE]) == nonce:
                self._words[slot, NONCE] = 0
                self._free.append(slot)


class _Opened:
    """A receiver's inbox mapped in a sender, with the count of its claims in flight per slot."""

    def __init__(self, path: str, inode: int, inbox_id: bytes) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        try:
            if os.fstat(self.fd).st_ino != inode:  # replaced since it was looked at
                raise ValueError(f"{path} is not the receipt's inbox")
            self.map = mmap.mmap(self.fd, SIZE)
            if self.map[: len(MAGIC) + 16] != MAGIC + inbox_id:
                self.map.close()
                raise ValueError(f"{path} is not the receipt's inbox")
        except BaseException:
            os.close(self.fd)  # no lock of this process is on this description
            raise
        self.id = inbox_id
        self.words = np.frombuffer(self.map, dtype="<u8", count=SLOTS * 8, offset=HEADER).reshape(SLOTS, 8)
        self.base = np.frombuffer(self.map, dtype=np.uint8).ctypes.data
        self.registered = self.closed = False
        self.alive: dict[int, int] = {}  # slot -> claims of this process whose copies may still land
        self.lock = threading.Lock()

    def done_address(self, slot: int) -> int:
        return self.base + HEADER + slot * SLOT_BYTES + DONE * 8

    def close(self) -> None:
        if self.registered:
            from kvstore.shared.cudart import load_runtime

            load_runtime().host_unregister(self.base)
        self.closed = True
        del self.words
        self.map.close()
        os.close(self.fd)  # its locks go with it (none are held: no claim is in flight)


class Inboxes:
    """The receivers' inboxes a sender has opened, one per inode."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, int], _Opened] = {}  # (st_dev, st_ino) -> opened
        self._me = (os.getpid(), process_start_time(os.getpid()) or 0)
        self._lock = threading.Lock()

    def claim(
        self, address: tuple[int, int, int, bytes], slot: int, nonce: int, receipt: bytes
    ) -> _Opened | None:
        """The inbox at `address`, its `slot` claimed for this process; None where the receipt is
        no longer the slot's (delivered, cancelled, the slot reused) or not the one posted there
        (its digest differs). OSError or ValueError where the inbox cannot be reached."""
        if not 0 <= slot < SLOTS:
            raise ValueError(f"receipt: slot {slot} outside the inbox's {SLOTS}")
        opened = self._opened(address)
        expected = digest(receipt)
        with opened.lock, _locked(opened.fd, slot):
            row = opened.words[slot]
            if int(row[NONCE]) != nonce or row[PID] or not np.array_equal(row[4:], expected):
                return None
            if not opened.alive.get(slot):
                _lock(opened.fd, fcntl.F_RDLCK, ALIVE + slot, wait=True)  # kept until the copy has run
            opened.alive[slot] = opened.alive.get(slot, 0) + 1
            row[PID], row[START] = self._me
        return opened

    @staticmethod
    def finished(opened: _Opened, slot: int) -> None:
        """One claim of `slot` is over (its done landed, or will never be written by a copy)."""
        with opened.lock:
            left = opened.alive.get(slot, 0) - 1
            if left > 0:
                opened.alive[slot] = left
                return
            opened.alive.pop(slot, None)
            if not opened.closed:
                _lock(opened.fd, fcntl.F_UNLCK, ALIVE + slot)

    def abandon(self, opened: _Opened, slot: int, nonce: int) -> None:
        """A claim whose copies will never run (or have run and been waited for): the receiver is
        told that nothing landed, unless its done did land (or the slot holds another receipt)."""
        with opened.lock, _locked(opened.fd, slot):
            row = opened.words[slot]
            if int(row[NONCE]) == nonce and int(row[DONE]) == 0:
                row[DONE] = nonce
        self.finished(opened, slot)

    def _opened(self, address: tuple[int, int, int, bytes]) -> _Opened:
        pid, fd, inode, inbox_id = address
        path = f"/proc/{pid}/fd/{fd}"
        info = os.stat(path)  # what it is, before anything opens it
        if not stat.S_ISREG(info.st_mode) or info.st_ino != inode or info.st_size != SIZE:
            raise ValueError(f"{path} is not the receipt's inbox")
        key = (info.st_dev, info.st_ino)
        with self._lock:
            found = self._open.get(key)
            if found is None:
                idle = [k for k, o in self._open.items() if not o.alive]
                if len(self._open) >= MAX_OPEN and idle:
                    _synchronize_all()  # no copy of this process still to write into it
                    self._open.pop(idle[0]).close()
                found = self._open[key] = _Opened(path, inode, inbox_id)
        if found.id != inbox_id:
            raise ValueError(f"{path} is not the receipt's inbox")
        return found

    def close(self) -> None:
        with self._lock:
            if self._open:
                _synchronize_all()
            for opened in self._open.values():
                opened.close()
            self._open.clear()


def _synchronize_all() -> None:
    import torch

    if torch.cuda.is_initialized():
        for device in range(torch.cuda.device_count()):
            torch.cuda.synchronize(device)


def _lock(fd: int, kind: int, offset: int, length: int = 1, wait: bool = False) -> None:
    """An open-file-description lock (`F_RDLCK`, `F_WRLCK`, `F_UNLCK`) on `length` bytes at
    `offset`; BlockingIOError where another holds a conflicting one (without `wait`)."""
    command = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    fcntl.fcntl(fd, command, _FLOCK.pack(kind, os.SEEK_SET, offset, length, 0))


def _held(fd: int, offset: int) -> bool:
    """Whether another open of the file holds a lock on byte `offset`."""
    try:
        _lock(fd, fcntl.F_WRLCK, offset)
    except OSError:
        return True
    _lock(fd, fcntl.F_UNLCK, offset)
    return False


class _locked:
    """A slot's lock, across processes and opens."""

    def __init__(self, fd: int, slot: int) -> None:
        self._fd, self._offset = fd, HEADER + slot * SLOT_BYTES

    def __enter__(self) -> None:
        _lock(self._fd, fcntl.F_WRLCK, self._offset, SLOT_BYTES, wait=True)

    def __exit__(self, *exc: Any) -> None:
        _lock(self._fd, fcntl.F_UNLCK, self._offset, SLOT_BYTES)


_mine: Inbox | None = None
_mine_lock = threading.Lock()


def mine() -> Inbox:
    """This process's inbox (made at first use; a forked child makes its own)."""
    global _mine
    with _mine_lock:
        if _mine is None or _mine.pid != os.getpid():
            _mine = Inbox()
        return _mine
