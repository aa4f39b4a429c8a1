"""The one lowering table: aten op overload -> pure JAX function (arrays in, arrays out).

A lowering takes the aten op's arguments with every tensor replaced by a ``jax.Array`` and returns
a ``jax.Array`` (or a tuple/list of them, in the op's output order). Python numbers may arrive as
traced 0-d values unless the lowering is registered with ``static=True``. Output dtypes are cast
to PyTorch's (from meta inference) by the caller, so a lowering need not fight JAX's promotion.

Register a family once over many overloads::

    @op("add.Tensor", "add.Scalar")
    def add(x, y, *, alpha=1): ...

Overload names are strings, resolved defensively: one missing from this torch version is skipped.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class Lowering:
    fn: Callable
    static: bool = False     # Python numbers are baked in (the op needs concrete values)
    rng: bool = False        # receives ``key=`` (a fresh PRNG key) and draws random numbers
    meta: bool = False       # receives ``out=((shape, np_dtype), ...)`` from meta inference


LOWERINGS: dict = {}
MISSING: list[str] = []   # overload names a lowering asked for that this torch lacks


def resolve(name: str):
    """``"add.Tensor"`` -> ``aten.add.Tensor``, or None when this torch has no such overload."""
    packet, _, overload = name.partition(".")
    p = getattr(aten, packet, None)
    if p is None:
        return None
    return getattr(p, overload or "default", None)


def op(*names: str, static: bool = False, rng: bool = False, meta: bool = False):
    def deco(fn):
        low = Lowering(fn, static, rng, meta)
        for name in names:
            o = resolve(name)
            if o is None:
                MISSING.append(name)
                continue
            if o in LOWERINGS:
                raise AssertionError(f"duplicate lowering for {o}")
            LOWERINGS[o] = low
        return fn
    return deco


FAMILIES = ("pointwise", "reductions", "views", "linalg", "creation", "nn", "indexing", "random",
            "foreach")
for _f in FAMILIES:
    importlib.import_module(f"{__name__}.{_f}")
