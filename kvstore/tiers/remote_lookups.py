"""The remote tier's Lookups and figures: what it asks of every node at once, on the daemon's event
loop (a Lookup) or for `kvctl stats` (each node's memory and keys), within `lookup_timeout_s`.

- `RemoteLookups(config, nodes, router, clock, count, tier)`: owned by the `RemoteTier`
  (`remote`), which gives it its config, its `Nodes`, the `Router` that holds each thread's
  connections and each node's health, its clock and counters, and itself as what it asks whether
  the tier is up and how a record is named (`TierState`).
- `present(namespace, keys)`: how many leading keys have a record (EXISTS pipelined to each node,
  all nodes at once, redirects followed once).
- `node_usage()`, `server_usage()`: each node's figures, and the server's totals.
"""

from __future__ import annotations

from binascii import hexlify
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvstore.config.root import RemoteTierConfig
from kvstore.tiers.remote_nodes import Node, Nodes, NodeUsage, server_totals
from kvstore.tiers.remote_resp import RecordConnection, Redirect, command
from kvstore.tiers.remote_routing import Router

EXISTS_HEAD = b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s"  # a Lookup's command, % (len(name), prefix): + key hex
ASKING = command(b"ASKING")


class TierState(Protocol):
    """What Lookups ask of the tier that owns them."""

    @property
    def up(self) -> bool: ...

    @property
    def closed(self) -> bool: ...

    def record_key(self, namespace: bytes, key: bytes) -> bytes: ...


class RemoteLookups:
    def __init__(
        self,
        config: RemoteTierConfig,
        nodes: Nodes,
        router: Router,
        clock: Callable[[], float],
        count: Callable[..., None],
        tier: TierState,
    ) -> None:
        self.config = config
        self.nodes = nodes
        self._router = router
        self._clock = clock
        self._count = count
        self._tier = tier

    def present(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """How many leading `keys` have a record; 0 while the tier is down."""
        if not keys or not self._tier.up:
            return 0
        self._count("lookups")
        deadline = self._clock() + self.config.lookup_timeout_s
        prefix = self._tier.record_key(namespace, b"")  # a record's name is prefix + its key in hex
        suffixes = [hexlify(key) for key in keys]
        nodes = self.nodes.route(prefix, suffixes)
        usable = {node for node in set(nodes) if node is not None and self.nodes.usable(node)}
        run = len(nodes)  # the leading run, up to the first record whose node is down
        for node in set(nodes) - usable:
            run = min(run, nodes.index(node))
        del nodes[run:]
        by_node = {node: [i for i, other in enumerate(nodes) if other is node] for node in usable}
        answers = [False] * run
        asking: set[int] = set()
        for _ in range(2):  # a second round for the records a redirect sent elsewhere
            by_node, asking = self._exists(prefix, suffixes, by_node, asking, answers, deadline)
            if not by_node:
                break
        found = 0
        for answer in answers:
            if not answer:
                break
            found += 1
        self._count("lookup_hits", found)
        return found

    def _exists(
        self,
        prefix: bytes,
        suffixes: list[bytes],
        by_node: dict[Node, list[int]],
        asking: set[int],
        answers: list[bool],
        deadline: float,
    ) -> tuple[dict[Node, list[int]], set[int]]:
        """EXISTS of each name, pipelined to its node, all nodes at once (ASKING first for those in
        `asking`); fills `answers`, and returns the names a redirect sent to another node."""
        head = EXISTS_HEAD % (len(prefix) + len(suffixes[0]), prefix)  # keys are all of one length
        requests = {
            node: [
                b"".join((ASKING if i in asking else b"") + head + suffixes[i] + b"\r\n" for i in places)
                if asking
                else head + (b"\r\n" + head).join([suffixes[i] for i in places]) + b"\r\n"
            ]
            for node, places in by_node.items()
            if places
        }
        counts = {node: len(places) + sum(i in asking for i in places) for node, places in by_node.items()}
        replies = self._fan_out(requests, counts, deadline, lookup=True)
        redirected: dict[Node, list[int]] = {}
        redirected_asking: set[int] = set()
        for node, places in by_node.items():
            got = iter(replies.get(node, ()))  # none: failed or too slow, these records are misses
            for i in places:
                if i in asking:
                    next(got, None)  # ASKING's OK
                reply = next(got, None)
                if reply.__class__ is int:
                    answers[i] = reply == 1
                elif isinstance(reply, Redirect):
                    self._count("redirects")
                    target = self.nodes.moved(reply)  # None: not announced (or one server): a miss
                    if target is None:
                        self._count("refused_redirects")
                        continue
                    if reply.ask:
                        redirected_asking.add(i)
                    redirected.setdefault(target, []).append(i)
        return redirected, redirected_asking

    def _fan_out(
        self, requests: dict[Node, list[bytes]], counts: dict[Node, int], deadline: float, lookup: bool
    ) -> dict[Node, list[Any]]:
        """Sends each node its commands, then reads its `counts[node]` replies, all nodes by
        `deadline`; a node missing from the result failed or was late. A `lookup`'s replies are
        one line each; for a lookup, a node that fails is down for retry_s and one past the
        deadline counts a slow lookup; for figures, neither."""
        sent: dict[Node, RecordConnection] = {}
        for node, commands in requests.items():
            connection = None
            try:
                connection = self._router.connection(node, max(deadline - self._clock(), 1e-3))
                connection.send(commands)
                sent[node] = connection
            except OSError as exc:
                if connection is not None:
                    self._router.drop_connection(node, connection)
                self._node_failed(node, exc, deadline, lookup)
        replies: dict[Node, list[Any]] = {}
        for node, connection in sent.items():
            try:
                connection.settimeout(max(deadline - self._clock(), 1e-3))
                count = counts[node]
                replies[node] = connection.line_replies(count) if lookup else connection.replies(count)
                node.slow_lookups = 0
                self._router.recovered(node)
            except (OSError, ValueError) as exc:
                self._router.drop_connection(node, connection)  # its replies may be half read
                self._node_failed(node, exc, deadline, lookup)
        return replies

    def _node_failed(self, node: Node, exc: Exception, deadline: float, lookup: bool) -> None:
        if not lookup:
            self._count("stats_failures")  # figures only: the node stays up
        elif isinstance(exc, TimeoutError) or self._clock() >= deadline:
            # A busy server (large writes ahead of it) can be slow once: that lookup is a miss.
            # Only a run of them takes the node out of Lookups for retry_s.
            self._count("lookup_timeouts")
            if self.nodes.slow(node):
                self._router.failed(node, f"{node.slow_lookups} lookups in a row", exc)
        else:
            self._router.failed(node, "a lookup", exc)

    def node_usage(self) -> list[NodeUsage]:
        """Each node's figures (INFO memory, DBSIZE), asked of all at once within lookup_timeout_s;
        a node that does not answer shows zeros. These count everything in that database."""
        nodes = [node for node in self.nodes.nodes() if node.role != "absent"]
        usable = [node for node in nodes if self.nodes.usable(node)] if not self._tier.closed else []
        requests = {node: [command(b"INFO", b"memory"), command(b"DBSIZE")] for node in usable}
        counts = {node: 2 for node in usable}
        replies = self._fan_out(requests, counts, self._clock() + self.config.lookup_timeout_s, lookup=False)
        usage = []
        for node in nodes:
            used = maximum = keys = 0
            got = replies.get(node)  # none: not asked (down), or failed (counted)
            try:
                if got is not None and isinstance(got[0], bytes) and isinstance(got[1], int):
                    text = got[0].decode(errors="replace")
                    info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
                    used, maximum = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
                    keys = got[1]
                elif got is not None:
                    self._count("stats_failures")  # an error reply
            except ValueError:
                self._count("stats_failures")  # figures that are not numbers
            usage.append(
                NodeUsage(str(node), node.role, self.nodes.usable(node), used, maximum, keys, node.errors)
            )
        return usage

    def server_usage(self) -> tuple[int, int, int]:
        """The server's (used memory, maxmemory (0: no limit), keys): `server_totals`."""
        return server_totals(self.node_usage())
