"""The clients of the connector's scheduler side (`kvstore_client.vllm.scheduler`): one per
KV-cache group and TP rank, each rank's under its own namespace.

- `GroupClients(group, ranks)`: one group's clients, one per TP rank (one for a group every rank
  holds alike).
- `make_clients(vllm_config, kv_cache_config, config, scales)`: those of every served group, made
  once the namespaces are known (an fp8 cache's after the handshake): the first group's clients
  connect, the others' are their siblings (one connection per rank).
- `connected(groups)`: each group and its connected clients, or None while any is not connected.
- `close_clients(groups)`: closes them all, siblings before the clients they share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore_client.vllm.config import ConnectorConfig, engine_specs
from kvstore_client.vllm.connection import LazyClient
from kvstore_client.vllm.groups import Group


class GroupClients:
    """One KV-cache group's clients on the scheduler side: one per TP rank (one for a group every
    rank holds alike), made once the namespaces are known (an fp8 cache's after the handshake)."""

    def __init__(self, group: Group, ranks: list[LazyClient]) -> None:
        self.group = group
        self.ranks = ranks


def make_clients(
    vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, scales: str
) -> list[GroupClients]:
    ranks = range(vllm_config.parallel_config.tensor_parallel_size)
    per_rank = [engine_specs(vllm_config, kv_cache_config, config, r, scales) for r in ranks]
    groups: list[GroupClients] = []
    for index, (group, _) in enumerate(per_rank[0]):
        specs = [per_rank[0][index][1]] if group.replicated else [per_rank[r][index][1] for r in ranks]
        # the first group's clients connect; the others' are their siblings (one connection)
        parents = groups[0].ranks if groups else []
        clients = [
            LazyClient(
                config.address,
                spec,
                parent=parents[min(rank, len(parents) - 1)] if parents else None,
                timeout_s=config.lookup_timeout_s,
                token=config.token,
                pin_arena=False,  # the scheduler moves no bytes
                name=f"vllm-scheduler-g{group.index}-tp{spec.tp_rank}",
            )
            for rank, spec in enumerate(specs)
        ]
        groups.append(GroupClients(group, clients))
    return groups


def connected(groups: Sequence[GroupClients]) -> list[tuple[Group, list[Any]]] | None:
    """Each group and its connected clients, or None while any is not connected."""
    if not groups:
        return None
    found = []
    for group_clients in groups:
        clients = [rank.get() for rank in group_clients.ranks]
        if any(client is None for client in clients):
            return None
        found.append((group_clients.group, clients))
    return found


def close_clients(groups: Sequence[GroupClients]) -> None:
    for group_clients in reversed(groups):  # siblings before the clients they share
        for rank in group_clients.ranks:
            rank.close()
