"""The one lowering table: aten op overload -> pure JAX function (arrays in, arrays out).

A lowering takes the aten op's arguments with every tensor replaced by a ``jax.Array`` and returns
a ``jax.Array`` (or a tuple/list of them, in the op's output order). Python numbers may arrive as
traced 0-d values unless the lowering is registered with ``static=True``. Output dtypes are cast
to PyTorch's (from meta inference) by the caller, so a lowering need not fight JAX's promotion.

Register a family once over many overloads::

    @op("add.Tensor", "add.Scalar")
    def add(x, y, *, alpha=1): ...

Overload names are strings, resolved defensively: one missing from this torch version is skipped.
``pad=`` states how the op runs padded in a bucket (NOTE [padding rules] in padding.py): one rule
for every name, or a dict from name to rule.
"""
from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, replace
from typing import Callable

import torch

from .padding import Pad, Pointwise

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class Lowering:
    fn: Callable
    static: bool = False     # Python numbers are baked in (the op needs concrete values)
    rng: bool = False        # receives ``key=`` (its generator's (seed, offset): runtime/prng.py)
    meta: bool = False       # receives ``out=((shape, np_dtype), ...)`` from meta inference
    pad: Pad | None = None   # how it runs padded (NOTE [padding rules] in padding.py)


LOWERINGS: dict = {}
MISSING: list[str] = []   # overload names a lowering asked for that this torch lacks

# NOTE [index checks]: XLA never faults on a bad index (gathers clamp, scatters drop). A lowering
# calls ``check_index`` to compute an out-of-range flag next to its result; the program returns the
# flags and the runtime raises PyTorch's error when it reads them (at once in strict/debug mode, at
# the next sync in defer mode, as CUDA reports device asserts). A message with ``{index}`` in it
# names the offending index as CPU does ("index 5 is out of bounds for dimension 1 with size 4"):
# its flag is then that index, encoded so that zero still means "none" (``flag_message``).
class _Traced(threading.local):
    """The flags traced so far by this thread: [(flag array, exception type, message)]. Per
    thread: two threads may trace programs at once (strict mode compiles on first use)."""
    def __init__(self):
        self.flags: list = []


_traced = _Traced()


def check_index(index, size: int, exc=IndexError, message: str = "index out of range in self",
                allow_negative: bool = True):
    """Flag ``index`` (an integer array) if any entry is outside [-size, size) (or [0, size))."""
    import jax.numpy as jnp
    if not hasattr(index, "dtype") or not jnp.issubdtype(index.dtype, jnp.integer):
        return
    if index.size == 0:
        return
    lo = -size if allow_negative else 0
    bad = (index < lo) | (index >= size)
    if "{index}" not in message:
        _traced.flags.append((jnp.any(bad), exc, message))
        return
    _traced.flags.append((jnp.where(jnp.any(bad), _first_bad(index, bad), 0), exc, message))


def _first_bad(index, bad):
    """The first offending entry of ``index`` in memory order (CPU's kernels report the first they
    meet), as v + 1 when v >= 0 and v itself when negative, so 0 stays "in range"."""
    import jax.numpy as jnp
    flat = index.reshape(-1).astype(jnp.int64)
    first = flat[jnp.argmax(bad.reshape(-1))]
    return jnp.where(first >= 0, first + 1, first)


def check_index_sized(index, size, exc=IndexError, message: str = "",
                      allow_negative: bool = True, valid=None):
    """``check_index`` against a size known only when the program runs (a padded dim's exact
    length, NOTE [buckets]): ``message`` names ``{index}`` and ``{size}``; the flag carries both,
    as ``code * 2**32 + size`` (``flag_message``). ``valid``: the entries to check (a padded
    index's exact ones; its padding indexes nothing, even where the dim it reads is empty)."""
    import jax.numpy as jnp
    if index.size == 0:
        return
    size = jnp.asarray(size).astype(jnp.int64)
    bad = ((index < -size) if allow_negative else (index < 0)) | (index >= size)
    if valid is not None:
        bad = bad & valid
    code = _first_bad(index, bad)
    _traced.flags.append((jnp.where(jnp.any(bad), code * (2 ** 32) + size, 0), exc, message))


def flag_message(message: str, flag) -> str:
    """``message`` of a flag that fired, with the index its flag carries in place of ``{index}``
    (and the size in place of ``{size}``: ``check_index_sized``)."""
    if "{index}" not in message:
        return message
    code = int(flag)
    if "{size}" in message:
        size = code % 2 ** 32
        code = (code - size) // 2 ** 32
        message = message.replace("{size}", str(size))
    return message.replace("{index}", str(code - 1 if code > 0 else code))


def check(bad, exc=RuntimeError, message: str = "invalid argument"):
    """Flag ``bad`` (a boolean array: any True entry raises ``exc(message)``), as check_index."""
    import jax.numpy as jnp
    _traced.flags.append((jnp.any(bad), exc, message))


def take_flags() -> list:
    """The flags traced since the last call (and forget them)."""
    out = _traced.flags
    _traced.flags = []
    return out


def resolve(name: str):
    """``"add.Tensor"`` -> ``aten.add.Tensor``, or None when this torch has no such overload."""
    packet, _, overload = name.partition(".")
    p = getattr(aten, packet, None)
    if p is None:
        return None
    return getattr(p, overload or "default", None)


def op(*names: str, static: bool = False, rng: bool = False, meta: bool = False,
       pad: Pad | dict | None = None):
    def deco(fn):
        lows: dict = {}
        for name in names:
            o = resolve(name)
            if o is None:
                MISSING.append(name)
                continue
            if o in LOWERINGS:
                raise AssertionError(f"duplicate lowering for {o}")
            rule = pad.get(name) if type(pad) is dict else pad
            low = lows.get(rule)
            if low is None:
                low = lows[rule] = Lowering(fn, static, rng, meta, rule)
            LOWERINGS[o] = low
        return fn
    return deco


def _default_pads() -> None:
    """NOTE [padding rules]: a lowering registered without ``pad=`` is ``Pointwise()`` when
    PyTorch tags its op ``pointwise``, else its family module's ``PAD`` (a ``Refuse``)."""
    import sys
    for o, low in list(LOWERINGS.items()):
        if low.pad is not None:
            continue
        if torch.Tag.pointwise in getattr(o, "tags", ()):
            rule = Pointwise()
        else:
            rule = getattr(sys.modules.get(getattr(low.fn, "__module__", None)), "PAD", None)
        if rule is not None:
            LOWERINGS[o] = replace(low, pad=rule)


FAMILIES = ("pointwise", "unary_int", "binary", "power", "prims", "special", "activations",
            "reductions", "sorting", "views", "linalg", "factorizations", "transforms",
            "matrix_exp", "linear", "creation", "nn", "norms", "embedding", "sampling", "losses",
            "attention", "pooling", "indexing", "rearrange", "random", "foreach", "optim", "rnn")
for _f in FAMILIES:
    importlib.import_module(f"{__name__}.{_f}")
_default_pads()
