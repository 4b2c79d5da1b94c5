"""What the connector's scheduler side tells its workers each step, and what they tell it back.

Chunk `c` of a request is its prompt tokens `[c * chunk_tokens, (c + 1) * chunk_tokens)`; its
blocks are `block_ids[c * blocks_per_chunk : (c + 1) * blocks_per_chunk]` of the request's
block table. The chunks travel as their keys, one tuple per TP rank (each rank stores its heads
under its own namespace, `StepMetadata.namespaces`): the scheduler side makes them once, most
from its memo of earlier prompts' keys, so no token id is packed, hashed or pickled twice.

- `LoadSpec`: load chunks `[first, stop)` into `block_ids` (the blocks of those chunks); vLLM
  already holds the first `skip` blocks of chunk `first` (its own prefix cache), which the load
  must not write.
- `SaveSpec`: store chunks `[first, stop)` from `block_ids`.
- `StepMetadata`: one step's loads and saves, the finished requests whose blocks vLLM holds until
  every worker has saved them (`held`), and the preempted ones, whose saves must end before their
  blocks are reused.
- `StoredChunks`: worker -> scheduler, the chunks a step committed or found missing, for KV events,
  and the chunks whose loads failed, which the scheduler does not offer again for a while.
- `Handshake`: worker -> scheduler once at start-up (vLLM's handshake metadata): what the workers
  read that the namespaces depend on (an fp8 cache's scales).

Every spec names its KV-cache group (`kvstore_client.vllm.groups`); a hybrid model's request has a
load and a save per group, each with the keys of that group's namespace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class SaveSpec:
    """Chunks `[first, stop)` of a request and their blocks."""

    req_id: str
    keys: tuple[tuple[bytes, ...], ...]  # per TP rank: the keys of chunks [first, stop)
    parent: bytes | None  # rank 0's key of chunk first - 1 (None for chunk 0), for KV events
    chunk_tokens: int
    first: int
    stop: int
    block_ids: tuple[int, ...]
    group: int = 0  # vLLM's KV-cache group id


@dataclass(frozen=True)
class LoadSpec(SaveSpec):
    skip: int = 0  # blocks of chunk `first` that vLLM holds: never written

    def target_blocks(self, blocks_per_chunk: int, first: int, stop: int) -> list[int]:
        """The blocks chunks `[first, stop)` write: their blocks without the `skip` vLLM holds."""
        start = max((first - self.first) * blocks_per_chunk, self.skip)
        return list(self.block_ids[start : (stop - self.first) * blocks_per_chunk])


@dataclass
class StepMetadata(KVConnectorMetadata):
    namespaces: dict[int, tuple[bytes, ...]] = field(default_factory=dict)  # per group, per TP rank
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    held: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)


@dataclass
class StoredChunks(KVConnectorWorkerMetadata):
    """The chunks a worker's commits stored (request, chunk index, key, parent key or None) and the
    keys its loads found gone, under that worker's namespace: TP rank 0 reports, the others do not."""

    stored: list[tuple[str, int, bytes, bytes | None]] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    failed: list[tuple[str, int, int]] = field(
        default_factory=list
    )  # (request, group, first chunk not loaded)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, StoredChunks):
            self.stored.extend(other.stored)
            self.removed.extend(other.removed)
            self.failed.extend(other.failed)
        return self


@dataclass
class Handshake(KVConnectorHandshakeMetadata):
    scales: str = ""  # `groups.scales_text` of an fp8 cache's layers; empty for others
