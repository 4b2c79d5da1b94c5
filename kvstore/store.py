"""The store: the page index, two-phase stores and loads under leases, eviction.

Primitives (each a few dict operations; they run on the daemon's event loop):
- `connect(spec)`: register a page spec, returning its namespace.
- `lookup(ns, keys, lease)`: longest committed prefix; a lease pins the hits.
- `reserve(ns, keys)` -> `commit` | `abort`: slots for the keys not stored yet.
- `acquire(ns, lease)` -> `release`: offsets of a load lease's pages, awaited while some are
  still read from disk (`acquire_now`: the same at once when nothing must be waited for, else
  None; a Lookup answers with it).
- `write_leased` / `read_leased`: page bytes of a lease sent inline (Put/Get), checked against
  the lease before every write and read, so a lease that expired mid-stream never touches a
  slot that was handed to someone else.
- `renew(ns, lease_ids)`: a live client's leases last another TTL.
- `pin(ns, keys, ttl)`: keeps the stored prefix of `keys` out of eviction until the TTL ends.
- With a GPU tier (`gpu_placement`): pages move up to it on repeated leased hits or a pin, and
  back down to the CPU tier when it needs room; a load lease reads each page where it is.
- `expire(now)`: leases past their deadline are released, or fenced (store leases written in
  place: their slots are quarantined until the writer is gone); pins and quarantines end.
- `clear(ns)`, `stats()`.

An entry being written is never visible to a lookup. Eviction takes committed,
unpinned pages in policy order, never one the current operation needs, and is
all or nothing: if the space cannot be made, nothing is evicted. It never takes
a page while a page after it in a committed chain is held (a tail without its
head is never hit), unless the policy is a chain-blind baseline replayed as
published. The policy hears of every page an operation uses, in chain order; a
page pinned with `pin` is out of its care until the pin ends. Each tier has its
own policy: a page in the GPU tier is in the GPU tier's policy's care.

A page has an arena slot (`offset`), a GPU slot (`gpu`), or both while it moves
or while a lease that read one copy still holds it; `settle` frees the copy it
no longer needs once no lease holds it and no copy is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, cast

from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvstore.index import (
    AcquireResult,
    Entry,
    LookupResult,
    Namespace,
    NamespaceUsage,
    PinResult,
    ReserveResult,
    StoreStats,
    TierUsage,
)
from kvstore.keys import KEY_BYTES, chunk_keys
from kvstore.leases import Lease, LeaseKind, LeaseTable, Quarantine
from kvstore.peers import Peer
from kvstore.pins import PinLimitExceeded, PinTable
from kvstore.policy import EvictionPolicy
from kvstore.spec import PageSpec
from kvstore.tiers import Tier
from kvstore.tiers.cpu import CpuTier

if TYPE_CHECKING:
    from kvstore.gpu_placement import GpuPlacement
    from kvstore.tiers.disk import DiskTier
    from kvstore.tiers.gpu import GpuTier
    from kvstore.tiers.remote import RemoteTier

log = logging.getLogger(__name__)

MAX_KEYS_PER_REQUEST = 1 << 16
MAX_NAMESPACES = 4096
_CPU = bytes([Tier.CPU])
_DISK = bytes([Tier.DISK])
_REMOTE = bytes([Tier.REMOTE])
PROMOTION_TIMEOUT_S = 10.0
WRITER_CHECK_S = 1.0  # how often a quarantine looks whether its writer is gone
SENDING_FRACTION = 0.25  # of the CPU tier: the most held pinned while the remote tier sends it


class Store:
    def __init__(
        self,
        cpu: CpuTier,
        policy: EvictionPolicy,
        lease_ttl_s: float,
        max_lease_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        pin_fraction: float = 0.1,
        max_pin_ttl_s: float = 86400.0,
        disk: DiskTier | None = None,
        gpu: GpuTier | None = None,
        gpu_policy: EvictionPolicy | None = None,
        promote_after_hits: int = 2,
        remote: RemoteTier | None = None,
        quarantine_s: float = 300.0,
    ) -> None:
        self.cpu = cpu
        self.disk = disk
        self.remote = remote
        self._sending_bytes = 0  # pinned in the arena until the remote tier has sent them
        self.policy = policy
        self.lease_ttl_s = lease_ttl_s
        self.max_lease_ttl_s = max_lease_ttl_s
        self.clock = clock
        self.pin_fraction = pin_fraction
        self.max_pin_ttl_s = max_pin_ttl_s
        self.pins: PinTable[Entry] = PinTable(int(pin_fraction * cpu.capacity))
        self.guard_chains = policy.chain_safe
        self.namespaces: dict[bytes, Namespace] = {}
        self.leases = LeaseTable(max_age_s=max_lease_ttl_s)
        self.quarantine_s = quarantine_s
        self.quarantined: dict[int, Quarantine] = {}  # expired store leases, by id: slots kept from reuse
        self.counters: Counter[str] = Counter()
        self.gpu_placement: GpuPlacement | None = None
        if gpu is not None:
            from kvstore.gpu_placement import GpuPlacement

            self.gpu_placement = GpuPlacement(self, gpu, gpu_policy or type(policy)(), promote_after_hits)

    # -- namespaces ---------------------------------------------------------

    def connect(self, spec: PageSpec, device_pci_bus_id: str = "") -> Namespace:
        if not self.cpu.slots.can_hold(spec.page_bytes):
            raise InvalidArgument(
                f"a page of this spec is {spec.page_bytes} bytes, larger than a CPU-tier slab "
                f"({self.cpu.slots.slab_bytes} bytes): raise tiers.cpu.slab_bytes (and tiers.cpu.bytes) "
                f"or use smaller chunk_tokens"
            )
        ns_id = spec.namespace()
        ns = self.namespaces.get(ns_id)
        if ns is None:
            if len(self.namespaces) >= MAX_NAMESPACES:
                self._forget_empty_namespaces()
            if len(self.namespaces) >= MAX_NAMESPACES:
                raise ResourceExhausted(
                    f"this daemon already serves {MAX_NAMESPACES} namespaces that hold pages; "
                    f"`kvctl clear` some of them"
                )
            ns = self.namespaces[ns_id] = Namespace(ns_id, spec)
        if device_pci_bus_id and self.gpu_placement is not None:
            ns.gpu_pool = self.gpu_placement.gpu.pool_for(device_pci_bus_id)
        return ns

    def _forget_empty_namespaces(self) -> None:
        """Drops namespaces with no pages and no leases; their clients register them again."""
        leased = {lease.namespace for lease in self.leases.all()}
        for ns_id in [n.id for n in self.namespaces.values() if not n.entries and n.id not in leased]:
            del self.namespaces[ns_id]

    def _namespace(self, ns_id: bytes) -> Namespace:
        ns = self.namespaces.get(ns_id)
        if ns is None:
            if len(ns_id) != KEY_BYTES:
                raise InvalidArgument(f"namespace: expected {KEY_BYTES} bytes, got {len(ns_id)}")
            raise NotFound(
                f"namespace {ns_id.hex()} is not registered with this daemon "
                f"(it may have restarted): call Connect with its page spec first"
            )
        return ns

    def _check_keys(self, keys: Sequence[bytes]) -> None:
        if len(keys) > MAX_KEYS_PER_REQUEST:
            raise InvalidArgument(f"keys: {len(keys)} keys in one request; at most {MAX_KEYS_PER_REQUEST}")

    def _ttl(self, ttl_s: float | None) -> float:
        if ttl_s is None or ttl_s == 0:
            ttl_s = self.lease_ttl_s
        if not 0 < ttl_s <= self.max_lease_ttl_s:
            raise InvalidArgument(
                f"lease_ttl_ms: {ttl_s * 1000:.0f} ms is outside 1..{self.max_lease_ttl_s * 1000:.0f} "
                f"(leases.max_ttl_s)"
            )
        return ttl_s

    def _lease(self, ns_id: bytes, lease_id: int, kind: LeaseKind) -> Lease:
        self._namespace(ns_id)
        lease = self.leases.get(lease_id)
        if lease is None or lease.namespace != ns_id:
            raise NotFound(
                f"lease {lease_id} not found in namespace {ns_id.hex()[:12]}: it expired, was already "
                f"released, or belongs to another namespace"
            )
        if lease.kind is not kind:
            verb = "Commit/Abort/Put" if lease.kind is LeaseKind.STORE else "Acquire/Release/Get"
            raise FailedPrecondition(f"lease {lease_id} is a {lease.kind.value} lease: use {verb} with it")
        return lease

    # -- load ---------------------------------------------------------------

    def lookup(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        lease: bool = False,
        ttl_s: float | None = None,
        touch: bool = True,
        gpu_pools: Sequence[int] = (),
    ) -> LookupResult:
        """The longest committed prefix of `keys`; with `lease`, pins it.

        `touch`: the lookup counts as a use of the hit pages for the eviction policy. The daemon
        counts the leased lookup of a load (and the store), not the query before it, so a page
        that is looked up and then loaded counts once.
        `gpu_pools`: the GPU pools the lease's reader has opened; its pages in other pools are
        copied into the arena for it.
        """
        ns = self._namespace(ns_id)
        self._check_keys(keys)
        ttl_s = self._ttl(ttl_s)
        hits: list[Entry] = []
        on_disk: list[bytes] = []  # keys past the CPU-resident prefix found on disk, in order
        disk = self.disk
        for key in keys:
            entry = ns.entries.get(key)
            if entry is not None and (entry.committed or entry.loaded is not None) and not on_disk:
                hits.append(entry)
            elif entry is None and disk is not None and disk.contains(ns.id, key):
                on_disk.append(key)
            else:
                break
        on_remote: list[bytes] = []  # keys past those found with a record in the remote tier, in order
        remote = self.remote
        past = len(hits) + len(on_disk)
        if remote is not None and past < len(keys):
            tail: list[bytes] = []  # up to a key this daemon knows (being stored, or being read in)
            for key in keys[past:]:
                if key in ns.entries:
                    break
                tail.append(key)
            on_remote = tail[: remote.present(ns.id, tail)]
        if lease and (on_disk or on_remote):
            if disk is not None and on_disk:
                self._promote(disk, Tier.DISK, ns, on_disk, hits)
            if remote is not None and on_remote and len(hits) == past:  # the disk part all joined
                self._promote(remote, Tier.REMOTE, ns, on_remote, hits)
            on_disk, on_remote = [], []  # promoted ones joined `hits`; the rest are no longer in the answer
        found = len(hits) + len(on_disk) + len(on_remote)
        self.counters["lookups"] += 1
        self.counters["hit_chunks"] += found
        self.counters["missed_chunks"] += len(keys) - found
        if touch:
            self._tell_hit(self._policy_pages([e for e in hits if e.committed]))
            if disk is not None and found:
                disk.touch(ns.id, keys[:found])
        tiers = bytes(_tier(e) for e in hits) + _DISK * len(on_disk) + _REMOTE * len(on_remote)
        lease_id = 0
        placement = self.gpu_placement
        if lease and hits and placement is not None:
            hits = placement.readable(hits, gpu_pools)
        if lease and hits:
            for entry in hits:
                entry.pins += 1
            load = self.leases.add(ns_id, LeaseKind.LOAD, hits, self.clock() + ttl_s, ttl_s)
            load.gpu_pools = frozenset(gpu_pools)
            lease_id = load.id
            if touch and placement is not None:
                placement.hit(hits)
        return LookupResult(found, tiers, lease_id)

    def _promote(
        self, source: DiskTier | RemoteTier, tier: Tier, ns: Namespace, keys: list[bytes], hits: list[Entry]
    ) -> None:
        """Starts reading `keys` from the disk or remote tier into new CPU slots; they join `hits`,
        the lease's pages.

        Without room for all of them (everything else pinned) none is promoted: the lease covers
        the CPU-resident prefix only. A page that cannot be read ends the prefix at Acquire.
        """
        protected = hits
        try:
            self._make_room(ns, len(keys), protected=protected)
        except ResourceExhausted:
            self.counters["promotions_refused"] += len(keys)
            return
        loop = asyncio.get_running_loop()
        page_bytes = ns.spec.page_bytes
        for key in keys:
            entry = Entry(ns, key, self.cpu.slots.alloc(page_bytes))
            entry.loaded = loop.create_future()
            entry.source = tier
            ns.entries[key] = entry

            def done(page: object, entry: Entry = entry) -> None:
                loop.call_soon_threadsafe(self._promoted, entry, page is not None)

            if not source.submit_read(ns.id, key, done, into=self.cpu.read(entry.offset, page_bytes)):
                self._promoted(entry, False)  # gone meanwhile: the prefix ends before it
                break
            protected.append(entry)
        self.counters["promotions_started"] += len(keys)

    def _promoted(self, entry: Entry, ok: bool) -> None:
        """A promotion finished (on the event loop): the page is committed, or dropped as a miss."""
        ns = entry.namespace
        if ok and not entry.removed:
            entry.committed = True
            ns.pages += 1
            self.policy.stored(self._policy_pages([entry]))
            self.counters["promoted_chunks"] += 1
        else:
            self.counters["promotion_failures"] += 1
            if ns.entries.get(entry.key) is entry:
                del ns.entries[entry.key]
            entry.removed = True
        if entry.loaded is not None and not entry.loaded.done():
            entry.loaded.set_result(ok)
        self.settle(entry)

    async def acquire(self, ns_id: bytes, lease_id: int) -> AcquireResult:
        """Offsets of the lease's leading pages that are in the CPU tier (or a GPU pool its reader
        reads), once the pages still being promoted from disk are in (waited for up to
        PROMOTION_TIMEOUT_S); a page that could not be read ends the ready prefix."""
        lease = self._lease(ns_id, lease_id, LeaseKind.LOAD)
        pending = _pending(lease)
        if pending:
            await asyncio.wait(pending, timeout=PROMOTION_TIMEOUT_S)
            if self.leases.get(lease.id) is not lease:
                raise NotFound(f"lease {lease.id} expired while its pages were read from disk")
        return self._ready(lease)

    def acquire_now(self, ns_id: bytes, lease_id: int) -> AcquireResult | None:
        """`acquire`'s answer if it needs no waiting (no page of the lease is still being read from
        disk or copied into the arena), else None: the reader then calls `acquire`."""
        lease = self._lease(ns_id, lease_id, LeaseKind.LOAD)
        return None if _pending(lease) else self._ready(lease)

    def _ready(self, lease: Lease) -> AcquireResult:
        offsets: list[int] = []
        tiers = bytearray()
        pools: list[int] = []
        readable = lease.gpu_pools
        for entry in lease.entries:
            if entry.gpu >= 0 and not entry.gpu_pending and entry.pool in readable:  # _in_pools, inline
                offsets.append(entry.gpu)
                tiers.append(Tier.GPU)
                pools.append(entry.pool)
            elif entry.committed and entry.cpu_ready:
                offsets.append(entry.offset)
                tiers.append(Tier.CPU)
                pools.append(0)
            else:
                break
        page_bytes = self.namespaces[lease.namespace].spec.page_bytes
        return AcquireResult(offsets, page_bytes, bytes(tiers), tuple(pools))

    def release(self, ns_id: bytes, lease_id: int) -> int:
        lease = self._lease(ns_id, lease_id, LeaseKind.LOAD)
        self.leases.pop(lease_id)
        return self._unpin(lease)

    def _unpin(self, lease: Lease) -> int:
        for entry in lease.entries:
            entry.pins -= 1
            self.settle(entry)
        return len(lease.entries)

    def settle(self, entry: Entry) -> None:
        """Frees the slots an entry no longer needs, once no lease holds it and no copy is in flight:
        both if it left the index, its arena slot if it belongs to the GPU tier."""
        if entry.pins or entry.busy:
            return
        if entry.removed:
            if entry.offset >= 0:
                self.cpu.slots.free(entry.offset)
                entry.offset = -1
            if entry.gpu >= 0 and self.gpu_placement is not None:
                self.gpu_placement.free_slot(entry)
        elif entry.on_gpu and entry.offset >= 0:
            self.cpu.slots.free(entry.offset)
            entry.offset = -1

    # -- store --------------------------------------------------------------

    def reserve(
        self, ns_id: bytes, keys: Sequence[bytes], ttl_s: float | None = None, writer: Peer | None = None
    ) -> ReserveResult:
        """Slots for the keys not stored yet, under one store lease. `writer`: the process that
        writes them in place (the arena), whose slots are fenced if the lease expires; None for a
        client that writes through Put only."""
        ns = self._namespace(ns_id)
        self._check_keys(keys)
        ttl_s = self._ttl(ttl_s)
        present: list[Entry] = []
        new_keys: list[bytes] = []
        seen: set[bytes] = set()
        offsets: list[int] = []
        for i, key in enumerate(keys):
            if key in seen:
                raise InvalidArgument(f"keys[{i}] repeats an earlier key of the same request")
            seen.add(key)
            entry = ns.entries.get(key)
            if entry is None:
                new_keys.append(key)
                offsets.append(0)
            else:
                present.append(entry)
                offsets.append(-1)
        if new_keys:
            self._make_room(ns, len(new_keys), protected=present)
        self.counters["reserves"] += 1
        self.counters["skipped_chunks"] += len(present)
        # Present pages stay recent while the new ones are written; the commit touches them again.
        self._tell_stored(self._policy_pages([e for e in present if e.committed]))
        if not new_keys:
            return ReserveResult(0, offsets)
        entries = []
        for key in new_keys:
            entry = Entry(ns, key, self.cpu.slots.alloc(ns.spec.page_bytes))
            ns.entries[key] = entry
            entries.append(entry)
        slots = iter(entries)
        offsets = [offset if offset < 0 else next(slots).offset for offset in offsets]
        lease = self.leases.add(
            ns_id, LeaseKind.STORE, entries, self.clock() + ttl_s, ttl_s, list(keys), writer
        )
        return ReserveResult(lease.id, offsets)

    def store_lease_offsets(self, ns_id: bytes, lease_id: int) -> AcquireResult:
        """Offsets of a store lease's reserved slots, in key order (for inline Put)."""
        lease = self._lease(ns_id, lease_id, LeaseKind.STORE)
        return AcquireResult(
            [entry.offset for entry in lease.entries], self.namespaces[ns_id].spec.page_bytes
        )

    def begin_put(self, ns_id: bytes, lease_id: int) -> tuple[Lease, AcquireResult]:
        """Claims a store lease for one inline Put; a second concurrent Put is refused."""
        lease = self._lease(ns_id, lease_id, LeaseKind.STORE)
        if lease.writer_active:
            raise FailedPrecondition(f"lease {lease_id}: another Put is already writing its pages")
        lease.writer_active = True
        return lease, self.store_lease_offsets(ns_id, lease_id)

    def end_put(self, lease: Lease, error: str = "") -> None:
        lease.writer_active = False
        if error:
            lease.broken = error

    def write_leased(self, lease: Lease, offset: int, data: memoryview, within: int) -> None:
        """Writes `data` at `within` bytes into the page at `offset`, while `lease` holds it."""
        if self.leases.get(lease.id) is not lease:
            raise NotFound(f"lease {lease.id} expired while its pages were being written")
        self.cpu.write(offset, data, within)

    async def begin_get(self, ns_id: bytes, lease_id: int) -> tuple[Lease, AcquireResult]:
        """A load lease and its pages (`acquire`), for one inline Get."""
        result = await self.acquire(ns_id, lease_id)
        return self._lease(ns_id, lease_id, LeaseKind.LOAD), result

    def read_leased(self, lease: Lease, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` in the arena, while `lease` holds them."""
        if self.leases.get(lease.id) is not lease:
            raise NotFound(f"lease {lease.id} expired while its pages were being read")
        return bytes(self.cpu.read(offset, length))

    def commit(self, ns_id: bytes, lease_id: int) -> int:
        if self._end_quarantine(ns_id, lease_id):  # its writer has finished: it commits after writing
            raise FailedPrecondition(
                f"lease {lease_id} expired before its Commit (the writer did not renew it within its "
                f"TTL, leases.ttl_s): nothing was stored; store the pages again"
            )
        lease = self._lease(ns_id, lease_id, LeaseKind.STORE)
        if lease.broken or lease.writer_active:
            why = lease.broken or "a Put is still writing its pages"
            raise FailedPrecondition(f"lease {lease_id} cannot be committed: {why}; Abort it and store again")
        self.leases.pop(lease_id)
        ns = self.namespaces[ns_id]
        for entry in lease.entries:
            entry.committed = True
        ns.pages += len(lease.entries)
        self._tell_stored(self._policy_pages(self._link(ns, lease.keys)))
        self.counters["stored_chunks"] += len(lease.entries)
        page_bytes = ns.spec.page_bytes
        if self.disk is not None and self.disk.write_through:
            for entry in lease.entries:
                self.disk.submit_write(ns_id, entry.key, bytes(self.cpu.read(entry.offset, page_bytes)))
        if self.remote is not None and self.remote.write_through:
            self._send_remote(ns, lease.entries)
        return len(lease.entries)

    def _send_remote(self, ns: Namespace, entries: Sequence[Entry]) -> None:
        """Hands committed pages to the remote tier. Up to SENDING_FRACTION of the CPU tier at a
        time, a page is sent straight from its arena slot, pinned (not evicted, its slot not
        reused) until its write worker has sent it; past that a copy is handed over instead, so
        a slow server never holds enough of the tier to make a Reserve fail."""
        remote, page_bytes = self.remote, ns.spec.page_bytes
        assert remote is not None
        loop = asyncio.get_running_loop()
        for entry in entries:
            if not remote.accepts(page_bytes):
                continue  # queue full or tier down: dropped (counted), and not copied
            if self._sending_bytes + page_bytes > SENDING_FRACTION * self.cpu.capacity:
                remote.submit_write(ns.id, entry.key, bytes(self.cpu.read(entry.offset, page_bytes)))
                continue
            entry.pins += 1
            self._sending_bytes += page_bytes

            def sent(ok: bool, entry: Entry = entry) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is gone: the daemon is exiting
                    loop.call_soon_threadsafe(self._sent, entry, page_bytes)

            if not remote.submit_write(ns.id, entry.key, self.cpu.read(entry.offset, page_bytes), sent):
                self._sent(entry, page_bytes)

    def _sent(self, entry: Entry, page_bytes: int) -> None:
        """A page sent from its slot (or dropped): its slot is free to go."""
        self._sending_bytes -= page_bytes
        entry.pins -= 1
        self.settle(entry)

    def abort(self, ns_id: bytes, lease_id: int) -> int:
        fenced = self.quarantined.get(lease_id)
        if fenced is not None and self._end_quarantine(ns_id, lease_id):
            return len(fenced.offsets)
        lease = self._lease(ns_id, lease_id, LeaseKind.STORE)
        self.leases.pop(lease_id)
        self._drop_reservation(lease)
        self.counters["aborted_chunks"] += len(lease.entries)
        return len(lease.entries)

    def _drop_reservation(self, lease: Lease) -> None:
        ns = self.namespaces[lease.namespace]
        for entry in lease.entries:
            del ns.entries[entry.key]
            self.cpu.slots.free(entry.offset)

    # -- fencing ------------------------------------------------------------

    def _fence(self, lease: Lease, now: float) -> None:
        """An expired store lease written in place: its pages leave the index (their keys can be
        stored again, into other slots) but its slots stay allocated until its writer is gone, its
        client ends the lease, or leases.quarantine_s passes."""
        ns = self.namespaces[lease.namespace]
        for entry in lease.entries:
            del ns.entries[entry.key]
        offsets = [entry.offset for entry in lease.entries]
        self.quarantined[lease.id] = Quarantine(lease, offsets, ns.spec.page_bytes, now + self.quarantine_s)
        self.counters["fenced_leases"] += 1

    def _end_quarantine(self, ns_id: bytes, lease_id: int) -> bool:
        """Frees the slots of a fenced lease of `ns_id`, if `lease_id` is one; whether it was."""
        fenced = self.quarantined.get(lease_id)
        if fenced is None or fenced.lease.namespace != ns_id:
            return False
        del self.quarantined[lease_id]
        for offset in fenced.offsets:
            self.cpu.slots.free(offset)
        return True

    def _end_quarantines(self, now: float) -> None:
        """Frees the quarantines whose writer is gone or whose time is up."""
        for lease_id, fenced in list(self.quarantined.items()):
            if now < fenced.until:
                if now < fenced.next_check:
                    continue
                fenced.next_check = now + WRITER_CHECK_S
                writer = fenced.lease.writer
                if writer is None or not writer.gone():
                    continue
            writer = fenced.lease.writer
            if now >= fenced.until and writer is not None and writer.pid and not writer.gone():
                log.warning(
                    "lease %d: its writer (pid %d) is alive but stalled for leases.quarantine_s; its %d "
                    "fenced slots are reused now",
                    lease_id,
                    writer.pid,
                    len(fenced.offsets),
                )
            self._end_quarantine(fenced.lease.namespace, lease_id)
            self.counters["quarantines_ended"] += 1

    def renew(self, ns_id: bytes, lease_ids: Sequence[int]) -> list[int]:
        """Gives the live leases among `lease_ids` another TTL from now; returns those renewed."""
        self._namespace(ns_id)
        if len(lease_ids) > MAX_KEYS_PER_REQUEST:
            raise InvalidArgument(
                f"lease_ids: {len(lease_ids)} in one request; at most {MAX_KEYS_PER_REQUEST}"
            )
        now = self.clock()
        renewed = []
        for lease_id in lease_ids:
            lease = self.leases.get(lease_id)
            if lease is not None and lease.namespace == ns_id and self.leases.renew(lease, now):
                renewed.append(lease_id)
        self.counters["renewed_leases"] += len(renewed)
        return renewed

    # -- space --------------------------------------------------------------

    def _policy_pages(self, entries: list[Entry]) -> list[Entry]:
        """The entries in the policies' care: all but those pinned with `pin`."""
        pins = self.pins
        return [entry for entry in entries if entry not in pins] if pins else entries

    def _tell_hit(self, entries: list[Entry]) -> None:
        """Each tier's policy hears of a use of its own pages of `entries`."""
        for policy, pages in self._by_tier(entries):
            policy.hit(pages)

    def _tell_stored(self, entries: list[Entry]) -> None:
        """Each tier's policy hears that its own pages of `entries` are stored."""
        for policy, pages in self._by_tier(entries):
            policy.stored(pages)

    def _by_tier(self, entries: list[Entry]) -> list[tuple[EvictionPolicy, list[Entry]]]:
        """`entries` by the policy in whose care each is: the GPU tier's or the CPU tier's."""
        placement = self.gpu_placement
        if placement is None or not placement.pages:
            return [(self.policy, entries)]
        return [
            (self.policy, [e for e in entries if not e.on_gpu]),
            (placement.policy, [e for e in entries if e.on_gpu]),
        ]

    def _link(self, ns: Namespace, keys: Sequence[bytes]) -> list[Entry]:
        """The committed entries of a chain, in order; each is linked to the one before it."""
        chain: list[Entry] = []
        parent: Entry | None = None
        for key in keys:
            entry = ns.entries.get(key)
            if entry is None or not entry.committed:
                parent = None
                continue
            if entry.parent is None and parent is not None:
                entry.parent = parent
                parent.children += 1
            chain.append(entry)
            parent = entry
        return chain

    def _evictable(self, protected: set[int]) -> Iterator[tuple[int, Entry]]:
        guard = self.guard_chains
        planned: Counter[int] = Counter()  # per parent: its children already offered in this plan
        for item in self.policy.candidates():
            entry = cast(Entry, item)
            if entry.pins or id(entry) in protected or entry.busy:
                continue
            if guard and entry.children and entry.children > planned[id(entry)]:
                continue  # a later page of its chain is held: tails go first
            if entry.parent is not None:
                planned[id(entry.parent)] += 1
            yield entry.offset, entry

    def _make_room(self, ns: Namespace, count: int, protected: list[Entry]) -> None:
        self.make_cpu_room(ns.spec.page_bytes, count, protected)

    def make_cpu_room(self, page_bytes: int, count: int, protected: list[Entry]) -> None:
        """Evicts CPU-tier pages so that `count` slots of `page_bytes` are free; all or nothing."""
        victims = self.cpu.slots.plan_free(page_bytes, count, self._evictable({id(e) for e in protected}))
        if victims is None:
            raise ResourceExhausted(
                f"cannot reserve {count} page(s) of {page_bytes} bytes in the CPU tier "
                f"({self.cpu.capacity} bytes, {self.cpu.bytes_used} in use): every page that could make "
                f"room is pinned by a lease or being written; release leases, wait for them to expire, "
                f"or raise tiers.cpu.bytes"
            )
        for entry in victims:
            self.remove(entry, evicted=True)
        self.counters["evicted_chunks"] += len(victims)

    def remove(self, entry: Entry, evicted: bool = False) -> None:
        """Drop a committed entry from the index; its slot is freed now, or at its last release."""
        ns = entry.namespace
        del ns.entries[entry.key]
        ns.pages -= 1
        if entry.parent is not None:
            entry.parent.children -= 1
        if evicted:
            self.policy.evicted(entry)
            self._demote(entry)
        elif not self.pins.unpin(entry):
            self._policy_of(entry).remove(entry)
        if entry.on_gpu and self.gpu_placement is not None:
            self.gpu_placement.left(entry)
        entry.removed = True
        self.settle(entry)

    def _policy_of(self, entry: Entry) -> EvictionPolicy:
        placement = self.gpu_placement
        return placement.policy if placement is not None and entry.on_gpu else self.policy

    def _demote(self, entry: Entry) -> None:
        """Hands an evicted page to the disk tier, and to the remote tier if it writes behind
        (written behind; dropped, counted, if they lag)."""
        disk, remote, ns = self.disk, self.remote, entry.namespace
        if not entry.committed:
            return
        page_bytes = ns.spec.page_bytes
        to_disk = disk is not None and not disk.contains(ns.id, entry.key)
        to_remote = (
            remote is not None
            and not remote.write_through
            and entry.source is not Tier.REMOTE  # read from there: its record is there
            and remote.accepts(page_bytes)
        )
        if not (to_disk or to_remote):
            return
        page = bytes(self.cpu.read(entry.offset, page_bytes))
        if to_disk and disk is not None and disk.submit_write(ns.id, entry.key, page):
            self.counters["demoted_chunks"] += 1
        if to_remote and remote is not None and remote.submit_write(ns.id, entry.key, page):
            self.counters["demoted_remote_chunks"] += 1

    # -- pins ---------------------------------------------------------------

    def chain_keys(self, ns_id: bytes, token_ids: Sequence[int]) -> list[bytes]:
        """The keys of the full chunks of `token_ids` in this namespace (for a Pin that sends tokens)."""
        ns = self._namespace(ns_id)
        return chunk_keys(ns.id, list(token_ids), ns.spec.chunk_tokens)

    def pin(self, ns_id: bytes, keys: Sequence[bytes], ttl_s: float) -> PinResult:
        """Keeps the stored prefix of `keys` out of eviction for `ttl_s`; pinning again moves the end."""
        ns = self._namespace(ns_id)
        self._check_keys(keys)
        if not 0 < ttl_s <= self.max_pin_ttl_s:
            raise InvalidArgument(
                f"ttl_ms: {ttl_s * 1000:.0f} ms is outside 1..{self.max_pin_ttl_s * 1000:.0f} "
                f"(eviction.max_pin_ttl_s)"
            )
        chain: list[Entry] = []
        for key in keys:
            entry = ns.entries.get(key)
            if entry is None or not entry.committed:
                break
            chain.append(entry)
        page_bytes = ns.spec.page_bytes
        try:
            fresh = self.pins.pin([(entry, page_bytes) for entry in chain], self.clock() + ttl_s)
        except PinLimitExceeded as exc:
            raise ResourceExhausted(
                f"pinning {len(chain)} page(s) would pin {self.pins.bytes + exc.new_bytes} bytes, over "
                f"eviction.pin_fraction ({self.pin_fraction:g}) of the CPU tier ({self.pins.limit_bytes} of "
                f"{self.cpu.capacity} bytes); pin fewer chunks, let other pins expire, or raise "
                f"eviction.pin_fraction"
            ) from None
        for entry in fresh:
            self._policy_of(entry).remove(entry)
        self.counters["pinned_chunks"] += len(fresh)
        if self.gpu_placement is not None:
            self.gpu_placement.promote(chain, protected=chain)
        return PinResult(len(chain), len(self.pins), self.pins.bytes)

    # -- housekeeping -------------------------------------------------------

    def expire(self, now: float | None = None) -> int:
        """Ends leases and pins past their deadline; returns the number of leases."""
        now = self.clock() if now is None else now
        expired = self.leases.pop_expired(now)
        for lease in expired:
            if lease.kind is LeaseKind.LOAD:
                self._unpin(lease)
            elif lease.writer is not None:
                self._fence(lease, now)
            else:
                self._drop_reservation(lease)
        self.counters["expired_leases"] += len(expired)
        if self.quarantined:
            self._end_quarantines(now)
        unpinned = self.pins.pop_expired(now)
        if unpinned:
            self._tell_stored(unpinned)
            self.counters["expired_pins"] += len(unpinned)
        return len(expired)

    def clear(self, ns_id: bytes | None = None) -> int:
        targets = [self._namespace(ns_id)] if ns_id else list(self.namespaces.values())
        cleared = 0
        for ns in targets:
            for entry in [e for e in ns.entries.values() if e.committed]:
                self.remove(entry)
                cleared += 1
        if self.disk is not None:
            cleared += self.disk.clear(ns_id)

        self.counters["cleared_chunks"] += cleared
        return cleared

    def stats(self) -> StoreStats:
        pages = sum(ns.pages for ns in self.namespaces.values())
        tiers = []
        if self.gpu_placement is not None:
            tiers.append(self.gpu_placement.usage())
            pages -= self.gpu_placement.pages
        tiers.append(TierUsage(Tier.CPU.name.lower(), self.cpu.bytes_used, self.cpu.capacity, pages))
        if self.disk is not None:
            disk = self.disk.stats()
            tiers.append(
                TierUsage(
                    "disk", int(disk["bytes_used"]), int(disk["bytes_capacity"]), int(disk["pages"]), disk
                )
            )
        if self.remote is not None:
            used, capacity, keys = self.remote.server_usage()
            tiers.append(TierUsage("remote", used, capacity, keys, self.remote.stats()))
        namespaces = [
            NamespaceUsage(ns.id, ns.spec.model, ns.pages, ns.spec.page_bytes)
            for ns in self.namespaces.values()
        ]
        counters: dict[str, float] = dict(self.counters)
        counters["active_store_leases"] = self.leases.count(LeaseKind.STORE)
        counters["active_load_leases"] = self.leases.count(LeaseKind.LOAD)
        counters["active_leases"] = len(self.leases)
        counters["active_puts"] = sum(1 for lease in self.leases.all() if lease.writer_active)
        counters["quarantined_pages"] = sum(len(q.offsets) for q in self.quarantined.values())
        counters["quarantined_bytes"] = sum(len(q.offsets) * q.page_bytes for q in self.quarantined.values())
        counters["pinned_pages"] = len(self.pins)
        counters["pinned_bytes"] = self.pins.bytes
        counters["namespaces"] = len(self.namespaces)
        if self.remote is not None:
            counters["remote_sending_bytes"] = self._sending_bytes
        return StoreStats(tiers, namespaces, counters)


def _tier(entry: Entry) -> Tier:
    """Where a hit is read from: the GPU tier, the arena, or the disk or remote tier (being read
    into the arena)."""
    if entry.gpu_ready:
        return Tier.GPU
    return Tier.CPU if entry.committed else entry.source


def _pending(lease: Lease) -> list[asyncio.Future[bool]]:
    """The copies a load lease's reader must wait for: pages on their way into the arena."""
    return [
        e.loaded
        for e in lease.entries
        if e.loaded is not None and not e.loaded.done() and not _in_pools(e, lease.gpu_pools)
    ]


def _in_pools(entry: Entry, pools: frozenset[int]) -> bool:
    """Whether a lease's reader reads this page in place in the GPU tier."""
    return entry.gpu_ready and entry.pool in pools
