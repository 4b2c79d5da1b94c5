"""The load plans of the connector's scheduler side (`kvstore_client.vllm.scheduler`): which of
vLLM's blocks a request's hit chunks go into.

- `load_plans(req_id, state, groups, namespaces, block_ids, first, stop, ...)`: a `LoadSpec` per
  KV-cache group for hit chunks `[first, stop)`, into the blocks vLLM gave the request, less
  those the load must not write (vLLM's own prefix cache, a window's skipped blocks); a Mamba
  group's, the state after chunk `stop - 1` into the block vLLM gave that boundary.
- `null_head(table, null_block)`: how many leading entries of a block table are vLLM's null block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvstore_client.vllm.groups import MAMBA, Group
from kvstore_client.vllm.metadata import LoadSpec
from kvstore_client.vllm.prompts import PromptKeys


def load_plans(
    req_id: str,
    state: PromptKeys,
    groups: Sequence[Group],
    namespaces: Mapping[int, tuple[bytes, ...]],
    block_ids: Sequence[Sequence[int]],
    first: int,
    stop: int,
    *,
    chunk_tokens: int,
    block_size: int,
    null_block: int,
) -> list[LoadSpec]:
    chunk, local = chunk_tokens, state.local
    per_chunk = chunk // block_size
    plans = []
    for group in groups:
        group_namespaces = namespaces.get(group.index, ())
        table = list(block_ids[group.index]) if group.index < len(block_ids) else []
        if group.kind == MAMBA:
            plans += _state_load(req_id, state, group, group_namespaces, table, stop, chunk, null_block)
            continue
        # blocks the load must not write: vLLM's own (its prefix cache), a window's skipped ones
        writable = max(local // block_size, null_head(table, null_block))
        group_first = max(first, writable // per_chunk)
        if group_first >= stop:
            continue
        # the lookup made every rank's keys as far as the hit: a rank without them loads nothing
        # and its blocks are recomputed (`WorkerSide`)
        keys = [state.keys.get(namespace, [])[group_first:stop] for namespace in group_namespaces]
        plans.append(
            LoadSpec(
                req_id=req_id,
                keys=tuple(map(tuple, keys)),
                parent=state.keys[group_namespaces[0]][group_first - 1] if group_first else None,
                chunk_tokens=chunk,
                first=group_first,
                stop=stop,
                skip=writable - group_first * per_chunk,
                block_ids=tuple(table[group_first * per_chunk : stop * per_chunk]),
                group=group.index,
            )
        )
    return plans


def _state_load(
    req_id: str,
    state: PromptKeys,
    group: Group,
    namespaces: Sequence[bytes],
    table: list[int],
    stop: int,
    chunk_tokens: int,
    null_block: int,
) -> list[LoadSpec]:
    """The load of the state after chunk `stop - 1` into the block vLLM gave that boundary (the
    last of the hit: a Mamba group's block table holds a state per block, at its end)."""
    index = stop * chunk_tokens // group.block_size - 1
    if index >= len(table) or table[index] == null_block:
        return []  # no block to load into: the other groups' loads fail the request whole
    keys = tuple(tuple(state.keys.get(namespace, [])[stop - 1 : stop]) for namespace in namespaces)
    return [
        LoadSpec(
            req_id=req_id,
            keys=keys,
            parent=None,
            chunk_tokens=chunk_tokens,
            first=stop - 1,
            stop=stop,
            block_ids=(table[index],),
            group=group.index,
        )
    ]


def null_head(table: Sequence[int], null_block: int) -> int:
    """How many leading entries of a block table are vLLM's null block."""
    count = 0
    for block in table:
        if block != null_block:
            break
        count += 1
    return count
