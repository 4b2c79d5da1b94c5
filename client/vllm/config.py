"""The connector's settings (vLLM's `kv_connector_extra_config`) and the KVSpec of a vLLM engine.

Extra-config keys, all optional:

- `address`: the daemon (default: the default config's unix socket, `unix:///run/kvstore/kvstored.sock`).
- `model`: the name that identifies the weights in the namespace (default: vLLM's `model`).
  Engines that name the same weights the same share pages; give fine-tunes their own name.
- `salt`: mixed into the namespace (a tenant, a model revision).
- `load_mode`: `"async"` (default: the request waits in WAITING_FOR_REMOTE_KVS while its pages
  are copied, and other requests run meanwhile) or `"layerwise"` (the load runs in the step that
  computes the rest of the prompt; layer i's attention waits for layer i's pages only).
- `lookup_timeout_s`: the longest a scheduler step waits for the daemon (default 0.2 s); a slower
  answer counts as a miss.
- `timeout_s`: the workers' deadline for one call to the daemon (default 30 s).
- `token`: the daemon's bearer token, where it asks for one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.spec import KVSpec

LOAD_MODES = ("async", "layerwise")
_KEYS = ("address", "model", "salt", "load_mode", "lookup_timeout_s", "timeout_s", "token")
# vLLM's cache dtypes that name a page dtype kvstore stores ("auto": the model's dtype).
_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


@dataclass(frozen=True)
class ConnectorConfig:
    address: str | None = None
    model: str | None = None
    salt: str = ""
    load_mode: str = "async"
    lookup_timeout_s: float = 0.2
    timeout_s: float = 30.0
    token: str | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """The settings in `extra`; a ValueError naming the key for one that is wrong or unknown."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_KEYS))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)}; "
                f"KVStoreConnector takes {', '.join(_KEYS)}"
            )
        for key in ("address", "model", "salt", "token"):
            if key in extra and not isinstance(extra[key], str):
                raise ValueError(f"kv_connector_extra_config.{key}: expected a string, got {extra[key]!r}")
        for key in ("lookup_timeout_s", "timeout_s"):
            if key in extra:
                value = extra[key]
                if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                    raise ValueError(
                        f"kv_connector_extra_config.{key}: expected a positive number of seconds, "
                        f"got {value!r}"
                    )
                extra[key] = float(value)
        if extra.get("load_mode", "async") not in LOAD_MODES:
            raise ValueError(
                f"kv_connector_extra_config.load_mode: expected one of {', '.join(LOAD_MODES)}, "
                f"got {extra['load_mode']!r}"
            )
        return cls(**extra)


def engine_spec(vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, tp_rank: int) -> KVSpec:
    """The KVSpec of TP rank `tp_rank` of the engine `vllm_config` describes, or a ValueError
    saying what the connector does not serve (several KV-cache groups, pipeline stages, MLA)."""
    model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
    cache_config = vllm_config.cache_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError(
            "KVStoreConnector: pipeline parallelism is not supported (each stage would need its own "
            "layer range in the namespace); run with pipeline_parallel_size=1"
        )
    if model_config.use_mla:
        raise ValueError("KVStoreConnector: MLA models are not supported yet")
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise ValueError(
            f"KVStoreConnector: the model has {len(groups)} KV-cache groups; only models whose layers "
            "all use full attention (one group) are supported"
        )
    cache_dtype = str(cache_config.cache_dtype)
    if cache_dtype == "auto":
        dtype: Any = model_config.dtype
    elif cache_dtype in _CACHE_DTYPES:
        dtype = _CACHE_DTYPES[cache_dtype]
    else:
        raise ValueError(f"KVStoreConnector: cache_dtype {cache_dtype!r} is not supported")
    tp_size = parallel.tensor_parallel_size
    return KVSpec(
        model=config.model or str(model_config.model),
        num_layers=len(groups[0].layer_names),
        num_kv_heads=model_config.get_num_kv_heads(parallel),
        head_dim=model_config.get_head_size(),
        dtype=dtype,
        block_size=cache_config.block_size,
        layout="vllm",
        tp_rank=tp_rank,
        tp_size=tp_size,
        salt=config.salt,
    )
