"""One KV-cache group on the connector's worker side (`kvstore_client.vllm.worker`).

- `GroupSide(group, spec, config, tp_rank)`: the group's client (its own namespace) and, once
  vLLM registered the caches (`register`), its tensors as the kernels take them.
- `GroupSide.client(chunk_tokens)`: the client, where it is connected and the daemon's chunk
  size is the scheduler's.
- `GroupSide.scratch_cache(blocks)`: one chunk's blocks of every layer of the group, shaped like
  vLLM's, for a chunk whose first blocks vLLM holds (made once per size).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

import kvstore_kernels
from kvstore.shared.spec import KVSpec
from kvstore_client.client import KVStoreClient
from kvstore_client.vllm.config import ConnectorConfig
from kvstore_client.vllm.connection import LazyClient
from kvstore_client.vllm.groups import Group
from kvstore_client.vllm.layouts import GroupCache, group_cache


class GroupSide:
    """One KV-cache group on this worker: its client (its own namespace) and, once vLLM registered
    the caches, its tensors as the kernels take them."""

    def __init__(self, group: Group, spec: KVSpec, config: ConnectorConfig, tp_rank: int) -> None:
        self.group = group
        self.spec = spec
        self.layer_index = {name: index for index, name in enumerate(group.layer_names)}
        self.conn = LazyClient(
            config.address,
            spec,
            timeout_s=config.timeout_s,
            token=config.token,
            name=f"vllm-tp{tp_rank}-g{group.index}",
        )
        self.cache: GroupCache | None = None
        self.registered: Any = None  # kvstore_kernels.register's view of cache.tensors
        self.scratch: list[torch.Tensor] | None = None

    def register(
        self, vllm_config: Any, kv_caches: dict[str, torch.Tensor], scales: str, parent: LazyClient | None
    ) -> None:
        self.spec = replace(self.spec, scales=scales)
        self.cache = group_cache(vllm_config, self.group, self.spec, kv_caches)
        # the client moves pages with the layout and (kernel) block size the tensors hold
        self.conn = self.conn.with_spec(self.cache.spec, parent)
        kernel = self.cache.spec
        self.registered = kvstore_kernels.register(
            kernel.with_chunk_tokens(kernel.block_size), list(self.cache.tensors)
        )

    def client(self, chunk_tokens: int) -> KVStoreClient | None:
        """The client, where it is connected and the daemon's chunk size is the scheduler's."""
        client = self.conn.get() if self.cache is not None else None
        if client is None or client.spec.page.chunk_tokens != chunk_tokens:
            return None
        return client

    def scratch_cache(self, blocks: int) -> list[torch.Tensor]:
        """One chunk's blocks of every layer of the group, shaped like vLLM's (made once per size)."""
        assert self.cache is not None
        if self.scratch is None or self.scratch[0].shape[0] != blocks:
            like = self.cache.tensors[0]
            shape = (blocks, *like.shape[1:])
            self.scratch = [
                torch.empty(shape, dtype=like.dtype, device=like.device) for _ in self.cache.tensors
            ]
        return self.scratch
