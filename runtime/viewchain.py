"""Views as a base value plus a chain of view ops: read a view, and write one back into its base.

A chain is a tuple of steps ``(op, args, kwargs)`` whose op has a lowering; reading applies them in
order. Writing runs them backwards: each step's inverse puts the new view value into the step's
input (``_INVERSE`` for the common views, an index scatter for the rest). See NOTE [storage model]
in deferfuse/tensor.py.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .lowering import LOWERINGS, aten


def apply_step(x, step):
    op, args, kwargs = step
    return LOWERINGS[op].fn(x, *args, **dict(kwargs))


def apply_chain(x, chain):
    for step in chain:
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


def _scatter_back(b, n, step):
    # Generic inverse: run the view over the element indices of b, then scatter n to them.
    idx = apply_step(jnp.arange(b.size, dtype=jnp.int32).reshape(b.shape), step)
    return b.reshape(-1).at[idx.reshape(-1)].set(n.reshape(-1).astype(b.dtype)).reshape(b.shape)


def scatter_chain(base, chain, new):
    """The value of ``base`` after its view ``apply_chain(base, chain)`` is overwritten by ``new``."""
    if not chain:
        return jnp.broadcast_to(new, base.shape).astype(base.dtype)
    inputs = [base]
    for step in chain[:-1]:
        inputs.append(apply_step(inputs[-1], step))
    n = new
    for step, b in zip(reversed(chain), reversed(inputs)):
        inv = _INVERSE.get(step[0])
        view_shape = apply_step(b, step).shape
        n = jnp.broadcast_to(n, view_shape).astype(b.dtype)
        n = inv(b, n, *step[1], **dict(step[2])) if inv is not None else _scatter_back(b, n, step)
    return n
