"""torchvision.transforms.functional, import-only (see the package's docstring)."""

import enum
from collections.abc import Callable
from typing import Any


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def unavailable(name: str) -> Callable[..., Any]:
    """A callable that stands for `name` and says so if it is ever called."""

    def call(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"torchvision {name}: the test stand-in cannot run it")

    return call


def __getattr__(name: str) -> Any:
    return unavailable(f"transforms.functional.{name}")
