"""Exceptions deferfuse raises of its own; PyTorch's own types are used wherever PyTorch raises."""
from .runtime.errors import LoweringError, RegionError

__all__ = ["LoweringError", "RegionError"]
