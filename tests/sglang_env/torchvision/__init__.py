"""An import-only stand-in for torchvision, for the tests that build SGLang's host memory pool.

SGLang's multimodal model configs import torchvision when `sglang.srt.mem_cache.memory_pool` is
imported; the only torchvision wheel the registry has links CUDA and cannot load against the
CPU torch. Nothing a KV pool does touches it: every attribute here raises if used.
`tests/sglang_pool.py` puts this directory on sys.path only after transformers has recorded that
torchvision is absent, so transformers never takes the stand-in for the real thing.
"""

__version__ = "0.0.0+stand-in"
