"""Remote tier: page records in Redis or Valkey, shared by every daemon pointed at it.

One daemon per host keeps its CPU (and disk) tier; the remote tier is what lets a host
reuse a prefix that another host computed. A page is stored as a record (`records`:
header with namespace, key, codec, lengths and xxh3 checksums, then the payload) under
the key `<key_prefix><namespace hex>:<chunk key hex>`. A record that does not check out
(wrong namespace or key, a checksum that fails) is a miss, never data, and is deleted.

- `present(namespace, keys) -> int`: how many leading keys have a record (one pipelined
  round trip, `lookup_timeout_s`). It runs on the daemon's event loop during a Lookup, so
  it is bounded: a lookup past the deadline is a miss (`lookup_timeouts`); a server that
  fails, or three such lookups in a row, make the tier `down` for `retry_s` (a warning
  once per outage, `errors` in stats), and a down tier answers 0 at once.
- `accepts(size)`, `submit_write(namespace, key, page) -> bool`: queued for a write worker,
  which skips a key already stored (records are content-addressed: same key, same bytes;
  its expiry is renewed) and writes the record with SET NX (PX `ttl_s` when set). False,
  counted in `dropped_writes`, when the tier is down or `queue_bytes` are already waiting
  (`accepts` answers first). `page` may be a view of the arena slot itself: the store keeps
  it pinned until `done` is called, which happens exactly once for every queued write.
- `submit_read(namespace, key, done, into) -> bool`: a read worker (reads never wait behind
  writes) GETs the record straight into `into` (an arena slot; `remote_resp`), checks it
  there and calls `done(page)`, or `done(None)` for a missing, unreadable or corrupt one.
  False when the tier is down; a job queued before an outage answers at once. A worker's
  connection that the server dropped (restart, idle timeout) is replaced and the read tried
  again once before it counts as a failure.
- `kvctl clear` clears this daemon's own tiers, never the shared server: other hosts'
  pages are theirs too. A change of weights under the same model name needs a new `salt`
  (a new namespace); the old records age out under the server's eviction or `ttl_s`.
- `stats()`, `server_usage()` (the server's memory and key count, for `kvctl stats`),
  `close(timeout_s)`: close lets queued writes finish for up to `timeout_s`, then drops
  the rest (counted).

Eviction in the remote tier is the server's: run it with a `maxmemory` and an
`allkeys-lru` (or `-lfu`) policy, or set `ttl_s`. The Python client (`redis`) is imported
only when the tier is enabled.
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

from kvstore.codec import CODECS, Buffer, compress
from kvstore.config import ConfigError, RemoteTierConfig
from kvstore.tiers import Tier
from kvstore.tiers.records import HEADER_BYTES, CorruptRecord, pack_header, unpack_header
from kvstore.tiers.remote_resp import RecordConnection

log = logging.getLogger(__name__)

SLOW_LOOKUPS_DOWN = 3  # lookups in a row past lookup_timeout_s that make the tier down for retry_s

ReadDone = Callable[[Buffer | None], None]
WriteDone = Callable[[bool], None]


def start_remote(config: RemoteTierConfig) -> RemoteTier:
    """The tier, after one PING: a server that does not answer is logged, and tried again later."""
    try:
        import redis  # noqa: F401
    except ImportError:
        raise ConfigError(
            "tiers.remote.enabled", "the remote tier needs the Python package redis (pip install redis)"
        ) from None
    tier = RemoteTier(config)
    try:
        tier._redis.ping()
    except tier._errors as exc:
        tier._failed("the first PING", exc)
    else:
        log.info("remote tier %s: reachable (records under %r)", config.url, config.key_prefix)
    return tier


class RemoteTier:
    name = "remote"
    medium = Tier.REMOTE

    def __init__(self, config: RemoteTierConfig, clock: Callable[[], float] = time.monotonic) -> None:
        import redis

        self.config = config
        self.write_through = config.write == "through"
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._timeout: type[BaseException] = redis.TimeoutError
        self._slow_lookups = 0  # lookups in a row that ran past lookup_timeout_s
        self._redis = redis.Redis.from_url(
            config.url, socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s
        )
        # The event loop's own connection: connecting too is bounded by a Lookup's deadline.
        self._lookup = redis.Redis.from_url(
            config.url,
            socket_timeout=config.lookup_timeout_s,
            socket_connect_timeout=config.lookup_timeout_s,
        )
        self._codec = CODECS[config.codec]
        self._clock = clock
        # Reads (a load waits on them) never queue behind writes (write-through may queue many).
        self._read_workers = ThreadPoolExecutor(config.threads, thread_name_prefix="kvstore-remote-read")
        self._write_workers = ThreadPoolExecutor(config.threads, thread_name_prefix="kvstore-remote-write")
        self._lock = threading.Lock()
        self._queued_bytes = 0
        self._pending = 0  # jobs submitted and not finished
        self._idle = threading.Condition(self._lock)
        self._down_until = 0.0
        self._closed = False
        self._deadline = float("inf")  # close(): queued writes past this are dropped
        self._direct = True  # reads received straight into their slot (`remote_resp`); not for TLS
        self._local = threading.local()  # each worker's RecordConnection
        self._connections: set[RecordConnection] = set()
        self.counters: Counter[str] = Counter()

    # -- keys ---------------------------------------------------------------

    def record_key(self, namespace: bytes, key: bytes) -> bytes:
        return f"{self.config.key_prefix}{namespace.hex()}:{key.hex()}".encode()

    # -- the store's calls --------------------------------------------------

    @property
    def up(self) -> bool:
        return not self._closed and self._clock() >= self._down_until

    def present(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """How many leading `keys` have a record; 0 while the tier is down."""
        if not keys or not self.up:
            return 0
        self._count("lookups")
        try:
            pipe = self._lookup.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.record_key(namespace, key))
            answers = pipe.execute()
        except self._timeout as exc:
            # A busy server (large writes ahead of it) can be slow once: that lookup is a miss.
            # Only a run of them takes the tier out of Lookups for retry_s.
            self._slow_lookups += 1
            self._count("lookup_timeouts")
            if self._slow_lookups >= SLOW_LOOKUPS_DOWN:
                self._failed(f"{SLOW_LOOKUPS_DOWN} lookups in a row", exc)
            return 0
        except self._errors as exc:
            self._failed("a lookup", exc)
            return 0
        self._slow_lookups = 0
        found = 0
        for answer in answers:
            if not answer:
                break
            found += 1
        self._count("lookup_hits", found)
        return found

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
        with self._lock:
            if not self.up or self._queued_bytes + size > self.config.queue_bytes:
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
            if not self.up:
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
            if not self.up and (not self._closed or self._clock() > self._deadline):
                self._count("dropped_writes")  # down since it was queued, or close() ran out of time
                return
            name = self.record_key(namespace, key)
            codec, payload = compress(self._codec, page)
            header = pack_header(namespace, key, codec, len(page), payload)
            try:
                stored = self._put(name, header, payload)
            except self._errors as exc:
                self._failed("a write", exc)
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

        def direct(connection: RecordConnection) -> bool:
            if connection.exists(name):
                if ttl_ms:
                    connection.pexpire(name, ttl_ms)  # in use again: it lives on
                return False
            return connection.put(name, header, payload, ttl_ms)

        done, stored = self._on_connection(direct)
        if done:
            return bool(stored)
        if self._redis.exists(name):
            if ttl_ms:
                self._redis.pexpire(name, ttl_ms)
            return False
        return bool(self._redis.set(name, header + bytes(payload), nx=True, px=ttl_ms or None))

    def _read(self, namespace: bytes, key: bytes, done: ReadDone, into: memoryview) -> None:
        page: Buffer | None = None
        name = self.record_key(namespace, key)
        try:
            if self.up:  # down since it was queued: a miss without asking
                page = self._get(name, namespace, key, into)
        except CorruptRecord as exc:
            self._count("corrupted_records")
            log.warning("remote tier: record %s is corrupt (%s); deleted, read as a miss", name.decode(), exc)
            with contextlib.suppress(*self._errors):
                self._redis.delete(name)
        except self._errors as exc:
            self._failed("a read", exc)
        finally:
            if page is not None:
                self._count("read_bytes", len(page))
            self._count("read_misses" if page is None else "promotions")
            done(page)

    def _get(self, name: bytes, namespace: bytes, key: bytes, into: memoryview) -> Buffer | None:
        """The page read into `into` (None: no record); CorruptRecord, or the client's errors."""
        ttl_ms = int(self.config.ttl_s * 1000)
        done, page = self._on_connection(
            lambda connection: connection.get(name, namespace, key, into, ttl_ms=ttl_ms)
        )
        if done:
            return page
        ttl = self.config.ttl_s
        record = self._redis.getex(name, px=int(ttl * 1000)) if ttl else self._redis.get(name)
        if not isinstance(record, bytes):  # None: no record (replies are bytes: decode_responses is off)
            return None
        header = unpack_header(record)
        if (header.namespace, header.key) != (namespace, key):
            raise CorruptRecord("the header names another page")
        page = header.decode(memoryview(record)[HEADER_BYTES:])
        if len(page) != len(into):
            raise CorruptRecord(f"record holds a {len(page)}-byte page, the slot is {len(into)} bytes")
        into[:] = page
        return into

    def _on_connection(self, work: Callable[[RecordConnection], Any]) -> tuple[bool, Any]:
        """(True, work(this worker's connection)), or (False, None) where there is none (TLS: the
        caller goes through the redis client). A connection that fails after serving earlier
        calls (the server restarted, or closed it as idle) is replaced once and `work` run again."""
        connection: RecordConnection | None = getattr(self._local, "connection", None)
        if connection is not None:
            try:
                return True, work(connection)
            except (ConnectionError, EOFError):  # dropped by the server: try a fresh one, once
                self._drop_connection(connection)
            except BaseException:  # a timeout or an error reply: not tried again
                self._drop_connection(connection)
                raise
        if not self._direct:
            return False, None
        connection = RecordConnection.open(self.config.url, self.config.timeout_s)
        if connection is None:
            self._direct = False
            return False, None
        self._local.connection = connection
        with self._lock:
            self._connections.add(connection)
        try:
            return True, work(connection)
        except BaseException:
            self._drop_connection(connection)
            raise

    def _drop_connection(self, connection: RecordConnection) -> None:
        self._local.connection = None
        with self._lock:
            self._connections.discard(connection)

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.counters["errors"] += 1
            was_up = self._clock() >= self._down_until
            self._down_until = self._clock() + self.config.retry_s
            if was_up:
                self.counters["outages"] += 1
        if was_up:
            log.warning(
                "remote tier %s: %s failed (%s); its pages are misses for %.1f s, then it is tried again",
                self.config.url,
                what,
                exc,
                self.config.retry_s,
            )

    # -- figures and shutdown -----------------------------------------------

    def stats(self) -> dict[str, float]:
        with self._lock:
            figures: dict[str, float] = dict(self.counters)
            figures.update(up=float(self.up), queue_bytes=self._queued_bytes, jobs=self._pending)
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
            "lookups",
            "lookup_hits",
            "lookup_timeouts",
            "stats_failures",
            "errors",
            "outages",
        ):
            figures.setdefault(name, 0.0)
        return figures

    def server_usage(self) -> tuple[int, int, int]:
        """The server's (used memory, maxmemory (0: no limit), keys in the database); zeros when
        it cannot be asked. These count everything in that database, not only page records."""
        if not self.up:
            return 0, 0, 0
        try:
            pipe = self._lookup.pipeline(transaction=False)
            pipe.info("memory")
            pipe.dbsize()
            memory, keys = pipe.execute()
        except self._errors:
            self._count("stats_failures")  # figures only: the tier stays up
            return 0, 0, 0
        return int(memory.get("used_memory", 0)), int(memory.get("maxmemory", 0)), int(keys)

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
        self._redis.close()
        self._lookup.close()
        with self._lock:
            connections, self._connections = self._connections, set()
        for connection in connections:
            connection.close()
