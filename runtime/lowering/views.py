"""View ops: read a view out of its base value. (Writing back is runtime/viewchain.py.)"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import op
from .padding import MoveDims, Refuse, Reshape, Slice

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("a view that reads across positions (a diagonal, a window, strides, a split)")


def _norm(d, n):
    return d % n if n else 0


@op("view.default", "_unsafe_view.default", "reshape.default", "_reshape_alias.default",
    "view_copy.default", pad={"view.default": Reshape(sizes=(1, "size")),
                              "_unsafe_view.default": Reshape(sizes=(1, "size")),
                              "reshape.default": Reshape(sizes=(1, "shape")),
                              "_reshape_alias.default": Reshape(),
                              "view_copy.default": Reshape(sizes=(1, "size"))})
def view(x, size, *stride):
    return jnp.reshape(x, tuple(size))


@op("view.dtype")
def view_dtype(x, dtype):
    from ..dtypes import to_np_dtype
    d = to_np_dtype(dtype)
    if d.itemsize == x.dtype.itemsize:
        return lax.bitcast_convert_type(x, d)
    if d.itemsize < x.dtype.itemsize:
        y = lax.bitcast_convert_type(x, d)   # adds a trailing dim of ratio
        return y.reshape(x.shape[:-1] + (-1,))
    r = d.itemsize // x.dtype.itemsize
    return lax.bitcast_convert_type(x.reshape(x.shape[:-1] + (-1, r)), d)


@op("alias.default", "detach.default", "lift_fresh.default", "alias_copy.default", "detach_copy.default",
    pad={"alias.default": MoveDims(), "detach.default": MoveDims(),
         "lift_fresh.default": MoveDims()})
def alias(x):
    return x


@op("t.default", "t_copy.default", pad={"t.default": MoveDims()})
def t(x):
    return x.T if x.ndim == 2 else x


@op("transpose.int", "transpose_copy.int", pad={"transpose.int": MoveDims()})
def transpose(x, d0, d1):
    if x.ndim == 0:
        return x
    return jnp.swapaxes(x, _norm(d0, x.ndim), _norm(d1, x.ndim))


@op("permute.default", "permute_copy.default", pad={"permute.default": MoveDims()})
def permute(x, dims):
    return jnp.transpose(x, [_norm(d, x.ndim) for d in dims])


@op("unsqueeze.default", "unsqueeze_copy.default", pad={"unsqueeze.default": MoveDims()})
def unsqueeze(x, dim):
    return jnp.expand_dims(x, _norm(dim, x.ndim + 1))


@op("squeeze.default", "squeeze.dim", "squeeze.dims", "squeeze_copy.default", "squeeze_copy.dim",
    "squeeze_copy.dims", pad={"squeeze.default": MoveDims(), "squeeze.dim": MoveDims(),
                              "squeeze.dims": MoveDims()})
def squeeze(x, dim=None):
    if x.ndim == 0:
        return x
    if dim is None:
        dims = tuple(i for i, s in enumerate(x.shape) if s == 1)
    else:
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
        dims = tuple(d % x.ndim for d in dims if x.shape[d % x.ndim] == 1)
    return jnp.squeeze(x, dims) if dims else x


@op("expand.default", "expand_copy.default", pad=MoveDims(sizes=(1, "size")))
def expand(x, size, *, implicit=False):
    size = list(size)
    lead = len(size) - x.ndim
    shape = [x.shape[i - lead] if s == -1 else s for i, s in enumerate(size)]
    return jnp.broadcast_to(x, shape)


def _bounds(n, start, end):
    """PyTorch's slice bounds: None as the ends, negatives from the end, clamped to [0, n]."""
    start = 0 if start is None else start
    end = n if end is None else end
    if start < 0:
        start += n
    if end < 0:
        end += n
    start = min(max(start, 0), n)
    return start, min(max(end, start), n)


@op("slice.Tensor", "slice_copy.Tensor", pad={"slice.Tensor": Slice()})
def slice_(x, dim=0, start=None, end=None, step=1):
    if x.ndim == 0:
        return x
    dim = _norm(dim, x.ndim)
    start, end = _bounds(x.shape[dim], start, end)
    return lax.slice_in_dim(x, start, end, step, axis=dim)


def _write(x, src, dim, key):
    """``x`` with ``src`` written at ``key`` (a slice or an index) along ``dim``."""
    idx = [slice(None)] * x.ndim
    idx[dim] = key
    return x.at[tuple(idx)].set(src.astype(x.dtype))


# Writing a slice or a row into a whole (and the backward of slicing or selecting: the gradient
# written into zeros) as one op each, not the composites' new_zeros + copy through a view.
@op("slice_scatter.default", static=True)
def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    dim = _norm(dim, x.ndim)
    return _write(x, src, dim, slice(*_bounds(x.shape[dim], start, end), step))


@op("slice_backward.default", static=True)
def slice_backward(g, input_sizes, dim, start, end, step):
    return slice_scatter(jnp.zeros(tuple(input_sizes), g.dtype), g, dim, start, end, step)


@op("select_scatter.default", static=True)
def select_scatter(x, src, dim, index):
    dim = _norm(dim, x.ndim)
    return _write(x, src, dim, index % x.shape[dim])


@op("select_backward.default", static=True)
def select_backward(g, input_sizes, dim, index):
    return select_scatter(jnp.zeros(tuple(input_sizes), g.dtype), g, dim, index)


@op("select.int", "select_copy.int", pad={"select.int": Slice()})
def select(x, dim, index):
    dim = _norm(dim, x.ndim)
    return lax.index_in_dim(x, index % x.shape[dim], axis=dim, keepdims=False)


@op("diagonal.default", "diagonal_copy.default")
def diagonal(x, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(x, offset, _norm(dim1, x.ndim), _norm(dim2, x.ndim))


@op("unfold.default")
def unfold(x, dim, size, step):
    if x.ndim == 0:
        return x.reshape(1)
    dim = _norm(dim, x.ndim)
    n = (x.shape[dim] - size) // step + 1
    idx = np.arange(n)[:, None] * step + np.arange(size)[None, :]
    y = jnp.take(x, idx, axis=dim)           # dims: ..., n, size, ...
    return jnp.moveaxis(y, dim + 1, -1)


@op("as_strided.default", "as_strided_copy.default")
def as_strided(x, size, stride, storage_offset=0, base_shape=None, base_stride=None):
    # Applied to the storage's base value (see deferfuse/meta.py): gather by flat memory index,
    # the value first laid out in memory order (NOTE [storage layout] in deferfuse/meta.py).
    flat = _memory_order(x, base_stride)
    idx = np.full(tuple(size), storage_offset or 0, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n) * s).reshape(shape)
    return flat[idx.astype(np.int32)] if flat.size < 2**31 else flat[idx]


def _memory_order(x, base_stride):
    """``x`` flattened in the memory order of a tensor of its shape with strides ``base_stride``:
    a permutation of the dims for a dense layout; element by element where memory has gaps
    (which hold zeros)."""
    if base_stride is None or x.ndim == 0:
        return x.reshape(-1)
    shape = x.shape
    contig, acc = [], 1
    for n in reversed(shape):
        contig.append(acc)
        acc *= max(n, 1)
    if tuple(base_stride) == tuple(reversed(contig)):
        return x.reshape(-1)
    perm = sorted(range(x.ndim), key=lambda d: (-base_stride[d], -d))
    dense, acc = True, 1
    for d in reversed(perm):
        if shape[d] != 1 and base_stride[d] != acc:
            dense = False
        acc *= shape[d]
    if dense:
        return jnp.transpose(x, perm).reshape(-1)
    size = 1 + sum((n - 1) * st for n, st in zip(shape, base_stride) if n > 0)
    idx = np.zeros(shape, np.int64)
    for d, (n, st) in enumerate(zip(shape, base_stride)):
        sh = [1] * x.ndim
        sh[d] = n
        idx = idx + (np.arange(n) * st).reshape(sh)
    return jnp.zeros((size,), x.dtype).at[idx.reshape(-1)].set(x.reshape(-1))


@op("view_as_real.default")
def view_as_real(x):
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


@op("view_as_complex.default")
def view_as_complex(x):
    return lax.complex(x[..., 0], x[..., 1])


@op("_conj.default", pad=MoveDims())
def conj_view(x):
    # The conj bit as a view: read as a conjugated copy. Writing through one needs
    # its own inverse in runtime/viewchain.py (the generic index scatter would write it unchanged).
    return jnp.conj(x) if jnp.iscomplexobj(x) else x


# Views with several outputs. Eager mode makes each output a slice or select step of its own
# (deferfuse/views.py); a compiled graph (runtime/graph.py) calls these.
@op("split_with_sizes.default", "split.sizes")
def split_with_sizes(x, split_sizes, dim=0):
    dim %= max(x.ndim, 1)
    bounds = np.cumsum(split_sizes)[:-1].tolist()
    return list(jnp.split(x, bounds, axis=dim))


@op("split.Tensor", "split_copy.Tensor")
def split(x, split_size, dim=0):
    dim %= max(x.ndim, 1)
    n = x.shape[dim]
    sizes = [split_size] * (n // split_size) + ([n % split_size] if n % split_size else [])
    return split_with_sizes(x, sizes or [0], dim)


@op("unbind.int", "unbind_copy.int")
def unbind(x, dim=0):
    dim %= max(x.ndim, 1)
    return [jnp.take(x, i, axis=dim) for i in range(x.shape[dim])]
