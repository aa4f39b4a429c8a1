"""Transforms and distances that mix whole dims but factor nothing: the FFT (``_fft_r2c``,
``_fft_c2c``, ``_fft_c2r``), pairwise distances (``_cdist_forward``/``_pdist_forward`` and their
backwards), and the two products over several operands' dims, ``_trilinear`` and ``_grouped_mm``
(mixture-of-experts layers).

Apart from factorizations.py because they call no LAPACK kernel: no pivots, ``info`` or
per-matrix batching (NOTE [LAPACK batches on CPU]), only jnp's FFT and products. They share its
padding rule (the same ``PAD``: a region where one of them touches a padded dim runs exactly) and
its batch broadcasting (``_bcast``).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import op
from .factorizations import _bcast
from .linalg import _LOWP, _mat
from .padding import Refuse
from .precision import HALF, dot_inputs, round_to

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py):
# factorizations.py's
PAD = Refuse("a factorization or transform mixes every position of its input")

# --------------------------------------------------------------------------------------------
# FFT. ``normalization``: 0 none, 1 by 1/sqrt(n), 2 by 1/n (n: the signal's size over ``dim``).
# jnp.fft's ``norm`` names where the 1/n goes, so a forward and an inverse transform map apart.

_FWD_NORM = {0: "backward", 1: "ortho", 2: "forward"}
_INV_NORM = {0: "forward", 1: "ortho", 2: "backward"}


@op("_fft_r2c.default")
def fft_r2c(x, dim, normalization, onesided):
    dim = [d % x.ndim for d in dim]
    if onesided:
        return jnp.fft.rfftn(x, axes=dim, norm=_FWD_NORM[normalization])
    return jnp.fft.fftn(x, axes=dim, norm=_FWD_NORM[normalization])


@op("_fft_c2c.default")
def fft_c2c(x, dim, normalization, forward):
    dim = [d % x.ndim for d in dim]
    if forward:
        return jnp.fft.fftn(x, axes=dim, norm=_FWD_NORM[normalization])
    return jnp.fft.ifftn(x, axes=dim, norm=_INV_NORM[normalization])


@op("_fft_c2r.default")
def fft_c2r(x, dim, normalization, last_dim_size):
    dim = [d % x.ndim for d in dim]
    s = [x.shape[d] for d in dim[:-1]] + [last_dim_size]
    return jnp.fft.irfftn(x, s=s, axes=dim, norm=_INV_NORM[normalization])


# --------------------------------------------------------------------------------------------
# distances and _trilinear

def _pnorm_dist(d, p):
    """The p-norm over the last axis of differences ``d`` (p a Python number)."""
    a = jnp.abs(d)
    if p == 0:
        return jnp.sum(a != 0, axis=-1).astype(d.dtype)
    if p == float("inf"):
        return jnp.max(a, axis=-1, initial=0)
    if p == 1:
        return jnp.sum(a, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=-1))
    return jnp.sum(a ** p, axis=-1) ** (1 / p)


@op("_cdist_forward.default", static=True)
def cdist_forward(x1, x2, p, compute_mode=None):
    x1, x2 = _bcast(x1, x2, core=(2, 2))
    return _pnorm_dist(x1[..., :, None, :] - x2[..., None, :, :], p)


@op("_pdist_forward.default", static=True)
def pdist_forward(x, p=2):
    i, j = np.triu_indices(x.shape[0], 1)
    return _pnorm_dist(x[i] - x[j], p)


@op("_trilinear.default")
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """Each input with size-1 dims inserted at ``expand*``, multiplied, summed over ``sumdim``:
    an einsum in which an input leaves out its expanded dims."""
    nd = i1.ndim + len(expand1)
    letters = "abcdefghijklmnopqrstuvwxyz"[:nd]
    subs = ["".join(c for d, c in enumerate(letters) if d not in e)
            for e in (set(expand1), set(expand2), set(expand3))]
    kept = [d for d in range(nd) if d not in set(sumdim)]
    absent = [d for d in kept if all(letters[d] not in sub for sub in subs)]   # size 1 in all
    out = "".join(letters[d] for d in kept if d not in absent)
    if i1.dtype in HALF:
        r = _trilinear_half(i1, i2, i3, subs, letters, set(sumdim), out, unroll_dim)
    else:
        r = jnp.einsum(f"{subs[0]},{subs[1]},{subs[2]}->{out}", i1, i2, i3)
    return jnp.expand_dims(r, [kept.index(d) for d in absent]) if absent else r


def _trilinear_half(i1, i2, i3, subs, letters, summed, out, unroll_dim):
    """CPU's half-precision _trilinear: per index of ``unroll_dim``, i1 * i2 summed over the dims
    i3 lacks (a product accumulated in float32, rounded), then that times i3 summed over the rest
    (rounded); a summed ``unroll_dim`` adds the pieces one by one, each sum rounded."""
    dt = i1.dtype
    u = letters[unroll_dim]
    s12 = {letters[d] for d in summed if letters[d] not in subs[2] and letters[d] != u}
    mid = "".join(c for c in letters if (c in subs[0] or c in subs[1]) and c not in s12)
    f32 = {"preferred_element_type": jnp.float32}
    buf = round_to(jnp.einsum(f"{subs[0]},{subs[1]}->{mid}", *dot_inputs(i1, i2), **f32), dt)
    if u not in {letters[d] for d in summed}:
        return round_to(jnp.einsum(f"{mid},{subs[2]}->{out}", buf, i3.astype(jnp.float32)), dt)
    pieces = jnp.einsum(f"{mid},{subs[2]}->{u}{out}", buf, i3.astype(jnp.float32))
    acc = round_to(pieces[0], dt)
    for k in range(1, pieces.shape[0]):
        acc = round_to(acc + round_to(pieces[k], dt), dt)
    return acc


# --------------------------------------------------------------------------------------------
# distance backwards (PyTorch's formulas: 0 where the distance is 0)

def _pnorm_dist_grad(diff, d, g, p):
    """d(dist)/d(x1) times ``g``, per pair of rows (``diff`` = x1_i - x2_j)."""
    g, d = g[..., None], d[..., None]
    safe = jnp.where(d == 0, 1, d)
    if p == 0:
        return jnp.zeros_like(diff)
    if p == 1:
        return g * jnp.sign(diff)
    if p == float("inf"):
        return g * jnp.sign(diff) * (jnp.abs(diff) == d)
    if p == 2:
        r = diff / safe
    else:
        r = jnp.sign(diff) * (jnp.abs(diff) / safe) ** (p - 1)
    return jnp.where(d == 0, 0, g * r)


def _sum_to(x, shape):
    lead = x.ndim - len(shape)
    x = jnp.sum(x, axis=tuple(range(lead))) if lead else x
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and x.shape[i] != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


@op("_cdist_backward.default", static=True)
def cdist_backward(grad, x1, x2, p, cdist):
    a, b = _bcast(x1, x2, core=(2, 2))
    diff = a[..., :, None, :] - b[..., None, :, :]
    return _sum_to(jnp.sum(_pnorm_dist_grad(diff, cdist, grad, p), axis=-2), x1.shape)


@op("_pdist_backward.default", static=True)
def pdist_backward(grad, x, p, pdist):
    i, j = np.triu_indices(x.shape[0], 1)
    c = _pnorm_dist_grad(x[i] - x[j], pdist, grad, p)
    return jnp.zeros_like(x).at[i].add(c).at[j].add(-c)


# --------------------------------------------------------------------------------------------
# grouped matmul (mixture-of-experts layers)

def _group_of(offs, n):
    """The group of each of ``n`` positions; ``offs`` holds each group's end (cumulative), and
    positions past the last end get ``len(offs)`` (no group)."""
    return jnp.searchsorted(offs, jnp.arange(n, dtype=offs.dtype), side="right")


@op("_grouped_mm.default")
def grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """Mixture-of-experts products. ``offs`` splits the grouped dim: the rows of a 2-D ``a``
    against a 3-D ``b`` (one matrix per group: ``lax.ragged_dot``), the shared dim of two 2-D
    operands (one output matrix per group: the weight gradient), the columns of a 2-D ``b``
    against a 3-D ``a``; 3-D by 3-D is a batched product. Positions past the last end give 0.
    (``bias`` is always None: meta inference rejects one.)"""
    kw = {"preferred_element_type": jnp.float32} if a.dtype in _LOWP else {}
    a, b = dot_inputs(a, b)     # NOTE [half dots on CPU]
    if a.ndim == 3 and b.ndim == 3:
        return _mat(a, b)
    if a.ndim == 2 and b.ndim == 3:
        sizes = jnp.diff(offs, prepend=jnp.zeros((1,), offs.dtype)).astype(jnp.int32)
        return lax.ragged_dot(a, b, sizes, **kw)
    if a.ndim == 2:
        hot = _group_of(offs, a.shape[1])[None, :] == jnp.arange(offs.shape[0])[:, None]
        return jnp.einsum("mk,gk,kn->gmn", a, hot.astype(a.dtype), b, **kw)
    gid = _group_of(offs, b.shape[1])                                    # each column's group
    full = _mat(a, b, "gmk,kn->gmn")
    pick = jnp.take_along_axis(full, jnp.minimum(gid, a.shape[0] - 1)[None, None, :], axis=0)[0]
    return jnp.where(gid[None, :] < a.shape[0], pick, 0)
