"""What the checks learn about an engine's KV-cache tensors, remembered per tensor fingerprint.

A serving engine hands the same cache tensors to every transfer. Checking their dtypes,
shapes and devices and making the canonical views (`layouts.kv_views`) of every moved
layer is most of a call's host time (hundreds of microseconds for 32 layers, before the
first byte can move), so `cache_facts` does it once and remembers the outcome under a
fingerprint of every tensor it looked at: address, shape, strides, dtype and device.
Everything remembered (the device, block counts, each view's address and strides, why
scatter may not write the views) is a function of those fingerprints, the layout and the
layers, so a hit is exact whichever tensor objects carry them. Only numbers are kept, never
a tensor, so nothing here keeps an engine's memory alive. A failed check is not remembered:
a bad call is checked in full, and refused, every time.

- `ViewFacts`: where one canonical view `[blocks, block_size, heads, dim]` lies.
- `CacheFacts`: the checked device, the blocks of the smallest checked tensor, per moved
  layer its views' facts, and why scatter may not write them (None: it may).
- `cache_facts(spec, kv_caches, moved, checked, batch_index)`: the facts, checked or remembered.
- `forget()`: drop what is remembered (the benchmark times first calls with it).
- `register(spec, kv_caches)`: the tensors checked once, as `RegisteredCaches`, which a
  call takes in place of `kv_caches` and then neither checks nor fingerprints again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from kvstore.shared.spec import KVSpec

from .layouts import KVCaches, expected_shape, kv_views, layer_tensors, num_blocks_of, shape_text

MAX_REMEMBERED = 64  # fingerprints kept, least recently used dropped first


class ViewFacts(NamedTuple):
    """One canonical view of a layer's K, V or latent: its address, shape and strides (elements)."""

    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    packed: bool  # whether one block (all dimensions but the first) is one contiguous run

    @classmethod
    def of(cls, view: torch.Tensor) -> ViewFacts:
        shape, strides = tuple(view.shape), tuple(view.stride())
        return cls(view.data_ptr(), shape, strides, is_packed_run(shape, strides))


class CacheFacts(NamedTuple):
    device: torch.device
    num_blocks: int  # blocks in the smallest checked tensor: valid ids are 0..num_blocks-1
    smallest_layer: int  # the engine layer of that tensor (named in messages)
    views: tuple[tuple[ViewFacts, ...], ...]  # per moved layer: K, V (or latent)
    write_error: str | None  # why scatter cannot write the moved views; None: it can


def is_packed_run(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether the dimensions after the first (sizes `shape[1:]`) are one contiguous run."""
    expected = 1
    for size, stride in zip(reversed(shape[1:]), reversed(strides[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


_remembered: OrderedDict[tuple[Any, ...], CacheFacts] = OrderedDict()
_lock = threading.Lock()


def forget() -> None:
    """Drop every remembered fingerprint: the next call checks its tensors in full."""
    with _lock:
        _remembered.clear()


class RegisteredCaches(tuple):  # type: ignore[type-arg]
    """An engine's per-layer KV tensors, checked once: pass it wherever `kv_caches` goes.

    Made by `register`. The engine promises what vLLM's `register_kv_caches` assumes: the
    tensors keep their storage, shape and strides while it uses this object (writing KV into
    them is what they are for). A transfer then skips checking and fingerprinting 2 x layers
    tensors, most of what is left of its host time. It holds the tensors, so they stay alive.
    Used with a spec of another geometry, it is checked as a plain tuple of tensors.
    """

    geometry: tuple[Any, ...]
    _facts: dict[tuple[Any, ...], CacheFacts]
    # Its memory lies on another GPU than its tensors' device (a peer's cache mapped over CUDA IPC):
    # `copy_blocks` from it is a copy between GPUs, for the copy engines where its blocks allow.
    elsewhere: bool = False

    def facts(
        self, spec: KVSpec, moved: Sequence[int], checked: Sequence[int], batch_index: int
    ) -> CacheFacts:
        key = (tuple(moved), tuple(checked), batch_index)
        facts = self._facts.get(key)
        if facts is None:  # another layer subset: checked once, then kept
            facts = self._facts[key] = _checked_facts(spec, self, moved, checked, batch_index)
        return facts


def register(spec: KVSpec, kv_caches: KVCaches, *, elsewhere: bool = False) -> KVCaches:
    """`kv_caches` checked in full now (ValueError naming the mismatch), as `RegisteredCaches`;
    `elsewhere`: its memory lies on another GPU than its tensors' device (see the class).

    A cross_layer cache (one tensor, cheap to fingerprint) is returned as it is (`elsewhere` is
    then moot: its K and V interleave by block, which the copy engines never move).
    """
    _check_container(spec, kv_caches)
    if spec.layout == "cross_layer":
        return kv_caches
    stored = spec.stored_layers
    registered = RegisteredCaches(kv_caches)
    registered.geometry = spec_geometry(spec)
    registered.elsewhere = elsewhere
    key = (stored, stored, 0)
    registered._facts = {key: _checked_facts(spec, registered, *key)}
    return registered


def cache_facts(
    spec: KVSpec, kv_caches: KVCaches, moved: Sequence[int], checked: Sequence[int], batch_index: int
) -> CacheFacts:
    """Check the tensors of the `checked` engine layers (ValueError naming the mismatch); return
    their facts, with the views of the `moved` layers. Remembered per fingerprint (or, for
    `RegisteredCaches`, on the object)."""
    if type(kv_caches) is RegisteredCaches and kv_caches.geometry == spec_geometry(spec):
        return kv_caches.facts(spec, moved, checked, batch_index)
    _check_container(spec, kv_caches)
    key = _key(spec, kv_caches, moved, checked, batch_index)
    if key is not None:
        with _lock:
            facts = _remembered.get(key)
            if facts is not None:
                _remembered.move_to_end(key)
                return facts
    facts = _checked_facts(spec, kv_caches, moved, checked, batch_index)
    if key is not None:
        with _lock:
            _remembered[key] = facts
            while len(_remembered) > MAX_REMEMBERED:
                _remembered.popitem(last=False)
    return facts


def _check_container(spec: KVSpec, kv_caches: KVCaches) -> None:
    if spec.layout == "cross_layer":
        if not isinstance(kv_caches, torch.Tensor):
            raise ValueError(
                f"kv_caches: the cross_layer layout takes one tensor, got {type(kv_caches).__name__}"
            )
    elif not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != spec.num_layers:
        got = len(kv_caches) if isinstance(kv_caches, (list, tuple)) else type(kv_caches).__name__
        raise ValueError(
            f"kv_caches: expected a list of {spec.num_layers} layers (one per engine layer), got {got}"
        )


def _fingerprint(tensor: Any) -> tuple[Any, ...] | None:
    if not isinstance(tensor, torch.Tensor):
        return None
    try:
        return (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device)
    except RuntimeError:  # no storage (sparse, some subclasses): checked in full every time
        return None


def _key(
    spec: KVSpec, kv_caches: KVCaches, moved: Sequence[int], checked: Sequence[int], batch_index: int
) -> tuple[Any, ...] | None:
    """Everything the facts depend on, or None where something cannot be fingerprinted."""
    if spec.layout == "cross_layer":
        tensors: list[Any] = [kv_caches]
    elif spec.layout == "hf":
        tensors = []
        for layer in checked:
            pair = kv_caches[layer]
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                return None
            tensors += pair
    else:
        tensors = [kv_caches[layer] for layer in checked]
    prints = tuple(_fingerprint(tensor) for tensor in tensors)
    if None in prints:
        return None
    return (spec_geometry(spec), tuple(moved), tuple(checked), batch_index, prints)


def spec_geometry(spec: KVSpec) -> tuple[Any, ...]:
    """What a registered cache was checked against: equal geometries, the same checks."""
    return (spec.layout, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.block_size)


def _checked_facts(
    spec: KVSpec, kv_caches: KVCaches, moved: Sequence[int], checked: Sequence[int], batch_index: int
) -> CacheFacts:
    named = [
        (layer, name, tensor) for layer in checked for name, tensor in layer_tensors(spec, kv_caches, layer)
    ]
    first = named[0][2]
    device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
    smallest = (-1, -1)
    shape = expected_shape(spec)
    dtype = getattr(torch, spec.dtype)
    seen: set[int] = set()
    for layer, name, tensor in named:
        if id(tensor) in seen:  # cross_layer: one tensor holds every layer
            continue
        seen.add(id(tensor))
        _check_tensor(spec, shape, dtype, name, tensor, device)
        if spec.layout == "hf" and not 0 <= batch_index < tensor.shape[0]:
            raise ValueError(f"batch_index: {batch_index} is outside 0..{tensor.shape[0] - 1} for {name}")
        blocks = num_blocks_of(spec, tensor)
        if smallest[0] < 0 or blocks < smallest[0]:
            smallest = (blocks, layer)
    views = tuple(
        tuple(ViewFacts.of(view) for view in kv_views(spec, kv_caches, layer, batch_index)) for layer in moved
    )
    return CacheFacts(device, smallest[0], smallest[1], views, _write_error(moved, views))


def _check_tensor(
    spec: KVSpec,
    shape: tuple[tuple[str, int | None], ...],
    dtype: torch.dtype,
    name: str,
    tensor: Any,
    device: torch.device,
) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        got = str(tensor.dtype).removeprefix("torch.")
        raise ValueError(f"{name}: dtype {got} does not match the spec's {spec.dtype}")
    if tensor.dim() != len(shape) or any(
        size is not None and got != size for got, (_, size) in zip(tensor.shape, shape, strict=True)
    ):
        raise ValueError(
            f"{name}: shape {list(tensor.shape)} does not match the {spec.layout} layout, "
            f"expected {shape_text(shape)}"
        )
    if tensor.device != device:
        raise ValueError(f"{name}: on {tensor.device}, expected {device} like the other KV tensors")


def _write_error(moved: Sequence[int], views: tuple[tuple[ViewFacts, ...], ...]) -> str | None:
    """Scatter writes each cache element once: why these views would be written twice (or None)."""
    owner: dict[int, int] = {}
    for layer, kv in zip(moved, views, strict=True):
        for view in kv:
            if any(stride == 0 and size > 1 for stride, size in zip(view.strides, view.shape, strict=True)):
                return f"kv_caches[{layer}]: has a zero stride (an expanded view); scatter cannot write it"
            if view.address in owner:
                return (
                    f"kv_caches[{layer}]: same memory as layer {owner[view.address]}; "
                    "declare it in spec.kv_sharing instead of passing it twice"
                )
            owner[view.address] = layer
    return None
