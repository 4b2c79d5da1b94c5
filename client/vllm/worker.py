"""The connector's worker side: moves one TP rank's pages between vLLM's KV cache and kvstored.

- Loads (`start_loads`) scatter each request's hit chunks into the blocks the scheduler named,
  on a side stream ordered after the work already queued. A chunk whose first blocks vLLM
  already holds (its own prefix cache reached into it) is scattered into a one-chunk scratch
  cache, and only its remaining blocks are copied into vLLM's: a block vLLM holds is never
  written. With `load_mode: async` the request waits outside the forward and `finished_loads`
  reports it once its copy is done; with `layerwise` the copy runs beside this step's forward
  and `wait_layer(i)` makes layer i's attention wait for layer i's pages only.
- A chunk that could not be read back (gone from the daemon, a lease that lapsed, the daemon
  down) makes its blocks, and every block after them, a load error: vLLM recomputes exactly
  those tokens and never runs on bytes that were not loaded. A model of several KV-cache groups
  reports the request failed instead (vLLM cannot map a block id to a request across groups)
  and vLLM recomputes all of it.
- Saves (`start_saves`) gather the prompt chunks this step completed after the forward, as one
  call per request and all layers at once: a per-layer save would cost the host a call per
  layer inside the forward, and the gather on the side stream overlaps the next step anyway.
  Commits follow as gathers finish; a finished request's blocks are reported free
  (`finished_saves`) only after its commits, and a preempted request's saves end before its
  blocks can be reused (`settle`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from typing import Any

import torch

import kvstore_kernels
from kvstore.spec import KVSpec
from kvstore_client.client import KVStoreClient
from kvstore_client.handles import LoadHandle, StoreHandle
from kvstore_client.vllm.config import ConnectorConfig
from kvstore_client.vllm.connection import LazyClient
from kvstore_client.vllm.groups import MAMBA, Group, is_quantized, scales_text
from kvstore_client.vllm.layouts import GroupCache, group_cache, layer_scales
from kvstore_client.vllm.metadata import Handshake, LoadSpec, SaveSpec, StepMetadata, StoredChunks

log = logging.getLogger(__name__)


class _Load:
    """One request's load: its parts (a handle and the chunks it covers), the event after its
    scratch copy (every layer of the first chunk, queued before the other chunks) and the event
    after all of it (None on the CPU, where both are done when the load starts)."""

    def __init__(
        self,
        spec: LoadSpec,
        parts: list[tuple[LoadHandle, int, int]],
        copied: Any = None,
        event: Any = None,
    ) -> None:
        self.spec = spec
        self.parts = parts
        self.copied = copied
        self.event = event

    def done(self) -> bool:
        return (self.event is None or self.event.query()) and all(
            handle.done() for handle, _, _ in self.parts
        )


class _GroupSide:
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


class WorkerSide:
    def __init__(
        self,
        vllm_config: Any,
        groups: list[Group],
        specs: list[KVSpec],
        config: ConnectorConfig,
        tp_rank: int,
        *,
        saves: bool,
        save_to_gpu: bool = False,
    ) -> None:
        self.vllm_config = vllm_config
        self.tp_rank = tp_rank
        self.groups = {
            group.index: _GroupSide(group, spec, config, tp_rank)
            for group, spec in zip(groups, specs, strict=True)
        }
        self.layer_group = {name: side for side in self.groups.values() for name in side.group.layer_names}
        self.saves = saves
        self.save_to_gpu = save_to_gpu  # saves land in the GPU tier's pool on this GPU (`save_to`)
        self.layerwise = config.load_mode == "layerwise"
        self.reports = tp_rank == 0  # KV events speak of rank 0's keys
        self.handshake = Handshake()
        self._stream: Any = None
        self._namespaces: dict[int, tuple[bytes, ...]] = {}  # the step's, per group and TP rank
        self._loading: dict[str, list[_Load]] = {}  # async loads in flight, one per group
        self._step_loads: list[_Load] = []  # layer-wise loads of the current step
        self._saving: dict[str, list[tuple[StoreHandle, SaveSpec]]] = {}
        self._errors: set[int] = set()
        self._failed: set[str] = set()  # requests whose loads failed (several groups: see `_finish`)
        self._finished: set[str] = set()  # finished while loading: forgotten once loaded
        self._report = StoredChunks()

    # -- set-up -------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        scales = ""
        if is_quantized(self.vllm_config):
            names = [
                name
                for side in self.groups.values()
                if side.group.kind != MAMBA  # states carry no scales
                for name in side.group.layer_names
            ]
            scales = scales_text(layer_scales(self.vllm_config, names))
        self.handshake = Handshake(scales=scales)
        first: LazyClient | None = None
        for side in self.groups.values():  # the first group's client, and its siblings
            side.register(self.vllm_config, kv_caches, scales, first)
            first = first or side.conn
        cache = next(iter(self.groups.values())).cache
        if cache is not None and cache.tensors[0].is_cuda:
            self._stream = torch.cuda.Stream(cache.tensors[0].device)
        for side in self.groups.values():
            side.conn.get()  # connect now where the daemon is up, not in the first step

    def _keys_of(self, side: _GroupSide, client: KVStoreClient, spec: SaveSpec) -> tuple[bytes, ...] | None:
        """This rank's keys of chunks `[spec.first, spec.stop)` of the spec's group; None where the
        scheduler made none for it or made them under another namespace than this rank's client has."""
        rank = 0 if side.group.replicated else self.tp_rank
        namespaces = self._namespaces.get(spec.group, ())
        if rank >= len(namespaces) or namespaces[rank] != client.namespace:
            return None
        keys = spec.keys[rank] if rank < len(spec.keys) else ()
        return keys if len(keys) == spec.stop - spec.first else None

    def _ordered_stream(self) -> Any:
        """The side stream, after the work queued so far (a block's last writer, the forward)."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        return self._stream

    # -- loads --------------------------------------------------------------

    def start_loads(self, meta: StepMetadata) -> None:
        self._namespaces = dict(meta.namespaces)
        for spec in meta.loads:
            load = self._start_load(spec)
            if self.layerwise:
                self._step_loads.append(load)
            else:
                self._loading.setdefault(spec.req_id, []).append(load)

    def _start_load(self, spec: LoadSpec) -> _Load:
        side = self.groups.get(spec.group)
        client = side.client(spec.chunk_tokens) if side is not None else None
        if side is None or client is None or side.cache is None:
            return _Load(spec, [])
        keys = self._keys_of(side, client, spec)
        if keys is None:
            return _Load(spec, [])
        cache = side.cache
        ratio, per_chunk = cache.ratio, spec.chunk_tokens // cache.spec.block_size
        stream = self._ordered_stream()
        parts: list[tuple[LoadHandle, int, int]] = []
        first, copied = spec.first, None
        try:
            if spec.skip:  # the chunk's first blocks are vLLM's (or none): through the scratch cache
                scratch = self._scratch_cache(side, per_chunk)
                handle = client.load_async(
                    None, scratch, list(range(per_chunk)), keys=keys[:1], stream=stream
                )
                parts.append((handle, first, first + 1))
                if handle.tokens:
                    target = cache.kernel_blocks(spec.block_ids[spec.skip : per_chunk // ratio])
                    self._copy_blocks(cache, scratch, spec.skip * ratio, target, stream)
                    copied = _record(stream)
                first += 1
            if first < spec.stop and all(handle.tokens for handle, _, _ in parts):
                handle = client.load_async(
                    None,
                    side.registered,
                    cache.kernel_blocks(spec.block_ids[(first - spec.first) * (per_chunk // ratio) :]),
                    keys=keys[first - spec.first :],
                    stream=stream,
                    layerwise=self.layerwise,
                )
                parts.append((handle, first, spec.stop))
        except Exception:  # a bad block table or cache: recompute rather than fail the engine
            log.exception("loading %s failed; its tokens are recomputed", spec.req_id)
        return _Load(spec, parts, copied, _record(stream))

    def _scratch_cache(self, side: _GroupSide, blocks: int) -> list[torch.Tensor]:
        """One chunk's blocks of every layer of a group, shaped like vLLM's (made once per size)."""
        assert side.cache is not None
        if side.scratch is None or side.scratch[0].shape[0] != blocks:
            like = side.cache.tensors[0]
            shape = (blocks, *like.shape[1:])
            side.scratch = [
                torch.empty(shape, dtype=like.dtype, device=like.device) for _ in side.cache.tensors
            ]
        return side.scratch

    def _copy_blocks(
        self, cache: GroupCache, scratch: list[torch.Tensor], skip: int, block_ids: list[int], stream: Any
    ) -> None:
        """Scratch blocks `skip..` -> `block_ids` of the group, every layer, on `stream` after the scatter."""
        target = torch.tensor(block_ids, dtype=torch.int64, device=cache.tensors[0].device)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for tensor, source in zip(cache.tensors, scratch, strict=True):
                tensor.index_copy_(0, target, source[skip : skip + len(block_ids)])

    def wait_layer(self, layer_name: str) -> None:
        side = self.layer_group.get(layer_name)
        if side is None:
            return
        layer = side.layer_index[layer_name]
        for load in self._step_loads:
            if load.spec.group != side.group.index:
                continue
            if load.copied is not None:
                torch.cuda.current_stream().wait_event(load.copied)
            for handle, _, _ in load.parts:
                if handle.tokens:
                    handle.wait_layer(layer)

    def finish_step_loads(self) -> None:
        for load in self._step_loads:
            self._finish(load)
        self._step_loads = []

    def finished_loads(self) -> set[str]:
        done = {req_id for req_id, loads in self._loading.items() if all(load.done() for load in loads)}
        for req_id in done:
            for load in self._loading.pop(req_id):
                self._finish(load)
            if req_id in self._finished:  # aborted while its pages were loading
                self._forget(req_id)
        return done

    def _finish(self, load: _Load) -> None:
        """Ends a load's leases; the blocks of every chunk not known valid become load errors."""
        spec = load.spec
        valid = spec.first
        for handle, first, stop in load.parts:
            try:
                tokens = handle.wait()
            except Exception:
                log.exception("the load of %s failed; its tokens are recomputed", spec.req_id)
                tokens = 0
            if valid == first:
                valid = first + tokens // spec.chunk_tokens
            if self.reports and handle.tokens < (stop - first) * spec.chunk_tokens:
                gone = first + handle.tokens // spec.chunk_tokens  # the daemon no longer holds it
                self._report.removed.append(spec.keys[0][gone - spec.first])
        if valid < spec.stop:
            side = self.groups.get(spec.group)
            per_chunk = spec.chunk_tokens // (side.group.block_size if side is not None else 1)
            if len(self.groups) > 1:  # vLLM maps no block id back to a request across groups
                self._failed.add(spec.req_id)
            else:
                self._errors.update(spec.target_blocks(per_chunk, valid, spec.stop))
            self._report.failed.append((spec.req_id, spec.group, valid))

    def failed_requests(self) -> set[str]:
        """The requests reported done loading whose loads failed (a model of several groups):
        vLLM recomputes each whole."""
        failed, self._failed = self._failed, set()
        return failed

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # -- saves --------------------------------------------------------------

    def start_saves(self, meta: StepMetadata) -> None:
        self._namespaces = dict(meta.namespaces)
        for spec in meta.saves if self.saves else ():
            side = self.groups.get(spec.group)
            if side is None or (side.group.replicated and self.tp_rank != 0):
                continue  # one copy of a replicated group: rank 0's
            client = side.client(spec.chunk_tokens)
            if client is None or side.cache is None:
                continue
            keys = self._keys_of(side, client, spec)
            if keys is None:
                continue
            try:
                client.store_to_gpu = self.save_to_gpu
                stream = self._ordered_stream()
                handle = client.store_async(
                    None, side.registered, side.cache.kernel_blocks(spec.block_ids), keys=keys, stream=stream
                )
                if stream is not None and side.group.frees_blocks:
                    # vLLM may hand a window's or a state's block to another request from the
                    # next step on: no later forward writes it before the gather has read it
                    torch.cuda.current_stream(stream.device).wait_stream(stream)
            except Exception:
                log.exception("saving %s failed; its chunks are not stored", spec.req_id)
                continue
            self._saving.setdefault(spec.req_id, []).append((handle, spec))

    def commit_done(self) -> None:
        """Commits the saves whose gathers have finished (the others wait for a later step)."""
        for req_id in [req_id for req_id, saves in self._saving.items() if all(h.done() for h, _ in saves)]:
            self._commit(req_id)

    def _commit(self, req_id: str) -> None:
        for handle, spec in self._saving.pop(req_id, ()):
            try:
                handle.wait()
            except Exception:
                log.exception("committing a save of %s failed; its chunks are not stored", req_id)
                continue
            if self.reports and spec.group == self._reporting_group():
                keys = spec.keys[0]
                for position in handle.positions:
                    parent = keys[position - 1] if position else spec.parent
                    self._report.stored.append((req_id, spec.first + position, keys[position], parent))

    def _reporting_group(self) -> int:
        """The group whose keys KV events name: the first one of KV (not of states)."""
        return next((index for index, side in self.groups.items() if side.group.kind != MAMBA), -1)

    def settle(self, req_ids: set[str]) -> None:
        """Commits (waiting for their gathers) every save of `req_ids`: their blocks may be reused next."""
        for req_id in req_ids:
            self._commit(req_id)

    def finished_saves(self, held: set[str]) -> set[str]:
        """`held`, each once its saves are committed (now: the blocks go back to vLLM this step)."""
        self.settle(held)
        for req_id in held:
            self._forget(req_id)
        return set(held)

    def forget(self, req_ids: set[str]) -> None:
        """Drops what is kept for finished requests; one still loading is dropped once loaded."""
        for req_id in req_ids:
            if req_id in self._loading:
                self._finished.add(req_id)
            elif req_id not in self._saving:
                self._forget(req_id)

    def _forget(self, req_id: str) -> None:
        self._finished.discard(req_id)

    def take_report(self) -> StoredChunks | None:
        if not self._report.stored and not self._report.removed and not self._report.failed:
            return None
        report, self._report = self._report, StoredChunks()
        return report

    def close(self) -> None:
        self.settle(set(self._saving))
        for load in [*(load for loads in self._loading.values() for load in loads), *self._step_loads]:
            self._finish(load)
        self._loading, self._step_loads = {}, []
        for side in reversed(list(self.groups.values())):  # siblings before the first
            side.conn.close()


def _record(stream: Any) -> Any:
    """An event recorded on `stream` now (None without a stream: the CPU's work is done)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event
