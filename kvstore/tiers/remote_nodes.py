"""Which server holds a record: the one server of `tiers.remote.url`, or the node of a Redis or
Valkey Cluster that serves the record's slot.

A cluster is used as it is: a record's name hashes to one of 16384 slots (CRC16, as every
cluster client does; the names carry no hash tag, so a namespace spreads over every node),
and `CLUSTER SLOTS`, asked of any node, says which master serves each slot.

- `Nodes(seeds, cluster, timeout_s)`: one node (`cluster=False`), or the cluster the seed
  nodes belong to; `start()` discovers the slot map and keeps it fresh on a thread of its own
  (every `REFRESH_S`, at once after a redirect or a failure, and every `REFRESH_DOWN_S` while a
  node is down, so that a failover to a replica is seen in about that time).
- `node_for(name) -> Node | None`: the node that serves `name` (None: no map yet, or a slot no
  node serves); `route(prefix, suffixes)`: the same for many names that share a prefix.
- Redirects, in cluster mode only (one server's `MOVED` is an error, never followed): a node is
  reached only where a slot map announced it, a map that came from a configured seed or from a
  node an earlier map announced, so a server cannot send the daemon (its AUTH password, its
  records) to an address of its choosing. `announced(address) -> Node | None`;
  `follow(redirect) -> Node | None` in a worker: an address the map does not name is looked
  up in a fresh map (at most every `REFRESH_DOWN_S`), and None if it is still not there;
  `moved(redirect) -> Node | None` on the event loop: an announced node takes the slot at once,
  and any redirect asks the refresher for a fresh map.
- At most `MAX_NODES` nodes: a map that names more is not used (logged), and nodes that left
  the map are forgotten when the count would pass it.
- Health, per node: `usable(node)`; `failed(node) -> bool` makes it a miss for `retry_s`
  (True for the first failure of an outage, which lasts until `recovered(node)`, its next
  answer: the caller warns once); `slow(node) -> bool`
  counts a lookup past its deadline (True when `SLOW_LOOKUPS_DOWN` in a row took it down).
- `nodes()`: every node seen, with its role in the current map and its errors, for stats.
- `NodeUsage`: one node as stats show it (role, health, memory, keys, errors);
  `server_totals(nodes)`: the server's (used memory, maxmemory, keys), its masters summed.
"""

from __future__ import annotations

import logging
import threading
import time
from binascii import crc_hqx
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvstore.tiers.remote_resp import Address, Endpoint, RecordConnection, Redirect, format_address

log = logging.getLogger(__name__)

SLOTS = 16384
LAST_SLOT = SLOTS - 1


def slot(name: bytes) -> int:
    """The cluster slot of a key: CRC16 (XMODEM) of the key, or of its {hash tag}, mod 16384."""
    start = name.find(b"{")
    if start >= 0:
        end = name.find(b"}", start + 1)
        if end > start + 1:
            name = name[start + 1 : end]
    return crc_hqx(name, 0) & LAST_SLOT


REFRESH_S = 30.0
REFRESH_DOWN_S = 0.5
SLOW_LOOKUPS_DOWN = 3  # lookups in a row past lookup_timeout_s that make a node down for retry_s
MAX_NODES = 1024  # Redis Cluster's own advice is at most ~1000 nodes; each is a Stats row and metrics label


@dataclass(eq=False)
class Node:
    endpoint: Endpoint
    role: str = "master"  # in the current slot map: master, replica, or absent (no longer in it)
    down_until: float = 0.0
    failing: bool = False  # in an outage: from a failure to the next request it answers
    slow_lookups: int = 0  # lookups in a row that ran past lookup_timeout_s
    errors: int = 0
    outages: int = 0

    @property
    def address(self) -> Address:
        return self.endpoint.address

    def __str__(self) -> str:
        return str(self.endpoint)


class Nodes:
    def __init__(
        self,
        seeds: Sequence[Endpoint],
        cluster: bool,
        timeout_s: float,
        retry_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        self._seeds = list(seeds)
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[Address, Node] = {}
        self._slots: list[Node | None] = [None] * SLOTS
        self._single = None if cluster else self._node(seeds[0].address)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._asked_at = -float("inf")  # the last refresh a redirect to an unknown node made
        self._too_many_warned = False
        self.refreshes = 0
        self.refresh_failures = 0

    # -- routing ------------------------------------------------------------

    def node_for(self, name: bytes) -> Node | None:
        return self.route(name, [b""])[0]

    def route(self, prefix: bytes, suffixes: Sequence[bytes]) -> list[Node | None]:
        """The node of each name prefix + suffix, for a Lookup's whole run at once (the CRC of the
        prefix is taken once). The suffixes are keys in hex: only the prefix may hold a {hash tag}."""
        if self._single is not None:
            return [self._single] * len(suffixes)
        slots = self._slots
        if b"{" in prefix:
            return [slots[slot(prefix + suffix)] for suffix in suffixes]
        base = crc_hqx(prefix, 0)
        return [slots[crc_hqx(suffix, base) & LAST_SLOT] for suffix in suffixes]

    def announced(self, address: Address) -> Node | None:
        """The node at `address` if the current slot map names it (a cluster only)."""
        with self._lock:
            node = self._nodes.get(address) if self.cluster else None
            return node if node is not None and node.role != "absent" else None

    def moved(self, redirect: Redirect) -> Node | None:
        """A redirect seen on the event loop (never waits): the announced node it names (a MOVED
        gives it the slot now), or None; either way the refresher asks for a fresh map."""
        node = self.announced(redirect.address)
        if node is not None and not redirect.ask:
            with self._lock:
                self._slots[redirect.slot] = node
        self._wake.set()
        return node

    def follow(self, redirect: Redirect) -> Node | None:
        """The node a worker follows `redirect` to: one the map announces, asked for a fresh map
        first where it names none (at most every REFRESH_DOWN_S, so a server that redirects every
        request costs one CLUSTER SLOTS per interval). None: not to be followed."""
        if not self.cluster:
            return None
        node = self.moved(redirect)
        if node is None:
            with self._lock:
                now = self._clock()
                may_ask = now >= self._asked_at + REFRESH_DOWN_S
                if may_ask:
                    self._asked_at = now
            if may_ask and self.refresh():
                node = self.moved(redirect)
        return node

    def _node(self, address: Address) -> Node:
        """The node at `address`, made on first sight (under the lock, or before threads start)."""
        node = self._nodes.get(address)
        if node is None:
            seed = self._seeds[0]
            endpoint = seed if isinstance(address, str) else seed.at(*address)
            node = self._nodes[address] = Node(endpoint)
        return node

    # -- health -------------------------------------------------------------

    def usable(self, node: Node) -> bool:
        return self._clock() >= node.down_until

    def any_usable(self) -> bool:
        with self._lock:
            masters = [node for node in self._nodes.values() if node.role == "master"]
        return any(self.usable(node) for node in masters)

    def failed(self, node: Node) -> bool:
        """`node` is a miss for retry_s; True for the first failure of an outage (one that ends
        when the node answers again: `recovered`)."""
        with self._lock:
            node.errors += 1
            node.down_until = self._clock() + self._retry_s
            node.slow_lookups = 0
            new = not node.failing
            node.failing = True
            if new:
                node.outages += 1
        self._wake.set()  # a failover may move its slots: look again soon
        return new

    def recovered(self, node: Node) -> bool:
        """`node` answered; True when that ends an outage."""
        if not node.failing:
            return False
        with self._lock:
            ended, node.failing = node.failing, False
        return ended

    def slow(self, node: Node) -> bool:
        node.slow_lookups += 1
        return node.slow_lookups >= SLOW_LOOKUPS_DOWN

    # -- the slot map -------------------------------------------------------

    def start(self) -> None:
        """Discovers the slot map (a cluster), then keeps it fresh on a thread; a cluster no seed
        answers is warned of, and every record a miss until one does."""
        if not self.cluster:
            return
        if not self.refresh():
            log.warning(
                "remote tier: no seed node of the cluster (%s) answered CLUSTER SLOTS; its pages are "
                "misses until one does",
                ", ".join(str(seed) for seed in self._seeds),
            )
        self._thread = threading.Thread(target=self._refresher, name="kvstore-remote-slots", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout_s + 1)

    def _refresher(self) -> None:
        while not self._stop.is_set():
            down = any(not self.usable(node) for node in self.nodes() if node.role == "master")
            self._wake.wait(REFRESH_DOWN_S if down else REFRESH_S)
            if self._stop.is_set():
                return
            self._wake.clear()
            self.refresh()
            self._stop.wait(REFRESH_DOWN_S)  # a burst of redirects asks once

    def refresh(self) -> bool:
        """Asks the nodes (usable masters first, then the others, then the seeds) for the slot map
        until one answers; True if the map was replaced."""
        with self._lock:
            known = sorted(
                (node for node in self._nodes.values() if node.role != "absent"),
                key=lambda node: (node.role != "master", not self.usable(node)),
            )
        candidates = [node.endpoint for node in known] + self._seeds
        tried: set[Address] = set()
        for endpoint in candidates:
            if endpoint.address in tried:
                continue
            tried.add(endpoint.address)
            try:
                connection = RecordConnection.open(endpoint, self._timeout_s)
                try:
                    reply = connection.call(b"CLUSTER", b"SLOTS")
                finally:
                    connection.close()
                self._install(reply, endpoint)
            except (OSError, ValueError, IndexError, TypeError) as exc:
                log.debug("remote tier: CLUSTER SLOTS from %s failed: %s", endpoint, exc)
                continue
            self.refreshes += 1
            return True
        self.refresh_failures += 1
        return False

    def _install(self, reply: Any, asked: Endpoint) -> None:
        """Replaces the map with `CLUSTER SLOTS`'s: [[first, last, [host, port, id, ...], replicas...]]."""
        asked_host = asked.address[0] if isinstance(asked.address, tuple) else "127.0.0.1"

        def address(entry: list[Any]) -> tuple[str, int]:
            host = entry[0].decode() if isinstance(entry[0], bytes) else ""
            return (host if host and host != "?" else asked_host), int(entry[1])

        ranges: list[tuple[int, int, tuple[str, int]]] = []
        roles: dict[Address, str] = {}
        for first, last, master, *replicas in reply:
            if not 0 <= int(first) <= int(last) <= LAST_SLOT:
                raise ValueError(f"CLUSTER SLOTS named slots {first}..{last}")
            ranges.append((int(first), int(last), address(master)))
            roles[address(master)] = "master"
            for replica in replicas:
                roles.setdefault(address(replica), "replica")
        if len(roles) > MAX_NODES:
            self._too_many(asked, len(roles))
            raise ValueError(f"{len(roles)} nodes, more than {MAX_NODES}")
        self._too_many_warned = False
        slots: list[Node | None] = [None] * SLOTS
        with self._lock:
            if len(self._nodes.keys() | roles.keys()) > MAX_NODES:  # forget the nodes that left the map
                self._nodes = {a: node for a, node in self._nodes.items() if a in roles}
            for first, last, master_address in ranges:
                slots[first : last + 1] = [self._node(master_address)] * (last - first + 1)
            for node_address in roles:
                self._node(node_address)
            for node in self._nodes.values():
                node.role = roles.get(node.address, "absent")
            self._slots = slots

    def _too_many(self, asked: Endpoint, count: int) -> None:
        level = logging.DEBUG if self._too_many_warned else logging.ERROR
        self._too_many_warned = True
        log.log(
            level,
            "remote tier: CLUSTER SLOTS from %s names %d nodes, more than the %d this tier serves; "
            "that map is not used (the slots keep the nodes they had)",
            asked,
            count,
            MAX_NODES,
        )

    # -- figures ------------------------------------------------------------

    def nodes(self) -> list[Node]:
        with self._lock:
            return sorted(self._nodes.values(), key=lambda node: format_address(node.address))


class NodeUsage(NamedTuple):
    """One server of the remote tier (a cluster's node): its role in the slot map (master,
    replica, absent), whether the tier uses it now, the server's own figures (zeros where it
    did not answer) and the tier's errors with it."""

    address: str
    role: str
    up: bool
    bytes_used: int
    bytes_capacity: int  # maxmemory; 0: no limit
    keys: int
    errors: int


def server_totals(nodes: Sequence[NodeUsage]) -> tuple[int, int, int]:
    """(used memory, maxmemory (0: no limit), keys) summed over the masters: a cluster's data
    counted once, not again for its replicas. These count every key, not only page records."""
    masters = [node for node in nodes if node.role == "master"]
    return (
        sum(node.bytes_used for node in masters),
        sum(node.bytes_capacity for node in masters),
        sum(node.keys for node in masters),
    )
