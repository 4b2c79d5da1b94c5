"""torchvision.transforms, import-only (see the package's docstring)."""

from typing import Any

from . import functional as functional
from .functional import InterpolationMode as InterpolationMode
from .functional import unavailable


def __getattr__(name: str) -> Any:
    return unavailable(f"transforms.{name}")
