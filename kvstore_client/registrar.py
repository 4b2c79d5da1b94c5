"""Registering a mapped arena with CUDA slab by slab, in the background.

Registering a whole host-scale arena at connect costs the worker seconds per 10 GiB (the pages
are faulted in as they are pinned), so a connect only starts a `SlabRegistrar` and returns:

- `SlabRegistrar(host, base, size, slab_bytes)`: a slab is made ready in two steps, each in the
  order the daemon hands slabs out (ascending offsets), the slabs a transfer asks for first:
  - faulting its pages in (`fault`, `MADV_POPULATE_WRITE`): CPU work that does not take the CUDA
    driver's lock, done ahead of need by `faulters` threads in parallel, whatever the transfers
    do;
  - registering it (`host.register`, `cudaHostRegister` of pages already present: ~13 ms a
    256 MiB slab on the H100 host, against ~110 ms where it faults them in itself), on one
    thread. The driver serialises a registration with the worker's own CUDA calls, so the
    slabs no transfer asked for are registered at full speed only once no transfer has asked
    for `quiet_s`; while transfers keep coming they go on at a `duty` share of the time at most
    (after a registration of d seconds, the next waits d * (1 - duty) / duty), so a worker that
    never pauses still gets its arena registered (its stores meanwhile go through the bounce
    ring, `bounce.py`), and a transfer waits for one registration in progress at most.
- `ready(slabs, wait_s)`: whether every slab in `slabs` is registered, waiting at most `wait_s`
  for those still pending (moved to the front of both queues). False: one failed, or the wait
  ran out; the caller then moves its pages on a path that needs no registration.
- `registered_now(slabs)`: the same question without waiting or moving them ahead (a store that
  can go around the registration, `bounce.BounceRing`); it still counts as a transfer for the
  pause rule, and a miss as a transfer bounced.
- `after_registered(callback)`: `callback()` runs on the registration thread once every slab is
  registered (or failed) and transfers have then paused for `quiet_s` (the bounce ring is freed
  so: its unpinning holds the driver as a registration does, so not beside a transfer); never if
  the registrar stops first.
- `stop()`: ends the faulting and the registrations (after those in progress); the registration
  thread unregisters every slab before it exits, so every CUDA call is made on it, with the
  worker's device current.
- `stats()`: slabs faulted in, registered, pending and failed; transfers waiting now, those that
  waited and how long in all; transfers that took the unpinned path.
- `HostRegistrar`: what pins host memory; `CudaRegistrar` is the CUDA runtime's
  (`cudaHostRegister`, portable, on the worker's device). Tests pass their own, slowed and
  recording the order, and their own `fault`.

A slot never crosses a slab (`kvstore.tiers.slab`), so a page is pinned once its slab is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from kvstore_client.faulting import Faulter, default_faulters

log = logging.getLogger(__name__)

PENDING, REGISTERED, FAILED = 0, 1, 2
QUIET_S = 0.25  # slabs no transfer asked for are registered once transfers have paused this long
# ... and, while transfers keep coming, for at most this share of the time: the driver holds the
# worker's CUDA calls while it registers, ~13-16 ms a 256 MiB slab on the H100 host. Not measured
# on a GPU yet beside bounced stores (bench/NOTES-connect.md).
REGISTER_DUTY = 0.1


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
        self._use_device()
        self._runtime.host_register(address, size, portable=True)

    def unregister(self, address: int) -> None:
        self._use_device()
        self._runtime.host_unregister(address)


class SlabRegistrar:
    def __init__(
        self,
        host: HostRegistrar,
        base: int,
        size: int,
        slab_bytes: int,
        quiet_s: float = QUIET_S,
        faulters: int | None = None,
        fault: Callable[[int, int], object] | None = None,
        duty: float = REGISTER_DUTY,
    ) -> None:
        if not 0 <= duty <= 1:
            raise ValueError(f"duty: expected a share of the time in [0, 1], got {duty}")
        self.host = host
        self.base = base
        self.size = size
        self.slab_bytes = slab_bytes if 0 < slab_bytes <= size else size
        self.num_slabs = -(-size // self.slab_bytes)
        self._state = [PENDING] * self.num_slabs
        self._faulted = [False] * self.num_slabs  # pages present
        self._faulting = [False] * self.num_slabs
        self._next = 0  # the lowest slab not yet taken in order, for registering
        self._fault_next = 0  # the same, for faulting in
        self._urgent: deque[int] = deque()  # slabs a transfer waits for
        self._stopping = False
        self._quiet_s = quiet_s
        self._quiet_until = 0.0  # slabs no transfer asked for wait until then, at full speed
        self._duty = duty
        self._duty_until = 0.0  # ... and until then while transfers keep coming
        self._fault = fault or Faulter()
        self._cond = threading.Condition()
        self._after: list[Callable[[], object]] = []  # run once every slab is done, at a pause
        self.num_registered = self.num_failed = self.num_faulted = self.num_fault_failures = 0
        self.transfers_waited = self.transfers_unpinned = self.transfers_bounced = 0
        self.transfers_waiting = 0  # now
        self.wait_s = 0.0
        self.started = time.perf_counter()
        self.faulted_s: float | None = None  # from start until every slab was faulted in
        self.num_faulters = default_faulters() if faulters is None else faulters
        self._faulters = [
            threading.Thread(target=self._fault_slabs, name=f"kvstore-fault-{i}", daemon=True)
            for i in range(self.num_faulters)
        ]
        self._thread = threading.Thread(target=self._run, name="kvstore-register", daemon=True)
        for thread in [self._thread, *self._faulters]:
            thread.start()

    def slabs_of(self, offsets: Iterable[int]) -> set[int]:
        """The slabs holding pages at `offsets` (a page lies within one slab)."""
        return {offset // self.slab_bytes for offset in offsets}

    def _extent(self, slab: int) -> tuple[int, int]:
        start = slab * self.slab_bytes
        return self.base + start, min(self.slab_bytes, self.size - start)

    # -- faulting in, ahead of need ------------------------------------------------

    def _can_fault(self, slab: int) -> bool:
        return self._state[slab] == PENDING and not self._faulted[slab] and not self._faulting[slab]

    def _take_fault(self) -> int | None:
        """The next slab to fault in: one a transfer waits for, else the lowest not yet taken."""
        if self._stopping:
            return None
        for slab in self._urgent:
            if self._can_fault(slab):
                return slab
        while self._fault_next < self.num_slabs:
            slab, self._fault_next = self._fault_next, self._fault_next + 1
            if self._can_fault(slab):
                return slab
        return None

    def _fault_in(self, slab: int) -> None:
        """Faults `slab` in (its `_faulting` mark set by the caller), then marks it faulted."""
        try:
            self._fault(*self._extent(slab))
        except Exception as exc:  # the registration faults its pages in itself
            if not self.num_fault_failures:
                log.warning("faulting in slab %d of the arena failed (%s): its registration does", slab, exc)
            self.num_fault_failures += 1
        with self._cond:
            self._faulting[slab] = False
            self._faulted[slab] = True
            self.num_faulted += 1
            if self.num_faulted == self.num_slabs:
                self.faulted_s = time.perf_counter() - self.started
            self._cond.notify_all()

    def _fault_slabs(self) -> None:
        while True:
            with self._cond:
                slab = self._take_fault()
                if slab is None:
                    return
                self._faulting[slab] = True
            self._fault_in(slab)

    # -- registering -----------------------------------------------------------------

    def _take(self) -> tuple[int, bool] | None:
        """The next slab to register and whether this thread must fault it in first: one a
        transfer waits for (faulted in here unless a faulter has it: then it is waited for), else
        (once transfers have paused for quiet_s) the lowest pending one, once faulted in. None
        when none is left or the registrar stops."""
        while not self._stopping:
            while self._urgent and self._state[self._urgent[0]] != PENDING:
                self._urgent.popleft()
            waiting_for_faulter = False
            for slab in self._urgent:
                if self._state[slab] != PENDING:
                    continue
                if self._faulted[slab] or not self._faulting[slab]:
                    return slab, not self._faulted[slab]
                waiting_for_faulter = True
            now = time.perf_counter()
            pause = self._quiet_until - now
            if pause > 0 and self._duty and now >= self._duty_until:
                pause = 0.0  # transfers keep coming, but this slab's turn within the duty has come
            elif pause > 0 and self._duty:
                pause = min(pause, self._duty_until - now)
            if pause <= 0 and not waiting_for_faulter:
                while self._next < self.num_slabs and self._state[self._next] != PENDING:
                    self._next += 1
                if self._next == self.num_slabs:
                    return None
                slab = self._next
                if self._faulted[slab] or (not self.num_faulters and not self._faulting[slab]):
                    return slab, not self._faulted[slab]  # else the faulters' order reaches it
            self._cond.wait(pause if pause > 0 and not waiting_for_faulter else None)
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                taken = self._take()
                if taken is None:
                    break
                slab, must_fault = taken
                if must_fault:
                    self._faulting[slab] = True
            if must_fault:
                self._fault_in(slab)
            with self._cond:
                self._state[slab] = -1  # in progress
            address, length = self._extent(slab)
            started = time.perf_counter()
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
                ended = time.perf_counter()
                if self._duty:
                    self._duty_until = ended + (ended - started) * (1 - self._duty) / self._duty
                self._state[slab] = state
                if state == REGISTERED:
                    self.num_registered += 1
                else:
                    self.num_failed += 1
                self._cond.notify_all()
        if not self._stopping:
            log.info(
                "registered %d of %d arena slabs with CUDA in %.2f s (all faulted in after %s s, %d threads)",
                self.num_registered,
                self.num_slabs,
                time.perf_counter() - self.started,
                f"{self.faulted_s:.2f}" if self.faulted_s is not None else "-",
                self.num_faulters,
            )
        self._run_after_registered()
        with self._cond:  # unregistering waits for stop(), here: no CUDA call on the caller's thread
            while not self._stopping:
                self._cond.wait()
        for slab, state in enumerate(self._state):
            if state == REGISTERED:
                try:
                    self.host.unregister(self._extent(slab)[0])
                except Exception as exc:
                    log.warning("unregistering slab %d of the arena failed: %s", slab, exc)

    def after_registered(self, callback: Callable[[], object]) -> None:
        """Runs `callback()` on the registration thread once every slab is done and transfers have
        paused for quiet_s (at once, on that thread, if that time has come already)."""
        with self._cond:
            self._after.append(callback)
            self._cond.notify_all()

    def _run_after_registered(self) -> None:
        """Waits for a pause in the transfers, then runs the callbacks; again for any added later,
        until stop()."""
        while True:
            with self._cond:
                while not self._stopping and not self._after:
                    self._cond.wait()
                while not self._stopping and (left := self._quiet_until - time.perf_counter()) > 0:
                    self._cond.wait(left)
                if self._stopping:
                    return
                callbacks, self._after = self._after, []
            for callback in callbacks:
                try:
                    callback()
                except Exception as exc:
                    log.warning("after the arena's registration: %s", exc)

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

    def registered_now(self, slabs: Iterable[int]) -> bool:
        """Whether every slab in `slabs` is registered, without waiting for any."""
        with self._cond:
            self._quiet_until = time.perf_counter() + self._quiet_s
            if all(self._state[slab] == REGISTERED for slab in slabs):
                return True
            self.transfers_bounced += 1
            return False

    @property
    def all_registered(self) -> bool:
        return self.num_registered == self.num_slabs

    def stop(self) -> None:
        """Ends the registrations (after the one in progress) and unregisters every slab; the
        caller first makes sure no transfer still uses them."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in [self._thread, *self._faulters]:
            thread.join()
        with self._cond:
            self._state = [PENDING] * self.num_slabs
            self.num_registered = 0

    def stats(self) -> dict[str, float]:
        with self._cond:
            return {
                "slabs": self.num_slabs,
                "slabs_faulted": self.num_faulted,
                "slabs_registered": self.num_registered,
                "slabs_failed": self.num_failed,
                "slabs_pending": self.num_slabs - self.num_registered - self.num_failed,
                "transfers_waiting": self.transfers_waiting,
                "transfers_waited": self.transfers_waited,
                "wait_s": round(self.wait_s, 6),
                "transfers_unpinned": self.transfers_unpinned,
                "transfers_bounced": self.transfers_bounced,
            }
