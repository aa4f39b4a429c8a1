"""Pooling (max, average, adaptive, their backwards) and upsampling (nearest, linear, bilinear,
bicubic, trilinear), in pure JAX. Shared helpers come from nn.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import op
from .padding import Refuse
from .nn import _acc, _tup
from .precision import HALF, acc, round_to

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("a window or an interpolation mixes neighbouring positions")


# --------------------------------------------------------------------------------------------
# pooling

def _lowest(dt):
    return -jnp.inf if jnp.issubdtype(dt, jnp.inexact) else jnp.iinfo(dt).min


def _max_pool(x, kernel_size, stride, padding, dilation, out_spatial):
    """(values, flat indices into each input plane) of a max pool over the last len(kernel) dims."""
    nd = len(out_spatial)
    k = _tup(kernel_size, nd)
    s = _tup(stride, nd, k)
    p, d = _tup(padding, nd, 0), _tup(dilation, nd, 1)
    insp = x.shape[-nd:]
    pads = [(0, 0)] * (x.ndim - nd)
    for i in range(nd):
        need = (out_spatial[i] - 1) * s[i] + d[i] * (k[i] - 1) + 1    # padded extent read
        pads.append((p[i], max(need - insp[i] - p[i], 0)))
    xp = jnp.pad(x, pads, constant_values=_lowest(x.dtype))
    vals, offs = [], []
    for kk in np.ndindex(*k):
        sl = [slice(None)] * (x.ndim - nd)
        for i in range(nd):
            start = kk[i] * d[i]
            sl.append(slice(start, start + (out_spatial[i] - 1) * s[i] + 1, s[i]))
        vals.append(xp[tuple(sl)])
        offs.append(kk)
    stack = jnp.stack(vals, axis=-1)
    which = jnp.argmax(stack, axis=-1)
    # NaN propagates as PyTorch's kernel does (argmax already picks the NaN).
    out = jnp.take_along_axis(stack, which[..., None], axis=-1)[..., 0]
    # Flat input index of each chosen element: sum over dims of (o*s - p + k*d) * plane stride.
    offs = np.asarray(offs, dtype=np.int64)                            # (K, nd)
    idx = jnp.zeros(out.shape, jnp.int64)
    plane = 1
    for i in reversed(range(nd)):
        o = lax.broadcasted_iota(jnp.int64, out_spatial, i)
        o = o.reshape((1,) * (out.ndim - nd) + tuple(out_spatial))
        pos = o * s[i] - p[i] + jnp.asarray(offs[:, i] * d[i])[which]
        idx = idx + pos * plane
        plane *= insp[i]
    return out, idx


def _max_pool_backward(grad_output, x, indices, nd):
    lead = x.shape[:-nd]
    b = int(np.prod(lead, dtype=np.int64))
    g = grad_output.reshape(b, -1)
    i = indices.reshape(b, -1)
    plane = int(np.prod(x.shape[-nd:], dtype=np.int64))
    out = jnp.zeros((b, plane), _acc(g).dtype).at[jnp.arange(b)[:, None], i].add(_acc(g))
    return out.reshape(x.shape)


def _max_pool_ops(nd):
    def with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False, *,
                     _avals):
        return _max_pool(self, _tup(kernel_size, nd), stride, padding, dilation,
                         _avals[0][0][-nd:])

    def values(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False, *, _avals):
        return with_indices(self, kernel_size, stride, padding, dilation, ceil_mode,
                            _avals=_avals)[0]

    def backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
        return _max_pool_backward(grad_output, self, indices, nd)

    op(f"max_pool{nd}d_with_indices.default", meta=True)(with_indices)
    op(f"max_pool{nd}d.default", meta=True)(values)
    if nd > 1:
        op(f"max_pool{nd}d_with_indices_backward.default")(backward)


for _nd in (1, 2, 3):
    _max_pool_ops(_nd)


def _avg_divisor(insp, outsp, k, s, p, count_include_pad):
    """Static per-output divisor of an average pool (numpy), as PyTorch's kernel computes it."""
    div = np.ones((), np.float64)
    for n, o, kk, ss, pp in zip(insp, outsp, k, s, p):
        start = np.arange(o) * ss - pp
        end = np.minimum(start + kk, n + pp)
        if count_include_pad:
            c = end - start
        else:
            c = np.minimum(end, n) - np.maximum(start, 0)
        div = np.multiply.outer(div, c.astype(np.float64))
    return div


def _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
              out_spatial):
    nd = len(out_spatial)
    k = _tup(kernel_size, nd)
    s = _tup(stride, nd, k)
    p = _tup(padding, nd, 0)
    insp = x.shape[-nd:]
    xa = _acc(x)
    pads = [(0, 0)] * (x.ndim - nd)
    for i in range(nd):
        need = (out_spatial[i] - 1) * s[i] + k[i]
        pads.append((p[i], max(need - insp[i] - p[i], 0)))
    total = lax.reduce_window(jnp.pad(xa, pads), np.array(0, xa.dtype), lax.add,
                              (1,) * (x.ndim - nd) + k, (1,) * (x.ndim - nd) + s, "VALID")
    if divisor_override:
        return total / divisor_override
    div = _avg_divisor(insp, out_spatial, k, s, p, count_include_pad)
    return total / jnp.asarray(div, xa.dtype)


def _avg_pool_ops(nd):
    def forward(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None, *, _avals):
        return _avg_pool(self, _tup(kernel_size, nd), stride, padding, ceil_mode,
                         count_include_pad, divisor_override, _avals[0][0][-nd:])

    def backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                 divisor_override):
        def f(x):
            return _avg_pool(x, _tup(kernel_size, nd), stride, padding, ceil_mode,
                             count_include_pad, divisor_override, grad_output.shape[-nd:])
        _, vjp = jax.vjp(f, _acc(self))
        return vjp(_acc(grad_output))[0]

    op(f"avg_pool{nd}d.default", meta=True)(forward)
    if nd > 1:
        op(f"avg_pool{nd}d_backward.default")(backward)


def _adaptive_matrix(n_in, n_out):
    """(n_out, n_in) averaging matrix of PyTorch's adaptive pool bins (static numpy)."""
    m = np.zeros((n_out, n_in), np.float64)
    for i in range(n_out):
        a = (i * n_in) // n_out
        b = -((-(i + 1) * n_in) // n_out)
        m[i, a:b] = 1.0 / (b - a)
    return m


def _adaptive_avg(x, out_spatial):
    nd = len(out_spatial)
    y = _acc(x)
    for i in range(nd):
        ax = x.ndim - nd + i
        m = jnp.asarray(_adaptive_matrix(x.shape[ax], out_spatial[i]), y.dtype)
        y = jnp.moveaxis(jnp.tensordot(y, m, axes=([ax], [1]), precision=lax.Precision.HIGHEST),
                         -1, ax)
    return y


def _adaptive_avg3d_half(x, out_spatial):
    """CPU's half-precision adaptive_avg_pool3d: each bin summed element by element in the
    input's dtype (d, then h, then w; every sum rounded), then divided by its depth, height and
    width one after the other (each quotient rounded)."""
    r = functools.partial(round_to, dtype=x.dtype)
    y = acc(x)
    lead = x.ndim - 3
    idx, valid, sizes = [], [], []
    for i in range(3):
        n_in, n_out = x.shape[lead + i], out_spatial[i]
        start = (np.arange(n_out) * n_in) // n_out
        end = -((-(np.arange(n_out) + 1) * n_in) // n_out)
        k = int((end - start).max()) if n_out else 1
        pos = start[:, None] + np.arange(k)[None, :]
        idx.append(np.minimum(pos, n_in - 1))
        valid.append(pos < end[:, None])
        shp = [1, 1, 1]
        shp[i] = n_out
        sizes.append(jnp.asarray((end - start).reshape(shp), jnp.float32))
    total = None
    for kd, kh, kw in np.ndindex(idx[0].shape[1], idx[1].shape[1], idx[2].shape[1]):
        t = jnp.take(y, jnp.asarray(idx[0][:, kd]), axis=lead)
        t = jnp.take(t, jnp.asarray(idx[1][:, kh]), axis=lead + 1)
        t = jnp.take(t, jnp.asarray(idx[2][:, kw]), axis=lead + 2)
        ok = (valid[0][:, kd][:, None, None] & valid[1][:, kh][None, :, None]
              & valid[2][:, kw][None, None, :])
        t = jnp.where(jnp.asarray(ok), t, 0.0)       # adding 0 leaves a rounded sum as it is
        total = t if total is None else r(total + t)
    for size in sizes:
        total = r(total / size)
    return total


def _adaptive_ops(nd):
    def forward(self, output_size, *, _avals):
        if nd == 3 and self.dtype in HALF:
            return _adaptive_avg3d_half(self, _avals[0][0][-3:])
        return _adaptive_avg(self, _avals[0][0][-nd:])

    def backward(grad_output, self):
        _, vjp = jax.vjp(lambda y: _adaptive_avg(y, grad_output.shape[-nd:]), _acc(self))
        return vjp(_acc(grad_output))[0]

    if nd == 1:
        op("adaptive_avg_pool1d.default", meta=True)(forward)
        return
    op(f"_adaptive_avg_pool{nd}d.default", f"adaptive_avg_pool{nd}d.default", meta=True)(forward)
    op(f"_adaptive_avg_pool{nd}d_backward.default")(backward)


for _nd in (1, 2, 3):
    _avg_pool_ops(_nd)
    _adaptive_ops(_nd)


def _adaptive_bins(n_in, n_out):
    """(n_out, K) input indices of each adaptive bin, the last one repeated to a common width K."""
    start = (np.arange(n_out) * n_in) // n_out
    end = -((-(np.arange(n_out) + 1) * n_in) // n_out)
    k = int((end - start).max()) if n_out else 1
    return np.minimum(start[:, None] + np.arange(k)[None, :], end[:, None] - 1)


def _adaptive_max_ops(nd):
    def forward(self, output_size, *, _avals):
        out_spatial = _avals[0][0][-nd:]
        insp = self.shape[-nd:]
        bins = [_adaptive_bins(n, o) for n, o in zip(insp, out_spatial)]
        vals, flat = [], []
        for kk in np.ndindex(*[b.shape[1] for b in bins]):
            v = self
            pos = np.zeros(out_spatial, np.int64)
            for i in range(nd):
                ix = bins[i][:, kk[i]]
                v = jnp.take(v, jnp.asarray(ix), axis=self.ndim - nd + i)
                shape = [1] * nd
                shape[i] = -1
                pos = pos * insp[i] + ix.reshape(shape)
            vals.append(v)
            flat.append(pos)
        stack = jnp.stack(vals, axis=-1)
        which = jnp.argmax(stack, axis=-1)
        out = jnp.take_along_axis(stack, which[..., None], axis=-1)[..., 0]
        flat = jnp.asarray(np.stack(flat, axis=-1))                   # out_spatial + (K,)
        idx = jnp.take_along_axis(jnp.broadcast_to(flat, which.shape + flat.shape[-1:]),
                                  which[..., None], axis=-1)[..., 0]
        return out, idx

    def backward(grad_output, self, indices):
        return _max_pool_backward(grad_output, self, indices, nd)

    op(f"adaptive_max_pool{nd}d.default", meta=True)(forward)
    op(f"adaptive_max_pool{nd}d_backward.default")(backward)


for _nd in (2, 3):
    _adaptive_max_ops(_nd)


# --------------------------------------------------------------------------------------------
# upsampling (registered static: the scales, like the sizes, decide gather indices)

def _scale(n_in, n_out, scale, align_corners=False):
    """PyTorch's source-index scale (float32, as its CPU kernels compute it)."""
    if align_corners:
        return np.float32((n_in - 1) / (n_out - 1)) if n_out > 1 else np.float32(0)
    if scale is not None and scale > 0:
        return np.float32(1.0 / scale)
    return np.float32(n_in) / np.float32(n_out)


def _nearest_index(n_in, n_out, scale, exact):
    dst = np.arange(n_out, dtype=np.float32)
    if exact:
        src = np.floor((dst + np.float32(0.5)) * _scale(n_in, n_out, scale))
    elif n_out == n_in:
        src = dst
    elif n_out == 2 * n_in:
        src = np.floor(dst / 2)
    else:
        src = np.floor(dst * _scale(n_in, n_out, scale))
    return np.minimum(src.astype(np.int64), n_in - 1)


def _linear_taps(n_in, n_out, scale, align_corners):
    """[(source index, weight)] per output position of linear interpolation (static numpy)."""
    sc = _scale(n_in, n_out, scale, align_corners)
    dst = np.arange(n_out, dtype=np.float32)
    src = sc * dst if align_corners else np.maximum(sc * (dst + np.float32(0.5)) - np.float32(0.5), 0)
    src = src.astype(np.float32)
    i0 = src.astype(np.int64)
    lam = np.clip(src - i0.astype(np.float32), 0, 1).astype(np.float32)
    i1 = np.where(i0 < n_in - 1, i0 + 1, i0)
    return [(i0, 1 - lam), (i1, lam)]


def _cubic_taps(n_in, n_out, scale, align_corners):
    """The 4 taps of PyTorch's bicubic kernel (A = -0.75, borders clamped)."""
    sc = _scale(n_in, n_out, scale, align_corners)
    dst = np.arange(n_out, dtype=np.float32)
    src = (sc * dst if align_corners else sc * (dst + np.float32(0.5)) - np.float32(0.5))
    src = src.astype(np.float32)
    i = np.floor(src).astype(np.int64)
    t = (src - i.astype(np.float32)).astype(np.float32)
    A = np.float32(-0.75)

    def near(x):
        return ((A + 2) * x - (A + 3)) * x * x + 1

    def far(x):
        return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A
    ws = [far(t + 1), near(t), near(1 - t), far(2 - t)]
    return [(np.clip(i + k - 1, 0, n_in - 1), w.astype(np.float32)) for k, w in enumerate(ws)]


def _aa_taps(n_in, n_out, scale, align_corners, cubic=False):
    """The taps of antialiased interpolation (``interpolate(..., antialias=True)``): each output
    position averages a window of inputs with a triangle (bilinear) or a = -0.5 cubic filter,
    stretched by the scale when shrinking, the weights normalised to sum to 1. Padded to the widest
    window with zero weights (static numpy)."""
    sc = float(_scale(n_in, n_out, scale, align_corners))
    half = 2.0 if cubic else 1.0                  # the filter's support, in input positions
    support, inv = (half * sc, 1.0 / sc) if sc >= 1.0 else (half, 1.0)
    center = sc * (np.arange(n_out) + 0.5)
    lo = np.maximum((center - support + 0.5).astype(np.int64), 0)
    size = np.minimum((center + support + 0.5).astype(np.int64), n_in) - lo
    j = np.arange(max(int(size.max()), 1))
    x = np.abs((j[None, :] + lo[:, None] - center[:, None] + 0.5) * inv)
    if cubic:
        a = -0.5
        w = np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                     np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))
    else:
        w = np.maximum(1.0 - x, 0.0)
    w = np.where(j[None, :] < size[:, None], w, 0.0)
    total = w.sum(axis=1, keepdims=True)
    w = np.where(total != 0, w / np.where(total != 0, total, 1), w).astype(np.float32)
    idx = np.minimum(lo[:, None] + j[None, :], n_in - 1)
    return [(idx[:, k], w[:, k]) for k in range(len(j))]


def _half_weights(taps, dtype, mode):
    """PyTorch's CPU kernels keep half-precision inputs' interpolation weights in the input's
    dtype: each cubic weight rounded; for linear, lambda rounded and 1 - lambda taken of that."""
    def rnd(w):
        return np.asarray(w, np.dtype(dtype)).astype(np.float32)
    if mode == "linear":
        (i0, _), (i1, lam) = taps
        lam = rnd(lam)
        return [(i0, rnd(np.float32(1) - lam)), (i1, lam)]
    return [(i, rnd(w)) for i, w in taps]


_TAPS = {"linear": _linear_taps, "cubic": _cubic_taps,
         "linear_aa": _aa_taps, "cubic_aa": lambda *a: _aa_taps(*a, cubic=True)}


def _upsample(x, out_spatial, scales, mode, align_corners=False):
    nd = len(out_spatial)
    y = x if mode.startswith("nearest") else _acc(x)
    # Last dim first, as PyTorch's separable kernels interpolate.
    for i in reversed(range(nd)):
        ax = x.ndim - nd + i
        n_in, n_out = x.shape[ax], out_spatial[i]
        if mode.startswith("nearest"):
            y = jnp.take(y, jnp.asarray(_nearest_index(n_in, n_out, scales[i], mode == "nearest-exact")),
                         axis=ax)
            continue
        taps = _TAPS[mode](n_in, n_out, scales[i], align_corners)
        if x.dtype in HALF and (mode == "cubic" or mode == "linear" and nd != 2):
            taps = _half_weights(taps, x.dtype, mode)       # (CPU's bilinear keeps float32 ones)
        shp = (1,) * ax + (n_out,) + (1,) * (x.ndim - ax - 1)
        acc = None
        for idx, w in taps:
            term = jnp.take(y, jnp.asarray(idx), axis=ax) * jnp.asarray(w, y.dtype).reshape(shp)
            acc = term if acc is None else acc + term
        y = acc
    return y


def _scales_of(nd, scale_factors):
    """The .vec overloads' scale_factors list (or None) as one scale per spatial dim."""
    return tuple(scale_factors) if scale_factors is not None else (None,) * nd


def _upsample_ops(name, nd, mode):
    linear = not mode.startswith("nearest")

    def forward(input, output_size, *rest, _avals):
        # (output_size, [align_corners], scale...) or .vec: (output_size, [align_corners], scale_factors)
        if linear:
            align_corners, rest = rest[0], rest[1:]
        else:
            align_corners = False
        if len(rest) == 1 and (rest[0] is None or isinstance(rest[0], (tuple, list))):
            scales = _scales_of(nd, rest[0]) if output_size is None else (None,) * nd
        else:
            scales = tuple(rest) + (None,) * (nd - len(rest))
        return _upsample(input, _avals[0][0][-nd:], scales, mode, align_corners)

    def backward(grad_output, output_size, input_size, *rest):
        if linear:
            align_corners, rest = rest[0], rest[1:]
        else:
            align_corners = False
        scales = tuple(rest) + (None,) * (nd - len(rest))
        x0 = jnp.zeros(tuple(input_size), _acc(grad_output).dtype)
        _, vjp = jax.vjp(lambda x: _upsample(x, tuple(output_size), scales, mode, align_corners), x0)
        return vjp(_acc(grad_output))[0]

    op(f"{name}.default", f"{name}.vec", static=True, meta=True)(forward)
    op(f"{name}_backward.default", static=True)(backward)


for _name, _nd, _mode in (("upsample_nearest1d", 1, "nearest"), ("upsample_nearest2d", 2, "nearest"),
                          ("upsample_nearest3d", 3, "nearest"),
                          ("_upsample_nearest_exact1d", 1, "nearest-exact"),
                          ("_upsample_nearest_exact2d", 2, "nearest-exact"),
                          ("_upsample_nearest_exact3d", 3, "nearest-exact"),
                          ("upsample_linear1d", 1, "linear"), ("upsample_bilinear2d", 2, "linear"),
                          ("upsample_trilinear3d", 3, "linear"), ("upsample_bicubic2d", 2, "cubic"),
                          ("_upsample_bilinear2d_aa", 2, "linear_aa"),
                          ("_upsample_bicubic2d_aa", 2, "cubic_aa")):
    _upsample_ops(_name, _nd, _mode)
