"""The CUDA runtime for the copy-engine paths: `kvstore.shared.cudart`'s, once torch has set CUDA up.

`runtime()` is the library torch loaded (found first in /proc/self/maps), so the current device
and the streams are the ones torch uses; `CudaUnavailable` where torch sees no CUDA device.
"""

from __future__ import annotations

from kvstore.shared.cudart import CudaRuntime, CudaUnavailable, load_runtime

_ready: list[CudaRuntime] = []  # once torch has set CUDA up, it stays so


def runtime() -> CudaRuntime:
    if _ready:  # asked on every transfer: torch's checks once
        return _ready[0]
    import torch

    if not torch.cuda.is_available():
        raise CudaUnavailable("the copy engines need CUDA; torch sees no CUDA device")
    torch.cuda.init()
    _ready.append(load_runtime())
    return _ready[0]
