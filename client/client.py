"""KVStoreClient: a worker's connection to kvstored.

- `lookup(tokens)`: tokens in the longest stored prefix.
- `store(tokens, kv_caches, block_ids)`: Reserve -> gather pages -> Commit.
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
the epoch of the arena it was made for (`kvstore.handlers`). Leases held longer
than a third of their TTL are renewed by a background thread (`LeaseRenewer`).

The parts: `connection` (gRPC, the local channel, outages), `arena` (the mapped arena),
`transfers` (streams and the gather/scatter calls), `inline` (Put/Get bytes), `gpu_pools` (the
GPU tier's pools, read in place), and the two paths over them, `stores` and `loads` (`session`
names what they share). `KVStoreClient` is the façade: it connects, makes the parts, and
answers lookups, stats and clears itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import kvstore_kernels
from kvstore.channel import LocalChannel
from kvstore.errors import Unavailable
from kvstore.keys import pack_keys
from kvstore.peers import process_start_time
from kvstore.proto import kvstore_pb2 as pb
from kvstore.spec import KVSpec
from kvstore.wire import page_spec_message, stats_to_dict
from kvstore_client.arena import MappedArena
from kvstore_client.connection import ClientTls, Connection, default_address
from kvstore_client.gpu_pools import GpuPools, device_bus_id
from kvstore_client.loads import LoadPath
from kvstore_client.renewal import LeaseRenewer
from kvstore_client.stores import StorePath
from kvstore_client.transfers import Streams

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
# How a layer-wise load moves each run of layers: the auto rule (its staged path). The Triton
# kernel reading the arena issues faster (one launch per run, against a copy and a launch per
# page) but moves the hf layout's 4 KiB rows at a fraction of the link's rate: about as soon
# to the first token at 8k tokens, far later at 32k (bench/NOTES-ttft.md).
LAYERWISE_TRANSFER = kvstore_kernels.TransferOptions()
# Runs of a layer-wise load: the first layer, then the rest. Each run is a call whose host
# time the forward waits for where the forward is host-bound (HF eager), so few runs are best
# there; more runs pay only where the copy outlasts the forward (32k tokens).
# bench/NOTES-ttft.md.
LAYERWISE_RUNS = 2


class KVStoreClient(StorePath, LoadPath):
    def __init__(
        self,
        address: str,
        spec: KVSpec,
        shared_memory: bool | None = None,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        name: str = "",
        pin_arena: bool | None = None,
        local_channel: bool | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.name = name or f"pid-{os.getpid()}"
        self._want_local_channel = local_channel
        self._requested_spec = spec
        self._mapped = MappedArena(shared_memory, pin_arena)
        self._writer = (os.getpid(), process_start_time(os.getpid()) or 0)
        self._streams = Streams()
        # How a layer-wise load moves each run of layers (with the arena registered), and
        # into how many runs it cuts the layers (`layer_groups`).
        self.layerwise_options = LAYERWISE_TRANSFER
        self.layerwise_runs = LAYERWISE_RUNS
        self._gpu_pools = GpuPools(None, {})
        self._renewer = LeaseRenewer(self._renew)
        if token is None:  # $KVSTORE_TOKEN or $KVSTORE_TOKEN_FILE: a token never on a command line
            from kvstore.paths import default_token

            token = default_token()
        tls = tls if tls is not None else ClientTls.from_env()
        self._conn = Connection(address, timeout_s, token, self._handshake, self._drop_arena, tls)
        try:
            self._handshake()
        except BaseException:
            self.close()
            raise

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
        """
        if spec is None:
            raise ValueError("spec: a KVSpec describing this worker's KV cache is required")
        return cls(
            address or default_address(),
            spec,
            shared_memory,
            token,
            timeout_s,
            name,
            pin_arena,
            local_channel,
            tls,
        )

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

    # -- connection ---------------------------------------------------------

    def _handshake(self) -> None:
        spec = self._requested_spec
        page = spec.page_for(spec.chunk_tokens or spec.block_size)
        request = pb.ConnectRequest(
            client_name=self.name,
            spec=page_spec_message(page, chunk_tokens=spec.chunk_tokens or 0),  # 0: the daemon's
            device_pci_bus_id=device_bus_id(),
        )
        if self._want_local_channel is not False and self._conn.local is None and not self._conn.has_token:
            from kvstore.paths import local_socket_of  # not at import: `import kvstore_client` stays light

            # Connect where the daemon knows this process by its uid (its tenant), when it can.
            self._conn.open_local(local_socket_of(self._conn.address))
        reply = self._conn.rpc("Connect", request)
        connected_locally = self._conn.local is not None
        handed = self._conn.local.take_fd() if self._conn.local is not None else None
        try:
            self._connected(request, reply, spec, connected_locally, handed)
        finally:
            if handed is not None:
                os.close(handed)

    def _connected(
        self, request: Any, reply: Any, spec: KVSpec, connected_locally: bool, handed: int | None
    ) -> None:
        """Takes a Connect reply: checks it, maps the arena (from `handed` if it is sealed),
        opens the local channel."""
        # Checked before anything is kept: a daemon restarted with an incompatible config leaves
        # this client as it was (and in an outage, when it connects again).
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
        self._renewer.ttl_s = self.lease_ttl_s
        identity = (reply.arena.device, reply.arena.inode)
        mapped = self._mapped
        # A daemon without epochs (epoch 0) cannot prove its arena unchanged: map it again.
        if (
            not reply.epoch
            or reply.epoch != mapped.epoch
            or identity != mapped.identity
            or mapped.tensor is None
        ):
            self._renewer.forget()  # leases of another daemon
            self._gpu_pools.close()
            mapped.map(reply.arena, identity, self._streams, handed)
            mapped.identity = identity
            mapped.epoch = reply.epoch if mapped.tensor is not None else 0
            if mapped.tensor is not None:  # same host: the GPU tier's pools can be opened too
                self._gpu_pools = GpuPools.open(reply.gpu_pools)
        same_host = self._want_local_channel is not False and mapped.tensor is not None
        self._conn.open_local(reply.local_socket if same_host else "")
        if self._conn.local is not None and not connected_locally:
            self._conn.check_local(request, reply.namespace)
        self._conn.use_credential(reply.credential)
        self._conn.serving(reply.epoch)

    def _drop_arena(self) -> None:
        """The daemon is gone: its leases and arena with it."""
        self._renewer.forget()
        self._gpu_pools.close()
        self._gpu_pools = GpuPools(None, {})
        self._mapped.unmap(self._streams)
        self._mapped.identity = None

    def _renew(self, lease_ids: Sequence[int]) -> Sequence[int]:
        """Renews leases on the daemon (from the renewal thread); returns those still held."""
        request = pb.RenewRequest(namespace=self.namespace, lease_ids=lease_ids, epoch=self.epoch)
        renewed: Sequence[int] = self._conn.rpc("Renew", request).renewed
        return renewed

    def close(self) -> None:
        self._renewer.stop()
        self._conn.close_local()
        self._gpu_pools.close()
        self._mapped.unmap(self._streams)
        self._conn.close()

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
            reply = self._conn.call(
                "Lookup", lambda: pb.LookupRequest(namespace=self.namespace, keys=pack_keys(keys))
            )
        except Unavailable:
            return 0
        hit: int = reply.hit_chunks
        return hit

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
