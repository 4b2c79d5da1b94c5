"""Registering a mapped arena with CUDA slab by slab, in the background.

Registering a whole host-scale arena at connect costs the worker seconds per 10 GiB (the pages
are faulted in as they are pinned), so a connect only starts a `SlabRegistrar` and returns:

- `SlabRegistrar(host, base, size, slab_bytes)`: a thread that registers the arena's slabs in the
  order the daemon hands them out (ascending offsets), the slabs a transfer asks for first. The
  CUDA driver serialises a registration with the worker's own CUDA calls, so the slabs no
  transfer asked for wait until no transfer has asked for `quiet_s` (a transfer then waits for
  one registration in progress at most), and `CudaRegistrar` faults a slab's pages in before it
  calls `cudaHostRegister`, outside the driver's lock, which then only pins them.
- `ready(slabs, wait_s)`: whether every slab in `slabs` is registered, waiting at most `wait_s`
  for those still pending (moved to the front of the queue). False: one failed, or the wait ran
  out; the caller then moves its pages on a path that needs no registration.
- `stop()`: ends the registrations (after the one in progress); the thread unregisters every
  slab before it exits, so every CUDA call is made on it, with the worker's device current.
- `stats()`: slabs registered, pending and failed; transfers waiting now, those that waited and
  how long in all; transfers that took the unpinned path.
- `HostRegistrar`: what pins host memory; `CudaRegistrar` is the CUDA runtime's
  (`cudaHostRegister`, portable, on the worker's device). Tests pass their own, slowed and
  recording the order.

A slot never crosses a slab (`kvstore.tiers.slab`), so a page is pinned once its slab is.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Protocol

log = logging.getLogger(__name__)

PENDING, REGISTERED, FAILED = 0, 1, 2
QUIET_S = 0.25  # slabs no transfer asked for are registered once transfers have paused this long
MADV_POPULATE_WRITE = 23  # Linux 5.14+


_libc = ctypes.CDLL(None, use_errno=True)


def populate(address: int, size: int) -> bool:
    """Faults in `size` bytes at `address` for writing, their contents unchanged (the GIL released:
    a ctypes call); False where the kernel cannot (the registration faults them in itself)."""
    return _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), MADV_POPULATE_WRITE) == 0


class HostRegistrar(Protocol):
    def register(self, address: int, size: int) -> None:
        """Pins `size` bytes at `address` for DMA; raises on failure."""

    def unregister(self, address: int) -> None: ...


class CudaRegistrar:
    """`cudaHostRegister` (portable: for every context) through the runtime the worker's torch
    loaded. `device` is the worker's current device at connect: a thread calling here makes it
    current first, so the registrar's thread never makes a context on device 0."""

    def __init__(self, device: int) -> None:
        from kvstore_kernels.cudart import runtime

        self._runtime = runtime()
        self.device = device
        self._on_device: set[int] = set()

    def _use_device(self) -> None:
        if threading.get_ident() not in self._on_device:
            self._runtime.set_device(self.device)
            self._on_device.add(threading.get_ident())

    def register(self, address: int, size: int) -> None:
        populate(address, size)  # outside the driver's lock, which the worker's transfers need
        self._use_device()
        self._runtime.host_register(address, size, portable=True)

    def unregister(self, address: int) -> None:
        self._use_device()
        self._runtime.host_unregister(address)


class SlabRegistrar:
    def __init__(
        self, host: HostRegistrar, base: int, size: int, slab_bytes: int, quiet_s: float = QUIET_S
    ) -> None:
        self.host = host
        self.base = base
        self.size = size
        self.slab_bytes = slab_bytes if 0 < slab_bytes <= size else size
        self.num_slabs = -(-size // self.slab_bytes)
        self._state = [PENDING] * self.num_slabs
        self._next = 0  # the lowest slab not yet taken in order
        self._urgent: deque[int] = deque()  # slabs a transfer waits for
        self._stopping = False
        self._quiet_s = quiet_s
        self._quiet_until = 0.0  # slabs no transfer asked for wait until then
        self._cond = threading.Condition()
        self.num_registered = self.num_failed = 0
        self.transfers_waited = self.transfers_unpinned = 0
        self.transfers_waiting = 0  # now
        self.wait_s = 0.0
        self.started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="kvstore-register", daemon=True)
        self._thread.start()

    def slabs_of(self, offsets: Iterable[int]) -> set[int]:
        """The slabs holding pages at `offsets` (a page lies within one slab)."""
        return {offset // self.slab_bytes for offset in offsets}

    def _extent(self, slab: int) -> tuple[int, int]:
        start = slab * self.slab_bytes
        return self.base + start, min(self.slab_bytes, self.size - start)

    def _take(self) -> int | None:
        """The next slab to register: one a transfer waits for, else (once transfers have paused
        for quiet_s) the lowest pending one; None when none is left or the registrar stops."""
        while not self._stopping:
            while self._urgent:
                slab = self._urgent.popleft()
                if self._state[slab] == PENDING:
                    return slab
            pause = self._quiet_until - time.perf_counter()
            if pause <= 0:
                return self._take_next()
            self._cond.wait(pause)
        return None

    def _take_next(self) -> int | None:
        while self._next < self.num_slabs:
            slab, self._next = self._next, self._next + 1
            if self._state[slab] == PENDING:
                return slab
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                slab = self._take()
                if slab is None:
                    break
                self._state[slab] = -1  # in progress
            address, length = self._extent(slab)
            try:
                self.host.register(address, length)
                state = REGISTERED
            except Exception as exc:
                state = FAILED
                if not self.num_failed:
                    log.warning(
                        "registering slab %d of the arena with CUDA failed (%s): transfers touching "
                        "the slabs that fail take the unpinned path, at pageable speed",
                        slab,
                        exc,
                    )
            with self._cond:
                self._state[slab] = state
                if state == REGISTERED:
                    self.num_registered += 1
                else:
                    self.num_failed += 1
                self._cond.notify_all()
        if not self._stopping:
            log.info(
                "registered %d of %d arena slabs with CUDA in %.2f s",
                self.num_registered,
                self.num_slabs,
                time.perf_counter() - self.started,
            )
        with self._cond:  # unregistering waits for stop(), here: no CUDA call on the caller's thread
            while not self._stopping:
                self._cond.wait()
        for slab, state in enumerate(self._state):
            if state == REGISTERED:
                try:
                    self.host.unregister(self._extent(slab)[0])
                except Exception as exc:
                    log.warning("unregistering slab %d of the arena failed: %s", slab, exc)

    def ready(self, slabs: Iterable[int], wait_s: float) -> bool:
        """Whether every slab in `slabs` is registered, after waiting at most `wait_s` for the
        pending ones (registered next). Counted: a wait, its time, or a transfer left unpinned."""
        with self._cond:
            self._quiet_until = time.perf_counter() + self._quiet_s
            missing = sorted(slab for slab in slabs if self._state[slab] != REGISTERED)
            if not missing:
                return True
            started = time.perf_counter()
            deadline = started + wait_s
            if all(self._state[slab] != FAILED for slab in missing):
                self._urgent.extend(missing)
                self._cond.notify_all()
                self.transfers_waiting += 1
                while not self._stopping and any(self._state[slab] in (PENDING, -1) for slab in missing):
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                self.transfers_waiting -= 1
            waited = time.perf_counter() - started
            self.wait_s += waited
            if all(self._state[slab] == REGISTERED for slab in missing):
                self.transfers_waited += 1
                return True
            self.transfers_unpinned += 1
            return False

    def stop(self) -> None:
        """Ends the registrations (after the one in progress) and unregisters every slab; the
        caller first makes sure no transfer still uses them."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            self._state = [PENDING] * self.num_slabs
            self.num_registered = 0

    def stats(self) -> dict[str, float]:
        with self._cond:
            return {
                "slabs": self.num_slabs,
                "slabs_registered": self.num_registered,
                "slabs_failed": self.num_failed,
                "slabs_pending": self.num_slabs - self.num_registered - self.num_failed,
                "transfers_waiting": self.transfers_waiting,
                "transfers_waited": self.transfers_waited,
                "wait_s": round(self.wait_s, 6),
                "transfers_unpinned": self.transfers_unpinned,
            }
