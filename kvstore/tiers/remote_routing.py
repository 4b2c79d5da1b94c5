"""How the remote tier (`remote`) reaches the node serving a record, and what a failure does.

- `Router(config, nodes, clock, count)`: `count(name)` counts an event in the tier's figures.
  - `routed(node, name, work, what)`: `work(connection, asking)` on this thread's connection to
    `node`, the one serving record `name` (None: down), following MOVED and ASK (at most
    `MAX_REDIRECTS` hops, only to nodes a slot map announced; one server's redirects are errors).
    A connection the server dropped (restart, idle timeout) is replaced and `work` run again
    once (`on_node`).
  - `connection(node, timeout_s, opened_only)`, `drop_connection(node, connection)`: each
    thread's connections, by node address; `close()` closes every one.
  - `failed(node, what, error)`: counted; the node is down for `retry_s` (warned once per
    outage); `recovered(node)`: it answered again.
- `NodeDown`: a miss, the record's node being down or failing just now.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvstore.config.root import RemoteTierConfig
from kvstore.tiers.remote_nodes import Node, Nodes
from kvstore.tiers.remote_resp import Address, RecordConnection, Redirect, RespError

log = logging.getLogger("kvstore.tiers.remote")

MAX_REDIRECTS = 3  # MOVED/ASK hops one read or write follows (a reshard moves a slot once)
REFUSED_WARNING_S = 10.0  # at most one warning this often for redirects not followed

Work = Callable[[RecordConnection, bool], Any]  # (connection, asking: after an ASK redirect)


class NodeDown(Exception):
    """A miss: the record's node is down (args[0] None: it was, or no node serves its slot yet),
    or failed just now (args[0]: the error, already counted and warned of)."""


class Router:
    """The remote tier's way to the node serving each record: its connections and their health."""

    def __init__(
        self,
        config: RemoteTierConfig,
        nodes: Nodes,
        clock: Callable[[], float],
        count: Callable[[str], None],
    ) -> None:
        self.config = config
        self.nodes = nodes
        self._clock = clock
        self._count = count
        self._lock = threading.Lock()
        self._refused_warned_at = -float("inf")
        self._local = threading.local()  # each thread's connections, by node address
        self._connections: set[RecordConnection] = set()

    def routed(self, node: Node | None, name: bytes, work: Work, what: str) -> Any:
        """`work` on the connection to `node`, the one serving `name` (None: it is down), following
        MOVED and ASK. Raises NodeDown(None) where that node is down, NodeDown(error) where it
        failed now (it is down for retry_s from here, warned once)."""
        asking = False
        for _ in range(MAX_REDIRECTS + 1):
            if node is None:
                raise NodeDown(None)
            try:
                result = self.on_node(node, work, asking)
            except Redirect as redirect:
                self._count("redirects")
                target = self.nodes.follow(redirect)
                if target is None:
                    self.refused(node, redirect, what)
                    raise NodeDown(redirect) from None
                node, asking = target, redirect.ask
                if not self.nodes.usable(node):
                    node = None
            except OSError as exc:
                self.failed(node, what, exc)
                raise NodeDown(exc) from exc
            else:
                self.recovered(node)
                return result
        error = RespError(f"more than {MAX_REDIRECTS} redirections for {name.decode()}")
        self.failed(node, what, error)
        raise NodeDown(error)

    def on_node(self, node: Node, work: Work, asking: bool = False) -> Any:
        """`work(connection)` on this worker's connection to `node`. A connection that fails after
        serving earlier calls (the server restarted, or closed it as idle) is replaced once and
        `work` run again."""
        connection = self.connection(node, self.config.timeout_s, opened_only=True)
        if connection is not None:
            try:
                return work(connection, asking)
            except Redirect:
                raise
            except (ConnectionError, EOFError):  # dropped by the server: try a fresh one, once
                self.drop_connection(node, connection)
            except BaseException:  # a timeout or an error reply: not tried again
                self.drop_connection(node, connection)
                raise
        connection = self.connection(node, self.config.timeout_s)
        try:
            return work(connection, asking)
        except Redirect:
            raise
        except BaseException:
            self.drop_connection(node, connection)
            raise

    def refused(self, node: Node | None, redirect: Redirect, what: str) -> None:
        """A redirect not followed: one server's (an error: that server is down for retry_s), or a
        cluster's to an address no slot map announced (a miss). Counted, warned of now and then."""
        self._count("refused_redirects")
        if not self.nodes.cluster:
            self.failed(node, what, RespError(f"it answered {redirect}, and tiers.remote.cluster is false"))
            return
        with self._lock:
            now = self._clock()
            if now < self._refused_warned_at + REFUSED_WARNING_S:
                return
            self._refused_warned_at = now
        log.warning(
            "remote tier: node %s redirected %s to %s, which no CLUSTER SLOTS of the cluster announces; "
            "not followed (a miss)",
            node,
            what,
            redirect.address,
        )

    def connection(self, node: Node, timeout_s: float, opened_only: bool = False) -> Any:
        """This thread's connection to `node` (opened now unless `opened_only`: then None if
        there is none), with `timeout_s` for each send and receive."""
        connections: dict[Address, RecordConnection] | None = getattr(self._local, "connections", None)
        if connections is None:
            connections = self._local.connections = {}
        connection = connections.get(node.address)
        if connection is None:
            if opened_only:
                return None
            connection = connections[node.address] = RecordConnection.open(node.endpoint, timeout_s)
            with self._lock:
                self._connections.add(connection)
        connection.settimeout(timeout_s)
        return connection

    def drop_connection(self, node: Node, connection: RecordConnection) -> None:
        connection.close()
        getattr(self._local, "connections", {}).pop(node.address, None)
        with self._lock:
            self._connections.discard(connection)

    def recovered(self, node: Node) -> None:
        if self.nodes.recovered(node):
            log.info("remote tier %s: answering again", self.where(node))

    def where(self, node: Node) -> str:
        return f"node {node} of cluster" if self.nodes.cluster else self.config.where

    def failed(self, node: Node | None, what: str, exc: BaseException) -> None:
        self._count("errors")
        if node is None or not self.nodes.failed(node):
            return
        self._count("outages")
        log.warning(
            "remote tier %s: %s failed (%s); its pages are misses for %.1f s, then it is tried again",
            self.where(node),
            what,
            exc,
            self.config.retry_s,
        )

    def close(self) -> None:
        """Closes every thread's connections."""
        with self._lock:
            connections, self._connections = self._connections, set()
        for connection in connections:
            connection.close()
