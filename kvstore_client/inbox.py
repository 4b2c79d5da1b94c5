"""The inboxes of pushed hand-overs (`KVStoreClient.expect` and `deliver`): where a sender's GPU
tells the receiving worker that the pages it pushed into the receiver's KV cache have all landed.

A receiving process owns one inbox: a memfd of `HEADER` bytes and `SLOTS` slots, each four
little-endian u64 words:

- `nonce`: the receipt's, written by the receiver when it posts the receipt (0: the slot is free);
- `pid`, `start`: the sender that claimed the slot (its pid and start time, for the log), written
  by the sender under the slot's lock before it enqueues anything;
- `done`: written by the sender's GPU, in stream order after its last copy: the nonce plus the
  chunks delivered. Nothing else writes it, so a receiver that reads `nonce + n` knows that the
  first `n` chunks are whole.

A sender reaches the inbox through `/proc/<receiver pid>/fd/<fd>`: the kernel lets only a process
that may read the receiver's memory open it (the same user, one pid namespace), and the receipt's
inode number and random inbox id tell a reused pid or fd from the receiver's. Claims and cancels
take the slot's byte-range lock (`fcntl`, across processes) and a thread lock (within one):
a receipt is delivered at most once, and a cancelled one never.

When the receiver may reuse the blocks of a receipt it gave up on: at once if no sender claimed it
(the slot's nonce is cleared under the lock, so no sender can claim it after); else only once the
claim's `done` landed or the claiming process is gone (its CUDA context, and with it any copy not
yet run, went with it). A sender holds a shared lock on its slot's byte past the end of the file
(`ALIVE`) from before its claim until its copy has run: the kernel drops it when the process dies,
whatever pid namespace either side is in, so a receiver that can take that byte's lock knows that
no copy of that claim can still land. A sender alive and never finishing (a hung GPU) keeps the
blocks held.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import stat
import threading
from typing import Any

import numpy as np

from kvstore.shared.peers import process_start_time

MAGIC = b"kvstore-inbox-01"
HEADER = 4096  # the magic and the inbox id, then nothing: the slots start on their own page
SLOTS = 1024
SLOT_BYTES = 32
SIZE = HEADER + SLOTS * SLOT_BYTES
NONCE, PID, START, DONE = range(4)  # a slot's words
MAX_OPEN = 64  # receivers' inboxes a sender keeps open
ALIVE = SIZE  # a slot's liveness lock: byte ALIVE + slot (past the end: no byte of the file)


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
        self._words = np.frombuffer(self._map, dtype="<u8", count=SLOTS * 4, offset=HEADER).reshape(SLOTS, 4)
        self._free = list(range(SLOTS - 1, -1, -1))
        self._lock = threading.Lock()

    def address(self) -> tuple[int, int, int, bytes]:
        """What a receipt names the inbox by: (pid, fd, inode, id)."""
        return self.pid, self.fd, self.inode, self.id

    def post(self, nonce: int) -> int:
        """A free slot, holding `nonce` now; InboxFull where none is free."""
        with self._lock:
            if not self._free:
                raise InboxFull(f"all {SLOTS} hand-over slots of this process await their senders")
            slot = self._free.pop()
            with _locked(self.fd, slot):
                self._words[slot] = (nonce, 0, 0, 0)
        return slot

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

    def release(self, slot: int, nonce: int) -> None:
        """`slot` is done with (its delivery read): free for another receipt."""
        with self._lock, _locked(self.fd, slot):
            if int(self._words[slot, NONCE]) == nonce:
                self._words[slot, NONCE] = 0
                self._free.append(slot)


class _Opened:
    """A receiver's inbox mapped in a sender."""

    def __init__(self, path: str, inode: int, inbox_id: bytes) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            info = os.fstat(self.fd)
            if not stat.S_ISREG(info.st_mode) or info.st_ino != inode or info.st_size != SIZE:
                raise ValueError(f"{path} is not the receipt's inbox")
            self.map = mmap.mmap(self.fd, SIZE)
            if self.map[: len(MAGIC) + 16] != MAGIC + inbox_id:
                self.map.close()
                raise ValueError(f"{path} is not the receipt's inbox")
        except BaseException:
            os.close(self.fd)
            raise
        self.words = np.frombuffer(self.map, dtype="<u8", count=SLOTS * 4, offset=HEADER).reshape(SLOTS, 4)
        self.base = np.frombuffer(self.map, dtype=np.uint8).ctypes.data
        self.registered = self.closed = False
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
        os.close(self.fd)  # drops this process's locks on the inbox


class Inboxes:
    """The receivers' inboxes a sender has opened."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, int, int, bytes], _Opened] = {}
        self._me = (os.getpid(), process_start_time(os.getpid()) or 0)
        self._lock = threading.Lock()

    def claim(self, address: tuple[int, int, int, bytes], slot: int, nonce: int) -> _Opened | None:
        """The inbox at `address`, its `slot` claimed for this process; None where the receipt is
        no longer the slot's (delivered, cancelled, or the slot reused). OSError or ValueError
        where the inbox cannot be reached."""
        if not 0 <= slot < SLOTS:
            raise ValueError(f"receipt: slot {slot} outside the inbox's {SLOTS}")
        opened = self._opened(address)
        with opened.lock:
            fcntl.lockf(opened.fd, fcntl.LOCK_SH, 1, ALIVE + slot)  # kept until the copy has run
            with _locked(opened.fd, slot):
                row = opened.words[slot]
                taken = int(row[NONCE]) == nonce and not row[PID]
                if taken:
                    row[PID], row[START] = self._me
            if not taken:
                fcntl.lockf(opened.fd, fcntl.LOCK_UN, 1, ALIVE + slot)
                return None
        return opened

    @staticmethod
    def finished(opened: _Opened, slot: int) -> None:
        """The claim of `slot` is over (its done landed, or will never be written by a copy)."""
        with opened.lock:
            if not opened.closed:
                fcntl.lockf(opened.fd, fcntl.LOCK_UN, 1, ALIVE + slot)

    def _opened(self, address: tuple[int, int, int, bytes]) -> _Opened:
        with self._lock:
            found = self._open.get(address)
            if found is None:
                pid, fd, inode, inbox_id = address
                if len(self._open) >= MAX_OPEN:
                    oldest = next(iter(self._open))
                    _synchronize_all()  # no copy of this process still to write into it
                    self._open.pop(oldest).close()
                found = self._open[address] = _Opened(f"/proc/{pid}/fd/{fd}", inode, inbox_id)
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


def _held(fd: int, offset: int) -> bool:
    """Whether another process holds a lock on byte `offset` of the file."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
    except OSError:
        return True
    fcntl.lockf(fd, fcntl.LOCK_UN, 1, offset)
    return False


class _locked:
    """A slot's byte-range lock, across processes."""

    def __init__(self, fd: int, slot: int) -> None:
        self._args = (SLOT_BYTES, HEADER + slot * SLOT_BYTES)
        self._fd = fd

    def __enter__(self) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_EX, *self._args)

    def __exit__(self, *exc: Any) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN, *self._args)


_mine: Inbox | None = None
_mine_lock = threading.Lock()


def mine() -> Inbox:
    """This process's inbox (made at first use; a forked child makes its own)."""
    global _mine
    with _mine_lock:
        if _mine is None or _mine.pid != os.getpid():
            _mine = Inbox()
        return _mine
