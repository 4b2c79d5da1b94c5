"""A worker's mapping of an arena the daemon pinned (`tiers.cpu.pinned`, `kvstore.tiers.pinned`).

The daemon allocated each slab pinned through CUDA and hands its descriptor over the local
channel (`ArenaSlabs`, SCM_RIGHTS). Here the worker reserves one address range for the whole
arena and maps each slab into it as its turn comes (`cuMemImportFromShareableHandle`,
`cuMemMap`, `cuMemSetAccess` for the GPUs; for the CPU too only where a transfer needs it,
`grant_host`): nothing is faulted in or registered, a
256 MiB slab maps in ~7 ms on the H200 host, and the memory is pinned, so the kernels move
its pages at PCIe speed (bench/host_alloc.py).

- `ImportedRange(size, slab_bytes, fetch, device)`: the reserved range (`base`) and `buffer`,
  its bytes as a ctypes array (the tensor the client views them through keeps it alive; once
  the last view goes, every slab is unmapped and released and the range freed).
  `fetch(first, count)` returns the descriptors of slabs first.. that the daemon has pinned
  (fewer or none: not yet); the caller owns nothing it returns.
- `map_pinned(size, slab_bytes, fetch, device)`: the range and the `SlabRegistrar` mapping it.
- `importer`: the `HostRegistrar` the `SlabRegistrar` drives, in the order slabs are handed
  out and those a transfer waits for first: its `register(address, size)` maps the slab at
  `address`, asking the daemon for the next descriptors where needed, and waits (polling, until
  `close()`) for a slab the daemon has not pinned yet: no transfer can touch such a slab, since
  the daemon hands out no page in it. Its `unregister` keeps the slab mapped: the range goes
  with its last view. `grant_host(slabs)`: the CPU may then read and write those slabs (a KV
  cache in host memory moves its pages with the CPU); no other CPU access touches the range.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable

from kvstore.shared.cuda_vmm import Vmm, load_vmm
from kvstore.shared.domain import ARENA_SLABS_PER_CALL
from kvstore_client.registrar import SlabRegistrar

log = logging.getLogger(__name__)

POLL_S = (0.01, 0.5)  # a slab the daemon has not pinned yet is asked for again after 10 ms, then up to 0.5 s


class ImportedRange:
    def __init__(
        self, size: int, slab_bytes: int, fetch: Callable[[int, int], list[int]], device: int
    ) -> None:
        vmm = load_vmm()
        vmm.use_device(device)
        self.size = size
        self.slab_bytes = slab_bytes
        self.num_slabs = -(-size // slab_bytes)
        self._granule = vmm.granularity()
        self.base = vmm.reserve(self.num_slabs * slab_bytes)
        self.buffer = (ctypes.c_uint8 * size).from_address(self.base)
        self._mapped: dict[int, tuple[int, int]] = {}  # address -> (handle, bytes mapped)
        self.importer = SlabImporter(self, vmm, fetch, device)
        weakref.finalize(
            self.buffer, _release, vmm, device, self.base, self.num_slabs * slab_bytes, self._mapped
        )

    def slab_of(self, address: int) -> int:
        return (address - self.base) // self.slab_bytes

    def mapped_bytes(self, size: int) -> int:
        """The bytes a slab of `size` maps: its allocation, in whole granules."""
        return -(-size // self._granule) * self._granule


class SlabImporter:
    """Maps slabs of an `ImportedRange` for the `SlabRegistrar` (see the module)."""

    def __init__(
        self, imported: ImportedRange, vmm: Vmm, fetch: Callable[[int, int], list[int]], device: int
    ) -> None:
        self._range = imported
        self._vmm = vmm
        self._fetch = fetch
        self.device = device
        self._fds: dict[int, int] = {}  # slab -> descriptor fetched and not yet imported
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._host: set[int] = set()  # slabs this process's CPU may touch (`grant_host`)

    def seed(self, first: int, fds: list[int]) -> None:
        """Descriptors of slabs first.. fetched already (at connect); this importer owns them."""
        with self._lock:
            for index, fd in enumerate(fds):
                self._fds[first + index] = fd

    def _descriptor(self, slab: int) -> int:
        """Slab `slab`'s descriptor (this thread owns it), fetched with the next ones in one call;
        waits while the daemon has not pinned it."""
        delay = POLL_S[0]
        while True:
            with self._lock:
                fd = self._fds.pop(slab, None)
            if fd is not None:
                return fd
            if self._closed.is_set():
                raise ConnectionError("the arena's mapping was dropped")
            count = min(ARENA_SLABS_PER_CALL, self._range.num_slabs - slab)
            fds = self._fetch(slab, count)
            with self._lock:
                for index, descriptor in enumerate(fds):
                    stale = self._fds.pop(slab + index, None)
                    if stale is not None:
                        os.close(stale)
                    self._fds[slab + index] = descriptor
            if not fds:
                self._closed.wait(delay)
                delay = min(delay * 2, POLL_S[1])

    def register(self, address: int, size: int) -> None:
        slab = self._range.slab_of(address)
        fd = self._descriptor(slab)
        vmm = self._vmm
        try:
            vmm.use_device(self.device)
            handle = vmm.import_fd(fd)
        finally:
            os.close(fd)
        length = self._range.mapped_bytes(size)
        try:
            vmm.map(address, length, handle)
        except BaseException:
            vmm.release(handle)
            raise
        self._range._mapped[address] = (handle, length)
        # The GPUs only: granting the CPU too costs the driver about as much again, and, beside
        # a fill, lost 34-42% of it against 10% (bench/host_alloc.py); `grant_host` adds the CPU
        # where a transfer needs it (a KV cache in host memory).
        vmm.set_access(address, length, range(vmm.device_count), host=False)

    def grant_host(self, slabs: Iterable[int]) -> None:
        """Lets this process's CPU read and write `slabs` (mapped already), once each."""
        vmm, imported = self._vmm, self._range
        with self._lock:
            for slab in sorted(set(slabs) - self._host):
                address = imported.base + slab * imported.slab_bytes
                _, length = imported._mapped[address]
                vmm.use_device(self.device)
                vmm.set_access(address, length, range(vmm.device_count), host=True)
                self._host.add(slab)

    def unregister(self, address: int) -> None:
        """Nothing: the slab stays mapped until the range's last view goes (`ImportedRange`)."""

    def close(self) -> None:
        """Wakes a wait for a slab not pinned yet and closes the descriptors not imported."""
        self._closed.set()
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def map_pinned(
    size: int, slab_bytes: int, fetch: Callable[[int, int], list[int]], device: int
) -> tuple[ImportedRange, SlabRegistrar]:
    """Maps a pinned arena of `size`: its first descriptors fetched now (the daemon's refusal, a
    `KVStoreError`, comes here: a caller its mode keeps out sends bytes inline), the range
    reserved, and every slab mapped behind the transfers by a `SlabRegistrar` at full speed
    (~7 ms a slab: nothing to fault in, no pause rule)."""
    first = fetch(0, min(ARENA_SLABS_PER_CALL, -(-size // slab_bytes)))
    try:
        imported = ImportedRange(size, slab_bytes, fetch, device)
    except BaseException:
        for fd in first:
            os.close(fd)
        raise
    imported.importer.seed(0, first)
    registrar = SlabRegistrar(
        imported.importer, imported.base, size, slab_bytes, quiet_s=0.0, faulters=0, fault=_nothing, duty=0.0
    )
    return imported, registrar


def _nothing(address: int, size: int) -> None:
    """An imported slab has nothing to fault in."""


def _release(vmm: Vmm, device: int, base: int, span: int, mapped: dict[int, tuple[int, int]]) -> None:
    """Unmaps and releases every slab of a range and frees it (its last view is gone)."""
    try:
        vmm.use_device(device)
        for address, (handle, length) in list(mapped.items()):
            vmm.unmap(address, length)
            vmm.release(handle)
        mapped.clear()
        vmm.free(base, span)
    except Exception as exc:  # at exit, or a driver already gone: the process's end frees it
        log.debug("releasing an imported arena: %s", exc)
