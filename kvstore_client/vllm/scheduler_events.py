"""The KV events of the connector's scheduler side (`kvstore_client.vllm.scheduler`): what the
workers' commits stored and what their loads found gone, named by rank 0's chunk keys.

- `chunk_events(report, prompts, chunk_tokens)`: a BlockStored per chunk a commit stored (its
  key, its parent's, its tokens from the request's prompt) and a BlockRemoved for the chunks a
  load found gone.
- `MEDIUM`: the medium the events name, where a committed page lands first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvstore_client.vllm.metadata import StoredChunks

MEDIUM = "CPU"  # where a committed page lands first: the daemon's shared-memory arena


def chunk_events(
    report: StoredChunks, prompts: Mapping[str, Sequence[int]], chunk_tokens: int
) -> list[KVCacheEvent]:
    chunk = chunk_tokens
    events: list[KVCacheEvent] = []
    for req_id, index, key, parent in report.stored:
        prompt = prompts.get(req_id, ())
        events.append(
            BlockStored(
                block_hashes=[key],
                parent_block_hash=parent,
                token_ids=list(prompt[index * chunk : (index + 1) * chunk]),
                block_size=chunk,
                lora_id=None,
                medium=MEDIUM,
                lora_name=None,
            )
        )
    if report.removed:
        events.append(BlockRemoved(block_hashes=list(report.removed), medium=MEDIUM))
    return events
