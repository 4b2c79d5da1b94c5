"""The save plans of the connector's scheduler side (`kvstore_client.vllm.scheduler`): which
of vLLM's blocks the workers gather a step's newly computed prompt chunks from.

- `chunk_saves(groups, req_id, state, first, stop, ...)`: a `SaveSpec` per KV-cache group of KV
  for prompt chunks `[first, stop)` (a window's positions outside each chunk's own window read
  from the null block's zeros); None while some group's block table does not reach `stop`.
- `state_saves(offers, requests, groups, chunk_tokens, memo)`: the saves of the boundary states
  vLLM offers this step, in the blocks it names, each under the key of the chunk the boundary ends.
- `extend_tables(state, new_block_ids, resumed)`: a request's block tables with the blocks a step gave it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from kvstore_client.vllm.groups import MAMBA, Group
from kvstore_client.vllm.metadata import SaveSpec
from kvstore_client.vllm.prompts import KeyMemo, PromptKeys

Memo = Callable[[Any], KeyMemo]  # a client's namespace's memo of chunk keys


def chunk_saves(
    groups: Sequence[tuple[Group, list[Any]]],
    req_id: str,
    state: PromptKeys,
    first: int,
    stop: int,
    *,
    chunk_tokens: int,
    block_size: int,
    null_block: int,
    memo: Memo,
) -> list[SaveSpec] | None:
    chunk = chunk_tokens
    per_chunk = chunk // block_size
    planned = []
    for group, clients in groups:
        if group.kind == MAMBA:  # its states: as vLLM offers them (`state_saves`)
            continue
        table = state.block_ids[group.index] if group.index < len(state.block_ids) else []
        if len(table) < stop * per_chunk:
            return None
        blocks = list(table[first * per_chunk : stop * per_chunk])
        if group.windowed:  # positions outside each chunk's own window: the null block's zeros
            for offset in range(len(blocks)):
                block_end = (first * per_chunk + offset + 1) * block_size
                chunk_end = (first + offset // per_chunk + 1) * chunk
                if block_end <= group.window_start(chunk_end):
                    blocks[offset] = null_block
        keys = [state.chunk_keys(client, stop, memo(client)) for client in clients]
        planned.append(
            SaveSpec(
                req_id=req_id,
                keys=tuple(tuple(rank_keys[first:stop]) for rank_keys in keys),
                parent=keys[0][first - 1] if first else None,
                chunk_tokens=chunk,
                first=first,
                stop=stop,
                block_ids=tuple(blocks),
                group=group.index,
            )
        )
    return planned


def state_saves(
    offers: Mapping[str, Any],
    requests: Mapping[str, PromptKeys],
    groups: Sequence[tuple[Group, list[Any]]],
    chunk_tokens: int,
    memo: Memo,
) -> Iterator[tuple[PromptKeys, SaveSpec]]:
    """Saves of the boundary states this step commits, in the blocks vLLM names (a Mamba
    group's block table is not a list of positions to read from: vLLM frees and moves its
    blocks), each under the key of the chunk the boundary ends; with the request's state."""
    chunk = chunk_tokens
    stateful = {group.index: (group, clients) for group, clients in groups if group.kind == MAMBA}
    for req_id, entries in offers.items():
        state = requests.get(req_id)
        if state is None:
            continue
        for group_id, block_id, boundary in entries:
            entry = stateful.get(group_id)
            if entry is None or boundary <= 0 or boundary % chunk or boundary > state.num_prompt:
                continue  # not a chunk of the prompt's: no key names it
            group, clients = entry
            stop = boundary // chunk
            keys = [state.chunk_keys(client, stop, memo(client)) for client in clients]
            yield (
                state,
                SaveSpec(
                    req_id=req_id,
                    keys=tuple((rank_keys[stop - 1],) for rank_keys in keys),
                    parent=None,
                    chunk_tokens=chunk,
                    first=stop - 1,
                    stop=stop,
                    block_ids=(int(block_id),),
                    group=group.index,
                ),
            )


def extend_tables(state: PromptKeys, new_block_ids: Any, resumed: bool) -> None:
    """`state`'s block tables with the blocks a step gave the request (a resumed request gets
    its whole block table anew)."""
    if resumed:
        state.block_ids = [list(ids) for ids in new_block_ids] if new_block_ids else []
    elif new_block_ids:
        if not state.block_ids:
            state.block_ids = [[] for _ in new_block_ids]
        for table, ids in zip(state.block_ids, new_block_ids, strict=False):
            table.extend(ids)
