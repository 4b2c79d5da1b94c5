"""Remote tier: page records in Redis or Valkey, shared by every daemon pointed at it.

One daemon per host keeps its CPU (and disk) tier; the remote tier is what lets a host
reuse a prefix that another host computed. The server is one Redis or Valkey (`url`), or a
Redis/Valkey Cluster (`cluster: true`, seed nodes in `urls`; `remote_nodes` routes each record to
the master serving its slot and follows MOVED and ASK, only to nodes a slot map announced; one
server's redirects are errors). A page is stored as a record (`records`: header with namespace,
key, codec, lengths and xxh3 checksums, then the payload) under the key
`<key_prefix><namespace hex>:<chunk key hex>`. A record that does not check out (wrong namespace
or key, a checksum that fails) is a miss, never data, and is deleted.

With `record_key_file`, every record this tier writes carries a MAC under the fleet's key
(`records.RecordKey`), and a record read without one that checks out is a miss, deleted and
counted (`forged_records`): whoever can write to the servers cannot make a daemon serve
bytes a daemon of the fleet did not store. Without it, the server is trusted as it is.

- `present(namespace, keys) -> int` (`remote_lookups`): how many leading keys have a record (one pipelined
  round trip to each node the keys live on, sent to all of them at once, `lookup_timeout_s`
  for all of it). It runs on the daemon's event loop during a Lookup, so it is bounded: a
  lookup past the deadline is a miss (`lookup_timeouts`); a node that fails, or three such
  lookups in a row, make that node `down` for `retry_s` (a warning once per outage, `errors`
  in stats): its records are misses, answered at once. With one server, that is the tier.
- `accepts(size)`, `submit_write(namespace, key, page) -> bool`: queued for a write worker,
  which skips a key already stored (records are content-addressed: same key, same bytes;
  its expiry is renewed) and writes the record with SET NX (PX `ttl_s` when set). False,
  counted in `dropped_writes`, when the record's node is down or `queue_bytes` are already waiting
  (`accepts` answers first). `page` may be a view of the arena slot itself: the store keeps
  it pinned until `done` is called, which happens exactly once for every queued write.
- `submit_read(namespace, key, done, into) -> bool`: a read worker (reads never wait behind
  writes) GETs the record straight into `into` (an arena slot; `remote_resp`), checks it
  there and calls `done(page)`, or `done(None)` for a missing, unreadable or corrupt one.
  False when the record's node is down; a job queued before an outage answers at once. A worker's
  connection that the server dropped (restart, idle timeout) is replaced and the read tried
  again once before it counts as a failure.
- `kvctl clear` clears this daemon's own tiers, never the shared server: other hosts'
  pages are theirs too. A change of weights under the same model name needs a new `salt`
  (a new namespace); the old records age out under the server's eviction or `ttl_s`.
- `stats()`, `node_usage()` (each server's role, health, memory, keys and errors: one, or a
  cluster's nodes, for `kvctl stats`),
  `close(timeout_s)`: close lets queued writes finish for up to `timeout_s`, then drops
  the rest (counted).

Eviction in the remote tier is the server's: run it with a `maxmemory` and an
`allkeys-lru` (or `-lfu`) policy, or set `ttl_s`. The tier speaks RESP itself (`remote_resp`);
the `redis` package parses its URLs, imported only when it is enabled. Each worker's
connections, the redirects they follow and a node's outages are `remote_routing`'s.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvstore.config.root import ConfigError, RemoteTierConfig
from kvstore.shared.domain import Tier
from kvstore.tiers.codec import CODECS, Buffer, compress
from kvstore.tiers.records import FLAG_MAC, CorruptRecord, ForgedRecord, RecordKey, pack_header
from kvstore.tiers.remote_lookups import RemoteLookups
from kvstore.tiers.remote_nodes import Node, Nodes, NodeUsage
from kvstore.tiers.remote_resp import Endpoint, RecordConnection
from kvstore.tiers.remote_routing import NodeDown, Router, Work

log = logging.getLogger(__name__)

ReadDone = Callable[[Buffer | None], None]
WriteDone = Callable[[bool], None]


def start_remote(config: RemoteTierConfig) -> RemoteTier:
    """The tier, after one PING (or the cluster's slot map): a server that does not answer is
    logged, and tried again later."""
    try:
        import redis  # noqa: F401
    except ImportError:
        raise ConfigError(
            "tiers.remote.enabled", "the remote tier needs the Python package redis (pip install redis)"
        ) from None
    tier = RemoteTier(config)
    tier.start()
    return tier


class RemoteTier:
    name = "remote"
    medium = Tier.REMOTE

    def __init__(self, config: RemoteTierConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.write_through = config.write == "through"
        seeds = [Endpoint.parse(url) for url in config.seeds]
        self.nodes = Nodes(seeds, config.cluster, config.timeout_s, config.retry_s, clock)
        self._codec = CODECS[config.codec]
        secret = config.record_key()
        self._record_key = None if secret is None else RecordKey(secret)
        self._clock = clock
        # Reads (a load waits on them) never queue behind writes (write-through may queue many).
        self._read_workers = ThreadPoolExecutor(config.threads, thread_name_prefix="kvstore-remote-read")
        self._write_workers = ThreadPoolExecutor(config.threads, thread_name_prefix="kvstore-remote-write")
        self._lock = threading.Lock()
        self._queued_bytes = 0
        self._pending = 0  # jobs submitted and not finished
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._deadline = float("inf")  # close(): queued writes past this are dropped
        self.counters: Counter[str] = Counter()
        self._router = Router(config, self.nodes, clock, self._count)  # connections, redirects, health
        self._lookups = RemoteLookups(config, self.nodes, self._router, clock, self._count, self)

    def start(self) -> None:
        if self.config.cluster:
            self.nodes.start()
            masters = [node for node in self.nodes.nodes() if node.role == "master"]
            if masters:
                log.info(
                    "remote tier %s: %d masters (%s), records under %r",
                    self.config.where,
                    len(masters),
                    ", ".join(str(node) for node in masters),
                    self.config.key_prefix,
                )
            return
        try:
            self._routed(b"", lambda connection, _: connection.call(b"PING"), "the first PING")
        except NodeDown:
            pass  # warned: tried again after retry_s
        else:
            log.info(
                "remote tier %s: reachable (records under %r)", self.config.where, self.config.key_prefix
            )

    # -- keys ---------------------------------------------------------------

    def record_key(self, namespace: bytes, key: bytes) -> bytes:
        return f"{self.config.key_prefix}{namespace.hex()}:{key.hex()}".encode()

    # -- the store's calls --------------------------------------------------

    @property
    def up(self) -> bool:
        """Not closed, and the server (a cluster: any master) is not down."""
        return not self._closed and self.nodes.any_usable()

    @property
    def closed(self) -> bool:
        return self._closed

    def present(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """How many leading `keys` have a record; 0 while the tier is down (`RemoteLookups`)."""
        return self._lookups.present(namespace, keys)

    def node_usage(self) -> list[NodeUsage]:
        """Each node's role, health, memory, keys and errors (`RemoteLookups`)."""
        return self._lookups.node_usage()

    def server_usage(self) -> tuple[int, int, int]:
        """The server's (used memory, maxmemory (0: no limit), keys)."""
        return self._lookups.server_usage()

    def _usable(self, name: bytes) -> Node | None:
        node = self.nodes.node_for(name)
        return node if node is not None and not self._closed and self.nodes.usable(node) else None

    def accepts(self, size: int) -> bool:
        """Whether a write of `size` bytes would be queued now (the store copies a page only then)."""
        if self.up and self._queued_bytes + size <= self.config.queue_bytes:
            return True
        self._count("dropped_writes")
        return False

    def submit_write(
        self, namespace: bytes, key: bytes, page: bytes | memoryview, done: WriteDone | None = None
    ) -> bool:
        size = len(page)
        name = self.record_key(namespace, key)
        with self._lock:
            if self._usable(name) is None or self._queued_bytes + size > self.config.queue_bytes:
                self.counters["dropped_writes"] += 1
                return False
            self._queued_bytes += size
            self._pending += 1
            # Under the lock: close() marks the tier closed under it before it stops the workers.
            self._write_workers.submit(self._job, self._write, namespace, key, page, done)
        return True

    def submit_read(
        self, namespace: bytes, key: bytes, done: ReadDone, into: memoryview | None = None
    ) -> bool:
        with self._lock:
            if self._usable(self.record_key(namespace, key)) is None:
                self.counters["read_misses"] += 1
                return False
            self._pending += 1
            self.counters["reads"] += 1
            self._read_workers.submit(self._job, self._read, namespace, key, done, into)
        return True

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    # -- workers ------------------------------------------------------------

    def _job(self, work: Callable[..., None], *args: Any) -> None:
        try:
            work(*args)
        except Exception:  # a bug must not take a worker away
            self._count("errors")
            log.exception("remote tier: a worker job failed")
        finally:
            with self._lock:
                self._pending -= 1
                self._idle.notify_all()

    def _write(self, namespace: bytes, key: bytes, page: bytes | memoryview, done: WriteDone | None) -> None:
        ok = False
        try:
            codec, payload = compress(self._codec, page)
            if self._record_key is None:
                header = pack_header(namespace, key, codec, len(page), payload)
            else:
                header = pack_header(namespace, key, codec, len(page), payload, FLAG_MAC)
                header += self._record_key.mac(header, payload)
            try:
                stored = self._put(self.record_key(namespace, key), header, payload)
            except NodeDown as exc:
                if exc.args[0] is None:  # down since it was queued, or close() ran out of time
                    self._count("dropped_writes")
                return
            ok = True
            with self._lock:
                if stored:
                    self.counters["written"] += 1
                    self.counters["written_bytes"] += len(header) + len(payload)
                else:  # records are content-addressed: the one there holds the same bytes
                    self.counters["duplicate_writes"] += 1
        finally:
            with self._lock:
                self._queued_bytes -= len(page)
            if done is not None:
                done(ok)

    def _put(self, name: bytes, header: bytes, payload: Buffer) -> bool:
        """Stores the record unless one is there (then renews its expiry); True if it stored."""
        ttl_ms = int(self.config.ttl_s * 1000)

        def put(connection: RecordConnection, asking: bool) -> bool:
            if asking:
                connection.asking()
            if connection.exists(name):
                if ttl_ms:
                    if asking:
                        connection.asking()
                    connection.pexpire(name, ttl_ms)  # in use again: it lives on
                return False
            if asking:
                connection.asking()
            return connection.put(name, header, payload, ttl_ms)

        return bool(self._routed(name, put, "a write"))

    def _read(self, namespace: bytes, key: bytes, done: ReadDone, into: memoryview) -> None:
        page: Buffer | None = None
        name = self.record_key(namespace, key)
        ttl_ms = int(self.config.ttl_s * 1000)
        try:
            page = self._routed(
                name,
                lambda connection, _: connection.get(name, namespace, key, into, ttl_ms, self._record_key),
                "a read",
            )
        except NodeDown:
            pass  # a miss: down (since it was queued, or now)
        except CorruptRecord as exc:
            forged = isinstance(exc, ForgedRecord)
            self._count("forged_records" if forged else "corrupted_records")
            what = "fails authentication" if forged else "is corrupt"
            log.warning("remote tier: record %s %s (%s); deleted, read as a miss", name.decode(), what, exc)
            with contextlib.suppress(NodeDown):
                self._routed(name, lambda connection, _: connection.call(b"DEL", name), "a delete")
        finally:
            if page is not None:
                self._count("read_bytes", len(page))
            self._count("read_misses" if page is None else "promotions")
            done(page)

    def _routed(self, name: bytes, work: Work, what: str) -> Any:
        """`work` on the connection to the node serving `name` (`Router.routed`)."""
        return self._router.routed(self._usable(name), name, work, what)

    # -- figures and shutdown -----------------------------------------------

    def stats(self) -> dict[str, float]:
        with self._lock:
            figures: dict[str, float] = dict(self.counters)
            figures.update(up=float(self.up), queue_bytes=self._queued_bytes, jobs=self._pending)
        if self.nodes.cluster:
            nodes = self.nodes.nodes()
            figures.update(
                nodes=len(nodes),
                nodes_down=sum(not self.nodes.usable(node) for node in nodes if node.role == "master"),
                slot_map_refreshes=self.nodes.refreshes,
            )
        for name in (
            "written",
            "written_bytes",
            "duplicate_writes",
            "dropped_writes",
            "reads",
            "read_bytes",
            "read_misses",
            "promotions",
            "corrupted_records",
            "forged_records",
            "lookups",
            "lookup_hits",
            "lookup_timeouts",
            "redirects",
            "refused_redirects",
            "stats_failures",
            "errors",
            "outages",
        ):
            figures.setdefault(name, 0.0)
        return figures

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no job is queued or running; False if `timeout_s` passed first."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Lets queued jobs finish for up to `timeout_s`; writes still queued after it are dropped."""
        self._deadline = self._clock() + timeout_s
        self.wait_idle(timeout_s)
        with self._lock:
            self._closed = True
        self._read_workers.shutdown(wait=True, cancel_futures=False)
        self._write_workers.shutdown(wait=True, cancel_futures=False)
        self.nodes.close()
        self._router.close()
