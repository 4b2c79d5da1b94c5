"""A vLLM engine on the CPU for the connector's tests and benchmark: vLLM's real Scheduler, the
connector loaded by vLLM's KVConnectorFactory, one worker connector per TP rank over real CPU
KV-cache tensors laid out by vLLM's own `allocate_kv_cache`, and a stand-in for the model.

The stand-in model writes, for each scheduled token, K and V that are a function of the token's
whole prefix (a rolling hash of the token ids) and of the layer and TP rank, and for a Mamba
layer the state after the step's last token, where vLLM's align mode keeps it (the block of the
request's table holding that token): two requests that share a prefix compute the same bytes
for it, as a real model does. Before it writes, each
forward checks that every token the request attends to (its computed prefix, loaded or not) holds
exactly the KV of that prefix: a load that left a wrong byte, or a block vLLM was told is loaded
and is not, fails the step (`WrongKV`). The steps follow vLLM's worker: handle_preemptions, bind,
start_load_kv (before the forward when a load is synchronous, after it otherwise),
wait_for_layer_load per layer, wait_for_save, get_transfer_results, load errors, worker metadata, and
the outputs of all ranks aggregated by vLLM's KVOutputAggregator.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_configs, get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

CONNECTOR = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore_client.vllm"}
EOS = 2
SAMPLED = 7  # the token every decode step samples
POISON = 0x7E  # the byte every KV tensor starts as
# a Mamba layer's states per TP rank: a conv state and an SSM state, packed in its block
STATE_SHAPES = ((3, 8), (2, 3, 5))
STATE_DTYPES = (torch.float16, torch.float32)
STATE_BYTES = 3 * 8 * 2 + 2 * 3 * 5 * 4


class WrongKV(AssertionError):
    """A forward found a computed token whose KV is not the KV of its prefix."""


@dataclass(frozen=True)
class Model:
    """The stand-in model: its depth and each layer's kind (`full`, `sliding` with `window`,
    `chunked` (chunked-local attention in chunks of `window` tokens),
    `mla`, whose latent is `head_dim` wide and the same on every TP rank, or `mamba`, whose
    state is `STATE_BYTES` per TP rank, `state_shared` across them), its KV-cache dtype
    (`auto` or vLLM's fp8 names, with one per-tensor `kv_scale` for K and V) and the attention
    backend whose layout its KV is written in (`FLASH_ATTN`: K|V side by side, `CPU_ATTN`: K rows
    then V rows per block and head, `TRITON_MLA`: one latent per token)."""

    num_layers: int = 3
    num_kv_heads: int = 2  # per TP rank
    head_dim: int = 8
    dtype: torch.dtype = torch.float16
    kinds: tuple[str, ...] = ()  # per layer; () is every layer full attention
    window: int = 64
    cache_dtype: str = "auto"
    kv_scale: float = 1.0
    backend: str = "FLASH_ATTN"
    state_shared: bool = False

    def kind(self, layer: int) -> str:
        return self.kinds[layer] if self.kinds else "full"

    def write_config(self, directory: Path, tp_size: int) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        heads = 4 * self.num_kv_heads * tp_size
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": heads * self.head_dim,
            "head_dim": self.head_dim,
            "intermediate_size": 64,
            "num_attention_heads": heads,
            "num_key_value_heads": self.num_kv_heads * tp_size,
            "num_hidden_layers": self.num_layers,
            "max_position_embeddings": 262_144,
            "vocab_size": 32000,
            "torch_dtype": str(self.dtype).removeprefix("torch."),
        }
        (directory / "config.json").write_text(json.dumps(config))
        return directory


def vllm_config(
    model_dir: Path,
    extra: dict[str, Any] | None,
    *,
    cache_dtype: str = "auto",
    kv_role: str = "kv_both",
    prefix_caching: bool = False,
    tp_size: int = 1,
    block_size: int = 16,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 65536,
    failure_policy: str = "recompute",
    mamba_cache_mode: str = "none",
    retention_interval: int | None = 0,
) -> VllmConfig:
    """A CPU VllmConfig for `model_dir`; `extra`: the connector's extra config (None: no connector)."""
    model = ModelConfig(
        model=str(model_dir), tokenizer=str(model_dir), skip_tokenizer_init=True, dtype="float16"
    )
    transfer = None
    if extra is not None:
        transfer = KVTransferConfig(
            kv_connector=CONNECTOR["kv_connector"],
            kv_connector_module_path=CONNECTOR["kv_connector_module_path"],
            kv_role=cast(Any, kv_role),
            kv_connector_extra_config=extra,
            kv_load_failure_policy=cast(Any, failure_policy),
        )
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=64,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=block_size,
            enable_prefix_caching=prefix_caching,
            cache_dtype=cast(Any, cache_dtype),
            mamba_cache_mode=cast(Any, mamba_cache_mode),
            prefix_cache_retention_interval=retention_interval,
        ),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    config.parallel_config.tensor_parallel_size = tp_size
    config.model_config.max_model_len = max_model_len
    config.scheduler_config.disable_hybrid_kv_cache_manager = False  # as on a GPU: the HMA on
    return config


@dataclass
class Engine:
    """A scheduler and its workers; `step()` runs one engine step."""

    config: VllmConfig
    model: Model
    num_blocks: int = 256
    layout: KVCacheLayout = KVCacheLayout.LBNHC
    check: bool = True  # the stand-in model writes and checks KV (off: the benchmark times scheduling)
    kernel_block: int | None = None  # the backend's kernel block size, where it splits vLLM's blocks
    workers: list[Any] = field(default_factory=list)
    caches: list[list[torch.Tensor]] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)  # each request's sampled tokens
    finished: dict[str, Any] = field(default_factory=dict)  # request id -> finish reason
    computed_prompt_tokens: int = 0  # prompt tokens the stand-in model computed
    steps: int = 0

    def __post_init__(self) -> None:
        global _hash_ready
        if not _hash_ready:
            init_none_hash(sha256)
            _hash_ready = True
        block_size = self.config.cache_config.block_size
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(self.model.num_layers)]
        specs = {
            name: _layer_spec(self.model, layer, block_size, self.config.cache_config.mamba_cache_mode)
            for layer, name in enumerate(self.layer_names)
        }
        self.config.cache_config.num_gpu_blocks = self.num_blocks
        self.config.cache_config.kv_cache_layout = self.layout.name
        model_config = self.config.model_config
        model_config.max_model_len = min(model_config.max_model_len, self.num_blocks * block_size)
        # vLLM's own planner groups the layers (one group per kind, the HMA's way) and lays out
        # the tensors; the stand-in layers tell the connector which backend reads them
        groups = get_kv_cache_groups(self.config, specs)
        memory = (self.num_blocks + 1) * sum(
            spec.page_size_bytes for spec in specs.values()
        )  # + the null block
        self.kv_cache_config = get_kv_cache_configs(self.config, [specs], [memory], groups)[0]
        context = self.config.compilation_config.static_forward_context
        for layer, name in enumerate(self.layer_names):
            context[name] = StandInLayer(self.model, specs[name], layer)
        self.group_of = {
            name: index
            for index, group in enumerate(self.kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=self.kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=block_size,
        )
        self.events: list[Any] = []  # what the scheduler publishes to vLLM's KV-event publisher
        self.scheduler.kv_event_publisher = cast(Any, _Recorder(self.events))
        tp_size = self.config.parallel_config.tensor_parallel_size
        self.aggregator = KVOutputAggregator(tp_size)
        handshakes = {}
        for rank in range(tp_size if self.config.kv_transfer_config is not None else 0):
            worker_config = copy.copy(self.config)
            worker_config.parallel_config = copy.deepcopy(self.config.parallel_config)
            worker_config.parallel_config.rank = rank
            connector = KVConnectorFactory.create_connector(
                config=worker_config, role=KVConnectorRole.WORKER, kv_cache_config=self.kv_cache_config
            )
            kernel_blocks = [self.kernel_block] * len(groups) if self.kernel_block else None
            views = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), self.layout, kernel_blocks)
            for view in views.values():
                view.view(torch.uint8).fill_(POISON)
            connector.register_kv_caches(views)
            handshakes[(0, rank)] = connector.get_handshake_metadata()
            self.workers.append(connector)
            self.caches.append([views[name] for name in self.layer_names])
        if handshakes and self.connector is not None:
            self.connector.set_xfer_handshake_metadata_pp_aware(handshakes)

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add(self, request_id: str, prompt: Sequence[int], max_tokens: int = 1, **fields: Any) -> Request:
        request = self.request(request_id, prompt, max_tokens, **fields)
        self.scheduler.add_request(request)
        return request

    def request(self, request_id: str, prompt: Sequence[int], max_tokens: int = 1, **fields: Any) -> Request:
        """A vLLM Request for `prompt`, not yet given to the scheduler; `fields` go to Request
        (`cache_salt`, `lora_request`, `mm_features`, ...)."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.config.cache_config.block_size, sha256),
            **fields,
        )
        return request

    def poison(self) -> None:
        """Every KV byte of every rank back to the poison, and vLLM's own prefix cache (where it
        is on) emptied: what a fresh engine would hold."""
        for caches in self.caches:
            for cache in caches:
                cache.view(torch.uint8).fill_(POISON)
        if self.config.cache_config.enable_prefix_caching:
            assert self.scheduler.reset_prefix_cache(), "a request still holds blocks"

    def step(self) -> Any:
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        outputs: list[ModelRunnerOutput | None] = []
        for rank, worker in enumerate(self.workers):
            worker.handle_preemptions(meta)
            worker.bind_connector_metadata(meta)
            if output.has_sync_kv_loads:
                worker.start_load_kv(None)
            self._forward(rank, worker, output)
            if not output.has_sync_kv_loads:
                worker.start_load_kv(None)
            worker.wait_for_save()
            results = worker.get_transfer_results(output.finished_req_ids)
            sending, recving = results.finished_sending or None, results.finished_recving or None
            kv_output = KVConnectorOutput(
                failed_recving=results.failed_recving,
                finished_sending=sending,
                finished_recving=recving,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            )
            worker.clear_connector_metadata()
            outputs.append(self._runner_output(output, kv_output))
        self.steps += 1
        self.computed_prompt_tokens += sum(
            max(0, min(done + count, self.scheduler.requests[req_id].num_prompt_tokens) - done)
            for req_id, done, count in self._scheduled(output)
        )
        if self.workers:
            aggregated = self.aggregator.aggregate(outputs)
            if aggregated is None:
                raise AssertionError("KVOutputAggregator returned no output for rank 0")
        else:
            aggregated = self._runner_output(output, KVConnectorOutput())
        result = self.scheduler.update_from_output(output, aggregated)
        for client_outputs in result.values():
            for row in client_outputs.outputs:
                self.tokens.setdefault(row.request_id, []).extend(row.new_token_ids)
                if row.finish_reason is not None:
                    self.finished[row.request_id] = row.finish_reason
        return result

    def run(self, limit: int = 10_000) -> None:
        """Steps until every request is done and every held block is back."""
        for _ in range(limit):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"the engine did not drain in {limit} steps")

    def _scheduled(self, output: Any) -> list[tuple[str, int, int]]:
        """(request id, tokens computed before this step, tokens scheduled now) of each request."""
        rows = [(new.req_id, new.num_computed_tokens) for new in output.scheduled_new_reqs]
        cached = output.scheduled_cached_reqs
        rows += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        return [(req_id, done, output.num_scheduled_tokens[req_id]) for req_id, done in rows]

    def _forward(self, rank: int, worker: Any, output: Any) -> None:
        scheduled = self._scheduled(output)
        block_size = self.kernel_block or self.config.cache_config.block_size
        ratio = self.config.cache_config.block_size // block_size  # kernel blocks per vLLM block
        for layer, name in enumerate(self.layer_names):
            worker.wait_for_layer_load(name)
            if not self.check:
                continue
            cache = self.caches[rank][layer]
            kind = self.model.kind(layer)
            if kind == "mamba":
                self._forward_state(rank, layer, cache, scheduled)
                continue
            for req_id, done, count in scheduled:
                request = self.scheduler.requests[req_id]
                tokens = request.all_token_ids
                blocks = [
                    b * ratio + part
                    for b in self._block_ids(req_id, self.group_of[name])
                    for part in range(ratio)
                ]
                # a sliding window's layers attend to (and vLLM keeps) the window's tokens only, a
                # chunked-local layer's to its attention chunk's (of `window` tokens)
                start = 0
                if kind == "sliding":
                    start = max(0, done - (self.model.window - 1))
                elif kind == "chunked":
                    start = done // self.model.window * self.model.window
                if done > start:
                    held = read_kv(self.model, cache, blocks, start, done, block_size)
                    want = expected_kv(tokens[:done], layer, rank, self.model)[start:]
                    if not torch.equal(held.view(torch.uint8), want.view(torch.uint8)):
                        wrong = (held.view(torch.uint8) != want.view(torch.uint8)).reshape(done - start, -1)
                        token = start + int(wrong.any(1).nonzero()[0])
                        raise WrongKV(
                            f"{req_id}: rank {rank} layer {layer}: token {token} of the {done} computed "
                            "holds the wrong KV"
                        )
                values = expected_kv(tokens[: done + count], layer, rank, self.model)[done:]
                write_kv(self.model, cache, blocks, done, values, block_size)

    def _forward_state(
        self, rank: int, layer: int, cache: torch.Tensor, scheduled: list[tuple[str, int, int]]
    ) -> None:
        """A Mamba layer in vLLM's align mode: the state after token t lives in block (t - 1) //
        block_size of the request's table; a step reads the state its computed prefix ended with
        (loaded or not) and writes the state after its last token."""
        block_size = self.config.cache_config.block_size
        states = cache.view(torch.uint8)[:, 0, 0, :STATE_BYTES]
        for req_id, done, count in scheduled:
            tokens = self.scheduler.requests[req_id].all_token_ids
            table = self._block_ids(req_id, self.group_of[self.layer_names[layer]])
            if done:
                held = states[table[(done - 1) // block_size]]
                if not torch.equal(held, expected_state(tokens[:done], layer, rank, self.model)):
                    raise WrongKV(
                        f"{req_id}: rank {rank} layer {layer}: the state after {done} tokens is wrong"
                    )
            end = done + count
            states[table[(end - 1) // block_size]] = expected_state(tokens[:end], layer, rank, self.model)

    def _block_ids(self, req_id: str, group: int = 0) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[group])

    def _runner_output(self, output: Any, kv_output: KVConnectorOutput) -> ModelRunnerOutput:
        scheduled = self._scheduled(output)
        req_ids = [req_id for req_id, _, _ in scheduled]
        sampled = [
            [SAMPLED] if done + count >= self.scheduler.requests[req_id].num_tokens else []
            for req_id, done, count in scheduled
        ]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=None if kv_output.is_empty() else kv_output,
        )

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        if self.connector is not None:
            self.connector.shutdown()


_hash_ready = False


class _Recorder:
    """vLLM's EventPublisher interface, keeping every published event."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


class StandInLayer(AttentionLayerBase):
    """What the connector reads of a model layer: its attention backend, its KV-cache spec and,
    for an fp8 cache, its k/v scales."""

    def __init__(self, model: Model, spec: KVCacheSpec, layer: int) -> None:
        self.model, self.spec, self.layer = model, spec, layer
        self._k_scale_float = self._v_scale_float = float(model.kv_scale)

    def get_attn_backend(self) -> Any:
        return _backend(self.model.backend)

    def get_kv_cache_spec(self, vllm_config: Any) -> KVCacheSpec:
        return self.spec


def _backend(name: str) -> Any:
    if name == "CPU_ATTN":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend
    if name == "FLASH_ATTN":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        return FlashAttentionBackend
    if name == "TRITON_MLA":
        from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

        return TritonMLABackend
    if name == "FLASH_ATTN_DIFFKV":  # a backend whose layout the connector does not know
        from vllm.v1.attention.backends.flash_attn_diffkv import FlashAttentionDiffKVBackend

        return FlashAttentionDiffKVBackend
    if name == "CPU_MLA":
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

        return CPUMLABackend
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend

    return {"FLEX_ATTENTION": FlexAttentionBackend}[name]


def cache_dtype(model: Model) -> torch.dtype:
    """The dtype of the model's KV values (an fp8 cache's, whose tensors vLLM keeps as bytes)."""
    return {
        "auto": model.dtype,
        "fp8": torch.float8_e4m3fn,
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
    }[model.cache_dtype]


def _layer_spec(model: Model, layer: int, block_size: int, mamba_cache_mode: str = "none") -> KVCacheSpec:
    dtype = model.dtype if model.cache_dtype == "auto" else torch.uint8
    kind = model.kind(layer)
    if kind == "mamba":  # padded to an attention layer's page, as vLLM pads a hybrid's states
        attention = block_size * model.num_kv_heads * 2 * model.head_dim * cache_dtype(model).itemsize
        return MambaSpec(
            block_size=block_size,
            shapes=STATE_SHAPES,
            dtypes=STATE_DTYPES,
            page_size_padded=max(attention, STATE_BYTES),
            mamba_cache_mode=mamba_cache_mode,
            tp_replicated=model.state_shared,
        )
    if kind == "mla":
        return MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=model.head_dim,
            dtype=dtype,
            cache_dtype_str=model.cache_dtype,
        )
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(
            block_size=block_size,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_dim,
            dtype=dtype,
            attention_chunk_size=model.window,
        )
    if kind == "sliding_mla":
        return SlidingWindowMLASpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=model.head_dim,
            dtype=dtype,
            sliding_window=model.window,
            cache_dtype_str=model.cache_dtype,
        )
    if kind == "sliding":
        return SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_dim,
            dtype=dtype,
            sliding_window=model.window,
        )
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=model.num_kv_heads, head_size=model.head_dim, dtype=dtype
    )


def expected_kv(tokens: Sequence[int], layer: int, rank: int, model: Model) -> torch.Tensor:
    """[len(tokens), heads, width]: the stand-in model's K|V (or MLA latent) of each position, in
    the cache's dtype. An MLA latent is the same on every TP rank."""
    prefix = torch.empty(len(tokens), dtype=torch.int64)
    value = 17
    for position, token in enumerate(tokens):
        value = (value * 1_000_003 + int(token) + 1) % 2_147_483_629
        prefix[position] = value
    mla = model.kind(layer) == "mla"
    heads, width = (1, model.head_dim) if mla else (model.num_kv_heads, 2 * model.head_dim)
    salt = (layer + 1) * 7919 + (0 if mla else rank * 104_729)
    lanes = torch.arange(heads * width, dtype=torch.int64)
    mixed = ((prefix[:, None] + salt) * 2_654_435_761 + lanes * 40_503) % 65_521
    values = (mixed.to(torch.float32) / 65_521 - 0.5).to(cache_dtype(model))
    return values.view(len(tokens), heads, width)


def expected_state(tokens: Sequence[int], layer: int, rank: int, model: Model) -> torch.Tensor:
    """[STATE_BYTES] uint8: the stand-in Mamba layer's state after `tokens` (the same on every TP
    rank where `model.state_shared`)."""
    value = 17
    for token in tokens:
        value = (value * 1_000_003 + int(token) + 1) % 2_147_483_629
    salt = (layer + 1) * 7919 + (0 if model.state_shared else rank * 104_729)
    lanes = torch.arange(STATE_BYTES, dtype=torch.int64)
    return (((value + salt) * 2_654_435_761 + lanes * 40_503) % 251).to(torch.uint8)


def _positions(
    blocks: Sequence[int], start: int, stop: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(start, stop)
    table = torch.as_tensor(blocks, dtype=torch.int64)
    return table[positions // block_size], positions % block_size


def _typed(model: Model, cache: torch.Tensor) -> torch.Tensor:
    return cache.view(cache_dtype(model)) if cache.dtype != cache_dtype(model) else cache


def read_kv(
    model: Model, cache: torch.Tensor, blocks: Sequence[int], start: int, stop: int, block_size: int
) -> torch.Tensor:
    """[stop - start, heads, width] as the model's backend reads the cache."""
    index, offset = _positions(blocks, start, stop, block_size)
    cache = _typed(model, cache)
    if model.backend == "CPU_ATTN":
        rows = cache.view(cache.shape[0], cache.shape[1], 2 * block_size, -1)
        return torch.cat([rows[index, :, offset], rows[index, :, block_size + offset]], dim=-1)
    return cache[index, :, offset]


def write_kv(
    model: Model,
    cache: torch.Tensor,
    blocks: Sequence[int],
    start: int,
    values: torch.Tensor,
    block_size: int,
) -> None:
    """Writes `values` ([tokens, heads, width]) where the model's backend keeps them."""
    index, offset = _positions(blocks, start, start + len(values), block_size)
    cache = _typed(model, cache)
    if model.backend == "CPU_ATTN":
        rows = cache.view(cache.shape[0], cache.shape[1], 2 * block_size, -1)
        half = values.shape[-1] // 2
        rows[index, :, offset] = values[..., :half]
        rows[index, :, block_size + offset] = values[..., half:]
    else:
        cache[index, :, offset] = values
