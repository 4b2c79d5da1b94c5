"""The CUDA runtime for the copy-engine paths: `kvstore.shared.cudart`'s, once torch has set CUDA up.

`runtime()` is the library torch loaded (found first in /proc/self/maps), so the current device
and the streams are the ones torch uses; `CudaUnavailable` where torch sees no CUDA device.
"""

from __future__ import annotations

from kvstore.shared.cudart import CudaRuntime, CudaUnavailable, load_runtime


def runtime() -> CudaRuntime:
    import torch

    if not torch.cuda.is_available():
        raise CudaUnavailable("the copy engines need CUDA; torch sees no CUDA device")
    torch.cuda.init()
    return load_runtime()
