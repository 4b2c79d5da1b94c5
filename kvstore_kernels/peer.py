"""Buffers on another GPU of the host: whether a KV cache's kernels can address them.

- `why_not(device, other)`: None where kernels on `device` can read and write memory that
  lives on `other` (a peer buffer: a GPU-tier pool of another device, over NVLink or PCIe
  peer-to-peer); peer access is turned on here, once per pair of devices. Else why not, in
  words a person can act on.

Peer access is asked of the CUDA runtime torch loaded (`cudart.runtime()`), on `device` as
current, so torch's own peer copies and these kernels share it.
"""

from __future__ import annotations

import threading

import torch

_checked: dict[tuple[int, int], str | None] = {}
_lock = threading.Lock()


def why_not(device: torch.device, other: torch.device) -> str | None:
    """Why kernels on `device` cannot address `other`'s memory (None: they can, from now on)."""
    if device.type != "cuda" or other.type != "cuda":
        return f"peer access joins two CUDA devices; got {device} and {other}"
    pair = (_index(device), _index(other))
    with _lock:
        if pair not in _checked:
            _checked[pair] = _enable(*pair)
        return _checked[pair]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _enable(device: int, other: int) -> str | None:
    from kvstore.shared.cudart import CudaError

    from . import cudart

    if device == other:
        return None
    runtime = cudart.runtime()
    try:
        if not runtime.can_access_peer(device, other):
            return (
                f"cuda:{device} has no peer access to cuda:{other} (no NVLink or PCIe peer path between "
                f"them, or the platform turns it off: see `nvidia-smi topo -p2p r`)"
            )
        with torch.cuda.device(device):
            runtime.enable_peer_access(other)
    except CudaError as exc:
        return f"peer access from cuda:{device} to cuda:{other} failed: {exc}"
    return None
