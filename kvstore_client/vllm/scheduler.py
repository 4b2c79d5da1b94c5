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

Each request's chunk keys, and the memo of keys by vLLM's block hashes: `prompts.py`; the clients
per group and TP rank: `scheduler_clients.py`; the load and save plans: `scheduler_loads.py` and
`scheduler_saves.py`; the events: `scheduler_events.py`; the chunks whose loads failed lately:
`scheduler_failures.py`. A daemon that is down or slower than `lookup_timeout_s` makes a lookup a
miss; every call is bounded by that deadline and never raises (`KVStoreClient`).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent

from kvstore_client.vllm.config import ConnectorConfig, engine_specs
from kvstore_client.vllm.groups import MAMBA, Group, is_quantized
from kvstore_client.vllm.metadata import LoadSpec, StepMetadata, StoredChunks
from kvstore_client.vllm.prompts import KeyMemo, PromptKeys
from kvstore_client.vllm.scheduler_clients import GroupClients, close_clients, connected, make_clients
from kvstore_client.vllm.scheduler_events import chunk_events
from kvstore_client.vllm.scheduler_failures import FailedChunks
from kvstore_client.vllm.scheduler_loads import load_plans
from kvstore_client.vllm.scheduler_saves import chunk_saves, extend_tables, state_saves

log = logging.getLogger(__name__)

PROBE_TOKENS = 2048  # a lookup's first window (see `num_new_matched_tokens`)
ANSWER_STEPS = 8  # steps a waiting request's lookup answer is reused for (it asks every step)


class SchedulerSide:
    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, *, loads: bool, saves: bool
    ):
        self.vllm_config, self.kv_cache_config, self.config = vllm_config, kv_cache_config, config
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        engine_specs(vllm_config, kv_cache_config, config, 0)  # refuses what is not served, at start-up
        self._groups: list[GroupClients] = []
        if not is_quantized(vllm_config):  # else once the workers said their scales (`handshake`)
            self._make_clients("")
        self.block_size = vllm_config.cache_config.block_size
        # vLLM hashes each request's blocks at this size (HMA aside, its block size)
        self.hash_block = getattr(kv_cache_config, "hash_block_size", None) or self.block_size
        self.null_block = 0  # vLLM's null block (BlockPool), where a window's skipped blocks point
        self._memos: dict[bytes, KeyMemo] = {}  # per namespace (group and TP rank)
        self.loads, self.saves = loads, saves
        self._requests: dict[str, PromptKeys] = {}
        self._pending_loads: list[LoadSpec] = []
        self._held: set[str] = set()
        self._events: list[KVCacheEvent] = []
        # the prompts of requests with saves handed to the workers, until every rank reported
        # them done: a stored chunk's token ids for its BlockStored event
        self._prompts: dict[str, list[int]] = {}
        self._failed = FailedChunks()
        self.chunk_tokens = 0  # the daemon's, once connected
        self.namespaces: dict[int, tuple[bytes, ...]] = {}  # per group, per TP rank, once connected
        self.steps = 0

    def _make_clients(self, scales: str) -> None:
        close_clients(self._groups)
        self._groups = []  # none while the new ones are made
        self._groups = make_clients(self.vllm_config, self.kv_cache_config, self.config, scales)

    def handshake(self, scales: set[str]) -> None:
        """What the workers read at start-up: an fp8 cache's scales, which every rank must agree on."""
        if not is_quantized(self.vllm_config):
            return
        if len(scales) != 1:
            log.error("the TP ranks read different fp8 scales: nothing is loaded or saved")
            return
        self._make_clients(scales.pop())

    def bind_block_pool(self, block_pool: Any) -> None:
        self.null_block = int(block_pool.null_block.block_id)

    def _state(self, request: Any) -> PromptKeys | None:
        state = self._requests.get(request.request_id)
        if state is None:
            prompt = request.prompt_token_ids
            if not prompt:  # prompt embeddings: no token ids to key them by
                return None
            hashes = request.block_hashes
            if len(hashes) != request.num_tokens // self.hash_block:  # not hashed as expected: no memo
                hashes = ()
            state = self._requests[request.request_id] = PromptKeys(request, prompt, hashes)
        return state

    def _memo(self, client: Any) -> KeyMemo:
        memo = self._memos.get(client.namespace)
        if memo is None:
            chunk = client.spec.page.chunk_tokens
            # a chunk that does not end on a hashed block has no hash to be found by
            per_chunk = chunk // self.hash_block if chunk % self.hash_block == 0 else 0
            memo = self._memos[client.namespace] = KeyMemo(per_chunk)
        return memo

    def _clients(self) -> list[tuple[Group, list[Any]]] | None:
        """Each group and its connected clients, or None while any is not connected."""
        groups = connected(self._groups)
        if groups is None:
            return None
        self.chunk_tokens = groups[0][1][0].spec.page.chunk_tokens
        self.namespaces = {group.index: tuple(c.namespace for c in clients) for group, clients in groups}
        return groups

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        state = self._state(request)
        if state is None:
            return 0
        state.local = num_computed_tokens
        remembered = state.answer
        if (
            remembered is not None
            and remembered[0] == num_computed_tokens
            and self.steps - remembered[2] < ANSWER_STEPS
        ):
            return remembered[1]  # a request waiting for blocks asks every step: the answer holds a while
        clients = self._clients() if self.loads or self.saves else None
        if not self.loads or clients is None:
            return 0
        tokens = self._matched(state, request, num_computed_tokens, clients)
        state.answer = (num_computed_tokens, tokens, self.steps)
        return tokens

    def _matched(
        self, state: PromptKeys, request: Any, local: int, groups: list[tuple[Group, list[Any]]]
    ) -> int:
        chunk = self.chunk_tokens
        limit = min(state.num_prompt, state.limit)
        stateful = any(group.kind == MAMBA for group, _ in groups)
        if stateful:  # the hit ends on a boundary whose state is loaded, before the last token
            limit = min(limit, request.num_tokens - 1)
        first, whole = local // chunk, limit // chunk
        if whole <= first:
            return 0
        hit = whole
        # Groups of every token first (full attention, MLA), then the last stored state within
        # their hit, then the windows before it: a window cut short under a state misses.
        for group, clients in sorted(groups, key=lambda entry: _lookup_order(entry[0])):
            if hit <= first:
                return 0
            if group.kind == MAMBA:
                hit = self._state_hit(state, clients, first, hit)
                continue
            for client in clients:
                if hit <= first:
                    return 0
                if group.windowed:
                    reached = self._window_hit(state, client, group, first, hit, request.num_tokens)
                    if stateful and reached < hit:
                        return 0
                    hit = reached
                else:
                    hit = self._prefix_hit(state, client, first, hit)
        cut = self._failed.cut(state.keys.get(groups[0][1][0].namespace, []), first, hit)
        if stateful and cut < hit:
            return 0
        end = min(cut * chunk, request.num_tokens - 1)
        if self.block_size == 1 and end % chunk:  # the last chunk's last block would be missing
            end -= end % chunk
        return max(end - local, 0)

    def _state_hit(self, state: PromptKeys, clients: list[Any], first: int, stop: int) -> int:
        """`first` plus the chunks up to the last boundary in `(first, stop]` whose state every
        rank's namespace holds (`first` where there is none): states are kept only where a step
        of some engine ended, so they need not form a prefix."""
        held = [True] * (stop - first)
        for client in clients:
            keys = state.chunk_keys(client, stop, self._memo(client))[first:stop]
            held = [has and tier != 0 for has, tier in zip(held, client.lookup_each(keys), strict=True)]
        last = next((index for index in range(len(held) - 1, -1, -1) if held[index]), -1)
        return first + last + 1

    def _prefix_hit(self, state: PromptKeys, client: Any, first: int, stop: int) -> int:
        """`first` plus the stored chunks from `first` on under `client`'s namespace, up to `stop`.
        The chunks whose keys the memo holds (or PROBE_TOKENS' worth, where fewer) are looked
        up first, the rest only where all of those hit: the tokens past the first miss are never
        packed for a lookup (most prompts miss early)."""
        memo = self._memo(client)
        known = state.known(client, stop, memo)
        probe = min(stop, max(known, first + max(1, PROBE_TOKENS // self.chunk_tokens)))
        hit = first + client.lookup_chunks(state.chunk_keys(client, probe, memo)[first:])
        if hit == probe < stop:
            hit += client.lookup_chunks(state.chunk_keys(client, stop, memo)[probe:])
        return hit

    def _window_hit(
        self, state: PromptKeys, client: Any, group: Group, first: int, stop: int, tokens: int
    ) -> int:
        """How far the window's chunks of a windowed group are stored: `stop` where the chunks of
        the window before the resume point are, else the stored prefix."""
        end = min(stop * self.chunk_tokens, tokens - 1)
        start = max(first, group.window_start(end) // self.chunk_tokens)
        memo = self._memo(client)
        keys = state.chunk_keys(client, stop, memo)
        if client.lookup_chunks(keys[start:stop]) == stop - start:
            return stop
        return self._prefix_hit(state, client, first, stop)

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if num_external_tokens <= 0 or state is None or not self.chunk_tokens:
            return
        chunk, local = self.chunk_tokens, state.local
        first, stop = local // chunk, -(-(local + num_external_tokens) // chunk)
        self._pending_loads += load_plans(
            request.request_id,
            state,
            [group_clients.group for group_clients in self._groups],
            self.namespaces,
            blocks.get_block_ids(),
            first,
            stop,
            chunk_tokens=chunk,
            block_size=self.block_size,
            null_block=self.null_block,
        )
        state.loading = (first, stop)

    def build_metadata(self, scheduler_output: Any) -> StepMetadata:
        self.steps += 1
        meta = StepMetadata(
            namespaces=dict(self.namespaces),
            loads=self._pending_loads,
            held=self._held,
            preempted=set(scheduler_output.preempted_req_ids or ()),
        )
        self._pending_loads, self._held = [], set()
        groups = self._clients() if self.saves and self.chunk_tokens else None
        if groups is None:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = [list(ids) for ids in new.block_ids]
                computed = new.num_computed_tokens + scheduled[new.req_id]
                self._plan_save(meta, groups, new.req_id, state, computed)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            extend_tables(state, cached.new_block_ids[index], req_id in cached.resumed_req_ids)
            computed = cached.num_computed_tokens[index] + scheduled.get(req_id, 0)
            self._plan_save(meta, groups, req_id, state, computed)
        self._plan_state_saves(meta, groups, getattr(scheduler_output, "kv_connector_block_state", None))
        return meta

    def _plan_state_saves(
        self, meta: StepMetadata, groups: list[tuple[Group, list[Any]]], block_state: Any
    ) -> None:
        """Saves of the boundary states this step commits (`scheduler_saves.state_saves`)."""
        offers = getattr(block_state, "boundary_state_offloads", None)
        if not offers:
            return
        for state, spec in state_saves(offers, self._requests, groups, self.chunk_tokens, self._memo):
            meta.saves.append(spec)
            self._prompts[spec.req_id] = state.prompt
            state.saving = True

    def _plan_save(
        self,
        meta: StepMetadata,
        groups: list[tuple[Group, list[Any]]],
        req_id: str,
        state: PromptKeys,
        computed: int,
    ) -> None:
        loaded_from, _ = state.loading
        first = state.saved if loaded_from != 0 else max(state.saved, state.loading[1])
        stop = min(computed, state.num_prompt) // self.chunk_tokens
        if stop <= first:
            return
        planned = chunk_saves(
            groups,
            req_id,
            state,
            first,
            stop,
            chunk_tokens=self.chunk_tokens,
            block_size=self.block_size,
            null_block=self.null_block,
            memo=self._memo,
        )
        if planned is None:  # a block table does not reach `stop` yet
            return
        meta.saves.extend(planned)
        self._prompts[req_id] = state.prompt
        state.saved, state.saving = stop, True

    def finished(self, request: Any) -> bool:
        """Whether the request's blocks must wait for its saves (reported by `get_finished`)."""
        state = self._requests.pop(request.request_id, None)
        if state is None or not state.saving:
            return False
        self._held.add(request.request_id)
        return True

    def record(self, worker_meta: Any, finished_sending: set[str] | None) -> None:
        """Events for what the workers stored and found gone, and the loads that failed;
        `finished_sending`: the requests whose saves every rank has ended."""
        if isinstance(worker_meta, StoredChunks):
            self._events += chunk_events(worker_meta, self._prompts, self.chunk_tokens)
            self._record_failures(worker_meta.failed)
        for req_id in finished_sending or ():
            self._prompts.pop(req_id, None)

    def _record_failures(self, failed: list[tuple[str, int, int]]) -> None:
        """A chunk whose load failed is not offered again to its request (which recomputes it and
        saves it anew), nor for a while to any other (`FailedChunks`)."""
        if not failed or not self._groups:
            return
        namespace = self.namespaces.get(self._groups[0].group.index, (b"",))[0]
        lost = []
        for req_id, _group, index in failed:
            state = self._requests.get(req_id)
            if state is None:
                continue
            state.limit = min(state.limit, index * self.chunk_tokens)
            state.saved = min(state.saved, index)
            state.loading = (-1, 0)
            state.answer = None
            keys = state.keys.get(namespace, [])
            if index < len(keys):
                lost.append(keys[index])
        self._failed.add(lost)

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        close_clients(self._groups)


def _lookup_order(group: Group) -> int:
    """Groups of every token first, then states, then windows (see `_matched`)."""
    if group.kind == MAMBA:
        return 1
    return 2 if group.windowed else 0
