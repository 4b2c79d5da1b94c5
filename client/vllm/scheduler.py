"""The connector's scheduler side: what kvstore holds of a prompt, and which chunks move each step.

- `num_new_matched_tokens`: one Lookup per TP rank (each rank stores its heads under its own
  namespace), from the chunk holding the first token vLLM has not computed; the hit is the
  shortest of the ranks', so every rank can load what the scheduler promises. At most
  `num_tokens - 1` tokens: vLLM computes the last one for its logits.
- `after_alloc`: the load of the hit chunks into the blocks vLLM gave the request.
- `build_metadata`: this step's loads, the saves of the prompt chunks this step completes, the
  finished requests whose blocks wait for their saves, and the preempted ones.
- `finished`: whether vLLM must keep a finished request's blocks until the workers saved them.
- `events`: BlockStored / BlockRemoved for what the workers' commits stored and their loads
  found gone (medium CPU: kvstore's arena).

A daemon that is down or slower than `lookup_timeout_s` makes a lookup a miss; every call is
bounded by that deadline and never raises (`KVStoreClient`).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvstore.keys import chain_keys
from kvstore_client.vllm.config import ConnectorConfig, engine_spec
from kvstore_client.vllm.connection import LazyClient
from kvstore_client.vllm.metadata import LoadSpec, SaveSpec, StepMetadata, StoredChunks

MEDIUM = "CPU"  # where a committed page lands first: the daemon's shared-memory arena
PROBE_TOKENS = 2048  # a lookup's first window (see `num_new_matched_tokens`)


class _Request:
    """What the scheduler side keeps of one request. The prompt is packed (int32 LE) and hashed
    chunk by chunk as far as a lookup or a save needs: packing is most of a lookup's cost
    (~11 ns a token), and most lookups end a few chunks in."""

    __slots__ = ("prompt", "packed", "num_prompt", "keys", "local", "block_ids", "saved", "saving")

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        self.packed = bytearray()
        self.num_prompt = len(prompt)
        self.keys: dict[bytes, list[bytes]] = {}  # per namespace (TP rank): its first chunks' keys
        self.local = 0  # tokens vLLM had computed when the lookup was made
        self.block_ids: list[int] = []
        self.saved = 0  # leading chunks saved, or known stored
        self.saving = False  # some save was handed to the workers

    def pack(self, stop: int) -> None:
        """Packs the prompt's tokens up to `stop`."""
        have = len(self.packed) // 4
        if have < stop:
            self.packed += struct.pack(f"<{stop - have}i", *self.prompt[have:stop])

    def tokens(self, stop: int) -> bytes:
        """The first `stop` tokens, packed."""
        self.pack(stop)
        return bytes(self.packed[: stop * 4])

    def chunk_keys(self, client: Any, stop: int) -> list[bytes]:
        """The keys of chunks `[0, stop)` under `client`'s namespace (made once, extended as needed)."""
        keys = self.keys.setdefault(client.namespace, [])
        if len(keys) < stop:
            chunk = client.spec.page.chunk_tokens
            self.pack(stop * chunk)
            with memoryview(self.packed) as packed, packed[len(keys) * chunk * 4 : stop * chunk * 4] as new:
                keys += chain_keys(keys[-1] if keys else client.namespace, new, chunk)
        return keys[:stop]


class SchedulerSide:
    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, *, loads: bool, saves: bool
    ):
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._ranks = [
            LazyClient(
                config.address,
                engine_spec(vllm_config, kv_cache_config, config, rank),
                timeout_s=config.lookup_timeout_s,
                token=config.token,
                pin_arena=False,  # the scheduler moves no bytes
                name=f"vllm-scheduler-tp{rank}",
            )
            for rank in range(tp_size)
        ]
        self.block_size = vllm_config.cache_config.block_size
        self.loads, self.saves = loads, saves
        self._requests: dict[str, _Request] = {}
        self._pending_loads: list[LoadSpec] = []
        self._held: set[str] = set()
        self._events: list[KVCacheEvent] = []
        self.chunk_tokens = 0  # the daemon's, once connected

    def _state(self, request: Any) -> _Request | None:
        state = self._requests.get(request.request_id)
        if state is None:
            prompt = request.prompt_token_ids
            if not prompt:  # prompt embeddings: no token ids to key them by
                return None
            state = self._requests[request.request_id] = _Request(prompt)
        return state

    def _clients(self) -> list[Any] | None:
        clients = [rank.get() for rank in self._ranks]
        if any(client is None for client in clients):
            return None
        self.chunk_tokens = clients[0].spec.page.chunk_tokens
        return clients

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        state = self._state(request)
        if state is None:
            return 0
        state.local = num_computed_tokens
        clients = self._clients() if self.loads or self.saves else None
        if not self.loads or clients is None:
            return 0
        chunk = self.chunk_tokens
        first, whole = num_computed_tokens // chunk, state.num_prompt // chunk
        if whole <= first:
            return 0
        # Rank 0 first looks up the chunks of PROBE_TOKENS, then, where all of them hit, the rest:
        # the tokens past the first miss are never packed for a lookup (most prompts miss early).
        stop = min(whole, first + max(1, PROBE_TOKENS // chunk))
        hit = first + clients[0].lookup_chunks(state.chunk_keys(clients[0], stop)[first:])
        if hit == stop < whole:
            hit += clients[0].lookup_chunks(state.chunk_keys(clients[0], whole)[stop:])
        for client in clients[1:]:  # every rank must hold what is promised
            if hit <= first:
                break
            hit = first + client.lookup_chunks(state.chunk_keys(client, hit)[first:])
        end = min(hit * chunk, request.num_tokens - 1)
        if self.block_size == 1 and end % chunk:  # the last chunk's last block would be missing
            end -= end % chunk
        return max(end - num_computed_tokens, 0)

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if num_external_tokens <= 0 or state is None or not self.chunk_tokens:
            return
        chunk, local = self.chunk_tokens, state.local
        first, stop = local // chunk, -(-(local + num_external_tokens) // chunk)
        per_chunk = chunk // self.block_size
        self._pending_loads.append(
            LoadSpec(
                req_id=request.request_id,
                tokens=state.tokens(stop * chunk),
                chunk_tokens=chunk,
                first=first,
                stop=stop,
                skip=(local - first * chunk) // self.block_size,
                block_ids=tuple(block_ids[first * per_chunk : stop * per_chunk]),
            )
        )
        if first == 0:  # the chunks before `stop` are stored: no need to save them again
            state.saved = max(state.saved, stop)

    def build_metadata(self, scheduler_output: Any) -> StepMetadata:
        meta = StepMetadata(
            loads=self._pending_loads,
            held=self._held,
            preempted=set(scheduler_output.preempted_req_ids or ()),
        )
        self._pending_loads, self._held = [], set()
        if not self.saves or not self.chunk_tokens:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan_save(meta, new.req_id, state, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_block_ids = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:  # a resumed request gets its whole block table anew
                state.block_ids = list(new_block_ids[0]) if new_block_ids else []
            elif new_block_ids:
                state.block_ids.extend(new_block_ids[0])
            self._plan_save(meta, req_id, state, cached.num_computed_tokens[index] + scheduled.get(req_id, 0))
        return meta

    def _plan_save(self, meta: StepMetadata, req_id: str, state: _Request, computed: int) -> None:
        chunk = self.chunk_tokens
        per_chunk = chunk // self.block_size
        stop = min(computed, state.num_prompt) // chunk
        if stop <= state.saved or len(state.block_ids) < stop * per_chunk:
            return
        meta.saves.append(
            SaveSpec(
                req_id=req_id,
                tokens=state.tokens(stop * chunk),
                chunk_tokens=chunk,
                first=state.saved,
                stop=stop,
                block_ids=tuple(state.block_ids[state.saved * per_chunk : stop * per_chunk]),
            )
        )
        state.saved, state.saving = stop, True

    def finished(self, request: Any) -> bool:
        """Whether the request's blocks must wait for its saves (reported by `get_finished`)."""
        state = self._requests.pop(request.request_id, None)
        if state is None or not state.saving:
            return False
        self._held.add(request.request_id)
        return True

    def record(self, worker_meta: Any) -> None:
        if not isinstance(worker_meta, StoredChunks):
            return
        for key, parent, tokens in worker_meta.stored:
            self._events.append(
                BlockStored(
                    block_hashes=[key],
                    parent_block_hash=parent,
                    token_ids=np.frombuffer(tokens, "<i4").tolist(),
                    block_size=len(tokens) // 4,
                    lora_id=None,
                    medium=MEDIUM,
                    lora_name=None,
                )
            )
        if worker_meta.removed:
            self._events.append(BlockRemoved(block_hashes=list(worker_meta.removed), medium=MEDIUM))

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        for rank in self._ranks:
            rank.close()
