"""The connector's settings (vLLM's `kv_connector_extra_config`) and the KVSpecs of a vLLM engine.

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
- `save_to`: where saves land: `"arena"` (host memory, kept for every later request on the
  host), `"gpu"` (the daemon's GPU-tier pool on the worker's own GPU, written device to device;
  a decode instance on another GPU of the host reads it in place over NVLink; the arena where
  the daemon has no pool there or no room), `"lend"` (nothing is copied: the worker lends its
  own blocks, `KVStoreClient.lend`, and vLLM frees them once a decode instance on another GPU of
  the host has copied them in one copy over NVLink, or after 30 s unread; a group whose blocks
  vLLM reuses early, sliding windows and states, is saved to the arena instead), or `"auto"`
  (default): `"gpu"` for a `kv_producer` (a prefill instance handing prompts to decode
  instances), `"arena"` otherwise.
- `lend_readers` (with `save_to: "lend"`): how many workers read each lend of a group every TP
  rank holds alike (MLA's latent, a shared state), which rank 0 alone lends: the decode
  instance's TP size, 1..16 (default 1). Its blocks are held until that many workers (each its
  own connection to the daemon) have read them, or 30 s, so that no decode rank recomputes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.shared.spec import KVSpec
from kvstore_client.vllm.groups import Group, chunk_tokens_of, read_groups

LOAD_MODES = ("async", "layerwise")
SAVE_TO = ("auto", "arena", "gpu", "lend")
_KEYS = (
    "address", "model", "salt", "load_mode", "lookup_timeout_s", "timeout_s", "token", "save_to",
    "lend_readers",
)  # fmt: skip
MAX_LEND_READERS = 16  # the daemon's reads in flight of one lend


@dataclass(frozen=True)
class ConnectorConfig:
    address: str | None = None
    model: str | None = None
    salt: str = ""
    load_mode: str = "async"
    lookup_timeout_s: float = 0.2
    timeout_s: float = 30.0
    token: str | None = None
    save_to: str = "auto"
    lend_readers: int = 1

    def saves_to_gpu(self, *, loads: bool, saves: bool) -> bool:
        """Whether a worker of this role asks for its saves to land in the GPU tier."""
        return self.save_to == "gpu" or (self.save_to == "auto" and saves and not loads)

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
        if extra.get("save_to", "auto") not in SAVE_TO:
            raise ValueError(
                f"kv_connector_extra_config.save_to: expected one of {', '.join(SAVE_TO)}, "
                f"got {extra['save_to']!r}"
            )
        readers = extra.get("lend_readers", 1)
        if isinstance(readers, bool) or not isinstance(readers, int) or not 1 <= readers <= MAX_LEND_READERS:
            raise ValueError(
                f"kv_connector_extra_config.lend_readers: expected the decode instance's TP size, "
                f"1..{MAX_LEND_READERS}, got {readers!r}"
            )
        if "lend_readers" in extra and extra.get("save_to") != "lend":
            raise ValueError(
                "kv_connector_extra_config.lend_readers: only with save_to 'lend' (the decode ranks "
                "that read each lent group every rank holds alike)"
            )
        if extra.get("load_mode", "async") not in LOAD_MODES:
            raise ValueError(
                f"kv_connector_extra_config.load_mode: expected one of {', '.join(LOAD_MODES)}, "
                f"got {extra['load_mode']!r}"
            )
        return cls(**extra)


def engine_specs(
    vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, tp_rank: int, scales: str = ""
) -> list[tuple[Group, KVSpec]]:
    """Each served KV-cache group of the engine and its KVSpec on TP rank `tp_rank`, or a
    ValueError saying what the connector does not serve (`groups.read_groups`). A model whose
    layers are all one full-attention group keeps a whole model's namespace; one with Mamba state
    has chunks of its Mamba block size (`groups.chunk_tokens_of`)."""
    groups = read_groups(vllm_config, kv_cache_config)
    whole = len(groups) == 1 and groups[0].layer_ids == tuple(range(len(groups[0].layer_ids)))
    model = config.model or str(vllm_config.model_config.model)
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    chunk = chunk_tokens_of(groups, model)
    return [
        (group, group.spec(config, model, tp_rank, tp_size, whole=whole, scales=scales, chunk_tokens=chunk))
        for group in groups
    ]
