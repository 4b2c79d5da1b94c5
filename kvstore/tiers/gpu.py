"""GPU tier: device-memory pools owned by the daemon, shared with same-host workers over CUDA IPC.

- `GpuTier.start(config, arena)`: one pool per configured device, allocated once, each with its
  CUDA IPC handle; the arena is registered with CUDA so copies to and from it run at PCIe speed.
  Returns None, after one log line saying why, where this host has no CUDA runtime or device.
- `GpuPool`: a pool's device, address, IPC handle and slot allocator (`SlabAllocator`).
- `GpuTier.copy(pool, copies, done)`: runs `(dst, src, size)` copies (pool <-> arena addresses)
  on the pool's own stream in the pool's worker thread, in submission order, then calls
  `done(ok)` from that thread. The event loop never waits on a copy, and the daemon never
  waits on a worker's stream: workers read the pools themselves.

The tier knows bytes and slots only; the store decides what lives here. Since every copy
into or out of a pool runs on that pool's one stream, in order, a slot freed by the store
may be handed out again at once: a later copy into it runs after the earlier copy out of it.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.config.root import GpuTierConfig
from kvstore.shared.cudart import CudaError, CudaRuntime, CudaUnavailable, load_runtime
from kvstore.tiers.cpu import Arena
from kvstore.tiers.pinned import PinnedArena
from kvstore.tiers.slab import SlabAllocator

log = logging.getLogger(__name__)

Copy = tuple[int, int, int]  # destination address, source address, bytes
CopyDone = Callable[[bool], None]


@dataclass(eq=False)
class GpuPool:
    index: int
    device: int
    pci_bus_id: str
    base: int  # device address of the pool in the daemon
    size: int
    ipc_handle: bytes
    slots: SlabAllocator


class _Copier:
    """One worker thread and one CUDA stream per pool: copies run in submission order."""

    def __init__(self, runtime: CudaRuntime, device: int) -> None:
        self._runtime = runtime
        self._device = device
        self._jobs: queue.SimpleQueue[tuple[list[Copy], CopyDone] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"kvstore-gpu{device}", daemon=True)
        self.submitted = 0  # counted by the submitting thread only
        self.completed = 0  # counted by the copier thread only
        self._thread.start()

    def submit(self, copies: list[Copy], done: CopyDone) -> None:
        self.submitted += 1
        self._jobs.put((copies, done))

    def _run(self) -> None:
        runtime = self._runtime
        runtime.set_device(self._device)  # the current device is per thread
        stream = runtime.stream_create()
        try:
            while (job := self._jobs.get()) is not None:
                copies, done = job
                ok = True
                try:
                    for dst, src, size in copies:
                        runtime.memcpy_async(dst, src, size, stream)
                    runtime.stream_synchronize(stream)
                except CudaError as exc:
                    log.error("GPU tier copy on device %d failed: %s", self._device, exc)
                    ok = False
                self.completed += 1
                done(ok)
        finally:
            runtime.stream_destroy(stream)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


class GpuTier:
    name = "gpu"

    def __init__(
        self,
        runtime: CudaRuntime,
        pools: list[GpuPool],
        arena: Arena | PinnedArena,
        arena_base: int,
        registered: bool,
    ) -> None:
        self.runtime = runtime
        self.pools = pools
        self.arena = arena
        self.arena_base = arena_base  # the arena's address in this process
        self.arena_registered = registered
        self._copiers = [_Copier(runtime, pool.device) for pool in pools]

    @classmethod
    def start(cls, config: GpuTierConfig, arena: Arena | PinnedArena) -> GpuTier | None:
        """Allocates the pools; None (logged) where there is no CUDA runtime or device.

        A configured device that does not exist, or a pool that does not fit, is an error."""
        try:
            runtime = load_runtime()
            count = runtime.device_count()
        except (CudaUnavailable, CudaError) as exc:
            log.info("GPU tier off: %s; pages stay in the CPU tier", exc)
            return None
        if count == 0:
            log.info("GPU tier off: no CUDA device on this host; pages stay in the CPU tier")
            return None
        missing = [d for d in config.devices if d >= count]
        if missing:
            raise RuntimeError(
                f"tiers.gpu.devices: device {missing[0]} does not exist; this process sees {count} CUDA "
                f"device(s), 0..{count - 1} (after CUDA_VISIBLE_DEVICES)"
            )
        pools: list[GpuPool] = []
        try:
            for index, device in enumerate(config.devices):
                pools.append(cls._allocate(runtime, index, device, config))
        except BaseException:
            for pool in pools:
                runtime.set_device(pool.device)
                runtime.free(pool.base)
            raise
        arena_base = _address(arena)
        started = time.perf_counter()
        try:
            if arena.pages.kind != "pinned":  # a pinned arena is mapped for every GPU already
                runtime.host_register(arena_base, arena.size)
                log.info("registered the arena with CUDA in %.2f s", time.perf_counter() - started)
            registered = True
        except CudaError as exc:
            registered = False
            log.warning("GPU tier: %s; copies to and from the arena run at pageable-memory speed", exc)
        tier = cls(runtime, pools, arena, arena_base, registered)
        for pool in pools:
            log.info("GPU tier: %d MiB pool on device %d (%s)", pool.size >> 20, pool.device, pool.pci_bus_id)
        return tier

    @staticmethod
    def _allocate(runtime: CudaRuntime, index: int, device: int, config: GpuTierConfig) -> GpuPool:
        runtime.set_device(device)
        try:
            base = runtime.malloc(config.bytes)
        except CudaError as exc:
            size = config.bytes >> 20
            raise RuntimeError(
                f"tiers.gpu.bytes: cannot allocate a {size} MiB pool on device {device} ({exc}); "
                "lower tiers.gpu.bytes"
            ) from exc
        return GpuPool(
            index,
            device,
            runtime.pci_bus_id(device),
            base,
            config.bytes,
            runtime.ipc_handle(base),
            SlabAllocator(config.bytes, config.slab_bytes),
        )

    @property
    def capacity(self) -> int:
        return sum(pool.slots.capacity for pool in self.pools)

    @property
    def bytes_used(self) -> int:
        return sum(pool.slots.bytes_used for pool in self.pools)

    @property
    def pending_copies(self) -> int:
        return sum(copier.submitted - copier.completed for copier in self._copiers)

    def copies_in_flight(self, pool: GpuPool) -> int:
        """Copies submitted into or out of `pool` that have not finished."""
        copier = self._copiers[pool.index]
        return copier.submitted - copier.completed

    def pool_for(self, pci_bus_id: str) -> int:
        """Index of the pool on the device with this PCI bus id, or -1."""
        for pool in self.pools:
            if pool.pci_bus_id == pci_bus_id.lower():
                return pool.index
        return -1

    def copy(self, pool: GpuPool, copies: Sequence[Copy], done: CopyDone) -> None:
        self._copiers[pool.index].submit(list(copies), done)

    def close(self) -> None:
        """Waits for the copies in flight, then frees the pools and unregisters the arena."""
        for copier in self._copiers:
            copier.stop()
        for pool in self.pools:
            self.runtime.set_device(pool.device)
            self.runtime.free(pool.base)
        if self.arena_registered and self.arena.pages.kind != "pinned":  # a pinned one was never registered
            self.runtime.host_unregister(self.arena_base)


def _address(arena: Arena | PinnedArena) -> int:
    """The arena's address in this process (valid while the arena is open)."""
    anchor = ctypes.c_char.from_buffer(arena.view)
    address = ctypes.addressof(anchor)
    del anchor  # releases the buffer export, so the arena can still be closed
    return address
