"""SGLang's real host memory pools and backend factory against a real kvstored, in a process of its own.

`tests/test_sglang.py` runs this file as a script: importing SGLang's host pools
(`sglang.srt.mem_cache.pool_host.mha`, `.mla`) takes seconds and needs the torchvision stand-in
in `tests/sglang_env`, neither of which belongs in the test process. It reads one JSON request on
stdin, `{"address", "instances": [...], "steps": [...]}`, and prints one JSON object per step.
With `--serve` it imports SGLang once and then serves request after request, each in a process
forked for it (as fresh as a new worker, without the seconds of imports): after a request's
steps it prints `{"exit": STATUS}`, the forked process's exit status, and reads the next.

An instance is one SGLang host pool with its own backend (its own kvstore client), as one TP
rank of one SGLang instance has: `{"kind": "mha" | "mla", "layout", "seed", "tp_rank",
"tp_size"}`. The MLA pool has DeepSeek-V2-Lite's latent (kv_lora_rank 512 + rope 64) over 3
layers. Pages pass between instances only through the daemon. A step acts on instance `on`
(default 0):

- `fill`: `pages` pages of random KV (MHA: normal values; MLA: random bytes) written into fresh
  host slots in the pool's layout (SGLang's own `set_from_flat_data_page`; `page_unified`, which
  SGLang 0.5.23 gives no flat-page calls, through its page blocks), named by SGLang's chained
  SHA-256 page keys of random tokens. One seed gives the same keys and KV in every instance and
  layout. With `"write": false` the pool is left alone: the instance only knows what to expect.
- `set`: `batch_set_v1` of the filled pages (or `keys` indices of them).
- `exists`: `batch_exists` of the filled keys, with `missing` indices swapped for unknown keys.
- `get`: `batch_get_v1` of those keys into host slots poisoned first; per page whether it is
  byte-identical to the page filled, and whether it still holds only the poison.
- `legacy`: `set` of a flat page and `get` into a poisoned flat page.
- `clear_pool`: SGLang's host pool drops every page (`clear`).
- `concurrent`: threads that set, check and get their own pages at once, as SGLang's prefetch,
  I/O and backup threads do.
- `refusals`: what `register_mem_pool_host` (and `register_mem_host_pool_v2`) say of the MLA
  pools and settings the backend does not serve.
- `wait`: reads a line on stdin (the test stops the daemon meanwhile).
- `fill_states` (an instance with `"side": "mamba"` or `"swa"`, a hybrid model's: an MHA KV pool
  and beside it a real `MambaPoolHost` of 3 layers, or a second MHA pool, `layer_first`, as its
  sliding-window layers' pool): a random sidecar page for each filled page, in slots of the
  sidecar pool (`"write": false`: expected only).
- `set_v2`: `batch_set_v2` of the filled KV pages and the sidecar pages of pages `states`.
- `exists_v2`: `batch_exists_v2` of the filled keys (`missing` as for `exists`) with a sidecar
  transfer of the `trailing` last pages (SGLang's trailing-pages policy).
- `get_v2`: `batch_get_v2` of the KV pages and the last page's sidecar page into poisoned
  slots; per page whether it is identical, and whether the sidecar page is.

Every step's exceptions are reported, not raised: a backend that raises into SGLang fails the test.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import traceback
from pathlib import Path
from typing import Any

MHA_GEOMETRY = {"layers": 4, "heads": 2, "head_dim": 16}
MLA_GEOMETRY = {"layers": 3, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
PAGE_SIZE = 16
DEVICE_TOKENS = 256
POISON_BITS = -1  # 0xffff: a NaN, never what a page of normal values holds


def sglang_environment() -> None:
    """transformers records that torchvision is absent before the stand-in is importable."""
    import transformers.utils.import_utils as import_utils

    import_utils.is_torchvision_available()
    import_utils.is_torchvision_v2_available()
    sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_env"))


def page_keys(tokens: list[int], page_size: int) -> list[str]:
    """SGLang's storage keys: SHA-256 chained over each page's token ids (little-endian uint32)."""
    keys, prior = [], b""
    for start in range(0, len(tokens), page_size):
        page = tokens[start : start + page_size]
        prior = hashlib.sha256(prior + struct.pack(f"<{len(page)}I", *page)).digest()
        keys.append(prior.hex())
    return keys


def pointers(tensors: tuple[Any, ...]) -> Any:
    import torch

    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def poison_page(shape: tuple[int, ...]) -> Any:
    import torch

    return torch.full(shape, POISON_BITS, dtype=torch.int16).view(torch.bfloat16)


def mha_host_pool(layout: str) -> Any:
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    layers, heads, head_dim = MHA_GEOMETRY["layers"], MHA_GEOMETRY["heads"], MHA_GEOMETRY["head_dim"]
    rows = DEVICE_TOKENS + PAGE_SIZE
    k = tuple(torch.zeros(rows, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.zeros(rows, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=pointers(k), v_data_ptrs=pointers(v), layout=KVBufferLayout.NHD
        ),
        page_size=PAGE_SIZE,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    with host_memory_budget_scope(1 << 34):  # its default keeps 10 GiB free, more than a CI machine has
        return MHATokenToKVPoolHost(
            info,
            4.0,
            0,
            PAGE_SIZE,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=DEVICE_TOKENS,
            start_layer=0,
            end_layer=layers,
        )


def mla_host_pool(layout: str, *, allocator_only: bool = False, layer_shard_enabled: bool = False) -> Any:
    """SGLang's MLA host pool over device rows `[token, 1, kv_lora_rank + rope]` per layer, as
    its MLATokenToKVPool hands them over (CPU tensors here)."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mla import MLAHostAllocation, MLATokenToKVPoolHost

    layers, lora, rope = (MLA_GEOMETRY[name] for name in ("layers", "kv_lora_rank", "qk_rope_head_dim"))
    info: Any
    if allocator_only:
        itemsize = torch.bfloat16.itemsize
        info = MLAHostAllocation(
            dtype=torch.bfloat16,
            kv_lora_rank=lora,
            qk_rope_head_dim=rope,
            kv_cache_dim=lora + rope,
            size_per_token=(lora + rope) * itemsize * layers,
        )
    else:
        shape = (DEVICE_TOKENS + PAGE_SIZE, 1, lora + rope)
        rows = tuple(torch.zeros(shape, dtype=torch.bfloat16) for _ in range(layers))
        info = MLABufferInfo(
            buffers=rows,
            data_ptrs=pointers(rows),
            layer_indices=tuple(range(layers)),
            device_layer_num=layers,
            page_size=PAGE_SIZE,
            kv_lora_rank=lora,
            qk_rope_head_dim=rope,
            kv_cache_dim=lora + rope,
            dtype=torch.bfloat16,
            device=torch.device("cpu"),
        )
    with host_memory_budget_scope(1 << 34):
        return MLATokenToKVPoolHost(
            info,
            4.0,
            0,
            PAGE_SIZE,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=DEVICE_TOKENS,
            start_layer=0,
            end_layer=layers,
            target_layer_num=layers,
            layer_shard_enabled=layer_shard_enabled,
        )


MAMBA_LAYERS = 3


def mamba_host_pool() -> Any:
    """SGLang's Mamba host pool of 3 layers on the CPU: a conv state (3 x 8, bf16) and a temporal
    state (2 x 4 x 5, fp32) per layer and slot, page-first."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    slots = 17
    info = MambaStateBufferInfo(
        temporal=torch.zeros(MAMBA_LAYERS, slots, 2, 4, 5, dtype=torch.float32),
        conv=(torch.zeros(MAMBA_LAYERS, slots, 3, 8, dtype=torch.bfloat16),),
    )
    with host_memory_budget_scope(1 << 34):
        return MambaPoolHost(
            info, 2.0, 0, device_capacity=16, pin_memory=False, device="cpu", layout="page_first"
        )


def storage_config(address: str, pool: Any, model: str, **overrides: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    fields: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": pool.layout == "page_first",
        "model_name": model,
        "extra_config": {
            "backend_name": "kvstore",
            "module_path": "kvstore_client.sglang",
            "class_name": "KVStoreHiCache",
            "interface_v1": 1,
            "address": address,
            "timeout_s": 5,
        },
    }
    return HiCacheStorageConfig(**(fields | overrides))


def backend(config: Any, pool: Any) -> Any:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    made = StorageBackendFactory.create_backend("dynamic", config, pool)
    made.register_mem_pool_host(pool)  # as SGLang's cache controller does right after
    return made


def mha_in_layout(kv: Any, layout: str) -> Any:
    """A page's KV, `[k|v][layer][token][head][dim]`, as the flat page of `layout` that SGLang's
    `set_from_flat_data_page` takes: the same KV in every layout."""
    if layout in ("layer_first", "page_first_direct"):  # [2, L, ps, H, D], [2, 1, L, ps, H, D]
        return kv.flatten()
    if layout == "page_first":  # [2, ps, L, H, D]
        return kv.permute(0, 2, 1, 3, 4).flatten()
    if layout == "page_head":  # [2, 1, H, ps, L, D]
        return kv.permute(0, 3, 2, 1, 4).flatten()
    raise ValueError(f"layout: {layout!r}")


class MHAPages:
    """An MHA pool's pages, compared as SGLang's flat page of the pool's layout."""

    def __init__(self, layout: str) -> None:
        import torch

        self.torch = torch
        self.pool = mha_host_pool(layout)
        pool = self.pool
        self.shape = (2, pool.layer_num, PAGE_SIZE, pool.head_num, pool.head_dim)

    def random(self, generator: Any) -> Any:
        return self.torch.randn(self.shape, generator=generator).to(self.torch.bfloat16)

    def write(self, start: int, kv: Any) -> None:
        self.pool.set_from_flat_data_page(start, mha_in_layout(kv, self.pool.layout))

    def expected(self, kv: Any) -> Any:
        return mha_in_layout(kv, self.pool.layout)

    def read(self, start: int) -> Any:
        return self.pool.get_data_page(start, flat=True).clone()

    def flat(self, expected: Any) -> Any:
        return expected

    def poison(self, start: int) -> None:
        self.write(start, poison_page(self.shape))


class MLAPages:
    """An MLA pool's pages, compared as `[layer][token][latent]` whatever the pool's layout."""

    def __init__(self, layout: str) -> None:
        import torch

        self.torch = torch
        self.pool = mla_host_pool(layout)
        self.shape = (self.pool.layer_num, PAGE_SIZE, self.pool.kv_cache_dim)

    def random(self, generator: Any) -> Any:
        torch = self.torch
        return torch.randint(-(1 << 15), 1 << 15, self.shape, generator=generator, dtype=torch.int16).view(
            torch.bfloat16
        )

    def write(self, start: int, latent: Any) -> None:
        if self.pool.layout == "page_unified":  # [page, layer, token, latent]
            self.pool.kv_buffer[start // PAGE_SIZE] = latent
        else:
            self.pool.set_from_flat_data_page(start, self.flat(latent))

    def flat(self, latent: Any) -> Any:
        """The flat page of the pool's layout (`get_data_page`) holding `latent`."""
        if self.pool.layout == "page_first":  # [token, layer, 1, latent]
            return latent.transpose(0, 1).flatten()
        if self.pool.layout in ("layer_first", "page_first_direct"):  # [layer, token, 1, latent], [1, ...]
            return latent.flatten()
        raise ValueError(f"layout: SGLang gives {self.pool.layout!r} MLA pools no flat pages")

    def expected(self, latent: Any) -> Any:
        return latent

    def read(self, start: int) -> Any:
        layout = self.pool.layout
        if layout == "page_unified":
            return self.pool.kv_buffer[start // PAGE_SIZE].clone()
        page = self.pool.get_data_page(start, flat=False)
        if layout == "page_first":
            return page[:, :, 0].transpose(0, 1).clone()
        if layout == "page_first_direct":
            return page[0, :, :, 0].clone()
        return page[:, :, 0].clone()

    def poison(self, start: int) -> None:
        self.write(start, poison_page(self.shape))


class Session:
    """One instance: a host pool and its backend."""

    def __init__(self, address: str, instance: dict[str, Any]) -> None:
        import torch

        self.torch = torch
        mla = instance.get("kind", "mha") == "mla"
        self.store = MLAPages(instance["layout"]) if mla else MHAPages(instance["layout"])
        self.pool = self.store.pool
        model = instance.get("model", "sglang-mla-test" if mla else "sglang-test")
        tp = {"tp_rank": instance.get("tp_rank", 0), "tp_size": instance.get("tp_size", 1)}
        config = storage_config(address, self.pool, model, is_mla_model=mla, **tp)
        self.backend = backend(config, self.pool)
        self.page_size = self.pool.page_size
        self.generator = torch.Generator().manual_seed(instance.get("seed", 0))
        self.keys: list[str] = []
        self.indices: Any = None
        self.pages: list[Any] = []
        self.side: Any = None  # a hybrid model's sidecar pool: "mamba", or "swa" (an MHA pool)
        self.side_name = instance.get("side", "")
        self.states: list[Any] = []  # per filled page, the sidecar's flat page (as bytes)
        self.state_slots: list[int] = []  # per filled page, where the sidecar holds it
        if self.side_name:
            from sglang.srt.mem_cache.hicache_storage import PoolName

            self.side = mamba_host_pool() if self.side_name == "mamba" else mha_host_pool("layer_first")
            self.backend.register_mem_host_pool_v2(self.side, PoolName(self.side_name))

    def same(self, start: int, expected: Any) -> bool:
        int16 = self.torch.int16
        return bool(self.torch.equal(self.store.read(start).view(int16), expected.view(int16)))

    def poisoned(self, start: int) -> bool:
        return bool((self.store.read(start).view(self.torch.int16) == POISON_BITS).all())

    def fill(self, step: dict[str, Any]) -> dict[str, Any]:
        torch = self.torch
        count = step["pages"]
        tokens = torch.randint(0, 1 << 20, (count * self.page_size,), generator=self.generator).tolist()
        self.keys = page_keys(tokens, self.page_size)
        self.indices = self.pool.alloc(count * self.page_size)
        self.pages = []
        for page in range(count):
            kv = self.store.random(self.generator)
            start = int(self.indices[page * self.page_size])
            if step.get("write", True):
                self.store.write(start, kv)
            self.pages.append(self.store.expected(kv))
        written = [self.same(int(self.indices[p * self.page_size]), self.pages[p]) for p in range(count)]
        return {"keys": len(self.keys), "written": written}

    def chosen(self, step: dict[str, Any]) -> tuple[list[str], list[int]]:
        """The keys a step names (`keys`: indices of the filled ones; `missing`: swapped for unknown keys)."""
        which = step.get("keys", list(range(len(self.keys))))
        keys = [self.keys[i] for i in which]
        for position in step.get("missing", []):
            keys[position] = hashlib.sha256(f"missing-{position}".encode()).hexdigest()
        return keys, which

    def slots(self, which: list[int]) -> Any:
        torch = self.torch
        return torch.cat([self.indices[i * self.page_size : (i + 1) * self.page_size] for i in which])

    def set(self, step: dict[str, Any]) -> dict[str, Any]:
        keys, which = self.chosen(step)
        return {"results": self.backend.batch_set_v1(keys, self.slots(which))}

    def exists(self, step: dict[str, Any]) -> dict[str, Any]:
        keys, _ = self.chosen(step)
        return {"hits": self.backend.batch_exists(keys)}

    def get(self, step: dict[str, Any]) -> dict[str, Any]:
        keys, which = self.chosen(step)
        targets = self.pool.alloc(len(which) * self.page_size)
        starts = [int(targets[page * self.page_size]) for page in range(len(which))]
        for start in starts:
            self.store.poison(start)
        results = self.backend.batch_get_v1(keys, targets)
        same = [self.same(start, self.pages[i]) for start, i in zip(starts, which, strict=True)]
        poisoned = [self.poisoned(start) for start in starts]
        self.pool.free(targets)
        return {"results": results, "identical": same, "poisoned": poisoned}

    def concurrent(self, step: dict[str, Any]) -> dict[str, Any]:
        """SGLang's three storage threads at once: each of `threads` threads sets, checks and
        gets back its own share of the filled pages, `rounds` times."""
        from concurrent.futures import ThreadPoolExecutor

        threads, rounds = step.get("threads", 3), step.get("rounds", 5)
        shares = [list(range(i, len(self.keys), threads)) for i in range(threads)]

        def work(share: list[int]) -> dict[str, Any]:
            outcome: dict[str, Any] = {"set": [], "hits": [], "results": [], "identical": []}
            for _ in range(rounds):
                outcome["set"] += self.set({"keys": share})["results"]
                outcome["hits"].append(self.backend.batch_exists([self.keys[i] for i in share]))
                got = self.get({"keys": share})
                outcome["results"] += got["results"]
                outcome["identical"] += got["identical"]
            return outcome

        with ThreadPoolExecutor(threads) as pool:
            outcomes = list(pool.map(work, shares))
        return {
            "all_set": all(all(o["set"]) for o in outcomes),
            "all_hit": all(
                hits == len(share) for o, share in zip(outcomes, shares, strict=True) for hits in o["hits"]
            ),
            "all_got": all(all(o["results"]) for o in outcomes),
            "all_identical": all(all(o["identical"]) for o in outcomes),
        }

    def legacy(self, step: dict[str, Any]) -> dict[str, Any]:
        """SGLang's older calls: the flat page of the pool's layout that `get_data_page` gives."""
        torch = self.torch
        key = hashlib.sha256(b"legacy").hexdigest()
        page = self.store.flat(self.pages[0])
        stored = self.backend.set(key, page)
        target = torch.full_like(page.view(torch.int16), POISON_BITS).view(page.dtype)
        got = self.backend.get(key, target)
        return {
            "set": stored,
            "exists": self.backend.exists(key),
            "got": got is not None,
            "identical": bool(torch.equal(target.view(torch.int16), page.view(torch.int16))),
            "missing": self.backend.get(hashlib.sha256(b"absent").hexdigest(), torch.zeros_like(target))
            is None,
        }

    def clear_pool(self, step: dict[str, Any]) -> dict[str, Any]:
        """SGLang's host pool drops every page (its `clear`): what comes back must come from kvstore."""
        self.pool.clear()
        return {"available": int(self.pool.available_size())}

    def _side_slots(self, count: int) -> list[int]:
        """Where the sidecar pool holds `count` pages: each page's first slot."""
        size = int(self.side.page_size)
        slots = self.side.alloc(count * size)
        return [int(slots[page * size]) for page in range(count)]

    def _side_indices(self, starts: list[int]) -> Any:
        size = int(self.side.page_size)
        return self.torch.tensor([start + offset for start in starts for offset in range(size)])

    def _side_page(self, start: int) -> Any:
        return self.side.get_data_page(start, flat=True).reshape(-1).view(self.torch.uint8)

    def fill_states(self, step: dict[str, Any]) -> dict[str, Any]:
        """A random sidecar page (a Mamba state, or a window's KV) for each filled page."""
        torch = self.torch
        dummy = self.side.get_dummy_flat_data_page()
        size = dummy.numel() * dummy.element_size()
        self.state_slots = self._side_slots(len(self.keys))
        self.states = [
            torch.randint(0, 256, (size,), dtype=torch.uint8, generator=self.generator) for _ in self.keys
        ]
        if step.get("write", True):
            for start, state in zip(self.state_slots, self.states, strict=True):
                self.side.set_from_flat_data_page(start, state.view(dummy.dtype))
        return {"bytes": size}

    def _side_transfer(self, pages: list[int], **fields: Any) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        indices = self._side_indices([self.state_slots[page] for page in pages])
        keys = [self.keys[page] for page in pages]
        return PoolTransfer(name=PoolName(self.side_name), host_indices=indices, keys=keys, **fields)

    def set_v2(self, step: dict[str, Any]) -> dict[str, Any]:
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        which = list(range(len(self.keys)))
        transfers = [PoolTransfer(name=PoolName.KV, host_indices=self.slots(which), keys=list(self.keys))]
        transfers.append(self._side_transfer(step["states"]))
        results = self.backend.batch_set_v2(transfers)
        return {"kv": results[PoolName.KV], "side": results[PoolName(self.side_name)]}

    def exists_v2(self, step: dict[str, Any]) -> dict[str, Any]:
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        keys, _ = self.chosen(step)
        transfer = PoolTransfer(
            name=PoolName(self.side_name),
            keys=keys[-step.get("trailing", 1) :],
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
        )
        result = self.backend.batch_exists_v2(keys, [transfer])
        return {
            "kv_hit_pages": result.kv_hit_pages,
            "pools": {str(getattr(k, "value", k)): v for k, v in result.extra_pool_hit_pages.items()},
            "restorable": result.restorable_prefix_pages,
        }

    def get_v2(self, step: dict[str, Any]) -> dict[str, Any]:
        """The KV pages and the last page's sidecar page into slots poisoned first."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        torch = self.torch
        count, last = len(self.keys), len(self.keys) - 1
        targets = self.pool.alloc(count * self.page_size)
        starts = [int(targets[page * self.page_size]) for page in range(count)]
        for start in starts:
            self.store.poison(start)
        (side_start,) = self._side_slots(1)
        dummy = self.side.get_dummy_flat_data_page()
        self.side.set_from_flat_data_page(
            side_start, torch.full_like(self.states[last], 0x7E).view(dummy.dtype)
        )
        transfers = [
            PoolTransfer(name=PoolName.KV, host_indices=targets, keys=list(self.keys)),
            PoolTransfer(
                name=PoolName(self.side_name),
                host_indices=self._side_indices([side_start]),
                keys=[self.keys[last]],
            ),
        ]
        results = self.backend.batch_get_v2(transfers)
        return {
            "kv": results[PoolName.KV],
            "side": results[PoolName(self.side_name)],
            "identical": [self.same(start, self.pages[i]) for i, start in enumerate(starts)],
            "state_identical": bool(torch.equal(self._side_page(side_start), self.states[last])),
        }

    def wait(self, step: dict[str, Any]) -> dict[str, Any]:
        print(json.dumps({"waiting": True}), flush=True)
        return {"line": sys.stdin.readline().strip()}

    def close(self) -> None:
        self.backend.close()


def refusals(address: str) -> dict[str, Any]:
    """What the backend says of each MLA pool or setting it does not serve (None: it was served)."""
    from kvstore_client.sglang import KVStoreHiCache

    def refusal(pool: Any, **overrides: Any) -> str | None:
        config = storage_config(address, pool, "sglang-mla-refused", is_mla_model=True, **overrides)
        made = KVStoreHiCache(config)
        try:
            made.register_mem_pool_host(pool)
        except ValueError as exc:
            return str(exc)
        finally:
            made.close()
        return None

    split = mla_host_pool("layer_first")
    split.layout = "page_first_kv_split"  # Ascend's split latent: its pool needs NPU buffers to be built
    served = mla_host_pool("page_first")
    sidecar: str | None = None
    made = KVStoreHiCache(storage_config(address, served, "sglang-mla-refused", is_mla_model=True))
    made.register_mem_pool_host(served)
    made.register_mem_host_pool_v2(served, "kv")  # the KV pool itself, again: accepted
    try:
        made.register_mem_host_pool_v2(mla_host_pool("page_first"), "indexer")
    except ValueError as exc:
        sidecar = str(exc)
    made.close()
    return {
        "page_first_kv_split": refusal(split),
        "allocator_only": refusal(mla_host_pool("layer_first", allocator_only=True)),
        "layer_sharded": refusal(mla_host_pool("layer_first", layer_shard_enabled=True)),
        "dcp": refusal(served, tp_size=2, dcp_size=2, logical_page_size=2 * PAGE_SIZE),
        "mha_pool_of_an_mla_model": refusal(mha_host_pool("page_first")),
        "sidecar": sidecar,
    }


def run(request: dict[str, Any]) -> int:
    """Runs one request's steps, printing each step's result."""
    address = request["address"]
    sessions = [Session(address, instance) for instance in request["instances"]]
    for step in request["steps"]:
        try:
            if step["op"] == "refusals":
                result = refusals(address)
            else:
                result = getattr(sessions[step.get("on", 0)], step["op"])(step)
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        print(json.dumps({"op": step["op"], **result}), flush=True)
    for session in sessions:
        session.close()
    return 0


def preload() -> None:
    """Imports what every request uses, before any thread or gRPC channel exists: a process forked
    from here starts as a new worker would after its imports."""
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
    import sglang.srt.mem_cache.pool_host.mamba  # noqa: F401
    import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
    import sglang.srt.mem_cache.pool_host.mla  # noqa: F401
    import sglang.srt.mem_cache.storage  # noqa: F401

    import kvstore_client.sglang  # noqa: F401


def run_forked(request: dict[str, Any]) -> int:
    """`run(request)` in a child process; its exit status (1 on an exception, with the traceback
    on stderr)."""
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            status = run(request)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def serve() -> int:
    """Request after request from stdin, each in a forked process, until stdin closes. Nothing is
    written to stdin while a request runs but the `wait` step's line, which its process reads."""
    preload()
    while line := sys.stdin.readline():
        print(json.dumps({"exit": run_forked(json.loads(line))}), flush=True)
    return 0


def main() -> int:
    sglang_environment()
    if sys.argv[1:] == ["--serve"]:
        return serve()
    return run(json.loads(sys.stdin.readline()))


if __name__ == "__main__":
    sys.exit(main())
