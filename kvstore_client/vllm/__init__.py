"""kvstore as a vLLM KV connector (KVConnectorBase_V1, vLLM 0.33).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
      "kv_connector_module_path": "kvstore_client.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"address": "unix:///run/kvstore/kvstored.sock"}}'

vLLM makes one connector in its scheduler and one in each worker (`role`); the scheduler side
(`scheduler.SchedulerSide`) decides, the workers (`worker.WorkerSide`) move bytes, and the
step's `metadata.StepMetadata` is all that passes between them. Roles: `kv_both` loads and
saves; `kv_producer` (a prefill instance) saves every prompt and loads nothing; `kv_consumer`
(a decode instance) loads and never saves. A producer's saves land in the GPU tier's pool on its
own GPU where the daemon has one (`save_to`), and a consumer on another GPU of the host reads them
there over peer access: prefill to decode without the trip through host memory; with `save_to:
lend` the producer lends its blocks instead and a consumer copies them once (`worker_lends`). The
extra-config keys are in `config`.

A daemon that is down, restarting or slow costs at most `lookup_timeout_s` per scheduler call,
answers 0 matched tokens, saves nothing, logs one warning per outage, and never raises into vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore_client.vllm.config import ConnectorConfig, engine_specs
from kvstore_client.vllm.metadata import Handshake, StepMetadata
from kvstore_client.vllm.scheduler import SchedulerSide
from kvstore_client.vllm.worker import WorkerSide

log = logging.getLogger(__name__)

__all__ = ["KVStoreConnector", "ConnectorConfig"]


def _tp_rank(vllm_config: Any) -> int:
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    parallel = vllm_config.parallel_config
    return int(parallel.rank) % parallel.tensor_parallel_size


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        loads, saves = transfer.is_kv_consumer, transfer.is_kv_producer
        if loads and transfer.kv_load_failure_policy != "recompute":
            log.warning(
                "kv_load_failure_policy is %r: a chunk evicted between a lookup and its load fails "
                "the request; set it to 'recompute' to have vLLM recompute those tokens instead",
                transfer.kv_load_failure_policy,
            )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                vllm_config, kv_cache_config, self.config, loads=loads, saves=saves
            )
        else:
            rank = _tp_rank(vllm_config)
            groups = engine_specs(vllm_config, kv_cache_config, self.config, rank)
            if len(groups) > 1 and self.config.load_mode == "layerwise":
                raise ValueError(
                    "KVStoreConnector: load_mode 'layerwise' cannot serve a model with several "
                    "KV-cache groups (vLLM recomputes a failed load of such a model only as a "
                    "whole request, outside the forward); use load_mode 'async'"
                )
            self._worker = WorkerSide(
                vllm_config,
                [group for group, _ in groups],
                [spec for _, spec in groups],
                self.config,
                rank,
                saves=saves,
                save_to_gpu=self.config.saves_to_gpu(loads=loads, saves=saves),
                lends=saves and self.config.save_to == "lend",
            )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # A layer-wise load waits between layers, which a captured full graph would skip.
        return ConnectorConfig.from_extra(extra_config).load_mode == "layerwise"

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that does not happen is a later miss, never a lost hand-off

    # -- worker side ----------------------------------------------------------

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("KVStoreConnector: a worker method was called on the scheduler's connector")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, StepMetadata) and kv_connector_metadata.preempted:
            self._worker_side().preempted(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, StepMetadata):
            self._worker_side().start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side().wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass  # saved after the forward, all layers in one gather (worker.py says why)

    def wait_for_save(self) -> None:
        worker = self._worker_side()
        worker.finish_step_loads()
        meta = self._get_connector_metadata()
        if isinstance(meta, StepMetadata):
            worker.start_saves(meta)
        worker.commit_done()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        worker = self._worker_side()
        meta = self._connector_metadata
        sending = worker.finished_saves(meta.held) if isinstance(meta, StepMetadata) else set()
        recving = worker.finished_loads()
        worker.forget(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self._worker_side().failed_requests(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker_side().take_report()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker_side().handshake

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler side -------------------------------------------------------

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("KVStoreConnector: a scheduler method was called on a worker's connector")
        return self._scheduler

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        scheduler = self._scheduler_side()
        try:
            tokens = scheduler.num_new_matched_tokens(request, num_computed_tokens)
        except Exception:  # a prompt kvstore cannot key: vLLM computes it, as without kvstore
            log.exception("looking up %s failed; it is computed", request.request_id)
            return 0, False
        return tokens, tokens > 0 and self.config.load_mode == "async"

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._scheduler_side().after_alloc(request, blocks, num_external_tokens)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._scheduler_side().bind_block_pool(gpu_block_pool)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._scheduler_side().handshake(
            {meta.scales for meta in metadata.values() if isinstance(meta, Handshake)}
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler_side().build_metadata(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_side().record(
            connector_output.kv_connector_worker_meta, connector_output.finished_sending
        )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().finished(request), None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().finished(request), None

    def take_events(self) -> Iterable[Any]:
        return self._scheduler_side().take_events()
