"""Faulting a mapped arena's pages in ahead of its registration with CUDA (`registrar.py`), and
the bounce ring's memory before it is pinned (`bounce.py`).

- `populate(address, size)`: `MADV_POPULATE_WRITE`, the GIL released; False where the kernel
  cannot (before 5.14, or a sandbox's).
- `touch(address, size)`: faults pages in by reading one byte of each small page, where
  `populate` is refused.
- `Faulter`: `populate` in pieces, or `touch` once the kernel refused the advice itself.
- `default_faulters()`: how many threads fault a registrar's slabs in.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux 5.14+
FAULT_PIECE = 16 << 20  # faulted in per call (see Faulter)
TOUCH_STRIDE = 4096  # where the kernel cannot populate: one read per small page faults them in


_libc = ctypes.CDLL(None, use_errno=True)


def populate(address: int, size: int) -> bool:
    """Faults in `size` bytes at `address` for writing, their contents unchanged (the GIL released:
    a ctypes call); False where the kernel cannot (the registration faults them in itself)."""
    return _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), MADV_POPULATE_WRITE) == 0


def touch(address: int, size: int) -> None:
    """Faults in `size` bytes at `address` by reading one byte of each small page (torch releases
    the GIL): where `populate` is refused (a kernel before 5.14, or a sandbox's)."""
    import torch

    buffer = (ctypes.c_uint8 * size).from_address(address)
    torch.frombuffer(buffer, dtype=torch.uint8)[::TOUCH_STRIDE].sum()


class Faulter:
    """Faults slabs in with `populate`, or with `touch` once the kernel refused the advice itself
    (EINVAL); any other failure leaves the slab to its registration, which faults it in."""

    def __init__(self) -> None:
        self.populates = True

    def __call__(self, address: int, size: int) -> None:
        if self.populates:
            # In pieces: the kernel holds the process's mmap lock while it populates, and the
            # worker's own mmap calls (thread stacks, allocations) wait for it.
            done = 0
            while done < size and populate(address + done, min(FAULT_PIECE, size - done)):
                done += FAULT_PIECE
            if done >= size:
                return
            if ctypes.get_errno() != errno.EINVAL:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            self.populates = False
            log.info("MADV_POPULATE_WRITE is not supported here: slabs are faulted in by reading")
        touch(address, size)


def default_faulters() -> int:
    """Faulting threads: a quarter of this process's CPUs, 1-4 (the host's tmpfs allocates a
    file's pages under locks that many faulting threads contend for; bench/NOTES-connect.md)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) // 4))
