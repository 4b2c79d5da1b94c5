"""Reading and writing one record file; the disk tier's workers call these, nothing else does I/O.

- `write_record(temp, header, payload, sync)`: the whole record into a new temp file,
  fdatasync'ed when `sync`; the caller renames it into place. A failed write leaves no file.
- `read_record(path, namespace, key, stored_bytes, into) -> page`: reads and checks the
  record; with `into` (a byte buffer of the page's size) a raw record is read straight
  into it, and any other is decoded into it. Raises `CorruptRecord` for a record that
  does not check out, `OSError` (FileNotFoundError for a removed file) for the disk's errors.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from kvstore.codec import Buffer
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


def _read_all(fd: int, parts: list[Buffer]) -> int:
    """Fills `parts` in order; returns the bytes read (fewer at the end of the file)."""
    views = [memoryview(part) for part in parts if len(part)]
    total = 0
    while views:
        got = os.readv(fd, views)
        if got == 0:
            break
        total += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][got:]
    return total


def write_record(temp: Path, header: bytes, payload: Buffer, sync: bool) -> None:
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
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


def read_record(
    path: Path, namespace: bytes, key: bytes, stored_bytes: int, into: memoryview | None = None
) -> Buffer:
    head = bytearray(HEADER_BYTES)
    payload_bytes = stored_bytes - HEADER_BYTES
    # A record stored raw is exactly as long as its page: read it where it must end up.
    payload: Buffer = into if into is not None and len(into) == payload_bytes else bytearray(payload_bytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = _read_all(fd, [head, payload])
    finally:
        os.close(fd)
    if got != stored_bytes:
        raise CorruptRecord(f"file holds {got} bytes, the index says {stored_bytes}")
    header = unpack_header(head)
    if header.namespace != namespace or header.key != key or header.record_bytes != stored_bytes:
        raise CorruptRecord("the header names another page or length")
    page = header.decode(payload)
    if into is None or page is into:
        return page
    into[:] = page
    return into
