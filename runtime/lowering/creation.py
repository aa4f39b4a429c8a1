"""Creation and copy ops: fill, copy, dtype conversion, arange, full."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from . import op


@op("copy_.default")
def copy_(self, src, non_blocking=False):
    return src


@op("fill_.Scalar", "fill_.Tensor")
def fill_(self, value):
    return jnp.broadcast_to(jnp.asarray(value).astype(self.dtype), self.shape) if self is not None else value


@op("zero_.default")
def zero_(self):
    return jnp.zeros((), np.float32) if self is None else jnp.zeros_like(self)


@op("_to_copy.default", "clone.default", "lift_fresh_copy.default")
def to_copy(x, *, dtype=None, memory_format=None, layout=None, device=None, pin_memory=None,
            non_blocking=False):
    return x


@op("full.default", meta=True)
def full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None, _avals):
    shape, dt = _avals[0]
    return jnp.full(shape, fill_value, dt)


@op("scalar_tensor.default", meta=True)
def scalar_tensor(s, *, dtype=None, layout=None, device=None, pin_memory=None, _avals):
    return jnp.asarray(s, _avals[0][1])


@op("arange.start_step", "arange.start", "arange.default", static=True, meta=True)
def arange(start, end=None, step=1, *, dtype=None, layout=None, device=None, pin_memory=None, _avals):
    shape, dt = _avals[0]
    if end is None:
        start, end = 0, start
    return (start + step * jnp.arange(shape[0], dtype=np.float64 if isinstance(start + step, float) else np.int64)).astype(dt)


@op("full_like.default", meta=True)
def full_like(x, v, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, _avals):
    shape, dt = _avals[0]
    return jnp.full(shape, v, dt)


@op("zeros_like.default", meta=True)
def zeros_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, _avals):
    shape, dt = _avals[0]
    return jnp.zeros(shape, dt)


@op("ones_like.default", meta=True)
def ones_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, _avals):
    shape, dt = _avals[0]
    return jnp.ones(shape, dt)
