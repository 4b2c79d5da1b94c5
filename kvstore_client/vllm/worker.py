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

Each KV-cache group's client and caches: `worker_groups.py`; one request's load: `worker_loads.py`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvstore.shared.spec import KVSpec
from kvstore_client.client import KVStoreClient
from kvstore_client.handles import StoreHandle
from kvstore_client.vllm.config import ConnectorConfig
from kvstore_client.vllm.connection import LazyClient
from kvstore_client.vllm.groups import MAMBA, Group, is_quantized, scales_text
from kvstore_client.vllm.layouts import layer_scales
from kvstore_client.vllm.metadata import Handshake, LoadSpec, SaveSpec, StepMetadata, StoredChunks
from kvstore_client.vllm.worker_groups import GroupSide
from kvstore_client.vllm.worker_lends import Lending
from kvstore_client.vllm.worker_loads import Load, queue_parts, record_event

log = logging.getLogger(__name__)


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
        lends: bool = False,
    ) -> None:
        self.vllm_config = vllm_config
        self.tp_rank = tp_rank
        self.groups = {
            group.index: GroupSide(group, spec, config, tp_rank)
            for group, spec in zip(groups, specs, strict=True)
        }
        self.layer_group = {name: side for side in self.groups.values() for name in side.group.layer_names}
        self.saves = saves
        self.save_to_gpu = save_to_gpu  # saves land in the GPU tier's pool on this GPU (`save_to`)
        self.lends = lends  # saves lend the blocks instead (`save_to: lend`; `worker_lends`)
        self._lending = Lending()
        self.layerwise = config.load_mode == "layerwise"
        self.lend_readers = config.lend_readers  # of a lent group every rank holds alike
        self.reports = tp_rank == 0  # KV events speak of rank 0's keys
        self.handshake = Handshake()
        self._stream: Any = None
        self._namespaces: dict[int, tuple[bytes, ...]] = {}  # the step's, per group and TP rank
        self._loading: dict[str, list[Load]] = {}  # async loads in flight, one per group
        self._step_loads: list[Load] = []  # layer-wise loads of the current step
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

    def _keys_of(self, side: GroupSide, client: KVStoreClient, spec: SaveSpec) -> tuple[bytes, ...] | None:
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

    def _start_load(self, spec: LoadSpec) -> Load:
        side = self.groups.get(spec.group)
        client = side.client(spec.chunk_tokens) if side is not None else None
        if side is None or client is None or side.cache is None:
            return Load(spec, [])
        keys = self._keys_of(side, client, spec)
        if keys is None:
            return Load(spec, [])
        stream = self._ordered_stream()
        load = Load(spec, [])
        try:
            queue_parts(load, side, side.cache, client, keys, stream, layerwise=self.layerwise)
        except Exception:  # a bad block table or cache: recompute rather than fail the engine
            log.exception("loading %s failed; its tokens are recomputed", spec.req_id)
        load.event = record_event(stream)
        return load

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

    def _finish(self, load: Load) -> None:
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
            readers = self.lend_readers if side.group.replicated else 1  # rank 0's, read by every rank
            if (
                self.lends
                and not side.group.frees_blocks
                and self._lending.lend(client, side, spec, keys, readers)
            ):
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
        """Commits the saves whose gathers have finished; of the others (a later step's), the
        parts written already."""
        for req_id, saves in list(self._saving.items()):
            if all(h.done() for h, _ in saves):
                self._commit(req_id)
            else:
                for handle, _ in saves:
                    handle.progress()

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

    def preempted(self, req_ids: set[str]) -> None:
        """Requests whose blocks vLLM frees now: their lends end, their saves commit."""
        self._lending.revoke(req_ids)
        self.settle(req_ids)

    def settle(self, req_ids: set[str]) -> None:
        """Commits (waiting for their gathers) every save of `req_ids`: their blocks may be reused next."""
        for req_id in req_ids:
            self._commit(req_id)

    def finished_saves(self, held: set[str]) -> set[str]:
        """`held`, each once its saves are committed (now) and its lends are done (this step or a
        later one): then the blocks go back to vLLM."""
        self.settle(held)
        finished = self._lending.finished(held)
        for req_id in finished:
            self._forget(req_id)
        return finished

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
