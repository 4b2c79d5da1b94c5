"""The tiers below the arena, disk then remote, behind the few calls the store makes of them.

The store keeps the index of the pages in memory. Past the arena's prefix, a Lookup asks here
which of the next keys the lower tiers hold; a promotion reads them into arena slots; a page
the store commits is written through where a tier asks for that, and a page it evicts is
written behind. Each tier moves its own bytes on its own threads; nothing here waits.

- `find(ns, keys) -> list[Run]`: the keys the disk tier holds, then those the remote tier
  holds after them, each run in chain order; the runs end at a key the index knows (being
  stored, or being read in).
- `promote(ns, runs, hits)`: a leased Lookup's runs are read into new arena slots (all of a
  run or none of it, as room allows); their entries join the lease and commit as they land.
- `committed(ns, entries)`: write-through. The remote tier sends a page straight from its
  arena slot, pinned until sent, up to SENDING_FRACTION of the CPU tier; past that a copy.
- `touch(ns, keys)`, `clear(ns)` (this daemon's disk; never the shared remote server),
  `usage()`, `figures()`.
- The disk tier's notices (a record indexed or dropped, from its threads) become KV events.

`WriteBehind(cpu, disk, remote, counters).evicted(entry)`: where the CPU tier's victims go, to
each tier that does not hold the page yet. The store builds it first and gives it to the
eviction (`Eviction.demote`), then gives `LowerTiers` the eviction: nothing is set on either
afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvstore.shared.domain import Tier
from kvstore.shared.errors import ResourceExhausted
from kvstore.store.events import EventKind
from kvstore.store.eviction import Eviction
from kvstore.store.index import Entry, Namespace, TierUsage, server_totals
from kvstore.tiers.codec import Buffer
from kvstore.tiers.cpu import CpuTier

if TYPE_CHECKING:
    from kvstore.tiers.disk import DiskTier
    from kvstore.tiers.remote import RemoteTier

ReadDone = Callable[[Buffer | None], None]
SENDING_FRACTION = 0.25  # of the CPU tier: the most held pinned while the remote tier sends it


class LowerTier(Protocol):
    """What the store reads of a lower tier (`DiskTier`, `RemoteTier`)."""

    medium: Tier

    def submit_read(
        self, namespace: bytes, key: bytes, done: ReadDone, into: memoryview | None = None
    ) -> bool: ...


Run = tuple[LowerTier, list[bytes]]  # a tier and the keys it holds, in chain order


class LowerTiers:
    def __init__(
        self,
        cpu: CpuTier,
        disk: DiskTier | None,
        remote: RemoteTier | None,
        eviction: Eviction,
    ) -> None:
        self.cpu = cpu
        self.disk = disk
        self.remote = remote
        self.eviction = eviction
        self.counters = eviction.counters
        self._sending_bytes = 0  # pinned in the arena until the remote tier has sent them
        if disk is not None:
            disk.listen(self._disk_told)

    def _disk_told(self, stored: bool, ident: tuple[bytes, bytes], reason: str) -> None:
        """A disk record indexed or dropped, as a KV event."""
        kind = EventKind.STORED if stored else EventKind.REMOVED
        self.eviction.events.add(kind, Tier.DISK, ident[0], ident[1], b"", reason)

    def find(self, ns: Namespace, keys: Sequence[bytes]) -> list[Run]:
        known = ns.entries
        unknown: list[bytes] = []
        for key in keys:
            if key in known:
                break
            unknown.append(key)
        runs: list[Run] = []
        for tier in (self.disk, self.remote):
            if tier is None or not unknown:
                continue
            found = tier.present(ns.id, unknown)
            if found:
                runs.append((tier, unknown[:found]))
                unknown = unknown[found:]
        return runs

    def tier_of(self, ns: Namespace, key: bytes) -> int:
        """The lower tier holding `key` (`Tier.NONE`: neither)."""
        for tier in (self.disk, self.remote):
            if tier is not None and tier.present(ns.id, [key]):
                return int(tier.medium)
        return 0

    # -- up ------------------------------------------------------------------

    def promote(self, ns: Namespace, runs: list[Run], hits: list[Entry]) -> None:
        """Starts reading the runs' pages into new arena slots; they join `hits`, a load lease's
        pages, each run only if every page before it joined."""
        for source, keys in runs:
            if not self._promote(source, ns, keys, hits):
                break

    def _promote(self, source: LowerTier, ns: Namespace, keys: list[bytes], hits: list[Entry]) -> bool:
        """Without room for all of `keys` (everything else pinned) none is promoted: the lease
        covers the prefix before them. A page that cannot be read ends the prefix at Acquire."""
        page_bytes = ns.spec.page_bytes
        try:
            self.eviction.make_cpu_room(page_bytes, len(keys), protected=hits)
        except ResourceExhausted:
            self.counters["promotions_refused"] += len(keys)
            return False
        loop = asyncio.get_running_loop()
        self.counters["promotions_started"] += len(keys)
        ns.make_room(len(keys))
        for key in keys:
            entry = ns.new_entry(key, self.cpu.slots.alloc(page_bytes))
            entry.loaded = loop.create_future()
            entry.source = source.medium
            ns.entries[key] = entry  # (a `Tiering`: in `ns.unplain`)

            def done(page: object, entry: Entry = entry) -> None:
                loop.call_soon_threadsafe(self._promoted, entry, page is not None)

            if not source.submit_read(ns.id, key, done, into=self.cpu.read(entry.offset, page_bytes)):
                self._promoted(entry, False)  # gone meanwhile: the prefix ends before it
                return False
            hits.append(entry)
        return True

    def _promoted(self, entry: Entry, ok: bool) -> None:
        """A promotion finished (on the event loop): the page is committed, or dropped as a miss."""
        ns = entry.namespace
        if ok and not entry.removed:
            entry.committed = True
            ns.pages += 1
            self.eviction.policy.stored(self.eviction.policy_pages([entry]))
            self.counters["promoted_chunks"] += 1
            parent = entry.parent.key if entry.parent is not None else b""
            self.eviction.events.add(EventKind.STORED, Tier.CPU, ns.id, entry.key, parent, "promoted")
        else:
            self.counters["promotion_failures"] += 1
            if ns.entries.get(entry.key) is entry:
                del ns.entries[entry.key]
                ns.unplain.discard(entry.key)
            entry.removed = True
        if entry.loaded is not None and not entry.loaded.done():
            entry.loaded.set_result(ok)
        self.eviction.settle(entry)

    def touch(self, ns: Namespace, keys: Sequence[bytes]) -> None:
        """The pages of `keys` were used now (the disk tier's own eviction order)."""
        if self.disk is not None:
            self.disk.touch(ns.id, keys)

    # -- down ---------------------------------------------------------------

    def committed(self, ns: Namespace, entries: Sequence[Entry]) -> None:
        """Writes committed pages through to the tiers that ask for every page."""
        disk, remote, page_bytes = self.disk, self.remote, ns.spec.page_bytes
        if disk is not None and disk.write_through:
            for entry in entries:
                disk.submit_write(ns.id, entry.key, self.cpu.read(entry.offset, page_bytes))
        if remote is not None and remote.write_through:
            self._send(remote, ns, entries)

    def _send(self, remote: RemoteTier, ns: Namespace, entries: Sequence[Entry]) -> None:
        """Hands committed pages to the remote tier: from their arena slots, pinned until sent,
        while less than SENDING_FRACTION of the CPU tier is held so; a copy past that, so that
        a slow server never holds enough of the tier to make a Reserve fail."""
        page_bytes = ns.spec.page_bytes
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
        self.eviction.settle(entry)

    # -- housekeeping -------------------------------------------------------

    def clear(self, ns_id: bytes | None) -> int:
        """Clears this daemon's disk tier (of one namespace, or all); the remote server is shared."""
        return self.disk.clear(ns_id) if self.disk is not None else 0

    def usage(self, server_usage: bool = True) -> list[TierUsage]:
        tiers = []
        if self.disk is not None:
            disk = self.disk.stats()
            used, capacity, pages = (int(disk[name]) for name in ("bytes_used", "bytes_capacity", "pages"))
            tiers.append(TierUsage("disk", used, capacity, pages, disk))
        if self.remote is not None:
            nodes = self.remote.node_usage() if server_usage else []
            used, capacity, keys = server_totals(nodes)
            tiers.append(TierUsage("remote", used, capacity, keys, self.remote.stats(), tuple(nodes)))
        return tiers

    def figures(self) -> dict[str, float]:
        return {"remote_sending_bytes": self._sending_bytes} if self.remote is not None else {}


class WriteBehind:
    """The CPU tier's victims, written behind to the tiers below it; the eviction's `demote`."""

    def __init__(
        self, cpu: CpuTier, disk: DiskTier | None, remote: RemoteTier | None, counters: Counter[str]
    ) -> None:
        self.cpu = cpu
        self.disk = disk
        self.remote = remote
        self.counters = counters

    def evicted(self, entry: Entry) -> None:
        """Writes an evicted page behind to the disk tier, and to the remote tier unless it writes
        through or the page came from there (dropped, counted, when they lag)."""
        disk, remote, ns = self.disk, self.remote, entry.namespace
        page_bytes = ns.spec.page_bytes
        to_disk = disk is not None and not disk.contains(ns.id, entry.key)
        to_remote = (
            remote is not None
            and not remote.write_through
            and entry.source is not Tier.REMOTE
            and remote.accepts(page_bytes)
        )
        if not (to_disk or to_remote):
            return
        page = bytes(self.cpu.read(entry.offset, page_bytes))
        if to_disk and disk is not None and disk.submit_write(ns.id, entry.key, page):
            self.counters["demoted_chunks"] += 1
        if to_remote and remote is not None and remote.submit_write(ns.id, entry.key, page):
            self.counters["demoted_remote_chunks"] += 1
