"""Creation and copy ops: fill, copy, dtype conversion, arange, linspace, eye, full and friends.

Factories get their output shape and dtype from meta inference (``meta=True``); ops whose shape
depends on Python numbers (arange, linspace) are ``static=True``.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from ..dtypes import cast, to_np_dtype
from . import LOWERINGS, Lowering, op
from .padding import Factory, Refuse

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("values that depend on the whole size (linspace, eye) or a copy into a tensor")


@op("copy_.default")
def copy_(self, src, non_blocking=False):
    if self is not None and hasattr(self, "dtype") and hasattr(src, "dtype"):
        return cast(src, self.dtype)
    return src


@op("copy.default")
def copy(self, src, non_blocking=False):
    """The functional copy (AOTAutograd's graphs have it where eager code wrote ``copy_``): ``src``
    cast to ``self``'s dtype and broadcast to its shape."""
    return jnp.broadcast_to(cast(src, self.dtype), self.shape)


@op("fill_.Scalar", "fill_.Tensor")
def fill_(self, value):
    if self is None:        # overwritten whole: the runtime broadcasts the value
        return value
    return jnp.broadcast_to(jnp.asarray(value).astype(self.dtype), self.shape)


@op("zero_.default")
def zero_(self):
    return jnp.zeros((), np.float32) if self is None else jnp.zeros_like(self)


@op("_to_copy.default", "clone.default", "lift_fresh_copy.default",
    pad={"_to_copy.default": Factory(), "clone.default": Factory()})
def to_copy(x, *, dtype=None, memory_format=None, layout=None, device=None, pin_memory=None,
            non_blocking=False):
    if dtype is not None and hasattr(x, "dtype"):
        return cast(x, to_np_dtype(dtype))
    return x


# prims.convert_element_type (PyTorch's decompositions of renorm and others call it): the caller
# casts the result to the dtype meta inference gives.
_CONVERT = getattr(getattr(torch.ops.prims, "convert_element_type", None), "default", None)
if _CONVERT is not None:
    LOWERINGS[_CONVERT] = Lowering(
        lambda x, dtype: cast(x, to_np_dtype(dtype)) if hasattr(x, "dtype") else x)


def _integral(dt) -> bool:
    return not jnp.issubdtype(dt, jnp.inexact)


@op("full.default", "new_full.default", meta=True,
    pad={"full.default": Factory(sizes=(0, "size")),
         "new_full.default": Factory(sizes=(1, "size"))})
def full(*args, _avals, **kw):
    # full(size, fill_value, ...) / new_full(self, size, fill_value, ...)
    shape, dt = _avals[0]
    return jnp.full(shape, jnp.asarray(args[-1]).astype(dt), dt)


@op("zeros.default", "new_zeros.default", "zeros_like.default", "_efficientzerotensor.default",
    meta=True, pad={"zeros.default": Factory(sizes=(0, "size")),
                    "new_zeros.default": Factory(sizes=(1, "size")),
                    "zeros_like.default": Factory()})
def zeros(*args, _avals, **kw):
    shape, dt = _avals[0]
    return jnp.zeros(shape, dt)


@op("ones.default", "new_ones.default", "ones_like.default", meta=True,
    pad={"ones.default": Factory(sizes=(0, "size")),
         "new_ones.default": Factory(sizes=(1, "size")), "ones_like.default": Factory()})
def ones(*args, _avals, **kw):
    shape, dt = _avals[0]
    return jnp.ones(shape, dt)


@op("full_like.default", meta=True, pad=Factory())
def full_like(x, v, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None,
              _avals):
    shape, dt = _avals[0]
    return jnp.full(shape, jnp.asarray(v).astype(dt), dt)


@op("scalar_tensor.default", meta=True, pad=Factory())
def scalar_tensor(s, *, dtype=None, layout=None, device=None, pin_memory=None, _avals):
    return jnp.asarray(s).astype(_avals[0][1])


_CONST_LIMIT = 1 << 16   # arange values computed at trace time and baked in up to this length


@op("arange.start_step", "arange.start", "arange.default", static=True, meta=True,
    pad={"arange.start_step": Factory(sizes=(1, "end")), "arange.start": Factory(sizes=(1, "end")),
         "arange.default": Factory(sizes=(0, "end"))})
def arange(start, end=None, step=1, *, dtype=None, layout=None, device=None, pin_memory=None, _avals):
    shape, dt = _avals[0]
    n = shape[0]
    if end is None:
        start, end = 0, start
    if _integral(dt):
        # PyTorch converts start and step to the integer type first.
        start, step = int(start), int(step)
        last = start + step * max(n - 1, 0)
        it = np.int32 if max(abs(start), abs(last)) < 2 ** 31 else np.int64
        return (start + step * jnp.arange(n, dtype=it)).astype(dt)
    if n <= _CONST_LIMIT:
        # CPU computes start + step * i in double, then rounds: do exactly that, at trace time, so
        # no float64 arithmetic runs on the device.
        return jnp.asarray((float(start) + float(step) * np.arange(n, dtype=np.float64)).astype(dt))
    # long float ranges: in the output's precision (float32 for half types, as CUDA's kernel does)
    ct = np.float64 if np.dtype(dt) == np.float64 else np.float32
    return (ct(start) + ct(step) * jnp.arange(n, dtype=ct)).astype(dt)


def _linspace(start, end, steps, dt):
    """PyTorch's CPU linspace: from ``start`` up to halfway, from ``end`` down after it."""
    if steps == 0:
        return jnp.zeros((0,), dt)
    if _integral(dt):
        ct = np.float64
        s, e = jnp.trunc(jnp.asarray(start, ct)), jnp.trunc(jnp.asarray(end, ct))
    else:
        ct = np.float32 if np.dtype(dt).itemsize < 4 else dt
        s, e = jnp.asarray(start).astype(dt).astype(ct), jnp.asarray(end).astype(dt).astype(ct)
    if steps == 1:
        return jnp.reshape(s, (1,)).astype(dt)
    step = (e - s) / (steps - 1)
    i = jnp.arange(steps)
    up = s + step * i.astype(ct)
    down = e - step * (steps - i - 1).astype(ct)
    return jnp.where(i < steps // 2, up, down).astype(dt)


@op("linspace.default", "linspace.Tensor_Tensor", "linspace.Tensor_Scalar", "linspace.Scalar_Tensor",
    meta=True)
def linspace(start, end, steps, *, dtype=None, layout=None, device=None, pin_memory=None, _avals):
    return _linspace(start, end, steps, _avals[0][1])


@op("logspace.default", "logspace.Tensor_Tensor", "logspace.Tensor_Scalar", "logspace.Scalar_Tensor",
    meta=True)
def logspace(start, end, steps, base=10.0, *, dtype=None, layout=None, device=None, pin_memory=None,
             _avals):
    dt = _avals[0][1]
    if steps == 0:
        return jnp.zeros((0,), dt)
    # The exponents as PyTorch computes them (in the output type; double for integer outputs).
    ct = np.float64 if (_integral(dt) or np.dtype(dt) == np.float64) else np.float32
    e = _linspace(start, end, steps, ct)
    return jnp.power(jnp.asarray(base, ct), e).astype(dt)


@op("eye.default", "eye.m", meta=True)
def eye(n, m=None, *, dtype=None, layout=None, device=None, pin_memory=None, _avals):
    shape, dt = _avals[0]
    return jnp.eye(shape[0], shape[1], dtype=dt)


def _tri_indices(lower):
    def fn(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None, _avals):
        r, c = np.meshgrid(np.arange(row), np.arange(col), indexing="ij")
        keep = (c - r <= offset) if lower else (c - r >= offset)
        return jnp.asarray(np.stack([r[keep], c[keep]]).reshape(_avals[0][0]), _avals[0][1])
    return fn


op("tril_indices.default", meta=True)(_tri_indices(True))
op("triu_indices.default", meta=True)(_tri_indices(False))
