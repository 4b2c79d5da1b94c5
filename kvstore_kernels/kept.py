"""What a prepared transfer of `RegisteredCaches` keeps for the next one (`kvstore_kernels.prepare`):
the checked plan but its block ids, whether the staged path moves it, and its staged setups."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from kvstore.shared.spec import KVSpec

from .cache_facts import RegisteredCaches
from .layouts import KVCaches
from .routing import TransferOptions
from .validate import Transfer


def without_references(plan: Transfer) -> Transfer:
    """`plan` as kept: without the buffer (a weak reference decides) or the caches (kept on them:
    a reference back would keep the tensors alive until a garbage collection finds the cycle)."""
    return plan._replace(buffer=None, kv_caches=None)  # type: ignore[arg-type]  # filled in by `prepare`


class Kept:
    """What a prepared transfer of `RegisteredCaches` keeps for the next one of the same spec,
    layers, batch index, direction, options and buffer: the plan but its block ids (and the cache
    facts it was checked with), whether the staged path moves it, and the staged setup per page
    count. Kept on the registered caches object (it lives as long as they do), the buffer by a
    weak reference (a kept entry never holds an arena's mapping alive, and a new buffer at the
    same address is another buffer)."""

    MAX_ENTRIES = 16  # per registered caches object
    MAX_SETUPS = 16  # page counts per entry

    def __init__(self, spec: KVSpec, buffer: torch.Tensor) -> None:
        self.spec = spec
        self.buffer = weakref.ref(buffer)
        self.plan: Transfer | None = None
        self.facts: Any = None
        self.staged: bool | None = None
        self.setups: dict[int, Any] = {}

    @classmethod
    def of(
        cls,
        spec: KVSpec,
        kv_caches: KVCaches,
        buffer: Any,
        layers: range | None,
        batch_index: int,
        to_page: bool,
        options: TransferOptions,
    ) -> Kept | None:
        if type(kv_caches) is not RegisteredCaches or not isinstance(buffer, torch.Tensor):
            return None
        if layers is not None and type(layers) is not range:
            return None
        entries: dict[tuple[Any, ...], Kept] = kv_caches.__dict__.setdefault("_prepared", {})
        key = (id(spec), layers, batch_index, to_page, options, id(buffer))
        entry = entries.get(key)
        if entry is not None and entry.spec is spec and entry.buffer() is buffer:
            return entry
        if len(entries) >= cls.MAX_ENTRIES:
            entries.clear()
        entry = entries[key] = cls(spec, buffer)
        return entry
