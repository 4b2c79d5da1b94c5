"""The daemon's shared-memory arena, mapped into a worker on the daemon's host.

`MappedArena.map(arena, identity)` maps the file a Connect reply names once it is proven to be
the file the daemon maps: on this host (boot id) and the same file (`identity`: st_dev, st_ino).
Otherwise page bytes go inline, or (`shared_memory=True`) ConnectionError. With a GPU its slabs
are registered with CUDA in the background (`registrar.SlabRegistrar`), so the connect costs
the same whatever the arena's size and the kernels move pages at PCIe speed. `tensor` is the
mapping as uint8 (None when nothing is mapped); `epoch` is the mapped arena's (0: none).

`transfer_options(offsets)`: what a transfer of the pages at `offsets` must pass the kernels:
None (their auto rule) once the slabs holding them are registered, waiting up to `wait_s` for
them; else the torch reference, which needs no registration (counted in `stats()`).
`bounce_for(offsets, page_bytes, on_cuda)`: for a store of whole pages, the process's
`bounce.BounceRing` where their slabs are not registered yet (the store goes through it at once
instead of waiting), else None. `bounce` decides where it applies: None (the default) for KV
caches on CUDA, True for any (tests with CPU caches), False never. The ring is made in the
background when the registration starts, and freed by the registration thread once every slab
is registered and the transfers pause (`SlabRegistrar.after_registered`).

An arena the daemon pinned (`tiers.cpu.pinned`, path `cuda:...`) is mapped from the slabs'
descriptors the daemon hands over the local channel (`fetch`, given by the session), slab by
slab in the background, with nothing to fault in or register (`imported.ImportedRange`); no
bounce ring is needed, and a transfer into a slab not mapped yet waits for it (a slab that
cannot be mapped is an `Unavailable` error: its memory cannot be touched at all).

One mapping per process: every client of this process that maps the same arena (path, file,
size and epoch) shares one mapping and one registration (`SharedMapping`, counted by its users).
The driver counts each registration's pages in full, even where two mappings pin the same
pages: on the GPU hosts the registrations of one process stopped at ~124 GiB in all (64 GiB
then 15 of 256 slabs failing a second mapping; 100 GiB then 303 of 400), so a second pinned
mapping of a large arena could not pin, and it would have paid its registration again.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

import kvstore_kernels
from kvstore.shared.cudart import CudaUnavailable
from kvstore.shared.domain import MEMFD_PREFIX, PINNED_PREFIX
from kvstore.shared.errors import KVStoreError, Unavailable
from kvstore.shared.hugepages import advise_huge, thp_advised
from kvstore.shared.peers import boot_id
from kvstore_client.bounce import BounceRing
from kvstore_client.imported import Fetchers, ImportedRange, map_pinned
from kvstore_client.registrar import CudaRegistrar, HostRegistrar, SlabRegistrar
from kvstore_client.routes import UNPINNED
from kvstore_client.transfers import Streams
from kvstore_kernels import TransferOptions

log = logging.getLogger(__name__)

# How long a transfer waits for the slabs it touches to be registered before it takes the
# unpinned path: on the H100 host, registering 16 GiB whose pages were present took 0.8 s (13 ms
# a 256 MiB slab), 7.8 s where registering faulted them in (0.12 s a slab): far less than moving
# a prompt's pages at pageable speed.
REGISTER_WAIT_S = 10.0
RING_JOIN_S = 30.0  # how long unmapping waits for a bounce ring still being made


class MappingKey(NamedTuple):
    path: str
    identity: tuple[int, int]  # (st_dev, st_ino) of the file mapped
    size: int
    epoch: int


class SharedMapping:
    """One mapping of an arena in this process and its registration; `users`: the clients on it."""

    def __init__(self, key: MappingKey, mapping: Any, imported: ImportedRange | None = None) -> None:
        self.key = key
        self.mmap = mapping  # an mmap, or an imported range's buffer
        self.imported = imported
        self.fetchers: Fetchers | None = None  # a pinned arena's: each user's way to its slabs
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        self.registrar: SlabRegistrar | None = None
        self.users = 1
        self._ring: BounceRing | None = None
        self._ring_made = threading.Event()
        self._ring_lock = threading.Lock()
        self._ring_dropped = False
        self._ring_maker: threading.Thread | None = None

    def make_ring(self, device: int | None) -> None:
        """Makes the bounce ring in the background: pinned for every context, its CUDA calls on
        `device` (None: not pinned, tests with CPU caches)."""

        def make() -> None:
            try:
                pinner = CudaRegistrar(device) if device is not None else None
                ring: BounceRing | None = BounceRing(host=pinner, device=device)
            except Exception as exc:  # stores then wait for their slabs, as without the ring
                log.warning("the arena's bounce ring could not be made (%s): stores wait for slabs", exc)
                ring = None
            with self._ring_lock:
                dropped = self._ring_dropped
                if not dropped:
                    self._ring = ring
            if dropped and ring is not None:  # the mapping went while it was made
                ring.close()
            self._ring_made.set()

        self._ring_maker = threading.Thread(target=make, name="kvstore-bounce-ring", daemon=True)
        self._ring_maker.start()

    def ring(self) -> BounceRing | None:
        """The bounce ring (waiting for it to be made); None once every slab is registered (the
        registrar then frees the ring at the first pause in the transfers: `retire_ring`; a store
        that had it already finds it closed and takes the kernels' way)."""
        if self.imported is not None or not self._ring_made.wait(30.0):
            return None
        registrar = self.registrar
        if registrar is None or registrar.all_registered:
            return None
        with self._ring_lock:
            return self._ring

    def retire_ring(self) -> None:
        """Frees the ring once every slab is registered (the registrar calls it at a pause); where
        the driver refused some slab, the ring stays: stores into it go through the ring."""
        registrar = self.registrar
        if registrar is not None and registrar.all_registered:
            self.drop_ring()

    def drop_ring(self, join: bool = False) -> None:
        """Closes the ring (after the stores inside it), or the one still being made once it is;
        with `join`, returns only once the thread making it is done (a worker that closes its
        client and exits must not leave that thread in a CUDA call: seen as SIGABRT at exit)."""
        with self._ring_lock:
            ring, self._ring = self._ring, None
            self._ring_dropped = True
        if ring is not None:
            ring.close()
        maker = self._ring_maker
        if join and maker is not None and maker is not threading.current_thread():
            maker.join(RING_JOIN_S)


_mappings: dict[MappingKey, SharedMapping] = {}
_mappings_lock = threading.Lock()


def mappings_in_process() -> int:
    """Arena mappings this process holds (each client of an arena shares its one)."""
    with _mappings_lock:
        return len(_mappings)


class MappedArena:
    def __init__(self, want_shared_memory: bool | None, pin: bool | None) -> None:
        self.want_shared_memory = want_shared_memory
        self.pin = pin
        self._shared: SharedMapping | None = None
        self.tensor: torch.Tensor | None = None
        self.wait_s = REGISTER_WAIT_S
        self.slab_bytes = 0
        self.epoch = 0
        self.identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the daemon's arena file
        self.bounce: bool | None = None  # stores around the registration: None for CUDA caches
        # How this client asks for a pinned arena's slabs (a share of the mapping's `fetchers`).
        self._fetch: Callable[[int, int], list[int]] | None = None

    @property
    def registrar(self) -> SlabRegistrar | None:
        return self._shared.registrar if self._shared is not None else None

    def map(
        self,
        arena: Any,
        identity: tuple[int, int],
        streams: Streams | None = None,
        handed: int | None = None,
        epoch: int = 0,
        fetch: Callable[[int, int], list[int]] | None = None,
    ) -> None:
        """Maps the arena `pb.Arena` names (dropping any mapping first), or shares the mapping
        another client of this process made of it (the same file, size and `epoch`). A sealed
        arena (a tenant's: no path) is mapped from `handed`, the descriptor its Connect reply
        carried (the caller keeps and closes it). A pinned arena is mapped from the slabs'
        descriptors `fetch(first, count)` brings (None: no local channel to bring them)."""
        self.unmap(streams)
        if self.want_shared_memory is False:
            return
        path, size = arena.shm_path, arena.size
        if arena.boot_id and arena.boot_id != boot_id():
            if self.want_shared_memory:
                raise ConnectionError(f"the daemon runs on another host: its arena {path!r} cannot be mapped")
            log.info("the daemon runs on another host: page bytes go inline")
            return
        if path.startswith(PINNED_PREFIX):
            self._map_pinned(arena, epoch, fetch)
            return
        try:
            if path.startswith(MEMFD_PREFIX):
                if handed is None:
                    raise OSError(
                        errno.ENOENT, "it is handed only with a Connect on the daemon's local channel"
                    )
                fd = os.dup(handed)
            else:
                fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            if self.want_shared_memory:
                raise ConnectionError(
                    f"cannot map the daemon's arena {path!r}: {exc.strerror}; "
                    f"connect with shared_memory=False to send bytes instead"
                ) from exc
            log.info("arena %s not reachable (%s): page bytes go inline", path, exc.strerror)
            return
        try:
            st = os.fstat(fd)
            if identity != (0, 0) and (st.st_dev, st.st_ino) != identity:
                message = f"the file at {path} is not the daemon's arena (the daemon restarted meanwhile?)"
                if self.want_shared_memory:
                    raise ConnectionError(message)
                log.warning("%s: page bytes go inline until the client connects again", message)
                return
            self._shared = self._share(MappingKey(path, (st.st_dev, st.st_ino), size, epoch), fd)
        finally:
            os.close(fd)
        self.tensor = self._shared.tensor
        self.slab_bytes = arena.slab_bytes  # 0 (an older daemon): the arena is one slab
        if self._shared.registrar is None:  # a client of this process that pins none may have mapped it
            host = self.host_registrar()
            if host is not None:
                self.start_registrar(host)

    def _map_pinned(self, arena: Any, epoch: int, fetch: Callable[[int, int], list[int]] | None) -> None:
        """Maps the daemon's pinned arena slab by slab in the background (or shares this process's
        mapping of it); without the local channel or a GPU, page bytes go inline."""
        why = ""
        if fetch is None:
            why = "its slabs come over the daemon's local channel, which this client does not use"
        elif self.pin is False or not torch.cuda.is_available():
            why = "mapping it needs CUDA in this process"
        if why:
            if self.want_shared_memory:
                raise ConnectionError(f"cannot map the daemon's pinned arena {arena.shm_path}: {why}")
            log.info("the daemon's pinned arena is not mapped (%s): page bytes go inline", why)
            return
        assert fetch is not None
        key = MappingKey(arena.shm_path, (0, 0), arena.size, epoch)
        slab_bytes = arena.slab_bytes or arena.size
        with _mappings_lock:
            shared = _mappings.get(key)
            if shared is not None:
                shared.users += 1
            else:
                fetchers = Fetchers()
                fetchers.add(fetch)
                try:
                    imported, registrar = map_pinned(
                        arena.size, slab_bytes, fetchers, torch.cuda.current_device()
                    )
                except (KVStoreError, CudaUnavailable, RuntimeError) as exc:  # its mode keeps this caller out
                    if self.want_shared_memory:
                        raise ConnectionError(f"cannot map the daemon's pinned arena: {exc}") from exc
                    log.info("the daemon's pinned arena is not mapped (%s): page bytes go inline", exc)
                    return
                shared = SharedMapping(key, imported.buffer, imported)
                shared.fetchers = fetchers
                shared.registrar = registrar
                if epoch:
                    _mappings[key] = shared
            if shared.fetchers is not None and shared.users > 1:
                shared.fetchers.add(fetch)  # the mapping goes on with this client's channel too
        self._fetch = fetch
        self._shared = shared
        self.tensor = shared.tensor
        self.slab_bytes = slab_bytes

    def _share(self, key: MappingKey, fd: int) -> SharedMapping:
        """This process's mapping of the arena `key` names: the one made already (one more user),
        or a new one."""
        with _mappings_lock:
            shared = _mappings.get(key)
            if shared is not None and key.epoch:  # without an epoch nothing proves it the same arena
                shared.users += 1
                return shared
            mapping = mmap.mmap(fd, key.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if thp_advised(None if key.path.startswith(MEMFD_PREFIX) else os.path.dirname(key.path)):
                advise_huge(mapping)  # as the daemon's mapping does
            shared = SharedMapping(key, mapping)
            if key.epoch:
                _mappings[key] = shared
            return shared

    def host_registrar(self) -> HostRegistrar | None:
        """What pins a new mapping: CUDA's, where a GPU is present and `pin` allows (None: nothing)."""
        if self.pin is False or not torch.cuda.is_available():
            return None
        try:
            return CudaRegistrar(torch.cuda.current_device())
        except CudaUnavailable as exc:
            log.warning("the arena cannot be registered with CUDA (%s): transfers run at pageable speed", exc)
            return None

    def start_registrar(self, host: HostRegistrar, **options: Any) -> None:
        """Registers the mapped arena's slabs with `host` in the background (`options`: the
        `SlabRegistrar`'s), for every client sharing the mapping (unless it is registered), and
        makes the bounce ring for stores meanwhile."""
        shared = self._shared
        if shared is None or self.tensor is None:
            return
        with _mappings_lock:
            if shared.registrar is None:
                shared.registrar = SlabRegistrar(
                    host, self.tensor.data_ptr(), self.tensor.numel(), self.slab_bytes, **options
                )
                device = getattr(host, "device", None)
                shared.make_ring(device if isinstance(device, int) else None)
                shared.registrar.after_registered(shared.retire_ring)  # unpinned off the transfers' way

    @property
    def registered(self) -> bool:
        """Whether the arena is being registered (its slabs are, or will be, pinned)."""
        return self.registrar is not None

    def transfer_options(
        self, offsets: list[int], on_cuda: bool = True, device: int | None = None
    ) -> TransferOptions | None:
        """None where the pages at `offsets` may move by the kernels' auto rule (their slabs are
        registered, or nothing is registered here); else `UNPINNED`. `on_cuda`: the KV cache is
        on a GPU, `device` (else the CPU moves the pages); a pinned arena's slabs are opened to
        that GPU, or the CPU, first where the mapping did not give it them."""
        registrar = self.registrar
        if registrar is None or not offsets:
            return None
        # Slab 0 too: the kernels tell pinned from pageable memory at the buffer's first byte.
        slabs = registrar.slabs_of(offsets) | {0}
        imported = self._shared.imported if self._shared is not None else None
        if registrar.ready(slabs, self.wait_s):
            if imported is not None:  # None: the CPU moves these pages
                cpu = not on_cuda or kvstore_kernels.backend_name() == "torch"
                gpu = torch.cuda.current_device() if device is None else device
                imported.importer.grant(slabs, None if cpu else gpu)
            return None
        if imported is not None:  # no memory to fall back on
            raise Unavailable(
                f"slabs {sorted(slabs)} of the daemon's pinned arena could not be mapped "
                f"({registrar.stats()['slabs_failed']} failed; see the log): connect again"
            )
        return UNPINNED

    def bounce_for(self, offsets: list[int], page_bytes: int, on_cuda: bool) -> BounceRing | None:
        """The ring a store of whole pages at `offsets` goes through, where their slabs are not
        all registered yet (counted as bounced); None: the store takes `transfer_options`'s way."""
        shared, registrar = self._shared, self.registrar
        if shared is None or registrar is None or not offsets or self.bounce is False:
            return None
        if not on_cuda and self.bounce is None:
            return None
        ring = shared.ring()  # None once every slab is registered (the ring freed at a pause)
        if ring is None or not ring.fits(page_bytes):
            return None
        # Slab 0 too, as transfer_options asks: once it is registered the kernels see a pinned arena.
        return None if registrar.registered_now(registrar.slabs_of(offsets) | {0}) else ring

    def stats(self) -> dict[str, Any]:
        """The registration's progress and the transfers that waited for it or went unpinned."""
        registrar = self.registrar
        return {"mapped": self.tensor is not None, **(registrar.stats() if registrar else {})}

    def unmap(self, streams: Streams | None = None) -> None:
        """Drops this client's use of the mapping; the last user's drop ends its registration once
        no transfer can touch it (those on `streams` and on every device's streams). The mapping
        itself goes when the last tensor viewing it does (closing it under a live view would
        fault)."""
        shared, self._shared = self._shared, None
        fetch, self._fetch = self._fetch, None
        self.tensor = None
        self.epoch = 0
        if shared is None:
            return
        if shared.fetchers is not None and fetch is not None:
            shared.fetchers.remove(fetch)
        with _mappings_lock:
            shared.users -= 1
            last = shared.users == 0
            if last and _mappings.get(shared.key) is shared:
                del _mappings[shared.key]
        if last and shared.registrar is not None:
            if streams is not None:
                streams.synchronize()
            for device in range(torch.cuda.device_count()):  # transfers on the caller's streams too
                torch.cuda.synchronize(device)
            shared.drop_ring(join=True)  # its copies finish first
            if shared.imported is not None:
                shared.imported.importer.close()  # a wait for a slab not pinned yet ends
            shared.registrar.stop()
            shared.registrar = None
