"""KVStoreClient: a worker's connection to kvstored.

- `lookup(tokens)`: tokens in the longest stored prefix.
- `store(tokens, kv_caches, block_ids)`: Reserve -> gather pages -> Commit (into the arena, or
  with `store_to_gpu` into the daemon's GPU-tier pool on the cache's GPU, device to device).
- `load(tokens, kv_caches, block_ids)`: Lookup(lease) -> Acquire -> scatter -> Release (on the
  daemon's host the Lookup also answers the Acquire when no page must be waited for).

On the daemon's host the client maps the daemon's shared-memory arena and the
kernels read and write pages in place; otherwise (`shared_memory=False`, or a
remote daemon) page bytes travel inline through Put/Get.

A daemon that is down, stopping, restarting or too slow never raises out of
`lookup`, `load` or `store` (or their handles): they count a miss or store
nothing, one warning per outage, one info line when it serves again. The client
connects again by itself, at most every RECONNECT_INTERVAL_S, and after a restart
maps the new arena before it moves a byte: every call that names offsets carries
the epoch of the arena it was made for (`kvstore.server.handlers`). Leases held longer
than a third of their TTL are renewed by a background thread (`LeaseRenewer`).

A worker that needs several namespaces (a hybrid model's KV-cache groups) makes one client with
`connect` and the others with `client.sibling(spec)`: they share one connection, one mapped and
registered arena, the streams and the lease renewal (`session.Link`).

The parts: `connection` (gRPC, the local channel, outages), `arena` (the mapped arena),
`transfers` (streams and the gather/scatter calls), `inline` (Put/Get bytes), `gpu_pools` (the
GPU tier's pools, read in place), and the two paths over them, `stores` and `loads` (`session`
holds the parts a worker's clients share, and names what the paths use). `KVStoreClient` is the
façade: it connects, owns its two paths (`StorePath`, `LoadPath`, each given the client), and
answers lookups, stats and clears itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import kvstore_kernels
from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.channel import LocalChannel
from kvstore.shared.errors import Unavailable
from kvstore.shared.keys import pack_keys
from kvstore.shared.spec import KVSpec
from kvstore.shared.wire import QueryRequest, page_spec_message, stats_to_dict
from kvstore_client.connection import ClientTls, default_address
from kvstore_client.deliveries import HandOver
from kvstore_client.gpu_pools import device_bus_id
from kvstore_client.handles import LoadHandle, StoreHandle
from kvstore_client.lends import LendPath
from kvstore_client.loads import LoadPath
from kvstore_client.routes import LAYERWISE_TRANSFER
from kvstore_client.session import Link
from kvstore_client.stores import StorePath

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
# Runs of a layer-wise load: the first layer, then the rest. Each run is a call whose host
# time the forward waits for where the forward is host-bound (HF eager), so few runs are best
# there; more runs pay only where the copy outlasts the forward (32k tokens; bench/NOTES-ttft.md).
LAYERWISE_RUNS = 2


class KVStoreClient(HandOver):
    def __init__(self, link: Link, spec: KVSpec, name: str) -> None:
        """A client of `spec`'s namespace on `link` (made by `connect`, or shared: `sibling`)."""
        self._link = link
        self.address = link.conn.address
        self.timeout_s = link.timeout_s
        self.name = name or f"pid-{os.getpid()}"
        self._requested_spec = spec
        self._closed = False
        # How a layer-wise load moves each run of layers (with the arena registered), and
        # into how many runs it cuts the layers (`layer_groups`).
        self.layerwise_options = LAYERWISE_TRANSFER
        self.layerwise_runs = LAYERWISE_RUNS
        self._stores = StorePath(self)
        self._loads = LoadPath(self)
        self._lends = LendPath(self)
        link.join(self)

    @classmethod
    def connect(
        cls,
        address: str | None = None,
        spec: KVSpec | None = None,
        *,
        shared_memory: bool | None = None,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        name: str = "",
        pin_arena: bool | None = None,
        local_channel: bool | None = None,
        tls: ClientTls | None = None,
    ) -> KVStoreClient:
        """Connect to kvstored at `address` (default: the default config's unix socket).

        `shared_memory`: None maps the arena when the daemon's is reachable on this host,
        True requires it, False always sends page bytes inline. `pin_arena`: None registers the
        mapped arena with CUDA when a GPU is present (the kernels then move pages at PCIe speed).
        `local_channel`: None sends control calls over the daemon's local channel when the arena is
        mapped (same host), False always uses gRPC. `token` (default: $KVSTORE_TOKEN or the file
        $KVSTORE_TOKEN_FILE names) and `tls` (default: `ClientTls.from_env()`) reach a daemon over TCP.
        A worker that needs other namespaces too makes their clients with `sibling`.
        """
        if spec is None:
            raise ValueError("spec: a KVSpec describing this worker's KV cache is required")
        if token is None:  # $KVSTORE_TOKEN or $KVSTORE_TOKEN_FILE: a token never on a command line
            from kvstore.shared.paths import default_token

            token = default_token()
        link = Link(
            address or default_address(),
            timeout_s,
            token,
            tls if tls is not None else ClientTls.from_env(),
            shared_memory=shared_memory,
            pin_arena=pin_arena,
            local_channel=local_channel,
        )
        return cls(link, spec, name)

    def sibling(self, spec: KVSpec, *, name: str = "") -> KVStoreClient:
        """A client of `spec`'s namespace that shares this client's connection, local channel,
        mapped and registered arena, side streams, GPU pools and lease renewal (and the options
        they were made with): one worker's clients for several namespaces (a hybrid model's
        KV-cache groups) map and pin the arena once.

        It sends Connect for `spec` now and raises what `connect` would. Each client keeps its
        own namespace, spec and page size, and rides out outages as one: after a restart the
        first call of any of them connects all of them again (the arena mapped once) before
        any moves a byte. Closing a client closes only it; the shared parts close with the last.
        `name`: the client name the daemon sees (default: this client's).
        """
        if self._closed:
            raise ValueError("sibling: this client is closed")
        return KVStoreClient(self._link, spec, name or self.name)

    # -- the parts, as tests and benchmarks reach them ----------------------

    @property
    def shared_memory(self) -> bool:
        return self._mapped.tensor is not None

    @property
    def _registered(self) -> bool:
        return self._mapped.registered

    @property
    def _local(self) -> LocalChannel | None:
        return self._conn.local

    @property
    def _rpc(self) -> Any:
        return self._conn.rpc

    # -- connection (a `Member` of the link) --------------------------------

    def connect_request(self) -> pb.ConnectRequest:
        spec = self._requested_spec
        page = spec.page_for(spec.chunk_tokens or spec.block_size)
        return pb.ConnectRequest(
            client_name=self.name,
            spec=page_spec_message(page, chunk_tokens=spec.chunk_tokens or 0),  # 0: the daemon's
            device_pci_bus_id=device_bus_id(),
        )

    def take_reply(self, reply: Any) -> None:
        spec = self._requested_spec
        if reply.chunk_tokens % spec.block_size:
            raise ValueError(
                f"chunk_tokens: the daemon's {reply.chunk_tokens} is not a multiple of "
                f"block_size {spec.block_size}; pass KVSpec(chunk_tokens=...)"
            )
        new_spec = spec.with_chunk_tokens(reply.chunk_tokens)
        namespace = new_spec.page.namespace(reply.tenant)
        if namespace != reply.namespace or new_spec.page.page_bytes != reply.page_bytes:
            raise RuntimeError(
                "the daemon computed another namespace or page size for this spec: "
                "client and daemon run incompatible kvstore versions"
            )
        self.spec = new_spec
        self.namespace: bytes = reply.namespace
        self.page_bytes: int = reply.page_bytes
        self.max_message_bytes: int = reply.max_message_bytes
        self.lease_ttl_s: float = reply.lease_ttl_ms / 1000  # a lease's life when the request names none
        self.commits_in_parts = reply.commits_in_parts
        self._renewer.ttl_s = self.lease_ttl_s

    def close(self) -> None:
        """Closes this client; the parts it shares with its siblings close with the last of them."""
        if not self._closed:
            self._closed = True
            self._link.leave(self)

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- API ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> Any:
        """The engine's KV cache, checked once now: pass what this returns to store/load.

        As with vLLM's `register_kv_caches`, the engine keeps the tensors' storage, shape and
        strides while it uses them; each call then skips checking and fingerprinting every
        layer's tensors (`kvstore_kernels.register`). A bad tensor is a ValueError here.
        """
        return kvstore_kernels.register(self.spec, kv_caches)

    # -- stores and loads (`stores.StorePath`, `loads.LoadPath`) ----------------

    def store(
        self,
        token_ids: Any,
        kv_caches: Any,
        block_ids: Any,
        layers: range | None = None,
        *,
        keys: Sequence[bytes] | None = None,
        tail: bool = False,
    ) -> int:
        """Store the whole chunks of `token_ids` from the KV cache; returns how many were new."""
        return self.store_async(token_ids, kv_caches, block_ids, layers=layers, keys=keys, tail=tail).wait()

    def store_async(
        self,
        token_ids: Any,
        kv_caches: Any,
        block_ids: Any,
        *,
        stream: Any = None,
        layers: range | None = None,
        keys: Sequence[bytes] | None = None,
        tail: bool = False,
    ) -> StoreHandle:
        """Reserve the new chunks and enqueue their gather; `wait()` commits them.

        On CUDA the gather runs on `stream` (default: this client's side stream, which first
        waits for the caller's current stream), so the caller's stream is never blocked.
        With `tail`, the trailing partial chunk of `token_ids` is stored too, as a page of its
        own (keyed by exactly its tokens): the KV cache and block table must then reach to the
        end of that chunk (the positions past the prompt are stored but never served).
        """
        return self._stores.store_async(
            token_ids, kv_caches, block_ids, stream=stream, layers=layers, keys=keys, tail=tail
        )

    def lend(
        self,
        token_ids: Any,
        kv_caches: Any,
        block_ids: Any,
        *,
        keys: Sequence[bytes] | None = None,
        hold_s: float | None = None,
        tail: bool = False,
        meanwhile: Callable[[bytes], Any] | None = None,
        readers: int = 1,
    ) -> tuple[int, int]:
        """Lend the KV-cache blocks of the whole chunks of `token_ids` to workers on other GPUs of
        this host: their loads copy them device to device (prefill to decode). Returns (lend id,
        tokens lent); (0, 0) where the block table covers no chunk.

        Waits for the work queued on the cache's current stream (the KV must be written). The
        caller must keep those blocks unchanged until `lends_done` names the lend: read by a
        worker (`readers` workers: each rank of a TP decode instance reading blocks every rank
        holds alike, such as MLA's latent; at most 16), withdrawn, or `hold_s` (default 30 s)
        passed with no read in flight. Needs the
        local channel and a cache that CUDA IPC can export (not expandable segments).
        `meanwhile(ticket)` runs while the daemon records the lend: hand the ticket to the
        reader (`load_async(lent=ticket)`), which then copies without waiting for the daemon.
        """
        return self._lends.lend(
            token_ids, kv_caches, block_ids, keys=keys, hold_s=hold_s, tail=tail, meanwhile=meanwhile,
            readers=readers,
        )  # fmt: skip

    def lends_done(
        self, lend_ids: Sequence[int], *, withdraw: bool = False, revoke: bool = False
    ) -> list[int]:
        """Those of `lend_ids` whose blocks may be reused now. `withdraw` ends the others as soon
        as no read is in flight (call again to learn when). `revoke` ends them all now (a read in
        flight counts 0 for its reader) and returns them all; where the daemon cannot be reached
        it returns once no read of them can count any more (their hold and a read's TTL)."""
        return self._lends.done(lend_ids, withdraw, revoke)

    def load(
        self,
        token_ids: Any,
        kv_caches: Any,
        block_ids: Any,
        layers: range | None = None,
        *,
        keys: Sequence[bytes] | None = None,
        tail: bool = False,
    ) -> int:
        """Load the longest stored prefix of `token_ids` into the KV cache; returns tokens loaded."""
        return self.load_async(token_ids, kv_caches, block_ids, layers=layers, keys=keys, tail=tail).wait()

    def load_async(
        self,
        token_ids: Any,
        kv_caches: Any,
        block_ids: Any,
        *,
        stream: Any = None,
        layers: range | None = None,
        layerwise: bool = False,
        keys: Sequence[bytes] | None = None,
        tail: bool = False,
        lent: bytes | None = None,
    ) -> LoadHandle:
        """Pin the longest stored prefix and enqueue its scatter; `wait()` releases it.

        `handle.tokens` is what is being loaded: whole chunks, as many as the daemon could
        deliver (a chunk that could not be read back from disk ends the prefix). `wait()`
        returns the number of leading tokens that are valid in the KV cache: that, or 0 if the
        lease lapsed while the pages were read (their slots may have been reused meanwhile).
        With `layerwise`, runs of layers (`layer_groups`: 1, 1, 2, 4, ... layers, at most
        `layerwise_runs` of them) are moved and signalled on their own (`wait_layer(i)`), so a
        forward can start on layer 0 while later layers are still in flight. A daemon that
        cannot be reached gives an empty load (0 tokens, logged), never an exception.
        With `tail`, a stored trailing partial chunk of `token_ids` is loaded too (its whole
        page: the KV cache and block table must reach to the end of that chunk), and the
        tokens count only up to the end of `token_ids`. `lent`: a lender's ticket (`lend`'s
        `meanwhile`): its blocks are copied at once, and count if the daemon's answer, read after
        the copy, is a read of that lend that held; else 0 (load again from the tiers).
        """
        return self._loads.load_async(
            token_ids,
            kv_caches,
            block_ids,
            stream=stream,
            layers=layers,
            layerwise=layerwise,
            keys=keys,
            tail=tail,
            lent=lent,
        )

    def lookup(self, token_ids: Any, *, keys: Sequence[bytes] | None = None, tail: bool = False) -> int:
        """Number of leading tokens whose KV is stored: a multiple of chunk_tokens, or with
        `tail` every token of `token_ids` when its trailing partial chunk was stored too
        (`store(..., tail=True)`).

        A daemon that cannot be reached counts as a miss (logged), as it does for `load` and
        `store`: the worker recomputes rather than fails. `keys`: `self.keys(token_ids)` where
        the caller already has them (here and in `store_async` and `load_async`, where
        `token_ids` may then be None: the keys alone name the chunks).
        """
        return self._covered(token_ids, self.lookup_chunks(self._keys_of(token_ids, keys, tail)))

    def lookup_chunks(self, keys: Sequence[bytes]) -> int:
        """How many leading chunks of `keys` (any run of consecutive chunk keys, not only from the
        first chunk of a prompt) are stored; 0 when the daemon cannot be reached (logged)."""
        if not keys:
            return 0
        try:
            # A Query (a Lookup with no message built); lent blocks count too: a worker's load copies them.
            reply = self._conn.call("Query", lambda: QueryRequest(self.namespace, pack_keys(keys)))
        except Unavailable:
            return 0
        hit: int = reply.hit_chunks
        return hit

    def lookup_each(self, keys: Sequence[bytes]) -> bytes:
        """The tier of each of `keys` on its own (a byte per key, 0 where it is not stored):
        for pages that need not form a prefix, such as the chunk boundaries whose recurrent
        state is stored. All zeros when the daemon cannot be reached (logged)."""
        if not keys:
            return b""
        try:
            reply = self._conn.call(
                "Lookup",
                lambda: pb.LookupRequest(namespace=self.namespace, keys=pack_keys(keys), each=True),
            )
        except Unavailable:
            return bytes(len(keys))
        tiers: bytes = reply.tiers
        return tiers if len(tiers) == len(keys) else bytes(len(keys))

    def stats(self) -> dict[str, Any]:
        """The daemon's stats, and under "client" this worker's: the arena's registration with
        CUDA (slabs registered, pending, failed) and the transfers that waited for it (how many,
        seconds in all) or took the unpinned path."""
        stats = stats_to_dict(self._conn.call("Stats", pb.StatsRequest))
        stats["client"] = {"arena": self._mapped.stats()}
        return stats

    def clear(self) -> int:
        """Drop every page of this client's namespace; returns how many."""
        pages: int = self._conn.call("Clear", lambda: pb.ClearRequest(namespace=self.namespace)).pages
        return pages
