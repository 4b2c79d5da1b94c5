"""The CPU tier's arena allocated pinned by the daemon (`tiers.cpu.pinned: true`), one allocation
per slab, handed to workers as descriptors they map without registering anything.

A worker that maps a shared-memory arena must fault it in and pin it with `cudaHostRegister`
itself, per process: on the H200 host that left a worker storing from its first second 53-68%
of a 64 GiB fill behind the registration (bench/NOTES-connect.md). Here the daemon pins the
memory once, as it reserves each slab (`cuMemCreate` of pinned host memory on a NUMA node,
exportable as a POSIX file descriptor: `kvstore.shared.cuda_vmm`), and maps every slab into one
address range of its own, read-write for its CPU (the inline data plane, the lower tiers) and
its GPUs (the GPU tier). A worker asks for the slabs' descriptors over the local channel
(`ArenaSlabs`, SCM_RIGHTS: never over gRPC) and maps them into one range of its own, slab by
slab in the order they are handed out: ~7 ms a 256 MiB slab, behind its transfers
(bench/host_alloc.py: 10% of a 64 GiB fill lost on the H200, against 53-68% registering).

The arena has no file: `path` is `cuda:<name>`, a label; `identity` is (0, 0) (a worker checks
the arena by its epoch and the local channel's peer). A slab's memory stays allocated while any
process maps it: a worker still holding a restarted daemon's slabs reads its old bytes, never
unmapped memory, until it maps the new arena.

- `PinnedArena(name, size, slab_bytes, numa_node)`: reserves the address range only;
  `reserve(start, length)` allocates, exports and maps the slabs that cover it (the
  `ArenaReserver` calls it slab by slab, as for a shared-memory arena).
- `may_map(uid, gid, groups)`: whether a local-channel caller gets the descriptors at all: as
  if the arena were a file of the daemon's with `tiers.cpu.file_mode` (0600: its user alone).
- `slab_fds(first, count)`: the descriptors of the slabs allocated so far among those
  (the daemon keeps them; the local channel sends duplicates).
- `close()`: unmaps and releases every slab and the range, closes the descriptors.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import threading
import time
from pathlib import Path

from kvstore.shared.cuda_vmm import load_vmm
from kvstore.shared.cudart import CudaError, CudaUnavailable
from kvstore.shared.domain import PINNED_PREFIX
from kvstore.shared.hugepages import ArenaPages

log = logging.getLogger(__name__)

PINNED_KEY = "tiers.cpu.pinned"


def may_map(mode: int, uid: int, gid: int, groups: tuple[int, ...]) -> bool:
    """Whether a process of `uid` (`gid`, `groups`) could open the arena read-write if it were a
    file of the daemon's with `mode` (`tiers.cpu.file_mode`): the rule of a shared-memory arena,
    so pinning it gives no one more than the file would (root: always)."""
    if uid == 0:  # as for a file: root reads and writes whatever the mode
        return True
    if uid == os.geteuid():
        bits = mode >> 6
    elif os.getegid() == gid or os.getegid() in groups:
        bits = mode >> 3
    else:
        bits = mode
    return bits & 0o6 == 0o6


class PinnedArena:
    sealed = False
    fd = -1  # nothing to hand with a Connect: the slabs go with ArenaSlabs

    def __init__(self, name: str, size: int, slab_bytes: int, numa_node: int = 0, mode: int = 0o600) -> None:
        started = time.perf_counter()
        try:
            self._vmm = vmm = load_vmm()
            vmm.use_device(0)
            granule = vmm.granularity(numa_node)
        except (CudaUnavailable, CudaError) as exc:
            raise OSError(
                f"{PINNED_KEY}: the daemon cannot allocate pinned memory through CUDA ({exc}); "
                f"set {PINNED_KEY}: false to use a shared-memory arena"
            ) from None
        if slab_bytes % granule:
            raise OSError(
                f"tiers.cpu.slab_bytes: with {PINNED_KEY}, expected a multiple of the driver's "
                f"{granule >> 20} MiB granule, got {slab_bytes} bytes"
            )
        self.num_slabs = max(1, size // slab_bytes)
        self.size = size = self.num_slabs * slab_bytes  # whole slabs: the allocator uses no partial one
        self.mode = mode  # who may map it, as the file of a shared-memory arena (`may_map`)
        self.slab_bytes = slab_bytes
        self.numa_node = numa_node
        self.epoch = secrets.randbits(63) or 1
        self.path = Path(PINNED_PREFIX + name)
        self.identity = (0, 0)
        self.pages = ArenaPages("pinned", granule)
        self._granule = granule
        self._span = size
        self.base = vmm.reserve(self._span)
        self._devices = list(range(vmm.device_count))
        self._handles: list[int] = []
        self._fds: list[int] = []
        self._lock = threading.Lock()  # the reserver thread appends; the event loop reads
        self.view = memoryview((ctypes.c_uint8 * size).from_address(self.base)).cast("B")
        log.info(
            "arena %s: %d MiB to be pinned by the daemon on NUMA node %d, %d slabs (%.2f s)",
            self.path,
            size >> 20,
            numa_node,
            self.num_slabs,
            time.perf_counter() - started,
        )

    def reserve(self, start: int, length: int) -> None:
        """Allocates, exports and maps the slabs covering `length` bytes at `start` (in order;
        those allocated already are skipped)."""
        first, end = start // self.slab_bytes, -(-(start + length) // self.slab_bytes)
        for slab in range(max(first, len(self._handles)), min(end, self.num_slabs)):
            if slab != len(self._handles):
                raise OSError(f"{PINNED_KEY}: slab {slab} reserved before slab {len(self._handles)}")
            self._add_slab(slab)

    def _add_slab(self, slab: int) -> None:
        vmm, size = self._vmm, self.slab_bytes
        address = self.base + slab * self.slab_bytes
        vmm.use_device(0)  # on the reserving thread
        try:
            handle = vmm.create(size, self.numa_node)
        except CudaError as exc:
            raise OSError(
                f"tiers.cpu.bytes: cannot pin slab {slab} ({size >> 20} MiB) of the arena: {exc}; "
                f"free host memory or lower tiers.cpu.bytes"
            ) from None
        try:
            fd = vmm.export_fd(handle)
        except CudaError as exc:
            vmm.release(handle)
            raise OSError(f"{PINNED_KEY}: cannot export slab {slab} of the arena: {exc}") from None
        try:
            vmm.map(address, size, handle)
            vmm.set_access(address, size, self._devices, host=True)
        except CudaError as exc:
            os.close(fd)
            vmm.release(handle)
            raise OSError(f"{PINNED_KEY}: cannot map slab {slab} of the arena: {exc}") from None
        with self._lock:
            self._handles.append(handle)
            self._fds.append(fd)

    def may_map(self, uid: int, gid: int, groups: tuple[int, ...]) -> bool:
        return may_map(self.mode, uid, gid, groups)

    @property
    def num_pinned(self) -> int:
        return len(self._handles)

    def slab_fds(self, first: int, count: int) -> list[int]:
        """The descriptors of slabs `first..first+count-1` allocated so far (fewer, or none)."""
        with self._lock:
            return self._fds[first : first + count] if first >= 0 and count > 0 else []

    def close(self, unlink: bool = True) -> None:
        try:
            self.view.release()
        except BufferError:  # a tier still views it: the memory goes with the process
            log.warning("arena %s still in use at close; it is released when the daemon exits", self.path)
            return
        vmm = self._vmm
        with self._lock:
            handles, fds, self._handles, self._fds = self._handles, self._fds, [], []
        for fd in fds:
            os.close(fd)
        try:
            vmm.use_device(0)
            for slab, handle in enumerate(handles):
                vmm.unmap(self.base + slab * self.slab_bytes, self.slab_bytes)
                vmm.release(handle)  # freed once no worker maps it either
            vmm.free(self.base, self._span)
        except CudaError as exc:
            log.warning("releasing the arena %s: %s", self.path, exc)
