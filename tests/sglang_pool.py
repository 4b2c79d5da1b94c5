"""SGLang's real host memory pool and backend factory against a real kvstored, in a process of its own.

`tests/test_sglang.py` runs this file as a script: importing SGLang's host pool
(`sglang.srt.mem_cache.pool_host.mha`) takes seconds and needs the torchvision stand-in in
`tests/sglang_env`, neither of which belongs in the test process. It reads one JSON request on
stdin, `{"address", "layout", "steps": [...]}`, and prints one JSON object per step:

- `fill`: `pages` pages of random KV written into fresh host slots (SGLang's own `alloc` and
  `set_from_flat_data_page`, in the pool's layout: one seed gives the same KV in every layout),
  named by SGLang's chained SHA-256 page keys of random tokens.
- `set`: `batch_set_v1` of the filled pages (or `keys` indices of them).
- `exists`: `batch_exists` of the filled keys, with `missing` indices swapped for unknown keys.
- `get`: `batch_get_v1` of those keys into host slots poisoned first, and whether every page
  it reports True for is byte-identical to the page filled.
- `legacy`: `set` of a flat page and `get` into a poisoned flat page.
- `clear_pool`: SGLang's host pool drops every page (`clear`).
- `concurrent`: threads that set, check and get their own pages at once, as SGLang's prefetch,
  I/O and backup threads do.
- `wait`: reads a line on stdin (the test stops the daemon meanwhile).

Every step's exceptions are reported, not raised: a backend that raises into SGLang fails the test.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import traceback
from pathlib import Path
from typing import Any


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


def host_pool(layout: str, layers: int = 4, heads: int = 2, head_dim: int = 16, page_size: int = 16) -> Any:
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device_tokens = 256
    k = tuple(
        torch.zeros(device_tokens + page_size, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers)
    )
    v = tuple(
        torch.zeros(device_tokens + page_size, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers)
    )

    def pointers(tensors: tuple[Any, ...]) -> Any:
        return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=pointers(k), v_data_ptrs=pointers(v), layout=KVBufferLayout.NHD
        ),
        page_size=page_size,
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
            page_size,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device_tokens,
            start_layer=0,
            end_layer=layers,
        )


def backend(address: str, pool: Any, model: str) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=pool.layout == "page_first",
        model_name=model,
        extra_config={
            "backend_name": "kvstore",
            "module_path": "kvstore_client.sglang",
            "class_name": "KVStoreHiCache",
            "interface_v1": 1,
            "address": address,
            "timeout_s": 5,
        },
    )
    made = StorageBackendFactory.create_backend("dynamic", config, pool)
    made.register_mem_pool_host(pool)  # as SGLang's cache controller does right after
    return made


def in_layout(kv: Any, layout: str) -> Any:
    """A page's KV, `[k|v][layer][token][head][dim]`, as the flat page of `layout` that SGLang's
    `set_from_flat_data_page` takes: the same KV in every layout."""
    if layout in ("layer_first", "page_first_direct"):  # [2, L, ps, H, D], [2, 1, L, ps, H, D]
        return kv.flatten()
    if layout == "page_first":  # [2, ps, L, H, D]
        return kv.permute(0, 2, 1, 3, 4).flatten()
    if layout == "page_head":  # [2, 1, H, ps, L, D]
        return kv.permute(0, 3, 2, 1, 4).flatten()
    raise ValueError(f"layout: {layout!r}")


class Session:
    def __init__(self, request: dict[str, Any]) -> None:
        import torch

        self.torch = torch
        self.pool = host_pool(request["layout"])
        self.backend = backend(request["address"], self.pool, request.get("model", "sglang-test"))
        self.page_size = self.pool.page_size
        generator = torch.Generator().manual_seed(request.get("seed", 0))
        self.generator = generator
        self.keys: list[str] = []
        self.indices: Any = None
        self.pages: list[Any] = []

    def fill(self, step: dict[str, Any]) -> dict[str, Any]:
        torch = self.torch
        count = step["pages"]
        tokens = torch.randint(0, 1 << 20, (count * self.page_size,), generator=self.generator).tolist()
        self.keys = page_keys(tokens, self.page_size)
        self.indices = self.pool.alloc(count * self.page_size)
        self.pages = []
        pool = self.pool
        shape = (2, pool.layer_num, self.page_size, pool.head_num, pool.head_dim)
        for page in range(count):
            kv = torch.randn(shape, generator=self.generator).to(
                torch.bfloat16
            )  # [k|v][layer][token][head][dim]
            self.pool.set_from_flat_data_page(
                int(self.indices[page * self.page_size]), in_layout(kv, pool.layout)
            )
            self.pages.append(
                self.pool.get_data_page(int(self.indices[page * self.page_size]), flat=True).clone()
            )
        return {"keys": len(self.keys)}

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
        torch = self.torch
        keys, which = self.chosen(step)
        targets = self.pool.alloc(len(which) * self.page_size)
        poison = torch.full(
            (self.pool.get_dummy_flat_data_page().numel(),), float("nan"), dtype=torch.bfloat16
        )
        for page in range(len(which)):
            self.pool.set_from_flat_data_page(int(targets[page * self.page_size]), poison)
        results = self.backend.batch_get_v1(keys, targets)
        same = [
            bool(
                torch.equal(
                    self.pool.get_data_page(int(targets[page * self.page_size]), flat=True).view(torch.int16),
                    self.pages[which[page]].view(torch.int16),
                )
            )
            for page in range(len(which))
        ]
        self.pool.free(targets)
        return {"results": results, "identical": same}

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
        torch = self.torch
        key = hashlib.sha256(b"legacy").hexdigest()
        stored = self.backend.set(key, self.pages[0])
        target = torch.full_like(self.pages[0], float("nan"))
        got = self.backend.get(key, target)
        return {
            "set": stored,
            "exists": self.backend.exists(key),
            "got": got is not None,
            "identical": bool(torch.equal(target.view(torch.int16), self.pages[0].view(torch.int16))),
            "missing": self.backend.get(hashlib.sha256(b"absent").hexdigest(), torch.zeros_like(target))
            is None,
        }

    def clear_pool(self, step: dict[str, Any]) -> dict[str, Any]:
        """SGLang's host pool drops every page (its `clear`): what comes back must come from kvstore."""
        self.pool.clear()
        return {"available": int(self.pool.available_size())}

    def wait(self, step: dict[str, Any]) -> dict[str, Any]:
        print(json.dumps({"waiting": True}), flush=True)
        return {"line": sys.stdin.readline().strip()}


def main() -> int:
    request = json.loads(sys.stdin.readline())
    sglang_environment()
    session = Session(request)
    for step in request["steps"]:
        try:
            result = getattr(session, step["op"])(step)
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        print(json.dumps({"op": step["op"], **result}), flush=True)
    session.backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
