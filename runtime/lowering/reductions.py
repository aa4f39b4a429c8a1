"""Reductions over dimensions."""
from __future__ import annotations

import jax.numpy as jnp

from . import op


def _dims(x, dim):
    if dim is None or dim == () or dim == []:
        return None
    if isinstance(dim, int):
        dim = (dim,)
    return tuple(d % max(x.ndim, 1) for d in dim) if x.ndim else None


@op("sum.default", "sum.dim_IntList")
def sum_(x, dim=None, keepdim=False, *, dtype=None):
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.int64)
    return jnp.sum(x, axis=_dims(x, dim), keepdims=keepdim)


@op("mean.default", "mean.dim")
def mean(x, dim=None, keepdim=False, *, dtype=None):
    return jnp.mean(x, axis=_dims(x, dim), keepdims=keepdim)


@op("amax.default")
def amax(x, dim=(), keepdim=False):
    return jnp.max(x, axis=_dims(x, dim), keepdims=keepdim)


@op("amin.default")
def amin(x, dim=(), keepdim=False):
    return jnp.min(x, axis=_dims(x, dim), keepdims=keepdim)
