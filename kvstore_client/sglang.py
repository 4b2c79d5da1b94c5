"""kvstore as SGLang's HiCache storage backend (L3), for SGLang 0.5.23: its MHA and MLA host pools.

    python -m sglang.launch_server --model-path MODEL --page-size 64 \\
      --enable-hierarchical-cache --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore_client.sglang", "class_name": "KVStoreHiCache",
        "interface_v1": 1, "address": "unix:///run/kvstore/kvstored.sock"}'

SGLang's own factory builds `KVStoreHiCache(storage_config, kwargs)` and hands it the host
memory pool (`register_mem_pool_host`); `"interface_v1": 1` makes SGLang call the zero-copy
`batch_exists`, `batch_get_v1` and `batch_set_v1`, which move pages between the host pool and
the daemon's arena with no intermediate copy. Extra-config keys: `address` (default: the
default config's socket), `namespace_salt` (pages of different salts never match), `timeout_s`.

- Pages: one SGLang page (`--page-size` tokens) is one kvstore page, in kvstore's own layout
  whatever the host pool's. The pool is seen as one view per layer (`kvstore_client.sglang_pools`)
  and `kvstore_kernels` gathers and scatters the pages from it (on the CPU, vectorised torch
  copies, one per layer and K/V). SGLang instances with different host layouts therefore share pages.
  - MHA pools (`layer_first`, `page_first`, `page_first_direct`, `page_head`): pages
    `[layer][k|v][token][head][dim]`, views `[k|v][page][token][head][dim]`; the namespace is
    the model's and this TP rank's (each rank holds its own heads).
  - MLA pools (`MLATokenToKVPoolHost`: `layer_first`, `page_first`, `page_first_direct`,
    `page_unified`): pages `[layer][token][latent]` (the latent: kv_lora_rank + rope dims),
    views `[page][token][latent]`. The latent is the same on every TP rank, so the namespace
    names no TP rank or size: a chunk is stored once and every rank loads it. SGLang 0.5.23
    writes MLA pages from rank 0 only (`HiCacheStorageConfig.is_storage_writer`); the backend
    does not check, since another rank's store of those keys is skipped by the daemon (Reserve
    skips keys already stored or being written) and reports them held once committed.
  PP and context-parallel ranks are in the salt of both.
- Sidecar pools of a hybrid model (SGLang's v2 calls): Mamba state and sliding-window KV beside
  the KV pool, each a namespace of its own keyed by the KV pages' names
  (`kvstore_client.sglang_sidecars`); `batch_exists_v2` folds their hit policies (every page, or
  the trailing pages only) into the prefix every pool can restore, as SGLang's own file backend.
- Not served, refused at `register_mem_pool_host` with a message naming it: MLA's
  `page_first_kv_split` (Ascend), allocator-only MLA pools (no host buffer), layer-sharded MLA
  pools, decode context parallelism, other rank-replicated pools (DeepSeek V4's); and at
  `register_mem_host_pool_v2`, the sidecars other than Mamba and sliding-window (the DSA
  indexer, so DeepSeek-V3.2, speculative draft pools, DeepSeek V4's compressed pools).
- Keys: SGLang names each page itself (SHA-256 chained over the prefix's token ids, as hex);
  `kvstore.shared.keys.foreign_keys` maps each name into the namespace. Such a key still names its
  whole prefix, but it is not the key kvstore's own clients compute from the token ids, which
  SGLang does not pass to a storage backend: vLLM and SGLang instances of one model do not
  find each other's prefixes (the README says why).
- A daemon that is down is a miss: `batch_exists` answers 0, gets and sets report False,
  nothing raises into SGLang (one warning per outage; the client connects again by itself).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

import kvstore_kernels
from kvstore.shared.keys import foreign_keys
from kvstore.shared.spec import KVSpec
from kvstore_client.client import KVStoreClient
from kvstore_client.sglang_pools import HostPool, host_pool
from kvstore_client.sglang_sidecars import SERVED, Sidecar, exists_v2, move_v2, sidecar_spec

log = logging.getLogger(__name__)

CONNECT_RETRY_S = 5.0  # a daemon that could not be reached at start is tried again this often
KEY_SCHEME = b"sglang-page-sha256\n"


class KVStoreHiCache(HiCacheStorage):  # type: ignore[misc]
    """A HiCache L3 backend over a kvstored on this host (or reached over TCP)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.config = storage_config
        self.address: str | None = extra.get("address")
        self.salt = str(extra.get("namespace_salt", ""))
        self.timeout_s = float(extra.get("timeout_s", 30.0))
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {self.timeout_s}")
        self._lock = threading.Lock()
        self._client: KVStoreClient | None = None
        self._retry_at = 0.0
        self.spec: KVSpec | None = None
        self._pool: HostPool | None = None
        self._views: Any = None
        self._sidecars: dict[str, Sidecar] = {}

    # -- the host pool ------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._pool = host_pool(mem_pool_host, self.config, self._salt(self.config))
        self.spec = self._pool.spec
        # Checked now, so that a pool the kernels cannot serve fails SGLang's start-up.
        self._views = kvstore_kernels.register(self.spec, self._pool.views(mem_pool_host.kv_buffer))
        self._connected()

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """The KV pool registered again is accepted, and so are Mamba and sliding-window sidecar
        pools with flat pages; any other sidecar is refused by name, so SGLang does not start
        without its pages."""
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if host_pool is not getattr(self, "mem_pool_host", None):
            if name not in SERVED or not hasattr(host_pool, "set_from_flat_data_page"):
                raise ValueError(
                    f"host pool {name!r} ({type(host_pool).__name__}): kvstore serves SGLang's KV host "
                    f"pool and its {' and '.join(SERVED)} sidecar pools, not this one"
                )
            if self.spec is None:
                raise ValueError(f"host pool {name!r}: register the KV pool (register_mem_pool_host) first")
            spec = sidecar_spec(name, host_pool, self.spec)
            self._sidecars[name] = Sidecar(name, host_pool, spec, self.address, self.timeout_s)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _salt(self, config: Any) -> str:
        """The namespace salt, with the parallel ranks that cut the pages other than TP."""
        parts = [self.salt]
        for name in ("pp", "attn_cp"):
            size = int(getattr(config, f"{name}_size", 1) or 1)
            if size > 1:
                parts.append(f"{name}{int(getattr(config, f'{name}_rank', 0))}/{size}")
        return "|".join(parts) if len(parts) > 1 else self.salt

    def _connected(self) -> KVStoreClient | None:
        """The client, connected on first use and again after a failed start (every
        CONNECT_RETRY_S); None while the daemon cannot be reached (a miss, logged once)."""
        if self._client is not None or self.spec is None:
            return self._client
        with self._lock:
            if self._client is None and time.monotonic() >= self._retry_at:
                try:
                    self._client = KVStoreClient.connect(self.address, self.spec, timeout_s=self.timeout_s)
                except Exception as exc:
                    if self._retry_at == 0.0:
                        log.warning(
                            "kvstore: cannot connect to %s (%s); storage misses until it can",
                            self.address,
                            exc,
                        )
                    self._retry_at = time.monotonic() + CONNECT_RETRY_S
        return self._client

    def _keys(self, client: KVStoreClient, keys: Sequence[str]) -> list[bytes]:
        return foreign_keys(client.namespace, keys, KEY_SCHEME)

    def _pages(self, host_indices: torch.Tensor, count: int) -> torch.Tensor:
        """Host pool page numbers of `count` pages from their token indices (one page per
        `page_size` indices, a page starting at each multiple)."""
        assert self.spec is not None
        page_size = self.spec.block_size
        if host_indices.numel() != count * page_size:
            raise ValueError(
                f"host_indices: {host_indices.numel()} indices for {count} pages of {page_size} tokens"
            )
        starts = host_indices.reshape(count, page_size)[:, 0].to(torch.int64)
        if bool((starts % page_size).any()):
            raise ValueError("host_indices: a page does not start at a multiple of the page size")
        return starts // page_size

    # -- the zero-copy calls ------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of `keys`, from the first, are stored (0 while the daemon is down)."""
        client = self._connected()
        if client is None or not keys:
            return 0
        return client.lookup_chunks(self._keys(client, keys))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Loads the leading stored pages of `keys` into the host pool at `host_indices`; True for
        each page now in place (a run from the first)."""
        client = self._connected()
        if client is None or not keys:
            return [False] * len(keys)
        pages = self._pages(host_indices, len(keys))
        loaded = client.load(None, self._views, pages, keys=self._keys(client, keys)) // self.spec.block_size  # type: ignore[union-attr]
        return [index < loaded for index in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Stores the pages at `host_indices` under `keys` (those already stored are kept);
        True for each page the daemon then holds (a run from the first)."""
        client = self._connected()
        if client is None or not keys:
            return [False] * len(keys)
        mapped = self._keys(client, keys)
        client.store(None, self._views, self._pages(host_indices, len(keys)), keys=mapped)
        held = client.lookup_chunks(mapped)
        return [index < held for index in range(len(keys))]

    # -- the v2 calls: the KV pool and its sidecars --------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """The KV pages stored from the first, and the prefixes every sidecar can restore too."""
        return exists_v2(self.batch_exists(keys, extra_info), keys, pool_transfers or (), self._sidecars)

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Each transfer's pages into its pool's slots: True per page in place."""
        return {
            t.name: move_v2(t, self._sidecars, self.batch_get_v1, extra_info, load=True) for t in transfers
        }

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Each transfer's pages from its pool's slots: True per page the daemon then holds."""
        return {
            t.name: move_v2(t, self._sidecars, self.batch_set_v1, extra_info, load=False) for t in transfers
        }

    # -- the older calls: one flat page (the pool's layout) per key ---------

    def _page_views(self, page: torch.Tensor) -> list[torch.Tensor]:
        if self._pool is None:
            raise RuntimeError("register_mem_pool_host was not called")
        return self._pool.views(page.view(self._pool.page_shape))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        client = self._connected()
        if client is None:
            return None
        page = (
            target_location if target_location is not None else self.mem_pool_host.get_dummy_flat_data_page()
        )
        loaded = client.load(None, self._page_views(page), [0], keys=self._keys(client, [key]))
        return page if loaded else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(key, target) for key, target in zip(keys, targets, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        client = self._connected()
        if client is None or value is None:
            return False
        mapped = self._keys(client, [key])
        client.store(None, self._page_views(value.contiguous()), [0], keys=mapped)
        return client.lookup_chunks(mapped) == 1

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if values is None:
            return False
        return all([self.set(key, value) for key, value in zip(keys, values, strict=True)])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- administration -----------------------------------------------------

    def clear(self) -> None:
        """Drops every page of this rank's namespace (MLA: of every rank's, which is one)."""
        client = self._connected()
        if client is not None:
            client.clear()

    def get_stats(self) -> None:
        return None  # SGLang's storage metrics: the daemon's are on its /metrics

    def close(self) -> None:
        with self._lock:
            for sidecar in self._sidecars.values():
                sidecar.close()
            if self._client is not None:
                self._client.close()
                self._client = None
