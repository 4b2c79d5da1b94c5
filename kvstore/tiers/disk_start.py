"""What the disk tier (`disk`) does once, at start, before its workers run.

- `open_directory(root) -> fd`: claims the directory (`kvstore.config.claim.claim_private_directory`:
  created 0700, or a directory of this user or root that no one else can write, else a
  ConfigError naming `tiers.disk.path`), locks it against a second daemon and marks it as a
  disk tier's; every later file operation goes through this descriptor.
- `read_records(base, progress, counters) -> (records, source)`: the records of the
  clean-shutdown index, or else of a scan of the record headers (torn and corrupt files
  removed, counted in `counters`); `OSError` where the directory cannot be read.
- `warn_if_small(base, root, capacity, bytes_used)`: a warning when the filesystem has less
  room than `tiers.disk.bytes`.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections import Counter
from pathlib import Path

from kvstore.config.claim import claim_private_directory
from kvstore.tiers import disk_files as files
from kvstore.tiers.disk_files import Progress, RecordInfo

log = logging.getLogger("kvstore.tiers.disk")

PATH_KEY = "tiers.disk.path"


def open_directory(root: Path) -> int:
    """The claimed, locked and marked directory's descriptor."""
    root_fd = claim_private_directory(root, PATH_KEY)
    try:
        fcntl.flock(root_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(root_fd)
        raise RuntimeError(
            f"{PATH_KEY}: {root} is in use by another kvstored; give each daemon its own directory"
        ) from None
    try:
        files.mark(Path(f"/proc/self/fd/{root_fd}"))  # marks the directory as a disk tier's
    except OSError as exc:
        os.close(root_fd)
        raise OSError(exc.errno, f"{PATH_KEY}: cannot use {root}: {exc.strerror}") from exc
    return root_fd


def read_records(
    base: Path, progress: Progress | None, counters: Counter[str]
) -> tuple[list[RecordInfo], str]:
    """The records found, and where: the clean-shutdown index, or else a scan of the records."""
    records = files.load_index(base)
    source = "clean-shutdown index"
    if records is None:
        source = "record scan"
        result = files.scan(base, progress)
        records = result.records
        counters["torn_records"] += result.torn
        counters["skipped_on_recovery"] += result.torn + result.corrupted
        counters["corrupted_records"] += result.corrupted
    return records, source


def warn_if_small(base: Path, root: Path, capacity: int, bytes_used: int) -> None:
    fs = os.statvfs(base)
    room = fs.f_bavail * fs.f_frsize + bytes_used
    if room < capacity:
        log.warning(
            "tiers.disk.bytes is %d MiB but %s has room for %d MiB of records; the disk tier turns "
            "off when the filesystem fills up",
            capacity >> 20,
            root,
            room >> 20,
        )
