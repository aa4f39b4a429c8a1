"""Views as a base value plus a chain of view ops: read a view, and write one back into its base.

A chain is a tuple of steps ``(op, args, kwargs)`` whose op has a lowering; reading applies them in
order. Writing runs them backwards: each step's inverse puts the new view value into the step's
input (``_INVERSE`` for the common views, an index scatter for the rest). See NOTE [storage model]
in deferfuse/tensor.py.

NOTE [dynamic offsets]: where a view only moves a window (``data[i:i+35]``, ``x[i]``,
``narrow``, ``as_strided``'s offset), its start is data, not structure: the step is one of
``DSLICE``, ``DSELECT``, ``DSTRIDED`` holding the sizes (static), and the start, normalised at
record time (negative and clamped starts resolved, so it is always in range), is kept beside the
chain in the tensor's ``_dyn`` (one int per dynamic step, in chain order). The chain alone is in
the tensor's signature and so in every op key: a loop over ``data[i:i+35]`` is one structure for
every ``i``, and each op reading such a view takes its offsets as int inputs (appended to the op's
scalars: NOTE [packed scalars] in execute.py). Reading is ``lax.dynamic_slice``; writing through
the view is ``lax.dynamic_update_slice``.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .lowering import LOWERINGS, aten
from .lowering.views import _memory_order

DSLICE = "\0dslice"      # args (dim, length, step); offset: the start along dim
DSELECT = "\0dselect"    # args (dim,); offset: the index along dim
DSTRIDED = "\0dstrided"  # args (size, stride, base_shape, base_stride); offset: storage offset
DYNAMIC = frozenset((DSLICE, DSELECT, DSTRIDED))


def _dslice(x, off, dim, length, step):
    n = (length - 1) * step + 1 if length else 0
    y = lax.dynamic_slice_in_dim(x, off, n, axis=dim)
    return y if step == 1 else lax.slice_in_dim(y, 0, n, step, axis=dim)


def _dselect(x, off, dim):
    return lax.dynamic_index_in_dim(x, off, axis=dim, keepdims=False)


def _dstrided(x, off, size, stride, base_shape, base_stride):
    # as_strided's gather (runtime/lowering/views.py) with the offset added to static indices.
    flat = _memory_order(x, base_stride)
    idx = np.zeros(tuple(size), dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n) * s).reshape(shape)
    return flat[idx + off]


_DYN_APPLY = {DSLICE: _dslice, DSELECT: _dselect, DSTRIDED: _dstrided}


def n_dynamic(chain) -> int:
    """How many offsets a chain takes (its dynamic steps)."""
    return sum(1 for s in chain if s[0] in DYNAMIC)


def apply_step(x, step, off=None):
    op, args, kwargs = step
    if op in DYNAMIC:
        return _DYN_APPLY[op](x, off, *args)
    return LOWERINGS[op].fn(x, *args, **dict(kwargs))


def apply_chain(x, chain, dyn=()):
    """The view ``chain`` of ``x``, its dynamic steps at the offsets ``dyn`` (in order)."""
    k = 0
    for step in chain:
        if step[0] in DYNAMIC:
            x = apply_step(x, step, dyn[k])
            k += 1
        else:
            x = apply_step(x, step)
    return x


def _reshape_back(b, n, *a, **k):
    return n.reshape(b.shape)


def _transpose_back(b, n, d0, d1):
    return jnp.swapaxes(n, d0, d1)


def _t_back(b, n):
    return n.T if n.ndim == 2 else n


def _permute_back(b, n, dims):
    dims = [d % b.ndim for d in dims]
    return jnp.transpose(n, np.argsort(dims))


def _slice_back(b, n, dim=0, start=None, end=None, step=1):
    dim %= b.ndim
    size = b.shape[dim]
    start = 0 if start is None else start
    end = size if end is None else end
    start = min(max(start + size if start < 0 else start, 0), size)
    end = min(max(end + size if end < 0 else end, start), size)
    idx = [slice(None)] * b.ndim
    idx[dim] = slice(start, end, step)
    return b.at[tuple(idx)].set(n)


def _select_back(b, n, dim, index):
    dim %= b.ndim
    idx = [slice(None)] * b.ndim
    idx[dim] = index % b.shape[dim]
    return b.at[tuple(idx)].set(n)


_INVERSE = {}
for _o in ("view.default", "_unsafe_view.default", "reshape.default", "_reshape_alias.default",
           "unsqueeze.default", "squeeze.default", "squeeze.dim", "squeeze.dims", "alias.default",
           "detach.default", "lift_fresh.default", "view_as.default", "flatten.using_ints"):
    _p, _, _ov = _o.partition(".")
    _op = getattr(getattr(aten, _p, None), _ov, None)
    if _op is not None:
        _INVERSE[_op] = _reshape_back
_INVERSE[aten.transpose.int] = _transpose_back
_INVERSE[aten.t.default] = _t_back
_INVERSE[aten.permute.default] = _permute_back
_INVERSE[aten.slice.Tensor] = _slice_back
_INVERSE[aten.select.int] = _select_back
_INVERSE[aten._conj.default] = lambda b, n: jnp.conj(n)   # writing through a conj view


def _dslice_back(b, n, off, dim, length, step):
    if step != 1:
        return _scatter_back(b, n, (DSLICE, (dim, length, step), ()), off)
    return lax.dynamic_update_slice_in_dim(b, n, off, axis=dim)


def _dselect_back(b, n, off, dim):
    return lax.dynamic_update_index_in_dim(b, n, off, axis=dim)


_DYN_INVERSE = {DSLICE: _dslice_back, DSELECT: _dselect_back}


def _scatter_back(b, n, step, off=None):
    # Generic inverse: run the view over the element indices of b, then scatter n to them.
    idx = apply_step(jnp.arange(b.size, dtype=jnp.int32).reshape(b.shape), step, off)
    return b.reshape(-1).at[idx.reshape(-1)].set(n.reshape(-1).astype(b.dtype)).reshape(b.shape)


def scatter_chain(base, chain, new, dyn=()):
    """The value of ``base`` after its view ``apply_chain(base, chain, dyn)`` is overwritten by
    ``new``."""
    if not chain:
        return jnp.broadcast_to(new, base.shape).astype(base.dtype)
    offs, k = [], 0
    for step in chain:
        if step[0] in DYNAMIC:
            offs.append(dyn[k])
            k += 1
        else:
            offs.append(None)
    inputs = [base]
    for step, off in zip(chain[:-1], offs):
        inputs.append(apply_step(inputs[-1], step, off))
    n = new
    for step, off, b in zip(reversed(chain), reversed(offs), reversed(inputs)):
        op = step[0]
        view_shape = apply_step(b, step, off).shape
        n = jnp.broadcast_to(n, view_shape).astype(b.dtype)
        if op in DYNAMIC:
            inv = _DYN_INVERSE.get(op)
            n = inv(b, n, off, *step[1]) if inv is not None else _scatter_back(b, n, step, off)
            continue
        inv = _INVERSE.get(op)
        n = inv(b, n, *step[1], **dict(step[2])) if inv is not None else _scatter_back(b, n, step)
    return n
