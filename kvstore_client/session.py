"""What one worker's clients share, and what a client's store and load paths use of it.

- `Link`: the parts a worker's clients for several namespaces share (`KVStoreClient.sibling`):
  the connection (gRPC and the local channel), the mapped arena and its CUDA registration, the
  side streams, the GPU pools and the lease renewer. `handshake()` (at connect, and from the
  connection in an outage) sends Connect for every member's spec, mapping a new arena once for
  all of them, so every namespace is registered with the daemon before any member moves a byte.
  The parts close when the last member leaves.
- `Session`: a client's namespace (spec, namespace id, page size) and its link's parts under the
  names the store and load paths (`stores`, `loads`) use, and a few checks. `KVStoreClient`
  (`client`) makes it; this class only names what it holds.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.domain import PINNED_PREFIX
from kvstore.shared.errors import KVStoreError, Unavailable
from kvstore.shared.keys import chunk_keys
from kvstore.shared.peers import boot_id, process_start_time
from kvstore.shared.spec import KVSpec
from kvstore_client.arena import MappedArena
from kvstore_client.connection import ClientTls, Connection, is_outage
from kvstore_client.gpu_pools import GpuPools
from kvstore_client.lent import LentCaches
from kvstore_client.renewal import LeaseRenewer
from kvstore_client.transfers import Streams

log = logging.getLogger("kvstore_client.client")

# Passes of a handshake over every member before it gives up: a pass that met a daemon other than
# the one its first Connect met (a restart in between) is made again.
HANDSHAKE_PASSES = 3


def ignore(exc: BaseException) -> None:
    pass


class Member(Protocol):
    """A client of one namespace on a `Link`."""

    def connect_request(self) -> pb.ConnectRequest:
        """The Connect that registers this member's spec."""

    def take_reply(self, reply: Any) -> None:
        """Checks the daemon's reply to that Connect and keeps its namespace, page size and
        limits; raises before it keeps anything."""


class Link:
    def __init__(
        self,
        address: str,
        timeout_s: float,
        token: str | None,
        tls: ClientTls | None,
        *,
        shared_memory: bool | None,
        pin_arena: bool | None,
        local_channel: bool | None,
    ) -> None:
        self.timeout_s = timeout_s
        self.want_local_channel = local_channel
        self.mapped = MappedArena(shared_memory, pin_arena)
        self.writer = (os.getpid(), process_start_time(os.getpid()) or 0)
        self.streams = Streams()
        self.gpu_pools = GpuPools(None, {})
        self.lent = LentCaches()  # lenders' KV caches this process opened (lent blocks read here)
        self.renewer = LeaseRenewer(self._renew)
        self.closed = False
        self._members: list[weakref.ref[Member]] = []  # in the order they joined
        self._lock = threading.Lock()
        # The (epoch, arena identity) of the last Connect reply taken: a later member's reply that
        # names the same arena leaves the mapping as it is.
        self._seen: tuple[int, tuple[int, int]] | None = None
        self.conn = Connection(address, timeout_s, token, self.handshake, self.drop_arena, tls)

    def members(self) -> list[Member]:
        with self._lock:
            live = [member for ref in self._members if (member := ref()) is not None]
            self._members = [weakref.ref(member) for member in live]
        return live

    def join(self, member: Member) -> None:
        """Adds `member` and connects every member (it last); on failure it is not a member."""
        with self._lock:
            self._members.append(weakref.ref(member))
        try:
            self.handshake()
        except BaseException:
            self.leave(member)
            raise

    def leave(self, member: Member) -> None:
        """Removes `member`; the last one to leave closes the shared parts."""
        with self._lock:
            self._members = [ref for ref in self._members if ref() not in (None, member)]
            last = not self._members
        if last and not self.closed:
            self.close()

    # -- connecting -----------------------------------------------------------

    def handshake(self) -> None:
        """Connects every member, the arena mapped at most once (again only where the daemon's is
        another); raises what the first failed Connect raised."""
        for _ in range(HANDSHAKE_PASSES):
            first_seen = None
            for index, member in enumerate(self.members()):
                self._register(member, first=index == 0)
                first_seen = first_seen or self._seen
            if first_seen is None or self._seen == first_seen:
                self.conn.serving(self._seen[0] if self._seen else 0)
                return
        raise Unavailable(f"kvstored at {self.conn.address} restarted during every connect; trying again")

    def _register(self, member: Member, first: bool) -> None:
        """One member's Connect; then the shared parts follow the reply (`_attach`)."""
        conn = self.conn
        request = member.connect_request()
        if self.want_local_channel is not False and conn.local is None and not conn.has_token:
            from kvstore.shared.paths import (
                local_socket_of,  # not at import: `import kvstore_client` stays light
            )

            # Connect where the daemon knows this process by its uid (its tenant), when it can.
            conn.open_local(local_socket_of(conn.address))
        reply = conn.rpc("Connect", request)
        connected_locally = conn.local is not None
        handed = conn.local.take_fd() if conn.local is not None else None
        try:
            # Checked before anything is kept: a daemon restarted with an incompatible config
            # leaves the member as it was (and in an outage, when it connects again).
            member.take_reply(reply)
            self._attach(request, reply, connected_locally, handed, first)
        finally:
            if handed is not None:
                os.close(handed)

    def _attach(
        self, request: Any, reply: Any, connected_locally: bool, handed: int | None, first: bool
    ) -> None:
        """Maps the arena a Connect reply names (from `handed` if it is sealed) unless it is mapped
        already, and opens the local channel."""
        identity = (reply.arena.device, reply.arena.inode)
        seen = (reply.epoch, identity)
        mapped = self.mapped
        # A daemon without epochs (epoch 0) cannot prove its arena unchanged: the first member of
        # a handshake maps it again; the others' replies name the same arena.
        if (first or seen != self._seen) and (
            not reply.epoch
            or reply.epoch != mapped.epoch
            or identity != mapped.identity
            or mapped.tensor is None
        ):
            self.renewer.forget()  # leases of another daemon
            self.gpu_pools.close()
            fetch = None
            if reply.arena.shm_path.startswith(PINNED_PREFIX) and self.want_local_channel is not False:
                self.conn.open_local(reply.local_socket)  # a pinned arena's slabs come over it
                if self.conn.local is not None:
                    fetch = functools.partial(self._arena_slabs, reply.epoch)
            mapped.map(reply.arena, identity, self.streams, handed, epoch=reply.epoch, fetch=fetch)
            mapped.identity = identity
            mapped.epoch = reply.epoch if mapped.tensor is not None else 0
            if mapped.tensor is not None:  # same host: the GPU tier's pools can be opened too
                self.gpu_pools = GpuPools.open(reply.gpu_pools)
        self._seen = seen
        # Same host: the arena is mapped, or it is a pinned one of this boot that this client
        # chose not to map (an engine's scheduler, which moves no bytes, still asks locally).
        here = bool(reply.arena.boot_id) and reply.arena.boot_id == boot_id()
        pinned_here = here and reply.arena.shm_path.startswith(PINNED_PREFIX)
        same_host = self.want_local_channel is not False and (mapped.tensor is not None or pinned_here)
        self.conn.open_local(reply.local_socket if same_host else "")
        if self.conn.local is not None and not connected_locally:
            self.conn.check_local(request, reply.namespace)
        self.conn.use_credential(reply.credential)

    def _arena_slabs(self, epoch: int, first: int, count: int) -> list[int]:
        """Descriptors of the pinned arena's slabs first.. that the daemon has pinned (from the
        registration thread; none where the reply came without them: asked again)."""
        local = self.conn.local
        if local is None:
            raise Unavailable("the daemon's local channel is closed: the pinned arena's slabs come over it")
        request = pb.ArenaSlabsRequest(epoch=epoch, first=first, count=count)
        for _ in range(3):  # the daemon sends none while replies wait unread: asked again at once
            reply, fds = local.call_with_fds("ArenaSlabs", request)
            if len(fds) == reply.count:
                return fds
            for fd in fds:
                os.close(fd)
        return []

    def drop_arena(self) -> None:
        """The daemon is gone: its leases and arena with it."""
        self.renewer.forget()
        self.gpu_pools.close()
        self.gpu_pools = GpuPools(None, {})
        self.mapped.unmap(self.streams)
        self.mapped.identity = None
        self._seen = None

    def _renew(self, lease_ids: Sequence[int]) -> Sequence[int]:
        """Renews leases on the daemon (from the renewal thread), one call per namespace; returns
        those still held."""
        renewed: list[int] = []
        for namespace, ids in self.renewer.by_namespace(lease_ids).items():
            request = pb.RenewRequest(namespace=namespace, lease_ids=ids, epoch=self.mapped.epoch)
            renewed.extend(self.conn.rpc("Renew", request).renewed)
        return renewed

    def close(self) -> None:
        self.closed = True
        self.renewer.stop()
        self.conn.close_local()
        self.gpu_pools.close()
        self.lent.close()
        self.mapped.unmap(self.streams)
        self.conn.close()


class Session:
    spec: KVSpec
    namespace: bytes
    page_bytes: int
    commits_in_parts: bool = False  # the daemon commits a store lease in parts (LeaseRequest.commit_count)
    max_message_bytes: int
    lease_ttl_s: float
    timeout_s: float
    layerwise_options: Any
    layerwise_runs: int
    _lends: Any  # kvstore_client.lends.LendPath: lends, and reads of lent blocks
    # Whether a store asks to land its new pages in the daemon's GPU pool on the KV cache's
    # device (written there device to device, read in place by workers on that GPU or, over
    # peer access, on another GPU of the host: a prefill instance handing a prompt to a decode
    # instance). The daemon answers with the arena where the pool has no room; a client
    # without that pool open (no GPU tier, or a device it cannot see) always stores to the arena.
    store_to_gpu: bool = False
    _link: Link

    # -- the link's parts ----------------------------------------------------

    @property
    def _conn(self) -> Connection:
        return self._link.conn

    @property
    def _mapped(self) -> MappedArena:
        return self._link.mapped

    @property
    def _streams(self) -> Streams:
        return self._link.streams

    @property
    def _renewer(self) -> LeaseRenewer:
        return self._link.renewer

    @property
    def _gpu_pools(self) -> GpuPools:
        return self._link.gpu_pools

    @property
    def _writer(self) -> tuple[int, int]:
        return self._link.writer

    @property
    def arena(self) -> torch.Tensor | None:
        """The daemon's arena mapped here, as uint8 (None: page bytes go inline)."""
        return self._mapped.tensor

    @property
    def epoch(self) -> int:
        """The mapped arena's epoch (0: none mapped)."""
        return self._mapped.epoch

    def keys(self, token_ids: Any, *, tail: bool = False) -> list[bytes]:
        """Keys of the whole chunks of `token_ids`; with `tail`, then of the trailing partial
        chunk, keyed by exactly its tokens (it matches only the same tail after the same prefix)."""
        return chunk_keys(self.namespace, token_ids, self.spec.page.chunk_tokens, include_partial=tail)

    def _keys_of(self, token_ids: Any, keys: Sequence[bytes] | None, tail: bool = False) -> Sequence[bytes]:
        """The chunks' keys: `keys` (the caller's, the first ones when it has more; all of them
        where `token_ids` is None: the keys alone name the chunks), or hashed. With `tail`, a
        trailing partial chunk of `token_ids` counts as a chunk."""
        if keys is None:
            if token_ids is None:
                raise ValueError("token_ids: None needs keys, one per chunk")
            return self.keys(token_ids, tail=tail)
        if token_ids is None:
            return keys
        chunk_tokens = self.spec.page.chunk_tokens
        chunks = len(token_ids) // chunk_tokens
        kind = "whole chunks"
        if tail and len(token_ids) % chunk_tokens:
            chunks, kind = chunks + 1, "chunks (the tail's included)"
        if len(keys) < chunks:
            raise ValueError(f"keys: {len(keys)} keys for {chunks} {kind} of token_ids")
        return keys[:chunks]

    def _covered(self, token_ids: Any, chunks: int) -> int:
        """Tokens of `token_ids` that its first `chunks` chunks hold (a tail holds fewer than a
        chunk); without `token_ids`, whole chunks."""
        tokens = chunks * self.spec.page.chunk_tokens
        return tokens if token_ids is None else min(tokens, len(token_ids))

    def _layer_range(self, layers: range | None) -> range:
        if layers is None:
            return range(self.spec.num_layers)
        if not isinstance(layers, range) or layers.step != 1:
            raise ValueError(f"layers: expected a range with step 1, got {layers!r}")
        if not 0 <= layers.start <= layers.stop <= self.spec.num_layers:
            raise ValueError(f"layers: {layers!r} is outside 0..{self.spec.num_layers} engine layers")
        return layers

    def _end_quietly(self, method: str, lease: pb.LeaseRequest) -> bool:
        """Ends a lease (Abort or Release); whether the daemon did. A failure is logged only: the
        lease expires on its own, and the caller's own error matters more."""
        self._renewer.drop(lease.lease_id)
        if lease.epoch != self.epoch:
            return False  # the daemon that held it is gone
        try:
            self._conn.rpc(method, lease)
            return True
        except Exception as exc:
            quiet = isinstance(exc, KVStoreError) and is_outage(exc)
            log.log(
                logging.DEBUG if quiet else logging.WARNING,
                "%s of lease %d failed: %s",
                method,
                lease.lease_id,
                exc,
            )
            return False
