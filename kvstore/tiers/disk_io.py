"""Reading and writing one record file; the disk tier's workers call these, nothing else does I/O.

- `write_record(temp, header, payload, sync)`: the whole record into a new temp file
  (O_EXCL|O_NOFOLLOW: nothing planted at its name is followed or reused), fdatasync'ed when
  `sync`; the caller renames it into place. A failed write leaves no file.
- `read_record(path, namespace, key, stored_bytes, into, direct, tally, raw_length=) -> page`:
  reads and checks the record; with `into` (a byte buffer of the page's size) a raw record is
  read straight into it, and any other is decoded into it; `tally` counts the bytes read each
  way below (`read_bytes_cached`, `_direct`, `_buffered`). Raises `CorruptRecord` for a record
  that does not check out (a symlink, a file of another user, a header that names another page
  or another page size than `raw_length`, or `len(into)`, before anything is decompressed),
  `OSError` (FileNotFoundError for a removed file) for the disk's errors.

How a record is read (bench/NOTES-disk.md has the measurements):
1. A record wholly in the page cache (written or read lately; cachestat(2) says, without
   I/O) is copied from it: `read_bytes_cached`.
2. Otherwise, when `direct`: `O_DIRECT` reads of up to 4 MiB into this thread's bounce
   buffer, aligned to and backed by a 2 MiB huge page where the kernel gives one, then
   copied out: `read_bytes_direct`. A cold record file read through the page cache starts
   with small folios, so the device gets requests of at most its segment limit (0.5-1 MiB
   on a virtio disk), one file at a time; a huge-page buffer makes one request per 4 MiB,
   as long as a sequential stream's readahead reaches, and the page is not cached twice
   (it is on its way into the CPU tier).
3. Whatever is left (a filesystem without O_DIRECT, `direct` False): plain buffered reads,
   `read_bytes_buffered`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import platform
import stat
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from kvstore.tiers.codec import Buffer
from kvstore.tiers.records import HEADER_BYTES, CorruptRecord, unpack_header


def _write_all(fd: int, parts: list[Buffer]) -> None:
    views = [memoryview(part) for part in parts if len(part)]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][written:]


DIRECT_ALIGN = 4096  # O_DIRECT offsets and lengths: a multiple of any logical block size in use
DIRECT_CHUNK = 4 << 20  # bytes per O_DIRECT read
_HUGE_PAGE = 2 << 20
_local = threading.local()


def _views(parts: Sequence[Buffer]) -> list[memoryview]:
    return [memoryview(part).cast("B") for part in parts]


def _tail(parts: list[memoryview], offset: int) -> list[memoryview]:
    """`parts` (one record's spans, in order) from record byte `offset` on."""
    tail: list[memoryview] = []
    for part in parts:
        if offset >= len(part):
            offset -= len(part)
            continue
        tail.append(part[offset:])
        offset = 0
    return tail


def _read_all(fd: int, parts: list[memoryview], offset: int) -> int:
    """Fills `parts` in order from file `offset`; returns the bytes read (fewer at the end of the file)."""
    views = [part for part in parts if len(part)]
    total = 0
    while views:
        got = os.preadv(fd, views, offset + total)
        if got == 0:
            break
        total += got
        views = _tail(views, got)
    return total


class _CacheRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recent")]


# cachestat(2), Linux 6.5: 451 on the architectures that share the new syscall numbers.
_CACHESTAT = 451 if platform.machine() in ("x86_64", "aarch64") else None
_libc = ctypes.CDLL(None, use_errno=True)


def _cached(fd: int, size: int) -> bool:
    """Every byte of the file's first `size` is in the page cache (False where the kernel cannot say).

    Asked with cachestat, which does no I/O: a `preadv(RWF_NOWAIT)` probe was measured
    starting readahead of the whole file on 6.18, so the disk read every cold record twice.
    """
    global _CACHESTAT
    if _CACHESTAT is None:
        return False
    stat = _CacheStat()
    if _libc.syscall(_CACHESTAT, fd, ctypes.byref(_CacheRange(0, size)), ctypes.byref(stat), 0) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # an older kernel, or a seccomp filter
            _CACHESTAT = None
        return False
    return stat.cache * mmap.PAGESIZE >= size


def _bounce() -> memoryview:
    """This thread's O_DIRECT buffer: DIRECT_CHUNK bytes, 2 MiB aligned, on huge pages where it can."""
    view: memoryview | None = getattr(_local, "bounce", None)
    if view is None:
        # Private: shared anonymous memory is shmem, whose huge pages are configured apart (often off).
        region = mmap.mmap(-1, DIRECT_CHUNK + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(AttributeError, OSError):  # no THP: 4 KiB pages, smaller requests
            region.madvise(mmap.MADV_HUGEPAGE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        start = -address % _HUGE_PAGE
        view = memoryview(region)[start : start + DIRECT_CHUNK]
        view[:: mmap.PAGESIZE] = bytes(len(range(0, DIRECT_CHUNK, mmap.PAGESIZE)))  # fault it in once
        _local.bounce = view
    return view


def _scatter(data: memoryview, parts: list[memoryview], offset: int) -> None:
    """Copies `data`, the record's bytes from `offset` on, into the spans `parts` hold them in."""
    base = 0
    for part in parts:
        lo, hi = max(offset, base), min(offset + len(data), base + len(part))
        if hi > lo:
            part[lo - base : hi - base] = data[lo - offset : hi - offset]
        base += len(part)


def _read_direct(fd: int, parts: list[memoryview], end: int) -> int:
    """The record's first `end` bytes through O_DIRECT; returns how many it read (0 if refused)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError:
        return 0  # this filesystem has no O_DIRECT
    bounce = _bounce()
    position = 0
    try:
        while position < end:
            length = min(DIRECT_CHUNK, (end - position + DIRECT_ALIGN - 1) // DIRECT_ALIGN * DIRECT_ALIGN)
            got = os.preadv(fd, [bounce[:length]], position)
            if got <= 0:
                break  # the file ends early
            usable = min(got, end - position)
            _scatter(bounce[:usable], parts, position)
            position += usable
            if got < length:
                break  # the end of the file
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: an alignment this device refuses; read buffered
            raise
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return position


def write_record(temp: Path, header: bytes, payload: Buffer, sync: bool) -> None:
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _write_all(fd, [header, payload])
        if sync:
            os.fdatasync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    os.close(fd)


def open_own(path: Path) -> int:
    """A read-only descriptor on `path`, a regular file of this user (CorruptRecord otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptRecord(f"{path.name} is a symlink") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise CorruptRecord(f"{path.name} is not a regular file of this daemon's user (uid {info.st_uid})")
    return fd


def read_record(
    path: Path,
    namespace: bytes,
    key: bytes,
    stored_bytes: int,
    into: memoryview | None = None,
    direct: bool = True,
    tally: Counter[str] | None = None,
    raw_length: int | None = None,
) -> Buffer:
    head = bytearray(HEADER_BYTES)
    payload_bytes = stored_bytes - HEADER_BYTES
    if raw_length is None and into is not None:
        raw_length = len(into)
    # A record stored raw is exactly as long as its page: read it where it must end up.
    payload: Buffer = into if into is not None and len(into) == payload_bytes else bytearray(payload_bytes)
    parts = _views([head, payload])
    fd = open_own(path)
    try:
        cached = direct and _cached(fd, stored_bytes)
        got = uncached = _read_direct(fd, parts, stored_bytes) if direct and not cached else 0
        if got < stored_bytes:
            got += _read_all(fd, _tail(parts, got), got)
    finally:
        os.close(fd)
    if tally is not None:
        tally["read_bytes_cached" if cached else "read_bytes_buffered"] += got - uncached
        tally["read_bytes_direct"] += uncached
    if got != stored_bytes:
        raise CorruptRecord(f"file holds {got} bytes, the index says {stored_bytes}")
    header = unpack_header(head)
    if header.namespace != namespace or header.key != key or header.record_bytes != stored_bytes:
        raise CorruptRecord("the header names another page or length")
    if raw_length is not None and header.raw_length != raw_length:
        raise CorruptRecord(
            f"the header says a {header.raw_length}-byte page, this page is {raw_length} bytes"
        )
    page = header.decode(payload)
    if into is None or page is into:
        return page
    into[:] = page
    return into
