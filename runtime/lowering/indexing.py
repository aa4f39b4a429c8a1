"""Indexing ops: cat/stack, gather/scatter, index_* along a dim, advanced indexing, masks (padding,
flips, diagonals and sorted search: rearrange.py).

Negative indices follow PyTorch: advanced indexing, index_put, index_fill and take wrap them
(``i + size``, JAX's default); gather, scatter*, index_select, index_add and index_copy treat them
as out of range (``wrap_negative_indices=False``). Gathers clamp and scatters drop out-of-range
entries (JAX semantics); every lowering also calls ``check_index`` so the runtime raises PyTorch's
error (NOTE [index checks] in __init__.py).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import check_index, op
from .padding import Along, Cat, Factory, Index, IndexPut, Pointwise, Refuse, Scatter

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("a scatter or an indexed write with no padding rule")


_NOWRAP = {"wrap_negative_indices": False}   # PyTorch rejects negative indices for these ops


def _checked(index, size, dim, exc=RuntimeError, allow_negative=False, msg=None):
    """``index`` flagged if out of range for a dim of ``size``, then narrowed to int32 (64-bit
    integer arithmetic is emulated on accelerators; a valid index always fits)."""
    check_index(index, size, exc,
                msg or f"index {{index}} is out of bounds for dimension {dim} with size {size}",
                allow_negative)
    if index.dtype == jnp.int64 and size < 2 ** 31:
        index = index.astype(jnp.int32)
    return index


def _grid(index, dim):
    """Full index tuple for gather/scatter: ``index`` along ``dim``, iotas along the others."""
    return tuple(index if d == dim else lax.broadcasted_iota(index.dtype, index.shape, d)
                 for d in range(index.ndim))


def _crop(src, shape):
    if tuple(src.shape) == tuple(shape):
        return src
    return src[tuple(slice(0, s) for s in shape)]


def _as1d(x):
    return x.reshape(1) if x.ndim == 0 else x


def _scalar_as(v, dt):
    return jnp.asarray(v).astype(dt)


# --------------------------------------------------------------------------------------------
# concatenation

@op("cat.default", meta=True, pad=Cat())
def cat(tensors, dim=0, *, _avals):
    shape, dt = _avals[0]
    nd = len(shape)
    d = dim % nd if nd else 0
    # PyTorch skips legacy 1-D empty tensors (shape (0,)) whatever the other tensors' rank.
    xs = [t.astype(dt) for t in tensors if t is not None and t.ndim == nd and t.shape[d] != 0]
    if not xs:
        return jnp.zeros(shape, dt)
    if len(xs) == 1:
        return xs[0]
    return jnp.concatenate(xs, axis=d)


@op("stack.default", meta=True, pad=Factory())
def stack(tensors, dim=0, *, _avals):
    shape, dt = _avals[0]
    return jnp.stack([t.astype(dt) for t in tensors], axis=dim % len(shape))


# --------------------------------------------------------------------------------------------
# gather / scatter

@op("gather.default", pad=Along())
def gather(x, dim, index, *, sparse_grad=False):
    if index.size == 0:
        return jnp.zeros(index.shape, x.dtype)
    if x.ndim == 0 or index.ndim == 0:
        return gather(_as1d(x), 0, _as1d(index)).reshape(index.shape)
    dim %= x.ndim
    index = _checked(index, x.shape[dim], dim)
    # index may be smaller than x in the other dims: crop x to it.
    x = x[tuple(slice(None) if d == dim else slice(0, n) for d, n in enumerate(index.shape))]
    return jnp.take_along_axis(x, index, axis=dim, **_NOWRAP)


def _scatter_prep(x, dim, index):
    scalar = x.ndim == 0
    if scalar:
        x, index = _as1d(x), _as1d(index)
    dim %= x.ndim
    index = _checked(index, x.shape[dim], dim)
    return x, dim, index, scalar, _grid(index, dim)


def _src(src, index, dt):
    src = jnp.asarray(src)
    if src.ndim == 0:
        return src.astype(dt)
    if src.ndim != index.ndim:
        src = _as1d(src)
    return _crop(src, index.shape).astype(dt)


@op("scatter.src", "scatter.value", pad=Scatter())
def scatter(x, dim, index, src):
    if index.size == 0:
        return x
    shape = x.shape
    x, dim, index, _, g = _scatter_prep(x, dim, index)
    return x.at[g].set(_src(src, index, x.dtype), mode="drop", **_NOWRAP).reshape(shape)


@op("scatter.reduce", "scatter.value_reduce")
def scatter_reduce_legacy(x, dim, index, src, *, reduce):
    return scatter_reduce(x, dim, index, src, {"add": "sum", "multiply": "prod"}[reduce], True)


@op("scatter_add.default", pad=Scatter(add=True))
def scatter_add(x, dim, index, src):
    return scatter_reduce(x, dim, index, src, "sum", True)


def _lowest(dt):
    if jnp.issubdtype(dt, jnp.inexact):
        return -jnp.inf
    return False if dt == jnp.bool_ else jnp.iinfo(dt).min


def _highest(dt):
    if jnp.issubdtype(dt, jnp.inexact):
        return jnp.inf
    return True if dt == jnp.bool_ else jnp.iinfo(dt).max


_IDENT = {"sum": lambda dt: 0, "mean": lambda dt: 0, "prod": lambda dt: 1, "amax": _lowest,
          "amin": _highest}


def _reduce_into(x, g, s, reduce, include_self):
    """x with ``s`` reduced into the positions ``g`` (PyTorch's scatter_reduce/index_reduce)."""
    at = lambda a: a.at[g]  # noqa: E731
    kw = {"mode": "drop", **_NOWRAP}
    acc = x if include_self else at(x).set(_scalar_as(_IDENT[reduce](x.dtype), x.dtype), **kw)
    if reduce in ("sum", "mean"):
        out = at(acc).add(s, **kw) if x.dtype != jnp.bool_ else at(acc).max(s, **kw)
    elif reduce == "prod":
        out = at(acc).multiply(s, **kw) if x.dtype != jnp.bool_ else at(acc).min(s, **kw)
    elif reduce == "amax":
        out = at(acc).max(s, **kw)
    elif reduce == "amin":
        out = at(acc).min(s, **kw)
    else:
        raise ValueError(f"unknown reduction {reduce!r}")
    if reduce == "mean":
        cnt = (jnp.ones if include_self else jnp.zeros)(x.shape, jnp.int32)
        cnt = jnp.maximum(at(cnt).add(jnp.ones(jnp.shape(s), jnp.int32), **kw), 1)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            out = out / cnt.astype(x.dtype)
        else:
            out = jnp.floor_divide(out, cnt).astype(x.dtype)
    return out


@op("scatter_reduce.two")
def scatter_reduce(x, dim, index, src, reduce, include_self=True):
    if index.size == 0:
        return x
    shape = x.shape
    x, dim, index, _, g = _scatter_prep(x, dim, index)
    return _reduce_into(x, g, _src(src, index, x.dtype), reduce, include_self).reshape(shape)


# --------------------------------------------------------------------------------------------
# index_* along one dim

def _put(x, idx, v, accumulate=False, wrap=True):
    """x with ``v`` written (or added) at ``idx``; out-of-range entries are dropped."""
    kw = {"mode": "drop", "wrap_negative_indices": wrap}
    v = jnp.asarray(v).astype(x.dtype)
    if not accumulate:
        return x.at[idx].set(v, **kw)
    return x.at[idx].add(v, **kw) if x.dtype != jnp.bool_ else x.at[idx].max(v, **kw)


def _along(x, dim, index, exc=RuntimeError, allow_negative=False, msg=None):
    """(x as >=1-D, index tuple selecting ``index`` along ``dim``, dim)."""
    x = _as1d(x)
    dim %= x.ndim
    index = _checked(index, x.shape[dim], dim, exc, allow_negative, msg)
    return x, (slice(None),) * dim + (_as1d(index).reshape(-1),), dim


def _source(src, x, dim, n):
    """``src`` shaped as x with ``n`` entries along ``dim`` (0-d sources as PyTorch allows)."""
    src = jnp.asarray(src)
    want = x.shape[:dim] + (n,) + x.shape[dim + 1:]
    return src.reshape(want) if src.shape != want and src.size == int(np.prod(want)) else src


@op("index_select.default", pad=Along())
def index_select(x, dim, index):
    shape = x.shape
    # CPU raises IndexError, except from its kernel for dim 1 of an input of 2 or more dims.
    x1, idx, d = (_along(x, dim, index, msg="INDICES element is out of DATA bounds, id={index} "
                         f"axis_dim={shape[1]}") if x.ndim > 1 and dim % x.ndim == 1 else
                  _along(x, dim, index, IndexError, msg="index out of range in self"))
    out = x1.at[idx].get(**_NOWRAP)
    if len(shape) == 0:
        return out.reshape(index.shape if index.ndim else ())
    return out


@op("index_add.default")
def index_add(x, dim, index, source, *, alpha=1):
    shape = x.shape
    x1, idx, d = _along(x, dim, index)
    s = _source(source, x1, d, idx[-1].shape[0])
    if not (isinstance(alpha, (int, float)) and alpha == 1):
        s = s * alpha
    return _put(x1, idx, s, accumulate=True, wrap=False).reshape(shape)


@op("index_reduce.default")
def index_reduce(x, dim, index, source, reduce, *, include_self=True):
    shape = x.shape
    x1, idx, d = _along(x, dim, index, IndexError)
    s = _source(source, x1, d, idx[-1].shape[0]).astype(x1.dtype)
    return _reduce_into(x1, idx, s, reduce, include_self).reshape(shape)


@op("index_copy.default")
def index_copy(x, dim, index, source):
    shape = x.shape
    x1, idx, d = _along(x, dim, index, IndexError, msg=f"index_copy_(): index {{index}} is out of "
                        f"bounds for dimension {dim % max(x.ndim, 1)} with size "
                        f"{_as1d(x).shape[dim % max(x.ndim, 1)]}")
    return _put(x1, idx, _source(source, x1, d, idx[-1].shape[0]), wrap=False).reshape(shape)


@op("index_fill.int_Scalar", "index_fill.int_Tensor")
def index_fill(x, dim, index, value):
    shape = x.shape
    x1, idx, d = _along(x, dim, index, IndexError, True)
    return _put(x1, idx, value).reshape(shape)


@op("take.default")
def take(x, index):
    check_index(index, x.size, IndexError, f"out of range: tried to access index {{index}} on a tensor "
                f"of {x.size} elements.")
    return x.reshape(-1)[index]


@op("put.default")
def put(x, index, source, accumulate=False):
    check_index(index, x.size, IndexError, f"out of range: tried to access index {{index}} on a tensor "
                f"of {x.size} elements.")
    flat = _put(x.reshape(-1), index.reshape(-1), jnp.asarray(source).reshape(-1), accumulate)
    return flat.reshape(x.shape)


@op("one_hot.default", static=True)
def one_hot(x, num_classes=-1):
    # num_classes=-1 (a shape read from the data) becomes max() + 1 first (composed._h_one_hot).
    check_index(x, 2 ** 62, RuntimeError, "Class values must be non-negative.", False)
    check_index(x, num_classes, RuntimeError, "Class values must be smaller than num_classes.")
    return (x[..., None] == jnp.arange(num_classes, dtype=x.dtype)).astype(jnp.int64)


# --------------------------------------------------------------------------------------------
# *_scatter: the value of a view overwritten (static index arrays over the flat input)

@op("diagonal_scatter.default")
def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    idx = np.diagonal(np.arange(x.size).reshape(x.shape), offset, dim1 % x.ndim, dim2 % x.ndim)
    return x.reshape(-1).at[idx.astype(np.int32)].set(src.astype(x.dtype)).reshape(x.shape)


@op("as_strided_scatter.default")
def as_strided_scatter(x, src, size, stride, storage_offset=None):
    # x's value is its (contiguous) storage, as the as_strided lowering reads it.
    idx = np.full(tuple(size), storage_offset or 0, dtype=np.int64)
    for d, (n, st) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n) * st).reshape(shape)
    return x.reshape(-1).at[idx.astype(np.int32)].set(src.astype(x.dtype)).reshape(x.shape)


# --------------------------------------------------------------------------------------------
# advanced indexing (negative indices wrap: JAX's default, as in PyTorch)

def _is_mask(i):
    return i is not None and i.dtype in (jnp.bool_, jnp.uint8)


def _index_msg(k: int, size: int) -> str:
    # CPU numbers the dimension among the index tensors, not among x's dims: x[:, i] with i out
    # of range says "dimension 0".
    return f"index {{index}} is out of bounds for dimension {k} with size {size}"


def _index_tuple(x, indices):
    """jnp index tuple for PyTorch ``indices`` (Tensor?[]) of integer tensors; None = full slice.
    Flags indices outside [-size, size) of their dim."""
    out, k = [], 0
    for d, i in enumerate(indices):
        if i is None:
            out.append(slice(None))
        else:
            out.append(_checked(i, x.shape[d], d, IndexError, True, _index_msg(k, x.shape[d])))
            k += 1
    return tuple(out)


@op("index.Tensor", pad=Index())
def index(x, indices):
    if any(_is_mask(i) for i in indices):
        raise NotImplementedError("index.Tensor with a boolean mask has a data-dependent shape")
    return x[_index_tuple(x, indices)]


def _mask_put(x, indices, values, accumulate):
    """index_put with boolean masks: masks become padded nonzero() index lists whose padding is out
    of range (dropped by the scatter); a values dim holding one entry per True is padded to match."""
    out, d, adv_pos = [], 0, []
    for i in indices:
        if i is None:
            out.append(slice(None))
            d += 1
        elif _is_mask(i):
            m = i.astype(jnp.bool_)
            nz = jnp.nonzero(m, size=m.size, fill_value=tuple(x.shape[d:d + m.ndim]))
            for k in range(m.ndim):
                adv_pos.append(len(out))
                out.append(nz[k])
            d += m.ndim
        else:
            out.append(_checked(i, x.shape[d], d, IndexError, True,
                                _index_msg(len(adv_pos), x.shape[d])))
            adv_pos.append(len(out) - 1)
            d += 1
    out = tuple(out)
    # Where the advanced-index dim lands in x[out] (NumPy/PyTorch rule), and its size there.
    contiguous = adv_pos == list(range(adv_pos[0], adv_pos[0] + len(adv_pos)))
    pos = adv_pos[0] if contiguous else 0
    bshape = jnp.broadcast_shapes(*[out[p].shape for p in adv_pos])
    n_slices = sum(isinstance(o, slice) for o in out) + x.ndim - d
    v = jnp.asarray(values)
    vd = v.ndim - (n_slices + len(bshape) - pos)   # values' dim aligned with the advanced dim
    if len(bshape) == 1 and 0 <= vd < v.ndim and v.shape[vd] not in (1, bshape[0]):
        pad = [(0, 0)] * v.ndim
        pad[vd] = (0, bshape[0] - v.shape[vd])
        v = jnp.pad(v, pad)
    return _put(x, out, v, accumulate)


@op("index_put.default", pad=IndexPut())
def index_put(x, indices, values, accumulate=False):
    indices = list(indices)
    while indices and indices[-1] is None:
        indices.pop()
    if not indices:
        v = jnp.asarray(values).astype(x.dtype)
        return x + v if accumulate else jnp.broadcast_to(v, x.shape)
    masks = [i for i in indices if _is_mask(i)]
    if masks:
        m = masks[0]
        if (len(indices) == 1 and jnp.size(values) == 1 and not accumulate
                and m.shape == x.shape[:m.ndim]):
            # x[mask] = scalar: a select, no scatter
            mb = m.astype(jnp.bool_).reshape(m.shape + (1,) * (x.ndim - m.ndim))
            return jnp.where(mb, jnp.asarray(values).reshape(()).astype(x.dtype), x)
        return _mask_put(x, indices, values, accumulate)
    return _put(x, _index_tuple(x, indices), values, accumulate)


@op("_index_put_impl_.default", pad=IndexPut())
def _index_put_impl_(x, indices, values, accumulate=False, unsafe=False):
    return index_put(x, indices, values, accumulate)


# --------------------------------------------------------------------------------------------
# masks

@op("masked_fill.Scalar", "masked_fill.Tensor", meta=True, pad=Pointwise())
def masked_fill(x, mask, value, *, _avals):
    shape, dt = _avals[0]
    return jnp.where(mask, _scalar_as(value, dt), x.astype(dt))


@op("masked_scatter_backward.default")
def masked_scatter_backward(grad_output, mask, sizes):
    """The gradient of masked_scatter's ``source``: the masked entries of ``grad_output`` in order,
    zero-filled to ``sizes`` (PyTorch's masked_select + cat + view, with a static shape). Vision-
    language models put image features into token embeddings with masked_scatter."""
    shape = jnp.broadcast_shapes(grad_output.shape, mask.shape)
    g = jnp.broadcast_to(grad_output, shape).reshape(-1)
    m = jnp.broadcast_to(mask, shape).reshape(-1)
    n = math.prod(sizes)
    ct = jnp.int32 if m.size < 2 ** 31 else jnp.int64
    pos = jnp.where(m, jnp.cumsum(m.astype(ct)) - 1, n)        # n: dropped
    return jnp.zeros((n,), g.dtype).at[pos].set(g, mode="drop").reshape(tuple(sizes))


@op("masked_scatter.default", meta=True)
def masked_scatter(x, mask, source, *, _avals):
    shape, dt = _avals[0]
    xb = jnp.broadcast_to(x, shape).reshape(-1).astype(dt)
    mb = jnp.broadcast_to(mask, shape).reshape(-1)
    if source.size == 0:
        return xb.reshape(shape)
    ct = jnp.int32 if mb.size < 2 ** 31 else jnp.int64
    pos = jnp.clip(jnp.cumsum(mb.astype(ct)) - 1, 0, source.size - 1)
    vals = source.reshape(-1)[pos].astype(dt)
    return jnp.where(mb, vals, xb).reshape(shape)
