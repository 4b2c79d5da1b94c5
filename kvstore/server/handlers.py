"""Unary requests -> store calls -> replies: the conversions every transport shares.

Each method takes a request message and the caller (`tenants.Caller`: from the local
channel's socket credentials, or from the token a gRPC call carries) and returns the
reply message, raising a `KVStoreError` (or `ValueError`) for a request that cannot be
served. The gRPC servicer and the local channel call these and nothing else; neither
adds behaviour of its own. `Query` is the local channel's plain Lookup without protobuf.

Each tenant has a store of its own (`stores`, by tenant name; one, "", without tenants):
a call reaches its caller's tenant's store and nothing else, so namespaces, leases and
pages of another tenant cannot even be named. Admins reach every store for Stats, Clear
and Pin (`kvstore.server.tenants`).

Calls that name or hand out arena offsets carry the epoch of the caller's arena
(`ConnectResponse.epoch`): one from another arena is refused with `StaleEpoch` before
anything is done, so a worker still mapping a dead daemon's arena never stores into,
or loads from, the wrong memory.

While the daemon stops (`stopping`), calls that start work (Connect, Lookup,
Reserve, Pin, Clear) are refused as Unavailable, which clients treat as a miss;
calls that finish work in flight (Commit, Abort, Acquire, Release, Renew) are
served, so stores and loads under way complete.

Beside it: replies built from the store's answers (`handlers_replies`), a Put's page bytes
written into its lease (`handlers_pages`), Events streams (`handlers_events`), lent blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence

from kvstore import __version__
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.handlers_events import EVENTS_PER_BATCH, event_message, start_of
from kvstore.server.handlers_lends import lend_reply, lent_reply
from kvstore.server.handlers_pages import get_pages, put_pages
from kvstore.server.handlers_replies import (
    acquire_reply,
    arena_message,
    arena_slab_fds,
    arena_slabs_reply,
    gpu_pools,
    reserve_reply,
)
from kvstore.server.stats import RpcTimings, combined, stats_message
from kvstore.server.tenants import Caller, Tenancy
from kvstore.shared.errors import DAEMON_STOPPING, ArenaWarmingUp, InvalidArgument, StaleEpoch, Unavailable
from kvstore.shared.keys import unpack_keys
from kvstore.shared.peers import Peer, boot_id
from kvstore.shared.wire import QueryReply, QueryRequest, page_spec_of
from kvstore.store.events import MAX_STREAMS, MAX_STREAMS_PER_TENANT, Consumers
from kvstore.store.store import Store

WARMUP_WAIT_S = 10.0  # how long a Reserve waits for the arena's reservation to make room
WARMUP_POLL_S = 0.005


def _ttl(ms: int) -> float | None:
    return ms / 1000 if ms else None


class Handlers:
    def __init__(
        self,
        stores: Mapping[str, Store],
        chunk_tokens: int,
        max_message_bytes: int,
        local_socket: str = "",
        tenancy: Tenancy | None = None,
        max_event_streams: int = MAX_STREAMS,
        max_event_streams_per_tenant: int = MAX_STREAMS_PER_TENANT,
    ) -> None:
        self.stores = dict(stores)
        self.tenancy = tenancy or Tenancy()
        self.chunk_tokens = chunk_tokens
        self.max_message_bytes = max_message_bytes
        self.local_socket = local_socket
        self.started = time.monotonic()
        self.boot_id = boot_id()
        self.stopping = False
        self.serving = False  # the daemon started and is not stopping (readiness)
        self.timings = RpcTimings()  # the calls' latency, fed by both transports
        self.events = next(iter(self.stores.values())).events  # one log, shared by the tenants' stores
        self.consumers = Consumers(max_event_streams, max_event_streams_per_tenant)  # Events streams
        self.counters: Counter[str] = Counter()  # the channels' own figures (Stats adds them)
        self._writers: dict[tuple[int, int], Peer] = {}  # gRPC writers, checked once each
        self._anonymous = self.tenancy.of_token(None)
        self.heap_figures: Callable[[], dict[str, float]] = dict  # the collector's, for Stats (`heap`)

    @property
    def store(self) -> Store:
        """The one store of a daemon without tenants."""
        (store,) = self.stores.values()
        return store

    def _store(self, caller: Caller | None) -> Store:
        """The store of the caller's tenant (an error saying why, if it has none)."""
        return self.stores[self.tenancy.tenant_of(caller or self._anonymous)]

    def _store_with(self, caller: Caller | None, ns_id: bytes) -> Store:
        """The caller's store, or for an admin the store that serves namespace `ns_id`."""
        caller = caller or self._anonymous
        if caller.admin:
            for store in self.stores.values():
                if ns_id in store.namespaces:
                    return store
        return self._store(caller)

    def _check_serving(self) -> None:
        if self.stopping:
            raise Unavailable(f"{DAEMON_STOPPING}; it serves again once restarted")

    @staticmethod
    def _check_epoch(store: Store, epoch: int) -> None:
        """Refuses a call from another arena's epoch (0: the caller names none; not checked)."""
        if epoch == store.cpu.arena.epoch or epoch == 0:
            return
        raise StaleEpoch(
            f"the request is for arena epoch {epoch:#x}, but this daemon's arena is epoch "
            f"{store.cpu.arena.epoch:#x} (the daemon restarted): map the current arena and Connect again"
        )

    def Connect(self, request: pb.ConnectRequest, caller: Caller | None = None) -> pb.ConnectResponse:
        self._check_serving()
        store = self._store(caller)
        ns = store.connect(page_spec_of(request.spec, self.chunk_tokens), request.device_pci_bus_id)
        self.events.name(ns.id, store.tenant, ns.spec.model)
        self.events.prune(store.tenant, store.namespaces)  # those the store forgot to make room
        return pb.ConnectResponse(
            gpu_pools=gpu_pools(store),
            namespace=ns.id,
            chunk_tokens=ns.spec.chunk_tokens,
            page_bytes=ns.spec.page_bytes,
            arena=arena_message(store, self.boot_id),
            epoch=store.cpu.arena.epoch,
            lease_ttl_ms=int(store.settings.lease_ttl_s * 1000),
            max_message_bytes=self.max_message_bytes,
            local_socket=self.local_socket,
            tenant=store.tenant,
            commits_in_parts=True,
            # Issued where the caller is known by its uid, for its gRPC calls.
            credential=self.tenancy.credential(caller) if caller and caller.peer is not None else "",
        )

    def arena_fd(self, caller: Caller | None) -> int:
        """The descriptor of the caller's tenant's sealed arena, which the local channel hands to
        it with its Connect reply (-1: the arena has a path the worker opens itself)."""
        return self._store(caller).cpu.arena.fd

    def ArenaSlabs(
        self, request: pb.ArenaSlabsRequest, caller: Caller | None = None
    ) -> pb.ArenaSlabsResponse:
        """Which slabs of the caller's pinned arena it may map; the local channel sends their
        descriptors with the reply (`arena_slab_fds`), gRPC refuses the call."""
        self._check_serving()
        store = self._store(caller)
        self._check_epoch(store, request.epoch)
        return arena_slabs_reply(store, request, caller.peer if caller is not None else None)

    def arena_slab_fds(self, caller: Caller | None, reply: pb.ArenaSlabsResponse) -> list[int]:
        return arena_slab_fds(self._store(caller), reply)

    def Lookup(self, request: pb.LookupRequest, caller: Caller | None = None) -> pb.LookupResponse:
        self._check_serving()
        store = self._store(caller)
        self._check_epoch(store, request.epoch)
        if request.each:
            if request.lease or request.acquire:
                raise InvalidArgument("Lookup: each answers every key on its own and leases nothing")
            tiers = store.lookup_each(request.namespace, unpack_keys(request.keys))
            leading = next((i for i, tier in enumerate(tiers) if not tier), len(tiers))
            return pb.LookupResponse(hit_chunks=leading, tiers=tiers)
        lease = request.lease
        if request.lent_devices and store.lends:  # lent blocks, where they cover the stored prefix
            lent = lent_reply(store, request, caller)
            if lent is not None:
                return lent
        if lease and request.acquire:  # the Acquire too, when it needs no waiting
            result, ready = store.lookup_acquire(
                request.namespace, unpack_keys(request.keys), _ttl(request.lease_ttl_ms), request.gpu_pools
            )
        else:
            ready = None
            # A query is not a use (touch): the load's leased lookup is; gpu_pools: a lease's reader's.
            keys = unpack_keys(request.keys)
            gpu_pools = request.gpu_pools if lease else ()
            ttl_s = _ttl(request.lease_ttl_ms)
            result = store.lookup(request.namespace, keys, lease, ttl_s, lease, gpu_pools)
        reply = pb.LookupResponse(hit_chunks=result.hit_chunks, tiers=result.tiers, lease_id=result.lease_id)
        if ready is not None:
            reply.acquired.CopyFrom(acquire_reply(ready))
        return reply

    def Query(self, request: QueryRequest, caller: Caller | None = None) -> QueryReply:
        """A Lookup without lease or each, lent blocks counting (`wire.QUERY`): no message built."""
        self._check_serving()
        store = self._store(caller)
        if store.lends:  # lent blocks count: asked the Lookup's way
            reply = self.Lookup(request.as_lookup(), caller)
            return QueryReply(reply.hit_chunks, reply.tiers)
        return QueryReply(*store.query(request.namespace, unpack_keys(request.keys)))

    def Lend(self, request: pb.LendRequest, caller: Caller | None = None) -> pb.LendResponse:
        self._check_serving()
        return lend_reply(self._store(caller), request, caller.peer if caller is not None else None)

    def Lends(self, request: pb.LendsRequest, caller: Caller | None = None) -> pb.LendsResponse:
        lends = self._store(caller).lends
        done = lends.done(request.namespace, request.lend_ids, request.withdraw, request.revoke)
        return pb.LendsResponse(done=done)

    def Returned(self, request: pb.ReturnedRequest, caller: Caller | None = None) -> pb.LeaseResponse:
        lends = self._store(caller).lends
        return pb.LeaseResponse(pages=int(lends.returned(request.namespace, request.read_id, request.unused)))

    def Reserve(
        self, request: pb.ReserveRequest, caller: Caller | None = None
    ) -> pb.ReserveResponse | Awaitable[pb.ReserveResponse]:
        self._check_serving()
        store = self._store(caller)
        self._check_epoch(store, request.epoch)
        writer = None
        if request.epoch:  # the caller writes the slots in place: they are fenced if its lease expires
            peer = caller.peer if caller is not None else None
            writer = peer or self._declared_writer(request.writer_pid, request.writer_start_time)
        keys = unpack_keys(request.keys)
        try:
            result = store.reserve(
                request.namespace, keys, _ttl(request.lease_ttl_ms), writer, request.gpu_bus_id
            )
        except ArenaWarmingUp as exc:  # a daemon just started: the reply waits for its arena
            return self._reserved_later(store, request, keys, writer, exc)
        return reserve_reply(result)

    async def _reserved_later(
        self,
        store: Store,
        request: pb.ReserveRequest,
        keys: Sequence[bytes],
        writer: Peer | None,
        error: ArenaWarmingUp,
    ) -> pb.ReserveResponse:
        """The Reserve once the arena's reservation has made room for it: tried again each time
        more of the arena is reserved, for up to WARMUP_WAIT_S; then the warm-up error."""
        self.counters["reserves_waited_for_arena"] += 1
        deadline = time.monotonic() + WARMUP_WAIT_S
        while True:
            reserved = store.cpu.reserved_bytes
            while store.cpu.reserved_bytes == reserved:
                if time.monotonic() >= deadline or self.stopping:
                    raise error
                await asyncio.sleep(WARMUP_POLL_S)
            self._check_serving()
            self._check_epoch(store, request.epoch)
            try:
                result = store.reserve(
                    request.namespace, keys, _ttl(request.lease_ttl_ms), writer, request.gpu_bus_id
                )
            except ArenaWarmingUp as exc:
                error = exc
                continue
            return reserve_reply(result)

    def _declared_writer(self, pid: int, start_time: int) -> Peer:
        """The gRPC writer `pid` says it is, checked against /proc once per (pid, start time)."""
        writer = self._writers.get((pid, start_time))
        if writer is None:
            if len(self._writers) >= 4096:
                self._writers.clear()
            writer = self._writers[(pid, start_time)] = Peer.declared(pid, start_time)
        return writer

    def Commit(self, request: pb.LeaseRequest, caller: Caller | None = None) -> pb.CommitResponse:
        store = self._store(caller)
        self._check_epoch(store, request.epoch)
        committed = store.commit(request.namespace, request.lease_id, request.commit_count)
        return pb.CommitResponse(committed=committed)

    def Abort(self, request: pb.LeaseRequest, caller: Caller | None = None) -> pb.LeaseResponse:
        return pb.LeaseResponse(pages=self._store(caller).abort(request.namespace, request.lease_id))

    def Acquire(
        self, request: pb.LeaseRequest, caller: Caller | None = None
    ) -> pb.AcquireResponse | Awaitable[pb.AcquireResponse]:
        store = self._store(caller)
        self._check_epoch(store, request.epoch)
        ready = store.acquire_now(request.namespace, request.lease_id)
        if ready is not None:
            return acquire_reply(ready)
        return self._acquired_later(store, request)  # pages still read in from disk: the reply waits

    async def _acquired_later(self, store: Store, request: pb.LeaseRequest) -> pb.AcquireResponse:
        return acquire_reply(await store.acquire(request.namespace, request.lease_id))

    # -- inline page bytes (clients that cannot map the arena) -------------------------------

    async def put(
        self, messages: AsyncIterator[pb.PutRequest], caller: Caller | None = None
    ) -> pb.PutResponse:
        """A Put stream: a PutHeader naming the store lease, then exactly its pages' bytes. Each
        write is checked against the lease (`Store.write_leased`); a Put that fails part-way
        marks the lease broken, so its Commit stores nothing."""
        first = await anext(aiter(messages), None)
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidArgument("Put: the first message must be a PutHeader naming the store lease")
        return await put_pages(self._store(caller), first.header, messages)

    async def get(
        self, request: pb.LeaseRequest, message_bytes: int, caller: Caller | None = None
    ) -> AsyncIterator[bytes]:
        """A load lease's pages in pieces of at most `message_bytes` (`get_pages`)."""
        async for piece in get_pages(self._store(caller), request, message_bytes):
            yield piece

    def Release(self, request: pb.LeaseRequest, caller: Caller | None = None) -> pb.LeaseResponse:
        return pb.LeaseResponse(pages=self._store(caller).release(request.namespace, request.lease_id))

    def Renew(self, request: pb.RenewRequest, caller: Caller | None = None) -> pb.RenewResponse:
        store = self._store(caller)
        self._check_epoch(store, request.epoch)
        return pb.RenewResponse(renewed=store.renew(request.namespace, request.lease_ids))

    def Stats(self, request: pb.StatsRequest, caller: Caller | None = None) -> pb.StatsResponse:
        """An admin (or anyone, without tenants) sees every tenant; a tenant's member its own,
        with its own stream's last event (`event_sequence`), never the daemon's."""
        caller = caller or self._anonymous
        if caller.admin or not self.tenancy.enabled:
            # One remote server serves every tenant's tier: asked once (`combined` counts it once).
            stats = combined(
                [store.stats(server_usage=i == 0) for i, store in enumerate(self.stores.values())]
            )
            stats.counters.update(self.counters)
            stats.counters["event_streams"] = len(self.consumers)
            stats.counters["refused_event_streams"] = self.consumers.refused
            stats.counters["event_names"] = self.events.num_names
            stats.counters["event_wakeups"] = self.events.num_woken
            stats.counters.update(self.heap_figures())
        else:  # a member: its tenant's figures, not the shared remote server's totals
            stats = self._store(caller).stats(server_usage=False)
        stats.counters["event_sequence"] = self.events.last(self._event_stream(caller))
        return stats_message(stats, __version__, time.monotonic() - self.started, self.events.epoch)

    def _event_stream(self, caller: Caller) -> str | None:
        """Whose events the caller follows: its tenant's, or the daemon's (None) for an admin or
        anyone on a daemon without tenants."""
        return None if caller.admin or not self.tenancy.enabled else self.tenancy.tenant_of(caller)

    async def follow(
        self, request: pb.EventsRequest, caller: Caller | None = None
    ) -> AsyncGenerator[pb.EventBatch, None]:
        """The KV events after `request.since` (`kvstore.store.events`) that the caller may see (its
        tenant's stream; an admin's, or anyone's without tenants: the daemon's), in batches,
        until the caller cancels or the daemon stops. Streams are capped (`Consumers`: past a
        cap, ResourceExhausted); one that follows a namespace wakes for that namespace's events
        only."""
        caller = caller or self._anonymous
        tenant = self._event_stream(caller)
        owner = None if caller.admin and self.tenancy.enabled else self.tenancy.tenant_of(caller)
        self.consumers.open(owner)
        try:
            log, only = self.events, request.namespace
            keep = (lambda event: event.namespace == only) if only else None
            cursor, resync = start_of(log, request, tenant)
            while not log.closed:
                batch, cursor = log.read(cursor, EVENTS_PER_BATCH, keep, tenant, resync)
                resync = ""
                if batch:
                    yield pb.EventBatch(events=[event_message(log, event) for event in batch])
                else:
                    await log.wait(cursor, tenant, only)
        finally:
            self.consumers.close(owner)

    def Clear(self, request: pb.ClearRequest, caller: Caller | None = None) -> pb.ClearResponse:
        """One namespace (the caller's tenant's; any, for an admin), or every one (admins only)."""
        self._check_serving()
        if request.namespace:
            store = self._store_with(caller, request.namespace)
            return pb.ClearResponse(pages=store.clear(request.namespace))
        self.tenancy.check_admin(caller or self._anonymous, "Clear of every namespace")
        return pb.ClearResponse(pages=sum(store.clear() for store in self.stores.values()))

    def Pin(self, request: pb.PinRequest, caller: Caller | None = None) -> pb.PinResponse:
        """Pins in the caller's tenant's namespaces (an admin's: any). Pinning again extends a
        pin; only an admin may bring its end closer (a member cannot cut an operator's pin)."""
        self._check_serving()
        if request.keys and request.tokens:
            raise InvalidArgument("Pin: send the chain as keys or as tokens, not both")
        caller = caller or self._anonymous
        store = self._store_with(caller, request.namespace)
        if request.keys:
            keys = unpack_keys(request.keys)
        else:
            keys = store.chain_keys(request.namespace, request.tokens)
        result = store.pin(request.namespace, keys, request.ttl_ms / 1000, shorten=caller.admin)
        chunks, pages, size = result.pinned_chunks, result.pinned_pages, result.pinned_bytes
        return pb.PinResponse(pinned_chunks=chunks, pinned_pages=pages, pinned_bytes=size)
