"""Sorting and selection along a dimension: sort, topk, kthvalue, median, mode. PyTorch's
conventions: NaN counts as the largest value, sorts are stable, ties pick the first index (mode:
the last)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import op
from .padding import Refuse, TopK
from .reductions import _idx, _isfloat, _up

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("sorts or ranks along a dim: the padding would be sorted in")


def _sort(x, dim, descending=False):
    """Stable sort along ``dim`` (NaN largest): (values, int64 indices)."""
    if x.ndim == 0:
        return x, _idx(())
    dim = dim % x.ndim
    n = x.shape[dim]
    if descending:   # stable descending = reverse of the stable ascending sort of the reverse
        x = jnp.flip(x, dim)
    key = x
    if _isfloat(x):
        key = jnp.where(jnp.isnan(x), jnp.array(jnp.nan, x.dtype), x)
    elif x.dtype == jnp.bool_:
        key = x.astype(jnp.uint8)
    idx = lax.broadcasted_iota(jnp.int64, x.shape, dim)
    k, i = lax.sort((key, idx), dimension=dim, num_keys=1, is_stable=True)
    v = k.astype(x.dtype)
    if descending:
        v, i = jnp.flip(v, dim), (n - 1) - jnp.flip(i, dim)
    return v, i


@op("sort.default")
def sort(x, dim=-1, descending=False):
    return _sort(x, dim, descending)


@op("sort.stable")
def sort_stable(x, *, stable=None, dim=-1, descending=False):
    return _sort(x, dim, descending)


@op("topk.default", pad=TopK())
def topk(x, k, dim=-1, largest=True, sorted=True):
    if x.ndim == 0:
        return x, _idx(())
    dim = dim % x.ndim
    if largest and x.dtype != jnp.bool_:
        # lax.top_k: NaN largest, ties to the lower index (as the stable sort would).
        v, i = lax.top_k(jnp.moveaxis(x, dim, -1), k)
        return jnp.moveaxis(v, -1, dim), jnp.moveaxis(i.astype(jnp.int64), -1, dim)
    v, i = _sort(x, dim, largest)
    return lax.slice_in_dim(v, 0, k, axis=dim), lax.slice_in_dim(i, 0, k, axis=dim)


def _pick(v, i, k, dim, keepdim):
    """Entries at position ``k`` (a number, or an array shaped like a keepdim reduction)."""
    if not isinstance(k, jax.Array):
        sv = lax.slice_in_dim(v, k, k + 1, axis=dim)
        si = lax.slice_in_dim(i, k, k + 1, axis=dim)
    else:
        sv = jnp.take_along_axis(v, k, axis=dim)
        si = jnp.take_along_axis(i, k, axis=dim)
    if not keepdim:
        sv, si = jnp.squeeze(sv, dim), jnp.squeeze(si, dim)
    return sv, si


@op("kthvalue.default")
def kthvalue(x, k, dim=-1, keepdim=False):
    if x.ndim == 0:
        return x, _idx(())
    dim = dim % x.ndim
    v, i = _sort(x, dim)
    return _pick(v, i, k - 1, dim, keepdim)


def _median(x, dim, keepdim, ignore_nan):
    if x.ndim == 0:
        return x, _idx(())
    dim = dim % x.ndim
    n = x.shape[dim]
    v, i = _sort(x, dim)
    if not _isfloat(x):
        return _pick(v, i, (n - 1) // 2, dim, keepdim)
    nan = jnp.sum(jnp.isnan(x), axis=dim, keepdims=True)
    if ignore_nan:      # lower median of the non-NaN values; all NaN: a NaN (CPU's is arbitrary)
        m = n - nan
        k = jnp.where(m > 0, (m - 1) // 2, 0)
    else:               # any NaN: the first NaN
        k = jnp.where(nan > 0, n - nan, (n - 1) // 2)
    return _pick(v, i, k.astype(jnp.int64), dim, keepdim)


@op("median.default")
def median(x):
    if x.size == 0:
        return jnp.full((), jnp.nan, _up(x).dtype)
    return _median(x.reshape(-1), 0, False, False)[0]


@op("nanmedian.default")
def nanmedian(x):
    if x.size == 0:
        return jnp.full((), jnp.nan, _up(x).dtype)
    return _median(x.reshape(-1), 0, False, True)[0]


@op("median.dim")
def median_dim(x, dim, keepdim=False):
    return _median(x, dim, keepdim, False)


@op("nanmedian.dim")
def nanmedian_dim(x, dim, keepdim=False):
    return _median(x, dim, keepdim, True)


@op("mode.default")
def mode(x, dim=-1, keepdim=False):
    """Most frequent value (ties: the smallest) and the last index where it occurs."""
    if x.ndim == 0:
        return x, _idx(())
    dim = dim % x.ndim
    v, i = _sort(x, dim)
    v, i = jnp.moveaxis(v, dim, -1), jnp.moveaxis(i, dim, -1)
    pos = lax.broadcasted_iota(jnp.int64, v.shape, v.ndim - 1)
    new = jnp.concatenate([jnp.ones(v.shape[:-1] + (1,), bool), v[..., 1:] != v[..., :-1]], -1)
    start = lax.cummax(jnp.where(new, pos, 0), axis=v.ndim - 1)
    best = jnp.argmax(pos - start, axis=-1, keepdims=True)   # end of the first longest run
    sv = jnp.take_along_axis(v, best, -1)
    si = jnp.take_along_axis(i, best, -1)
    sv, si = jnp.moveaxis(sv, -1, dim), jnp.moveaxis(si, -1, dim)
    if not keepdim:
        sv, si = jnp.squeeze(sv, dim), jnp.squeeze(si, dim)
    return sv, si
