"""A worker's mapping of an arena the daemon pinned (`tiers.cpu.pinned`, `kvstore.tiers.pinned`).

The daemon allocated each slab pinned through CUDA and hands its descriptor over the local
channel (`ArenaSlabs`, SCM_RIGHTS). Here the worker reserves one address range for the whole
arena and maps each slab into it as its turn comes (`cuMemImportFromShareableHandle`,
`cuMemMap`, `cuMemSetAccess` for the worker's own GPU; for another GPU of the process or its
CPU only where a transfer needs it, `grant`): nothing is faulted in or registered, a
256 MiB slab maps in 2.3 ms on the H200 host (3-4 ms beside stores: bench/pinned_grants.py),
and the memory is pinned, so the kernels move its pages at PCIe speed (bench/host_alloc.py).

- `ImportedRange(size, slab_bytes, fetchers, device)`: the reserved range (`base`) and `buffer`,
  its bytes as a ctypes array (the tensor the client views them through keeps it alive; once
  the last view goes, every slab is unmapped and released and the range freed). The arena is
  whole slabs (the daemon pins no partial one), each mapped whole.
- `Fetchers`: how descriptors are asked for: `fetch(first, count)` of each client sharing the
  mapping (`add`, `remove`), tried in turn, so the mapping goes on when the client that made it
  closes. A fetch returns the descriptors of slabs first.. the daemon has pinned (fewer or none:
  not yet), which the importer then owns.
- `map_pinned(size, slab_bytes, fetchers, device)`: the range and the `SlabRegistrar` mapping it.
- `importer`: the `HostRegistrar` the `SlabRegistrar` drives, in the order slabs are handed
  out and those a transfer waits for first: its `register(address, size)` maps the slab at
  `address`, asking the daemon for the next descriptors where needed, and waits (polling, until
  `close()`) for a slab the daemon has not pinned yet (no transfer can touch such a slab, since
  the daemon hands out no page in it), or while no fetch can reach the daemon (its local
  channel is closed in an outage until the client connects again). A refusal (another epoch:
  the daemon restarted; PERMISSION_DENIED) fails the slab. Its `unregister` keeps the slab
  mapped: the range goes with its last view. A slab is mapped for the importer's GPU alone
  (every location granted is the driver's work on every slab of every worker: granting all
  GPUs would be 8 times it per worker on an 8-GPU host). `grant(slabs, device)`: another GPU of this
  process (a KV cache on it), or the CPU (`device` None: a KV cache in host memory moves its
  pages with the CPU), may then read and write those slabs, and a GPU granted some gets every
  slab mapped after that with the importer's own; nothing else touches the range.
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
from kvstore.shared.errors import KVStoreError, Unavailable
from kvstore_client.registrar import SlabRegistrar

log = logging.getLogger(__name__)

POLL_S = (0.01, 0.5)  # a slab the daemon has not pinned yet is asked for again after 10 ms, then up to 0.5 s


Fetch = Callable[[int, int], list[int]]


class Fetchers:
    """The fetches of every client sharing one mapping, tried in turn (see the module)."""

    def __init__(self) -> None:
        self._fetches: list[Fetch] = []
        self._lock = threading.Lock()

    def add(self, fetch: Fetch) -> None:
        with self._lock:
            self._fetches.append(fetch)

    def remove(self, fetch: Fetch) -> None:
        with self._lock:
            if fetch in self._fetches:
                self._fetches.remove(fetch)

    def __call__(self, first: int, count: int) -> list[int]:
        """The first answer of a client's fetch; the last error where none could ask."""
        with self._lock:
            fetches = list(self._fetches)
        error: Exception = Unavailable("no client of this process can reach the daemon's local channel")
        for fetch in fetches:
            try:
                return fetch(first, count)
            except (Unavailable, ConnectionError, OSError) as exc:  # this one's channel is down
                error = exc
        raise error


class ImportedRange:
    def __init__(self, size: int, slab_bytes: int, fetchers: Fetchers, device: int) -> None:
        vmm = load_vmm()
        self.size = size
        self.slab_bytes = slab_bytes
        self.num_slabs = size // slab_bytes
        with vmm.on_device(device):
            self.base = vmm.reserve(self.num_slabs * slab_bytes)
        self.buffer = (ctypes.c_uint8 * size).from_address(self.base)
        mapped: dict[int, int] = {}  # address -> handle of each slab mapped
        self.importer = SlabImporter(vmm, fetchers, device, self.base, slab_bytes, self.num_slabs, mapped)
        weakref.finalize(self.buffer, _release, vmm, device, self.base, slab_bytes, self.num_slabs, mapped)


class SlabImporter:
    """Maps slabs of an `ImportedRange` for the `SlabRegistrar` (see the module); it knows the
    range by its numbers, not by reference, so the range goes with its last view."""

    def __init__(
        self,
        vmm: Vmm,
        fetch: Fetch,
        device: int,
        base: int,
        slab_bytes: int,
        num_slabs: int,
        mapped: dict[int, int],
    ) -> None:
        self._vmm = vmm
        self._fetch = fetch
        self.device = device
        self._base, self._slab_bytes, self._num_slabs = base, slab_bytes, num_slabs
        self._mapped = mapped
        self._fds: dict[int, int] = {}  # slab -> descriptor fetched and not yet imported
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._granted: dict[int | None, set[int]] = {}  # another GPU, or None: the CPU -> its slabs

    def seed(self, first: int, fds: list[int]) -> None:
        """Descriptors of slabs first.. fetched already (at connect); this importer owns them."""
        self._keep(first, fds)

    def _keep(self, first: int, fds: list[int]) -> None:
        """Keeps descriptors fetched for slabs first..; closes them if the importer closed."""
        with self._lock:
            closed = self._closed.is_set()
            if not closed:
                for index, fd in enumerate(fds):
                    stale = self._fds.pop(first + index, None)
                    if stale is not None:
                        os.close(stale)
                    self._fds[first + index] = fd
        if closed:
            for fd in fds:
                os.close(fd)

    def _descriptor(self, slab: int) -> int:
        """Slab `slab`'s descriptor (this thread owns it), fetched with the next ones in one call;
        waits while the daemon has not pinned it or cannot be reached."""
        delay = POLL_S[0]
        while True:
            with self._lock:
                fd = self._fds.pop(slab, None)
                if fd is None and self._closed.is_set():
                    raise ConnectionError("the arena's mapping was dropped")
            if fd is not None:
                return fd
            try:
                fds = self._fetch(slab, min(ARENA_SLABS_PER_CALL, self._num_slabs - slab))
            except (Unavailable, ConnectionError, OSError) as exc:  # asked again once it serves
                log.debug("slab %d of the pinned arena: %s; asking again", slab, exc)
                fds = []
            except KVStoreError:  # refused: another epoch (a restart), or PERMISSION_DENIED
                raise
            self._keep(slab, fds)
            with self._lock:
                fetched = slab in self._fds
            if not fetched:
                self._closed.wait(delay)
                delay = min(delay * 2, POLL_S[1])

    def register(self, address: int, size: int) -> None:
        slab = (address - self._base) // self._slab_bytes
        fd = self._descriptor(slab)
        vmm = self._vmm
        with vmm.on_device(self.device):
            try:
                handle = vmm.import_fd(fd)
            finally:
                os.close(fd)
            try:
                vmm.map(address, size, handle)
            except BaseException:
                vmm.release(handle)
                raise
            self._mapped[address] = handle
            # This GPU only: granting the CPU too costs the driver about as much again, and,
            # beside a fill, lost 34-42% of it against 10% (bench/host_alloc.py); `grant` adds
            # another GPU, or the CPU, where a transfer needs it. A GPU that has needed some
            # already gets each slab mapped from then on with it.
            vmm.set_access(address, size, (self.device,), host=False)
            with self._lock:
                others = [device for device in self._granted if device is not None]
                if others:
                    vmm.set_access(address, size, others, host=False)
                    for device in others:
                        self._granted[device].add(slab)

    def grant(self, slabs: Iterable[int], device: int | None) -> None:
        """Lets GPU `device` of this process (None: its CPU) read and write `slabs` (mapped
        already), once each; the importer's own GPU has them all."""
        if device == self.device:
            return
        vmm = self._vmm
        with self._lock:
            granted = self._granted.setdefault(device, set())
            missing = sorted(set(slabs) - granted)
            if not missing:
                return
            gpus = () if device is None else (device,)
            with vmm.on_device(self.device):
                for slab in missing:
                    address = self._base + slab * self._slab_bytes
                    vmm.set_access(address, self._slab_bytes, gpus, host=device is None)
                    granted.add(slab)

    def unregister(self, address: int) -> None:
        """Nothing: the slab stays mapped until the range's last view goes (`ImportedRange`)."""

    def close(self) -> None:
        """Wakes a wait for a slab not pinned yet and closes the descriptors not imported."""
        with self._lock:
            self._closed.set()
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def map_pinned(
    size: int, slab_bytes: int, fetchers: Fetchers, device: int
) -> tuple[ImportedRange, SlabRegistrar]:
    """Maps a pinned arena of `size` (whole slabs): its first descriptors fetched now (the
    daemon's refusal, a `KVStoreError`, comes here: a caller its mode keeps out sends bytes
    inline), the range reserved, and every slab mapped behind the transfers by a
    `SlabRegistrar` at full speed (2-4 ms a slab: nothing to fault in, no pause rule)."""
    first = fetchers(0, min(ARENA_SLABS_PER_CALL, size // slab_bytes))
    try:
        imported = ImportedRange(size, slab_bytes, fetchers, device)
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


def _release(
    vmm: Vmm, device: int, base: int, slab_bytes: int, num_slabs: int, mapped: dict[int, int]
) -> None:
    """Unmaps and releases every slab of a range and frees it (its last view is gone)."""
    span = slab_bytes * num_slabs
    try:
        with vmm.on_device(device):
            for address, handle in sorted(mapped.items()):
                vmm.unmap(address, slab_bytes)
                vmm.release(handle)
            mapped.clear()
            vmm.free(base, span)
    except Exception as exc:  # at exit, or a driver already gone: the process's end frees it
        log.debug("releasing an imported arena: %s", exc)
