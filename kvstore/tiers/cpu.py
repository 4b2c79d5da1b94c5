"""CPU tier: one POSIX shared-memory arena owned by the daemon, cut into slots.

Workers on the host map the same file (`/dev/shm/kvstore-...`) once and read
and write pages in place at offsets the daemon hands out; clients without the
mapping go through `write`/`read` (the inline Put/Get data plane).

Each arena has an epoch, a random number drawn when it is created: a client
learns it at Connect with the file's identity (st_dev, st_ino), checks that the
file it mapped is that one, and sends the epoch back with every call that names
offsets, so a call meant for another daemon's arena is refused, never served.

The arena's file is the daemon's own: `tiers.cpu.shm_dir` must be of the daemon's user or root
and writable by others only with the sticky bit (/dev/shm is), and the file is created new
(O_EXCL|O_NOFOLLOW) and checked to be this user's; a stale arena of this user is replaced,
anything else at its path is refused (`kvstore.config.claim`).

The tier knows bytes and slots only; the store decides what lives here.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import time
from pathlib import Path

from kvstore.config.claim import check_shared_directory, create_private_file, remove_stale_file
from kvstore.shared.domain import MEMFD_PREFIX
from kvstore.shared.hugepages import (
    advise_huge,
    arena_pages,
    hugetlbfs_free_bytes,
    hugetlbfs_page_bytes,
    thp_advised,
)
from kvstore.tiers.pinned import PinnedArena
from kvstore.tiers.slab import SlabAllocator

log = logging.getLogger(__name__)

SHM_KEY = "tiers.cpu.shm_dir"
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.13 names it


class Arena:
    """A shared-memory file of fixed size, mapped read-write.

    A sealed arena (`sealed=True`, a tenant's) is a memfd with no path, sealed against shrinking
    and growing: a worker that holds it (handed over the local channel to its tenant's members)
    can write pages but cannot truncate it under the daemon, whose mapping would then fault.
    `fd` is its descriptor (kept open to hand out); `path` is `memfd:<name>`, a label.
    """

    def __init__(
        self,
        path: Path,
        size: int,
        mode: int = 0o600,
        prefault: bool = True,
        sealed: bool = False,
    ) -> None:
        self.size = size
        self.epoch = secrets.randbits(63) or 1
        self.sealed = sealed
        self.fd = -1
        started = time.perf_counter()
        if sealed:
            self.path = Path(MEMFD_PREFIX + path.name)
            fd = os.memfd_create(path.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        else:
            self.path = path
            fd = self._create(path, size, mode, prefault)
        try:
            os.ftruncate(fd, size)  # `reserve` backs it with memory, slab by slab (`reserve.py`)
            if sealed:
                fcntl.fcntl(
                    fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
                )
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            # Where tmpfs gives huge pages only to mappings that ask, this one asks, and reserves
            # by faulting through it (a fallocate would get small pages).
            directory = None if sealed else str(path.parent)
            self.huge_advised = thp_advised(directory) and advise_huge(self._mmap)
            self.pages = arena_pages(directory, self.huge_advised)
            st = os.fstat(fd)
            self.identity = (st.st_dev, st.st_ino)  # while mapped here, no other file has it
        except OSError as exc:
            os.close(fd)
            if not sealed:
                path.unlink(missing_ok=True)
            raise OSError(
                f"tiers.cpu.bytes: cannot create a {size}-byte arena at {self.path}: {exc.strerror}; "
                f"free space in {path.parent} or lower tiers.cpu.bytes"
            ) from exc
        if sealed:
            self.fd = fd
        elif not prefault:
            os.close(fd)
        self._reserve_fd = fd if prefault else -1
        self.view = memoryview(self._mmap)
        log.info(
            "arena %s: %d MiB of %s in %.2f s",
            self.path,
            size >> 20,
            self.pages.describe(),
            time.perf_counter() - started,
        )

    def reserve(self, start: int, length: int) -> None:
        """Backs `length` bytes at `start` with memory now (`prefault`): where the shm directory
        is full this fails, rather than a later write there faulting (SIGBUS)."""
        try:
            if self.huge_advised:
                self._mmap.madvise(MADV_POPULATE_WRITE, start, length)
            else:
                os.posix_fallocate(self._reserve_fd, start, length)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"tiers.cpu.bytes: cannot reserve {length} bytes at {start} of the arena at {self.path}: "
                f"{exc.strerror}; free space in {self.path.parent} or lower tiers.cpu.bytes",
            ) from exc

    @staticmethod
    def _create(path: Path, size: int, mode: int, prefault: bool) -> int:
        check_shared_directory(path.parent, SHM_KEY)
        remove_stale_file(path, SHM_KEY, "arena")  # before the free space is measured: it may hold some
        if prefault:
            fs = os.statvfs(path.parent)
            free = fs.f_bavail * fs.f_frsize
            huge_page = hugetlbfs_page_bytes(str(path.parent))
            if huge_page:
                free = hugetlbfs_free_bytes(str(path.parent), huge_page)
            if free < size:
                raise OSError(
                    f"tiers.cpu.bytes: a {size}-byte arena does not fit in {path.parent}, which has "
                    f"{free} bytes free; free space there or lower tiers.cpu.bytes"
                )
        fd = create_private_file(path, mode, SHM_KEY)
        try:
            os.fchmod(fd, mode)  # the umask must not widen or narrow the configured mode
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return fd

    def close(self, unlink: bool = True) -> None:
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:  # a tier still holds a view of it: the mapping goes with the process
            log.warning("arena %s still in use at close; it is unmapped when the daemon exits", self.path)
        finally:
            if not self.sealed and self._reserve_fd >= 0:
                os.close(self._reserve_fd)
            self._reserve_fd = -1
            if self.sealed:
                if self.fd >= 0:
                    os.close(self.fd)
                    self.fd = -1
            elif unlink:
                self.path.unlink(missing_ok=True)


class CpuTier:
    name = "cpu"

    def __init__(
        self, arena: Arena | PinnedArena, slab_bytes: int, reserved_slabs: int | None = None
    ) -> None:
        """`reserved_slabs`: how many leading slabs may be handed out (None: all); `add_reserved`
        adds the next ones as their memory is reserved."""
        self.arena = arena
        self.slots = SlabAllocator(arena.size, slab_bytes, reserved_slabs)

    @property
    def reserved_bytes(self) -> int:
        return self.slots.num_reserved * self.slots.slab_bytes

    def add_reserved(self, count: int) -> None:
        self.slots.add_reserved(count)

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    @property
    def bytes_used(self) -> int:
        return self.slots.bytes_used

    def write(self, offset: int, data: memoryview | bytes, position: int = 0) -> None:
        """Copy `data` into the slot at `offset`, starting `position` bytes into it."""
        start = offset + position
        self.arena.view[start : start + len(data)] = data

    def read(self, offset: int, length: int) -> memoryview:
        return self.arena.view[offset : offset + length]

    def close(self) -> None:
        self.arena.close(unlink=True)
