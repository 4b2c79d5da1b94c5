"""kvstore as SGLang's HiCache storage backend (L3), for SGLang 0.5.23.

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
  (`[layer][k|v][token][head][dim]`) whatever the host pool's (`layer_first`, `page_first`,
  `page_first_direct`, `page_head`): the pool is seen as one `[k|v][page][token][head][dim]`
  view per layer and `kvstore_kernels` gathers and scatters the pages from it (on the CPU,
  vectorised torch copies, one per layer and K/V). SGLang instances with different host
  layouts therefore share pages, and a namespace is the model's (name, geometry, dtype, page
  size, TP rank and size; PP and context-parallel ranks in the salt).
- Keys: SGLang names each page itself (SHA-256 chained over the prefix's token ids, as hex);
  `kvstore.keys.foreign_keys` maps each name into the namespace. Such a key still names its
  whole prefix, but it is not the key kvstore's own clients compute from the token ids, which
  SGLang does not pass to a storage backend: vLLM and SGLang instances of one model do not
  find each other's prefixes (the README says why).
- A daemon that is down is a miss: `batch_exists` answers 0, gets and sets report False,
  nothing raises into SGLang (one warning per outage; the client connects again by itself).
- MLA pools (DeepSeek) and the pools SGLang's v2 calls serve (sliding-window, Mamba) are not
  served: `register_mem_pool_host` refuses them with a message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvstore.keys import foreign_keys
from kvstore.spec import KVSpec
from kvstore_client.client import KVStoreClient

log = logging.getLogger(__name__)

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
CONNECT_RETRY_S = 5.0  # a daemon that could not be reached at start is tried again this often
KEY_SCHEME = b"sglang-page-sha256\n"


def layer_views(buffer: torch.Tensor, layout: str, page_size: int) -> list[torch.Tensor]:
    """The pool's `kv_buffer` (of `layout`) as one `[k|v][page][token][head][dim]` view per layer,
    the `flash_attn` layout with one block per SGLang page. Views, never copies."""
    if layout == "layer_first":  # [2, L, S, H, D]
        return [buffer[:, layer].unflatten(1, (-1, page_size)) for layer in range(buffer.shape[1])]
    if layout == "page_first":  # [2, S, L, H, D]
        return [buffer[:, :, layer].unflatten(1, (-1, page_size)) for layer in range(buffer.shape[2])]
    if layout == "page_first_direct":  # [2, P, L, ps, H, D]
        return [buffer[:, :, layer] for layer in range(buffer.shape[2])]
    if layout == "page_head":  # [2, P, H, ps, L, D]
        return [buffer[:, :, :, :, layer].transpose(2, 3) for layer in range(buffer.shape[4])]
    raise ValueError(f"layout: kvstore serves SGLang host pools of {', '.join(LAYOUTS)}; got {layout!r}")


def page_shape(layout: str, layers: int, page_size: int, heads: int, head_dim: int) -> tuple[int, ...]:
    """The shape SGLang gives one page of `layout` (`get_data_page(flat=False)`)."""
    shapes = {
        "layer_first": (2, layers, page_size, heads, head_dim),
        "page_first": (2, page_size, layers, heads, head_dim),
        "page_first_direct": (2, 1, layers, page_size, heads, head_dim),
        "page_head": (2, 1, heads, page_size, layers, head_dim),
    }
    return shapes[layout]


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
        self._views: Any = None
        self._layout = ""

    # -- the host pool ------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        config = self.config
        if getattr(config, "is_mla_model", False) or not hasattr(mem_pool_host, "head_num"):
            raise ValueError(
                "mem_pool_host: kvstore serves SGLang's MHA host pools; MLA pools are not supported yet"
            )
        layout = mem_pool_host.layout
        if layout not in LAYOUTS:
            raise ValueError(
                f"layout: kvstore serves SGLang host pools of {', '.join(LAYOUTS)}; got {layout!r}"
            )
        page_size = int(mem_pool_host.page_size)
        self._layout = layout
        self.spec = KVSpec(
            model=getattr(config, "model_name", None) or "sglang",
            num_layers=int(mem_pool_host.layer_num),
            num_kv_heads=int(mem_pool_host.head_num),
            head_dim=int(mem_pool_host.head_dim),
            dtype=mem_pool_host.dtype,
            block_size=page_size,
            layout="flash_attn",
            chunk_tokens=page_size,
            tp_rank=int(getattr(config, "tp_rank", 0)),
            tp_size=int(getattr(config, "tp_size", 1)),
            salt=self._salt(config),
        )
        self._views = layer_views(mem_pool_host.kv_buffer, layout, page_size)
        self._connected()

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
                    self._views = self._client.register_kv_caches(self._views)
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

    # -- the older calls: one flat page (the pool's layout) per key ---------

    def _page_views(self, page: torch.Tensor) -> list[torch.Tensor]:
        spec = self.spec
        if spec is None:
            raise RuntimeError("register_mem_pool_host was not called")
        shape = page_shape(self._layout, spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim)
        return layer_views(page.view(shape), self._layout, spec.block_size)

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
        """Drops every page of this rank's namespace."""
        client = self._connected()
        if client is not None:
            client.clear()

    def get_stats(self) -> None:
        return None  # SGLang's storage metrics: the daemon's are on its /metrics

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
