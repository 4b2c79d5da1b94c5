"""SGLang's sidecar host pools beside the KV pool: Mamba state and sliding-window KV, as HiCache's
v2 calls (`batch_exists_v2`, `batch_get_v2`, `batch_set_v2`) move them (SGLang 0.5.23).

A hybrid model's SGLang names every page of a prompt once (the KV pool's page names); a sidecar
pool holds, for some of those pages, what that pool keeps of them: a Mamba pool the layers'
state after the page, a sliding-window pool the KV of its layers. Each sidecar is a namespace
of its own, its pages the pool's flat page bytes (`get_data_page(flat=True)`, which a state page
holds as raw bytes, `PageSpec.state` naming the pool, its layout and its tensors), keyed by the KV
page's name. The flat page is the pool's own layout, which is in the namespace: two layouts
never share a sidecar page.

- `Sidecar(name, pool, spec)`: one registered sidecar pool and its client (connected on first use).
- `held(names)`: per page whether it is stored (one per-key Lookup, `Lookup.each`).
- `store(names, slots)` / `load(names, slots)`: pages from / into the pool's slots, through a
  staging buffer of flat pages; True per page now held or in place.
- `restorable(held, kv_pages, policy, trailing)`: the prefix lengths (in pages) this pool can
  restore, under SGLang's hit policies (all pages, or the trailing ones only).
- `exists_v2(kv_pages, keys, transfers, sidecars)`: `batch_exists_v2`'s answer, the prefix every
  pool can restore (as SGLang's own file backend folds it); `move_v2(...)`: one transfer of
  `batch_get_v2` / `batch_set_v2`, the KV pool's through the backend's v1 calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvstore.shared.keys import foreign_keys
from kvstore.shared.spec import KVSpec
from kvstore_client.client import KVStoreClient

log = logging.getLogger(__name__)

SERVED = ("mamba", "swa")  # SGLang's PoolName values kvstore serves as sidecars
ALL_PAGES, TRAILING_PAGES = "all_pages", "trailing_pages"


def sidecar_spec(name: str, pool: Any, kv: KVSpec) -> KVSpec:
    """The sidecar pool's page spec: one flat page of raw bytes, in the KV pool's TP rank."""
    page = pool.get_dummy_flat_data_page()
    page_bytes = int(page.numel() * page.element_size())
    return KVSpec(
        model=kv.model,
        num_layers=1,
        num_kv_heads=1,
        head_dim=page_bytes,
        dtype="uint8",
        block_size=1,
        layout="mla",
        chunk_tokens=kv.page.chunk_tokens,
        tp_rank=kv.tp_rank,
        tp_size=kv.tp_size,
        salt=kv.salt,
        state=f"sglang-{name}:{type(pool).__name__}:{getattr(pool, 'layout', '')}:{_tensors(pool)}",
    )


def _tensors(pool: Any) -> str:
    """What gives a flat page's bytes their meaning, beside the pool's class and layout."""
    conv = getattr(pool, "conv_state_shapes", None)
    if conv is not None:  # a Mamba pool: its conv and temporal states per layer
        shapes = ",".join(str(list(shape)) for shape in conv)
        return (
            f"layers={pool.num_mamba_layers};conv={pool.conv_dtype}{shapes};"
            f"temporal={pool.temporal_dtype}{list(pool.temporal_state_shape)}"
        ).replace("torch.", "")
    fields = ("layer_num", "head_num", "head_dim", "page_size", "dtype")
    return ";".join(f"{field}={getattr(pool, field, '')}" for field in fields).replace("torch.", "")


class Sidecar:
    def __init__(self, name: str, pool: Any, spec: KVSpec, address: str | None, timeout_s: float) -> None:
        self.name = name
        self.pool = pool
        self.spec = spec
        self.page_size = int(getattr(pool, "page_size", 1) or 1)  # slots per page
        self.dtype = pool.get_dummy_flat_data_page().dtype  # what its flat pages hold
        self._address, self._timeout_s = address, timeout_s
        self._client: KVStoreClient | None = None

    def client(self) -> KVStoreClient | None:
        if self._client is None:
            try:
                self._client = KVStoreClient.connect(self._address, self.spec, timeout_s=self._timeout_s)
            except Exception as exc:  # a miss until the daemon answers, as the KV pool's
                log.warning("kvstore: the %s sidecar cannot connect (%s): a miss", self.name, exc)
        return self._client

    def _keys(self, client: KVStoreClient, names: Sequence[str]) -> list[bytes]:
        from kvstore_client.sglang import KEY_SCHEME

        return foreign_keys(client.namespace, names, KEY_SCHEME)

    def held(self, names: Sequence[str]) -> list[bool]:
        client = self.client()
        if client is None or not names:
            return [False] * len(names)
        return [tier != 0 for tier in client.lookup_each(self._keys(client, names))]

    def _starts(self, slots: Any, count: int) -> list[int]:
        if slots is None or slots.numel() != count * self.page_size:
            raise ValueError(
                f"host_indices: {0 if slots is None else slots.numel()} slots for {count} {self.name} "
                f"pages of {self.page_size}"
            )
        return [int(slots[index * self.page_size]) for index in range(count)]

    def _staging(self, count: int) -> torch.Tensor:
        return torch.empty((count, 1, self.spec.head_dim), dtype=torch.uint8)

    def store(self, names: Sequence[str], slots: Any) -> list[bool]:
        client = self.client()
        if client is None or not names:
            return [False] * len(names)
        staging = self._staging(len(names))
        for row, start in enumerate(self._starts(slots, len(names))):
            staging[row, 0] = self.pool.get_data_page(start, flat=True).reshape(-1).view(torch.uint8)
        keys = self._keys(client, names)
        client.store(None, [staging], list(range(len(names))), keys=keys)
        return [tier != 0 for tier in client.lookup_each(keys)]

    def load(self, names: Sequence[str], slots: Any) -> list[bool]:
        client = self.client()
        if client is None or not names:
            return [False] * len(names)
        starts = self._starts(slots, len(names))
        staging = self._staging(len(names))
        loaded = client.load(None, [staging], list(range(len(names))), keys=self._keys(client, names))
        pages = loaded // self.spec.page.chunk_tokens
        for row in range(pages):
            self.pool.set_from_flat_data_page(starts[row], staging[row, 0].view(self.dtype))
        return [row < pages for row in range(len(names))]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def restorable(held: Sequence[bool], kv_pages: int, policy: str, trailing: int) -> set[int]:
    """The prefix lengths in `1..kv_pages` this pool can restore: every page before it held
    (`all_pages`), or its last `trailing` pages (`trailing_pages`: a Mamba state, a window)."""
    if policy == ALL_PAGES:
        first_missing = next((index for index in range(kv_pages) if not held[index]), kv_pages)
        return set(range(1, first_missing + 1))
    if policy == TRAILING_PAGES:
        trailing = max(1, trailing)
        return {length for length in range(1, kv_pages + 1) if all(held[max(0, length - trailing) : length])}
    raise ValueError(f"hit_policy: kvstore serves {ALL_PAGES} and {TRAILING_PAGES}, not {policy!r}")


def _name(value: Any) -> str:
    return str(getattr(value, "value", value))  # SGLang's PoolName / PoolHitPolicy, or a string


def exists_v2(
    kv_pages: int, keys: Sequence[str], transfers: Sequence[Any], sidecars: Mapping[str, Sidecar]
) -> Any:
    """`kv_pages` KV pages stored from the first; the prefix lengths every transfer's pool can
    restore within them, the longest of those, and each pool's own longest."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

    hits: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
    lengths = set(range(1, kv_pages + 1))
    for transfer in transfers:
        if not lengths:
            break
        sidecar = sidecars.get(_name(transfer.name))
        if sidecar is None:  # a pool this backend holds nothing of
            lengths = set()
            break
        held = sidecar.held(list(keys[:kv_pages]))
        pool = restorable(held, kv_pages, _name(transfer.hit_policy), len(transfer.keys or ()))
        if pool:
            hits[transfer.name] = max(pool)
        lengths &= pool
    ordered = sorted(lengths)
    return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)


def move_v2(
    transfer: Any,
    sidecars: Mapping[str, Sidecar],
    kv_call: Callable[..., list[bool]],
    extra_info: Any,
    *,
    load: bool,
) -> list[bool]:
    """One transfer's pages between its pool's slots and the daemon: True per page done. Never
    raises into SGLang (a failure is a miss, logged)."""
    keys = list(transfer.keys or ())
    name = _name(transfer.name)
    try:
        if name == "kv":
            return kv_call(keys, transfer.host_indices, extra_info)
        sidecar = sidecars.get(name)
        if sidecar is None:
            return [False] * len(keys)
        move = sidecar.load if load else sidecar.store
        return move(keys, transfer.host_indices)
    except Exception:
        log.exception("kvstore: %s of %d %s pages failed", "a get" if load else "a set", len(keys), name)
        return [False] * len(keys)
