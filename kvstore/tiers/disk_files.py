"""The disk tier's files: where records live, the recovery scan, the clean-shutdown index.

Layout under `tiers.disk.path` (one file per page: bench/NOTES-disk.md has the numbers):

    LOCK                                   flock held by the daemon using the directory
    index.kvi                              written by a clean shutdown; deleted once loaded
    <namespace hex>/<key byte 0 hex>/<key hex>.kvr     one record per page
    <namespace hex>/<key byte 0 hex>/.<key hex>.<n>.tmp  a record being written

Nothing here follows a symlink: files are opened with O_NOFOLLOW, temporaries (records'
and the index's) created with O_EXCL, directories walked without following links, and a file
that is not a regular file of the daemon's user is corrupt (removed, counted), never data.
The tier passes its claimed directory's descriptor path as `root` (`DiskTier.base`).

A record is written to a temp file and renamed into place, so a record file under its
final name is complete unless the machine lost power before it was synced (then its
checksums catch it). A temp file is a write that never finished: recovery removes it.

- `record_path(root, namespace, key)` / `temp_path(final, serial)`
- `scan(root, progress) -> ScanResult`: every complete record's header, oldest first;
  temp files and corrupt records are removed and counted.
- `save_index(root, records)` / `load_index(root)`: the clean-shutdown index, checksummed.
- `mark(root)`: the LOCK file that marks a disk tier's directory.
- `fsync_dir(path)`, `sync_filesystem(fd)`: what the fsync policies call.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import xxhash

from kvstore.tiers.codec import Codec
from kvstore.tiers.disk_io import open_own
from kvstore.tiers.records import HEADER_BYTES, CorruptRecord, unpack_header

log = logging.getLogger(__name__)

LOCK_NAME = "LOCK"
INDEX_NAME = "index.kvi"
RECORD_SUFFIX = ".kvr"
TEMP_SUFFIX = ".tmp"
_INDEX_MAGIC = b"KVIX"
_INDEX_VERSION = 1
_INDEX_HEAD = struct.Struct("<4sHQ")
_INDEX_ENTRY = struct.Struct("<16s16sBQQ")
_INDEX_CHECK = struct.Struct("<Q")
_HEX_NAMESPACE = 32  # characters in a namespace directory's name

Progress = Callable[[int, int], None]  # (files done, files in all)


class RecordInfo(NamedTuple):
    namespace: bytes
    key: bytes
    codec: Codec
    raw_length: int
    stored_bytes: int  # the whole record file: header + payload


class ScanResult(NamedTuple):
    records: list[RecordInfo]  # oldest first
    torn: int  # temp files of writes that never finished
    corrupted: int  # record files whose header or length does not check out


def record_path(root: Path, namespace: bytes, key: bytes) -> Path:
    return root / namespace.hex() / key[:1].hex() / (key.hex() + RECORD_SUFFIX)


def temp_path(final: Path, serial: int) -> Path:
    return final.with_name(f".{final.stem}.{serial}{TEMP_SUFFIX}")


def mark(root: Path) -> None:
    os.close(os.open(root / LOCK_NAME, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))


def fsync_dir(path: Path) -> None:
    # Following a link here is harmless (a sync writes nothing), and `root` itself is one (/proc).
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_syncfs = getattr(_libc, "syncfs", None)


def sync_filesystem(fd: int) -> None:
    """Flush every dirty page and inode of the filesystem holding `fd` (one call for a batch)."""
    if _syncfs is None:
        os.sync()
        return
    if _syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _record_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for ns_dir in os.scandir(root):
        if len(ns_dir.name) != _HEX_NAMESPACE or not ns_dir.is_dir(follow_symlinks=False):
            continue
        for sub in os.scandir(ns_dir.path):
            if sub.is_dir(follow_symlinks=False):
                files.extend(Path(entry.path) for entry in os.scandir(sub.path))
    return files


def _read_header(path: Path) -> tuple[RecordInfo, int]:
    """The record in `path` and its mtime; CorruptRecord if its header or size does not check out."""
    fd = open_own(path)
    try:
        head = os.pread(fd, HEADER_BYTES, 0)
        stat = os.fstat(fd)
    finally:
        os.close(fd)
    header = unpack_header(head)
    if record_path(Path("/"), header.namespace, header.key).parts[-3:] != path.parts[-3:]:
        raise CorruptRecord("the header names another namespace or key than the file name")
    if stat.st_size != header.record_bytes:
        raise CorruptRecord(f"file is {stat.st_size} bytes, its header says {header.record_bytes}")
    info = RecordInfo(header.namespace, header.key, header.codec, header.raw_length, header.record_bytes)
    return info, stat.st_mtime_ns


def scan(root: Path, progress: Progress | None = None) -> ScanResult:
    """Every complete record under `root`, oldest first; removes torn and corrupt files."""
    files = _record_files(root)
    found: list[tuple[int, RecordInfo]] = []
    torn = corrupted = 0
    for done, path in enumerate(files, 1):
        if progress is not None and (done % 256 == 0 or done == len(files)):
            progress(done, len(files))
        if path.name.endswith(TEMP_SUFFIX):
            path.unlink(missing_ok=True)
            torn += 1
        elif path.name.endswith(RECORD_SUFFIX):
            try:
                info, mtime = _read_header(path)
            except FileNotFoundError:
                continue
            except CorruptRecord as exc:
                log.warning("disk tier: removing corrupt record %s: %s", path.relative_to(root), exc)
                path.unlink(missing_ok=True)
                corrupted += 1
                continue
            found.append((mtime, info))
    found.sort(key=lambda item: item[0])
    return ScanResult([info for _, info in found], torn, corrupted)


def save_index(root: Path, records: Sequence[RecordInfo]) -> None:
    """Writes the clean-shutdown index (records oldest first) atomically."""
    parts = [_INDEX_HEAD.pack(_INDEX_MAGIC, _INDEX_VERSION, len(records))]
    parts.extend(
        _INDEX_ENTRY.pack(r.namespace, r.key, r.codec, r.raw_length, r.stored_bytes) for r in records
    )
    body = b"".join(parts)
    temp = root / (INDEX_NAME + TEMP_SUFFIX)
    temp.unlink(missing_ok=True)  # a crashed close's; never followed, never reused
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as file:
        file.write(body + _INDEX_CHECK.pack(xxhash.xxh3_64_intdigest(body)))
        file.flush()
        os.fsync(file.fileno())
    os.replace(temp, root / INDEX_NAME)
    fsync_dir(root)


def load_index(root: Path) -> list[RecordInfo] | None:
    """The clean-shutdown index, removed from disk so that a crash from now on forces a scan.

    None when there is none or it does not check out (the caller scans instead).
    """
    path = root / INDEX_NAME
    try:
        fd = open_own(path)
    except FileNotFoundError:
        return None
    except CorruptRecord as exc:
        log.warning("disk tier: %s: %s; scanning the records instead", INDEX_NAME, exc)
        path.unlink()
        return None
    with open(fd, "rb") as file:
        data = file.read()
    path.unlink()
    fsync_dir(root)
    body, check = data[: -_INDEX_CHECK.size], data[-_INDEX_CHECK.size :]
    records: list[RecordInfo] = []
    with contextlib.suppress(struct.error, ValueError):
        magic, version, count = _INDEX_HEAD.unpack_from(body)
        if (
            magic == _INDEX_MAGIC
            and version == _INDEX_VERSION
            and len(body) == _INDEX_HEAD.size + count * _INDEX_ENTRY.size
            and _INDEX_CHECK.unpack(check)[0] == xxhash.xxh3_64_intdigest(body)
        ):
            for ns, key, codec, raw, stored in _INDEX_ENTRY.iter_unpack(body[_INDEX_HEAD.size :]):
                records.append(RecordInfo(ns, key, Codec(codec), raw, stored))
            return records
    log.warning("disk tier: %s does not check out; scanning the records instead", INDEX_NAME)
    return None
