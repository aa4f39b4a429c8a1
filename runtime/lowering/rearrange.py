"""Padding, rearrangements (flip, roll, repeat, triangles, diagonals) and sorted search
(searchsorted, bucketize, nonzero_static)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import op
from .padding import Factory, Refuse
from .indexing import _scalar_as
from .precision import acc

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("moves positions (a pad, a flip, a roll, a repeat, a search)")


# --------------------------------------------------------------------------------------------
# padding

@op("constant_pad_nd.default")
def constant_pad_nd(x, pad, value=0):
    pad = list(pad)
    k = len(pad) // 2
    cfg = [(0, 0, 0)] * (x.ndim - k)
    for j in range(k):
        d = k - 1 - j
        cfg.append((pad[2 * d], pad[2 * d + 1], 0))
    return lax.pad(x, _scalar_as(value, x.dtype), cfg)


def _pad_cfg(x, padding):
    k = len(padding) // 2
    cfg = [(0, 0)] * (x.ndim - k)
    for j in range(k):
        d = k - 1 - j
        cfg.append((padding[2 * d], padding[2 * d + 1]))
    return cfg


def _edge_pad(mode):
    """Pad by ``mode`` from the input's edges; negative amounts crop (after padding, so reflection
    still mirrors about the original edges, as PyTorch does)."""
    def fn(x, padding):
        cfg = _pad_cfg(x, padding)
        x = jnp.pad(x, [(max(lo, 0), max(hi, 0)) for lo, hi in cfg], mode=mode)
        if any(lo < 0 or hi < 0 for lo, hi in cfg):
            x = lax.pad(x, jnp.zeros((), x.dtype), [(min(lo, 0), min(hi, 0), 0) for lo, hi in cfg])
        return x
    return fn


_reflect = _edge_pad("reflect")
_replicate = _edge_pad("edge")


op("reflection_pad1d.default", "reflection_pad2d.default", "reflection_pad3d.default")(_reflect)
op("replication_pad1d.default", "replication_pad2d.default", "replication_pad3d.default")(_replicate)


def _pad_backward(fwd):
    def backward(grad_output, x, padding):
        # The border's gradient sums into the edge elements in float32 (a half-precision sum
        # of many terms rounds at each one), rounded once.
        up = acc(x)
        _, vjp = jax.vjp(lambda t: fwd(t, padding), up)
        return vjp(grad_output.astype(up.dtype))[0].astype(x.dtype)
    return backward


op("reflection_pad1d_backward.default", "reflection_pad2d_backward.default",
   "reflection_pad3d_backward.default")(_pad_backward(_reflect))
op("replication_pad1d_backward.default", "replication_pad2d_backward.default",
   "replication_pad3d_backward.default")(_pad_backward(_replicate))


# --------------------------------------------------------------------------------------------
# rearrangements

@op("flip.default")
def flip(x, dims):
    dims = tuple(d % x.ndim for d in dims) if x.ndim else ()
    return jnp.flip(x, dims) if dims else x


@op("roll.default")
def roll(x, shifts, dims=()):
    shifts, dims = list(shifts), list(dims)
    if not dims:
        return jnp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
    return jnp.roll(x, tuple(shifts), tuple(d % x.ndim for d in dims))


@op("repeat.default")
def repeat(x, repeats):
    repeats = tuple(repeats)
    if x.ndim < len(repeats):
        x = x.reshape((1,) * (len(repeats) - x.ndim) + x.shape)
    return jnp.tile(x, repeats)


@op("tril.default", pad=Factory())
def tril(x, diagonal=0):
    return jnp.tril(x, diagonal)


@op("triu.default", pad=Factory())
def triu(x, diagonal=0):
    return jnp.triu(x, diagonal)


@op("diag_embed.default")
def diag_embed(x, offset=0, dim1=-2, dim2=-1):
    m = x.shape[-1]
    n = m + abs(offset)
    nd = x.ndim + 1
    d1, d2 = dim1 % nd, dim2 % nd
    rows = np.arange(m) + max(-offset, 0)
    cols = np.arange(m) + max(offset, 0)
    out = jnp.zeros(x.shape[:-1] + (n, n), x.dtype).at[..., rows, cols].set(x)
    return jnp.moveaxis(out, (-2, -1), (d1, d2))


@op("diag.default")
def diag(x, diagonal=0):
    if x.ndim == 1:
        return diag_embed(x, diagonal, 0, 1)
    return jnp.diagonal(x, diagonal)


# --------------------------------------------------------------------------------------------
# sorted search

def _search(seq, v, side, sorter=None):
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter, axis=-1)
    v = jnp.asarray(v)
    if v.size == 0 or seq.shape[-1] == 0:
        return jnp.zeros(v.shape, jnp.int64)
    if seq.ndim == 1:
        return jnp.searchsorted(seq, v, side=side)
    seq2 = seq.reshape(-1, seq.shape[-1])
    v2 = v.reshape(seq2.shape[0], -1)
    return jax.vmap(lambda s, q: jnp.searchsorted(s, q, side=side))(seq2, v2).reshape(v.shape)


@op("searchsorted.Tensor", "searchsorted.Scalar")
def searchsorted(seq, v, *, out_int32=False, right=False, side=None, sorter=None):
    return _search(seq, v, "right" if (right or side == "right") else "left", sorter)


@op("bucketize.Tensor", "bucketize.Scalar")
def bucketize(v, boundaries, *, out_int32=False, right=False):
    return _search(boundaries, v, "right" if right else "left")


@op("nonzero_static.default")
def nonzero_static(x, *, size, fill_value=-1):
    if x.size == 0 or x.ndim == 0:
        return jnp.full((size, x.ndim), fill_value, jnp.int64)
    idx = jnp.nonzero(x, size=size, fill_value=fill_value)
    return jnp.stack(idx, axis=1)


# --------------------------------------------------------------------------------------------
# copies into several outputs (FSDP2's all-gather copy-out and reduce-scatter copy-in; their
# out= forms write the outputs with one op)

@op("split_with_sizes_copy.default", static=True)
def split_with_sizes_copy(x, split_sizes, dim=0):
    dim = dim % x.ndim
    return jnp.split(x, np.cumsum(list(split_sizes))[:-1].tolist(), axis=dim)


@op("_chunk_cat.default", static=True)
def chunk_cat(tensors, dim, num_chunks):
    """Each tensor padded with zeros along ``dim`` to a multiple of ``num_chunks``, viewed as
    (..., num_chunks, rest), and the tensors concatenated after the chunk dimension."""
    if len({t.ndim for t in tensors}) == 1:
        dim = dim % tensors[0].ndim
    parts = []
    for t in tensors:
        size = t.shape[dim]
        padded = -(-size // num_chunks) * num_chunks
        if padded != size:
            t = jnp.pad(t, [(0, 0)] * dim + [(0, padded - size)] + [(0, 0)] * (t.ndim - dim - 1))
        parts.append(t.reshape(t.shape[:dim] + (num_chunks, -1)))
    return jnp.concatenate(parts, axis=dim + 1)
