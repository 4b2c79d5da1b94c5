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
  those tokens and never runs on bytes that were not loaded.
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
from typing import Any

import torch

import kvstore_kernels
from kvstore.spec import KVSpec
from kvstore_client.client import KVStoreClient
from kvstore_client.handles import LoadHandle, StoreHandle
from kvstore_client.vllm.config import ConnectorConfig
from kvstore_client.vllm.connection import LazyClient
from kvstore_client.vllm.metadata import LoadSpec, SaveSpec, StepMetadata, StoredChunks

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


class WorkerSide:
    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, spec: KVSpec, *, saves: bool
    ) -> None:
        self.layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self.layer_index = {name: index for index, name in enumerate(self.layer_names)}
        self.spec = spec
        self.saves = saves
        self.layerwise = config.load_mode == "layerwise"
        self.reports = spec.tp_rank == 0  # KV events speak of rank 0's keys
        self._conn = LazyClient(
            config.address,
            spec,
            timeout_s=config.timeout_s,
            token=config.token,
            name=f"vllm-tp{spec.tp_rank}",
        )
        self._tensors: list[torch.Tensor] | None = None
        self._caches: Any = None
        self._scratch: list[torch.Tensor] | None = None
        self._stream: Any = None
        self._namespaces: tuple[bytes, ...] = ()  # the step's, per TP rank (`StepMetadata`)
        self._loading: dict[str, _Load] = {}  # async loads in flight
        self._step_loads: list[_Load] = []  # layer-wise loads of the current step
        self._saving: dict[str, list[tuple[StoreHandle, SaveSpec]]] = {}
        self._errors: set[int] = set()
        self._finished: set[str] = set()  # finished while loading: forgotten once loaded
        self._report = StoredChunks()

    # -- set-up -------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"kv_caches: no tensor for layer(s) {', '.join(missing[:4])}")
        self._tensors = [kv_caches[name] for name in self.layer_names]
        self._caches = kvstore_kernels.register(
            self.spec.with_chunk_tokens(self.spec.block_size), self._tensors
        )
        if self._tensors[0].is_cuda:
            self._stream = torch.cuda.Stream(self._tensors[0].device)
        self._conn.get()  # connect now where the daemon is up, not in the first step

    def _client(self, chunk_tokens: int) -> KVStoreClient | None:
        """The client, where it is connected and the daemon's chunk size is the scheduler's."""
        client = self._conn.get() if self._caches is not None else None
        if client is None or client.spec.page.chunk_tokens != chunk_tokens:
            return None
        return client

    def _keys_of(self, client: KVStoreClient, spec: SaveSpec) -> tuple[bytes, ...] | None:
        """This rank's keys of chunks `[spec.first, spec.stop)`; None where the scheduler made none
        for it or made them under another namespace than this rank's client has."""
        rank = self.spec.tp_rank
        if rank >= len(self._namespaces) or self._namespaces[rank] != client.namespace:
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
        self._namespaces = meta.namespaces
        for spec in meta.loads:
            load = self._start_load(spec)
            if self.layerwise:
                self._step_loads.append(load)
            else:
                self._loading[spec.req_id] = load

    def _start_load(self, spec: LoadSpec) -> _Load:
        client = self._client(spec.chunk_tokens)
        if client is None:
            return _Load(spec, [])
        keys = self._keys_of(client, spec)
        if keys is None:
            return _Load(spec, [])
        per_chunk = spec.chunk_tokens // self.spec.block_size
        stream = self._ordered_stream()
        parts: list[tuple[LoadHandle, int, int]] = []
        first, copied = spec.first, None
        try:
            if spec.skip:  # vLLM holds the chunk's first blocks: the chunk goes through the scratch cache
                scratch = self._scratch_cache(per_chunk)
                handle = client.load_async(
                    None,
                    scratch,
                    list(range(per_chunk)),
                    keys=keys[:1],
                    stream=stream,
                )
                parts.append((handle, first, first + 1))
                if handle.tokens:
                    self._copy_blocks(scratch, spec.skip, spec.block_ids[spec.skip : per_chunk], stream)
                    copied = _record(stream)
                first += 1
            if first < spec.stop and all(handle.tokens for handle, _, _ in parts):
                handle = client.load_async(
                    None,
                    self._caches,
                    list(spec.block_ids[(first - spec.first) * per_chunk :]),
                    keys=keys[first - spec.first :],
                    stream=stream,
                    layerwise=self.layerwise,
                )
                parts.append((handle, first, spec.stop))
        except Exception:  # a bad block table or cache: recompute rather than fail the engine
            log.exception("loading %s failed; its tokens are recomputed", spec.req_id)
        return _Load(spec, parts, copied, _record(stream))

    def _scratch_cache(self, blocks: int) -> list[torch.Tensor]:
        """One chunk's blocks of every layer, shaped like vLLM's (made once per chunk size)."""
        assert self._tensors is not None
        if self._scratch is None or self._scratch[0].shape[0] != blocks:
            like = self._tensors[0]
            shape = (blocks, *like.shape[1:])
            self._scratch = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in self._tensors]
        return self._scratch

    def _copy_blocks(self, scratch: list[torch.Tensor], skip: int, block_ids: Any, stream: Any) -> None:
        """Scratch blocks `skip..` -> vLLM's `block_ids`, every layer, on `stream` after the scatter."""
        assert self._tensors is not None
        target = torch.tensor(list(block_ids), dtype=torch.int64, device=self._tensors[0].device)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for cache, source in zip(self._tensors, scratch, strict=True):
                cache.index_copy_(0, target, source[skip:])

    def wait_layer(self, layer_name: str) -> None:
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        for load in self._step_loads:
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
        done = {req_id for req_id, load in self._loading.items() if load.done()}
        for req_id in done:
            self._finish(self._loading.pop(req_id))
            if req_id in self._finished:  # aborted while its pages were loading
                self._forget(req_id)
        return done

    def _finish(self, load: _Load) -> None:
        """Ends a load's leases; the blocks of every chunk not known valid become load errors."""
        spec, per_chunk = load.spec, load.spec.chunk_tokens // self.spec.block_size
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
            self._errors.update(spec.target_blocks(per_chunk, valid, spec.stop))

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # -- saves --------------------------------------------------------------

    def start_saves(self, meta: StepMetadata) -> None:
        self._namespaces = meta.namespaces
        for spec in meta.saves if self.saves else ():
            client = self._client(spec.chunk_tokens)
            if client is None:
                continue
            keys = self._keys_of(client, spec)
            if keys is None:
                continue
            try:
                handle = client.store_async(
                    None,
                    self._caches,
                    list(spec.block_ids),
                    keys=keys,
                    stream=self._ordered_stream(),
                )
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
            if self.reports:
                keys = spec.keys[0]
                for position in handle.positions:
                    parent = keys[position - 1] if position else spec.parent
                    self._report.stored.append((req_id, spec.first + position, keys[position], parent))

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
        if not self._report.stored and not self._report.removed:
            return None
        report, self._report = self._report, StoredChunks()
        return report

    def close(self) -> None:
        self.settle(set(self._saving))
        for load in [*self._loading.values(), *self._step_loads]:
            self._finish(load)
        self._loading, self._step_loads = {}, []
        self._conn.close()


def _record(stream: Any) -> Any:
    """An event recorded on `stream` now (None without a stream: the CPU's work is done)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event
