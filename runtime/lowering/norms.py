"""Normalizations: layer, group and batch norm and their backward ops, with CPU's statistics
(Welford's moments, float32 for 16-bit inputs as PyTorch's CPU kernels; NOTE [bf16 layer norm]).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import op
from .nn import _acc, _zeros
from .padding import Normalize, Refuse, ZeroPadded
from .precision import acc, is_half, round_to

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("a normalization across positions")


def _moments(x, axes):
    """(mean, biased variance) of ``x`` over ``axes`` (kept), the mean refined by the mean of the
    residuals (the corrected two-pass algorithm). PyTorch's CPU kernels take both by Welford's
    algorithm, whose mean of a constant row is that constant exactly; ``sum / n`` alone can be an
    ulp off, and ``(x - mean) * rsqrt(eps)`` then turns that ulp into values of order 1e-5 (with
    eps 1e-6) where CPU's normalized row is exactly zero (a group norm over a constant signal)."""
    mean = jnp.mean(x, axis=axes, keepdims=True)
    mean = mean + jnp.mean(x - mean, axis=axes, keepdims=True)
    return mean, jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)


def _norm_backward(g, xhat, rstd, axes):
    """d(loss)/dx of xhat = (x - mean(x)) * rstd over ``axes``, given g = d(loss)/d(xhat)."""
    mg = jnp.mean(g, axis=axes, keepdims=True)
    mgx = jnp.mean(g * xhat, axis=axes, keepdims=True)
    return rstd * (g - mg - xhat * mgx)


# NOTE [bf16 layer norm]: a bfloat16 layer norm (parameters bfloat16 too) computes as PyTorch's
# CPU kernel does, bit for bit where measured: the statistics by Welford's algorithm over the
# row's vectors (the mean of a row of bfloat16 values is often exactly halfway between two
# bfloat16 values, and rounds by the sign of the algorithm's error: the two-pass mean rounded the
# other way in up to 1% of rows), y = (x * rstd + (-rstd * mean)) * w + b, and the input gradient
# as rstd * dy * w + b * x + c from per-row sums in CPU's vector order over the rounded mean and
# rstd (the textbook form rounded a few elements per thousand rows differently, and a bfloat16
# model's gradients drifted from CPU's from there on). CPU's compiler fuses some of the
# multiply-adds and not others; XLA's would fuse its own choice, and rewrites divisions: the
# lowering spells out each FMA (_fma), each rounded product (_mul) and each true division (_div).
# On a TPU or GPU (where float64, which these use, is slow or absent) the float32 forms stay.


def _cpu_order(dtype, *params) -> bool:
    """NOTE [half layer norm parameter gradients] applies: a bfloat16 or float16 input whose
    parameters (those given) have its dtype, on XLA's CPU platform."""
    from ..platform import name
    return (is_half(dtype) and all(p is None or p.dtype == dtype for p in params)
            and name() == "cpu")


def _cpu_exact(dtype) -> bool:
    """NOTE [bf16 layer norm] applies: a bfloat16 tensor on XLA's CPU platform."""
    from ..platform import name
    return dtype == jnp.bfloat16 and name() == "cpu"


def _div(a, b):
    """``a / b`` (float32) divided as CPU divides: XLA rewrites a division by a constant into a
    product with its rounded reciprocal (different in about half of the elements) and
    ``a / sqrt(v)`` into ``a * rsqrt(v)``. The divisor, broadcast to the full shape, passes an
    optimization barrier, which nothing is folded through."""
    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))
    return a / lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, jnp.float32), shape))


def _mul(a, b):
    """``a * b`` rounded to float32 before whatever adds it (XLA's CPU compiler would fuse the
    product and a following sum into one FMA where CPU's kernel rounds the product first): the
    product of two float32 values is exact in float64, and rounds once on the way back."""
    f64 = jnp.float64
    return (jnp.asarray(a).astype(f64) * jnp.asarray(b).astype(f64)).astype(jnp.float32)


# The float32 lanes of the vectors PyTorch's CPU layer norm kernels run on (8 measured here: the
# statistics match CPU's only with 8; the backward's sums are the same with 8 or 16).
_NORM_LANES = 8
# The widest rows the bfloat16 layer norm forward follows CPU's statistics for (checked bit for
# bit up to 512 values, two chunks of the cascade; wider rows, whose deeper cascade differs in a
# few elements, and rows beyond a long unrolled program take the float32 two-pass form).
_NORM_EXACT = 512


def _welford_merge(n_add, m1_add, m2_add, n, m1, m2, vector):
    """PyTorch's ``AddMomentsVec`` (``vector``) or ``AddMoments``: the moments (m1, m2) of ``n``
    values joined by those of ``n_add`` more, with the multiply-adds CPU fuses."""
    total = n + n_add
    c = np.float32(0) if total == 0 else np.float32(n_add) / np.float32(total)
    delta = m1_add - m1
    if vector:
        cd = _mul(c, delta)
        return total, m1 + cd, _fma(delta * np.float32(n), cd, m2 + m2_add)
    return total, _fma(jnp.float32(c), delta, m1), m2 + (m2_add + _mul((delta * delta) * c, np.float32(n)))


def _cpu_moments(x):
    """(mean, biased variance), float32, of the rows of ``x`` (the float32 values of a bfloat16
    tensor) as PyTorch's CPU ``RowwiseMoments`` computes them (NOTE [bf16 layer norm]):
    Welford's algorithm per lane over the row's vectors (two float vectors per bfloat16 vector),
    chunks of 16 vectors joined by a cascade, the tail one value at a time, then the lanes joined
    one by one."""
    lanes = _NORM_LANES
    width, chunk = 2 * lanes, 16
    n_total = x.shape[-1]
    n = n_total // width
    lead = x.shape[:-1]
    zero = jnp.zeros(lead + (lanes,), jnp.float32)
    chunks = -(-n // chunk)
    depth = max(1, (chunks - 1).bit_length())
    stack = [(0, zero, zero) for _ in range(depth)]
    for i in range(chunks):
        count = min(chunk, n - i * chunk)
        halves = []
        for h in range(2):
            m1 = m2 = zero
            for j in range(count):
                start = (i * chunk + j) * width + h * lanes
                v = x[..., start:start + lanes]
                d = v - m1
                m1 = _fma(d, jnp.float32(np.float32(1) / np.float32(j + 1)), m1)
                m2 = _fma(d, v - m1, m2)
            halves.append((m1, m2))
        for m1, m2 in halves:
            stack[0] = _welford_merge(count, m1, m2, *stack[0], vector=True)
        mask, j = i + 1, 1
        while j < depth and mask & 1 == 0:
            stack[j] = _welford_merge(*stack[j - 1], *stack[j], vector=True)
            stack[j - 1] = (0, zero, zero)
            mask >>= 1
            j += 1
    for j in range(1, depth):
        stack[0] = _welford_merge(*stack[j], *stack[0], vector=True)
    m0, m1, m2 = 0, jnp.zeros(lead, jnp.float32), jnp.zeros(lead, jnp.float32)
    for k in range(n * width, n_total):
        v = x[..., k]
        d = v - m1
        m0 += 1
        m1 = m1 + _div(d, m0)
        m2 = _fma(d, v - m1, m2)
    for k in range(lanes):
        m0, m1, m2 = _welford_merge(2 * n, stack[0][1][..., k], stack[0][2][..., k], m0, m1, m2, vector=False)
    return m1, _div(m2, n_total)


@op("native_layer_norm.default", pad=Normalize(1))
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    x = _acc(input)
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    n = math.prod(normalized_shape)
    if _cpu_exact(input.dtype) and x.size and n <= _NORM_EXACT and all(
            t is None or t.dtype == input.dtype for t in (weight, bias)):
        # NOTE [bf16 layer norm]
        lead = x.shape[:x.ndim - len(normalized_shape)]
        flat = x.reshape(lead + (n,))
        mean, var = _cpu_moments(flat)
        rstd = _div(1, jnp.sqrt(var + jnp.asarray(eps).astype(jnp.float32)))
        y = _fma(flat, rstd[..., None], (-rstd * mean)[..., None])
        if weight is not None or bias is not None:
            w = jnp.ones((n,), jnp.float32) if weight is None else acc(weight).reshape(-1)
            b = jnp.zeros((n,), jnp.float32) if bias is None else acc(bias).reshape(-1)
            y = _fma(y, w, b)
        keep = lead + (1,) * len(normalized_shape)
        return y.reshape(x.shape), mean.reshape(keep), rstd.reshape(keep)
    mean, var = _moments(x, axes)
    rstd = lax.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out, mean, rstd


# Two of the float32 vectors PyTorch's CPU layer norm kernel sums in (see _NORM_LANES).
_F32_LANES = 16


def _fma(a, b, c):
    """``a * b + c`` (float32) rounded once, as a fused multiply-add: the product is exact in
    float64, so the float64 sum rounds as the FMA does except in ties of the second rounding."""
    f64 = jnp.float64
    return (a.astype(f64) * b.astype(f64) + c.astype(f64)).astype(jnp.float32)


def _cpu_row_sum(p):
    """The sum of ``p`` (float32) over its last axis in the order of PyTorch's vectorized CPU
    reductions over bfloat16 rows (``vec::map*_reduce_all``): two 8-lane accumulators take the
    float halves of each 16-value vector in turn (the tail padded with zeros), are added, and
    their lanes add pairwise, halves first; the same order as one 16-lane accumulator whose
    halves are added first, which is what this computes."""
    n = p.shape[-1]
    p = jnp.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, -n % _F32_LANES)])
    p = p.reshape(p.shape[:-1] + (-1, _F32_LANES))
    chunks = p.shape[-2]
    total = p[..., 0, :]
    if chunks <= 64:
        for i in range(1, chunks):
            total = total + p[..., i, :]
    else:
        total, _ = lax.scan(lambda t, v: (t + v, None), total, jnp.moveaxis(p[..., 1:, :], -2, 0))
    while total.shape[-1] > 1:
        h = total.shape[-1] // 2
        total = total[..., :h] + total[..., h:]
    return total[..., 0]


def _layer_norm_dx_cpu(g, x, mean, rstd, w):
    """The input gradient of a bfloat16 layer norm (weight of the input's dtype, or none)
    as PyTorch's CPU kernel computes it, bit for bit where measured (NOTE [bf16 layer norm]):
    per row ``ds = sum(dy * x * w)``, ``db = sum(dy * w)`` (``_cpu_row_sum``),
    ``b = (db * mean - ds) * a^3 / n``, ``c = -b * mean - db * a / n`` with ``a = rstd``, and
    ``dx = a * dy * w + b * x + c``, with the fused multiply-adds GCC's contraction makes of them
    (``db * mean - ds``, ``-b * mean - ...`` and ``... + b * x``)."""
    n = x.shape[-1]
    scale = np.float32(1) / np.float32(n)
    a = rstd[..., 0]
    m = mean[..., 0]
    gw = g if w is None else g * w
    ds = _cpu_row_sum(gw * x) if w is None else _cpu_row_sum((g * x) * w)
    db = _cpu_row_sum(gw)
    b = _fma(db, m, -ds) * a * a * a * scale
    c = _fma(-b, m, -(db * a * scale))
    b, c = b[..., None], c[..., None]
    return _fma(b, x, (a[..., None] * g) * w if w is not None else a[..., None] * g) + c


# NOTE [half layer norm parameter gradients]: PyTorch's CPU kernel
# (``LayerNormBackwardKernelImplInternal``, layer_norm_kernel.cpp) sums the weight and bias
# gradients of a bfloat16 or float16 layer norm (parameters of the input's dtype) per thread:
# ``at::parallel_for(0, M, 1)`` splits the M rows into min(T, M) chunks of ceil(M / chunks) rows (T
# = ``torch.get_num_threads()``), each thread adds its rows in order into a buffer of the input's
# dtype (``dgamma += dy * (rstd * x + (-rstd * mean))``, ``dbeta += dy``: each step in float32, the
# last product and sum one fused multiply-add as CPU's compiler makes it (float16 rows differ in an
# element now and then otherwise), rounded to the dtype), and the T buffers are then added in
# float32, in thread order, and rounded once. On XLA's CPU platform the lowering does the same (a
# scan over a chunk's rows, the chunks side by side), so the gradients are CPU's bit for bit; the
# thread count changes the program, so it reaches the lowering as a static argument from the
# recorder (``cpu_threads``, read when the op is recorded: deferfuse/specials.py
# ``_h_layer_norm_backward``, part of the op's key, so a new thread count compiles anew). Without it
# (compiled mode's graphs), on a TPU or GPU, and with float32 parameters the float32 sum rounded
# once stays (closer to the exact sum; docs/dtypes.md).


def _param_grads_cpu(g, x, mean, rstd, threads, dtype, want_w, want_b):
    """(weight gradient, bias gradient), float32 holding ``dtype`` values, of rows ``g`` and ``x``
    (M, N) with per-row ``mean`` and ``rstd`` (M,), summed in CPU's per-thread order (NOTE [half
    layer norm parameter gradients]); None where not wanted."""
    m, n = x.shape
    chunks = min(threads, m)
    size = -(-m // chunks)
    used = -(-m // size)
    pad = used * size - m
    a = rstd
    b = -a * mean
    # Rows past M (the last chunk's padding) add dy = 0: the buffer stays as it was.
    g = jnp.pad(g, ((0, pad), (0, 0))).reshape(used, size, n)
    x = jnp.pad(x, ((0, pad), (0, 0))).reshape(used, size, n)
    a = jnp.pad(a, (0, pad)).reshape(used, size, 1)
    b = jnp.pad(b, (0, pad)).reshape(used, size, 1)

    def step(bufs, rows):
        bw, bb = bufs
        dy, xr, ar, br = rows
        if want_w:
            bw = round_to(_fma(dy, _mul(ar, xr) + br, bw), dtype)
        if want_b:
            bb = round_to(bb + dy, dtype)
        return (bw, bb), None

    zero = jnp.zeros((used, n), jnp.float32)
    (bw, bb), _ = lax.scan(step, (zero, zero),
                           tuple(jnp.moveaxis(t, 1, 0) for t in (g, x, a, b)))
    gw, gb = bw[0], bb[0]
    for i in range(1, used):    # the buffers in thread order (unused threads' buffers are zero)
        gw, gb = gw + bw[i], gb + bb[i]
    return (gw if want_w else None), (gb if want_b else None)


@op("native_layer_norm_backward.default",
    pad=ZeroPadded(inputs=(0, 1, 3, 4), normalized=(2, "normalized_shape")))
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias,
                               output_mask, *, cpu_threads=None):
    x, g = _acc(input), _acc(grad_out)
    k = len(normalized_shape)
    axes = tuple(range(x.ndim - k, x.ndim))
    batch = tuple(range(x.ndim - k))
    gi = gw = gb = None
    if output_mask[0] and _cpu_exact(input.dtype) and mean.dtype == input.dtype and x.size:
        # NOTE [bf16 layer norm]
        lead = x.shape[:x.ndim - k]
        flat = lambda t: t.reshape(lead + (-1,))  # noqa: E731
        w = None if weight is None else acc(weight).reshape(-1)
        gi = _layer_norm_dx_cpu(flat(g), flat(x), acc(mean).reshape(lead + (1,)),
                                acc(rstd).reshape(lead + (1,)), w).reshape(x.shape)
        output_mask = (False,) + tuple(output_mask[1:])
    if (cpu_threads is not None and (output_mask[1] or output_mask[2]) and x.size
            and _cpu_order(input.dtype, weight, bias)):
        # NOTE [half layer norm parameter gradients]
        rows = math.prod(x.shape[:x.ndim - k])
        gw, gb = _param_grads_cpu(g.reshape(rows, -1), x.reshape(rows, -1),
                                  acc(mean).reshape(rows), acc(rstd).reshape(rows), cpu_threads,
                                  input.dtype, output_mask[1], output_mask[2])
        gw = None if gw is None else gw.reshape(x.shape[x.ndim - k:])
        gb = None if gb is None else gb.reshape(x.shape[x.ndim - k:])
        output_mask = (output_mask[0], False, False)
    xhat = (x - mean) * rstd
    if output_mask[0]:
        gx = g * weight if weight is not None else g
        gi = _norm_backward(gx, xhat, rstd, axes)
    if output_mask[1]:
        gw = jnp.sum(g * xhat, axis=batch)
    if output_mask[2]:
        gb = jnp.sum(g, axis=batch)
    return gi, gw, gb


def _per_channel(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


@op("native_group_norm.default")
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    # PyTorch's CPU kernel (contiguous input): statistics per (sample, group), then per channel
    # ``scale = rstd * weight``, ``shift = -scale * mean + bias`` and ``y = scale * x + shift`` in
    # float32 (XLA contracts the products and sums into fused multiply-adds as CPU's compiler does).
    x = _acc(input).reshape(N, group, C // group * HxW)
    mean, var = _moments(x, (2,))
    rstd = 1.0 / jnp.sqrt(var + eps)
    if weight is None and bias is None:
        out = (x - mean) * rstd
    else:
        m, r = _per_group(mean, N, C, group), _per_group(rstd, N, C, group)
        scale = r if weight is None else r * acc(weight).reshape(1, C, 1)
        shift = -scale * m
        if bias is not None:
            shift = shift + acc(bias).reshape(1, C, 1)
        out = scale * x.reshape(N, C, HxW) + shift
    return out.reshape(input.shape), mean.reshape(N, group), rstd.reshape(N, group)


def _per_group(v, N, C, group):
    """(N, group) statistics repeated for each channel of its group: (N, C, 1)."""
    return jnp.repeat(v.reshape(N, group), C // group, axis=1)[:, :, None]


@op("native_group_norm_backward.default")
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    # PyTorch's CPU kernel: per channel ds = sum(dy * x) and db = sum(dy); per group
    # c2 = (db * mean - ds) * rstd^3 / n and c3 = -c2 * mean - db * rstd / n (ds and db weighted
    # by the weight), dx = c1 * dy + c2 * x + c3 with c1 = rstd * weight; weight gradient
    # sum over samples of (ds - db * mean) * rstd, bias gradient sum of db.
    x = _acc(input).reshape(N, C, HxW)
    g = _acc(grad_out).reshape(N, C, HxW)
    m, r = acc(mean).reshape(N, group), acc(rstd).reshape(N, group)
    ds, db = jnp.sum(g * x, axis=2), jnp.sum(g, axis=2)
    gi = gw = gb = None
    if output_mask[0]:
        n = C // group * HxW
        s = float(np.float32(1) / np.float32(n)) if n else 0.0
        w = acc(weight).reshape(1, C) if weight is not None else None
        ds_g = (ds if w is None else ds * w).reshape(N, group, C // group).sum(axis=2)
        db_g = (db if w is None else db * w).reshape(N, group, C // group).sum(axis=2)
        c2 = (db_g * m - ds_g) * r * r * r * s
        c3 = -c2 * m - db_g * r * s
        c1 = _per_group(r, N, C, group)
        if w is not None:
            c1 = c1 * w[:, :, None]
        gi = (c1 * g + _per_group(c2, N, C, group) * x + _per_group(c3, N, C, group)).reshape(input.shape)
    if output_mask[1]:
        gw = jnp.sum((ds - db * _per_group(m, N, C, group)[:, :, 0]) * _per_group(r, N, C, group)[:, :, 0], axis=0)
    if output_mask[2]:
        gb = jnp.sum(db, axis=0)
    return gi, gw, gb


def _bn_apply(x, weight, bias, mean, invstd):
    """PyTorch's CPU batch norm transform: ``x * alpha + beta`` per channel in float32, with
    ``alpha = invstd * weight`` and ``beta = bias - mean * alpha`` (mean and invstd as saved)."""
    alpha = invstd if weight is None else invstd * acc(weight)
    beta = -mean * alpha if bias is None else acc(bias) - mean * alpha
    return x * _per_channel(alpha, x.ndim) + _per_channel(beta, x.ndim)


def _bn_train(x_in, weight, bias, running_mean, running_var, momentum, eps, stat_dt):
    """(output, saved mean, saved invstd, new running mean, new running var) in training mode,
    rounded where PyTorch's CPU kernel rounds them: statistics kept in ``stat_dt`` (the input's
    dtype, or float32 for a half input with float32 parameters) round before the output uses them.
    A bfloat16 batch norm with bfloat16 parameters keeps its mean and variance sum in bfloat16 and
    updates the running statistics in bfloat16 arithmetic (momentum itself rounded)."""
    x = acc(x_in)
    axes = (0,) + tuple(range(2, x.ndim))
    n = x.size // x.shape[1]
    mean = jnp.mean(x, axis=axes)
    var_sum = jnp.sum(jnp.square(x - _per_channel(mean, x.ndim)), axis=axes)
    r = lambda v: round_to(v, stat_dt)   # noqa: E731
    m = jnp.asarray(momentum, jnp.float32)
    if stat_dt == jnp.bfloat16:
        mean, var_sum = r(mean), r(var_sum)
        invstd = r(1.0 / jnp.sqrt(r(var_sum / r(jnp.float32(n))) + eps))
        m = r(m)
        new_mean = new_var = None
        if running_mean is not None:
            new_mean = r(r(m * mean) + r(r(1 - m) * acc(running_mean)))
        if running_var is not None:
            unbiased = r(var_sum / r(jnp.float32(max(n - 1, 1))))
            new_var = r(m * unbiased + r(r(1 - m) * acc(running_var)))
    else:
        invstd = r(1.0 / jnp.sqrt(var_sum / n + eps))
        mean_f, mean = mean, r(mean)
        new_mean = new_var = None
        if running_mean is not None:
            new_mean = m * mean_f + (1 - m) * acc(running_mean)
        if running_var is not None:
            new_var = m * var_sum / max(n - 1, 1) + (1 - m) * acc(running_var)
    return _bn_apply(x, weight, bias, mean, invstd), mean, invstd, new_mean, new_var


def _bn_eval(x, weight, bias, running_mean, running_var, eps):
    invstd = 1.0 / jnp.sqrt(acc(running_var) + eps)
    return _bn_apply(acc(x), weight, bias, acc(running_mean), invstd)


def _saved(avals, k, v):
    """Saved statistic ``k`` as meta shapes it (PyTorch returns empty ones in eval mode)."""
    shape = avals[k][0]
    return v if tuple(v.shape) == tuple(shape) else jnp.zeros(shape, avals[k][1])


@op("_native_batch_norm_legit_functional.default", meta=True)
def _native_batch_norm_legit_functional(input, weight, bias, running_mean, running_var, training,
                                        momentum, eps, *, _avals):
    # Running statistics may be None here (deferfuse/composed.py routes every batch norm variant
    # to this op; deferfuse/meta.py gives CPU's output shapes and dtypes).
    if not training:
        out = _bn_eval(input, weight, bias, running_mean, running_var, eps)
        return (out, _zeros(_avals[1]), _zeros(_avals[2]), running_mean, running_var)
    out, mean, invstd, new_mean, new_var = _bn_train(
        input, weight, bias, running_mean, running_var, momentum, eps, jnp.dtype(_avals[1][1]))
    return out, _saved(_avals, 1, mean), _saved(_avals, 2, invstd), new_mean, new_var


@op("_native_batch_norm_legit_no_training.default", meta=True)
def _native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum,
                                         eps, *, _avals):
    out = _bn_eval(input, weight, bias, running_mean, running_var, eps)
    return out, _zeros(_avals[1]), _zeros(_avals[2])


@op("native_batch_norm_backward.default")
def native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean,
                               save_invstd, train, eps, output_mask):
    x, g = _acc(input), _acc(grad_out)
    nd = x.ndim
    axes = (0,) + tuple(range(2, nd))
    if train:
        mean, invstd = _acc(save_mean), _acc(save_invstd)
    else:
        mean, invstd = _acc(running_mean), lax.rsqrt(_acc(running_var) + eps)
    mean_b, invstd_b = _per_channel(mean, nd), _per_channel(invstd, nd)
    xhat = (x - mean_b) * invstd_b
    w = _per_channel(weight, nd) if weight is not None else None
    gi = gw = gb = None
    if output_mask[0]:
        gx = g * w if w is not None else g
        gi = _norm_backward(gx, xhat, invstd_b, axes) if train else gx * invstd_b
    if output_mask[1]:
        gw = jnp.sum(g * xhat, axis=axes)
    if output_mask[2]:
        gb = jnp.sum(g, axis=axes)
    return gi, gw, gb


@op("batch_norm_backward.default")
def batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_var,
                        update, eps, output_mask, reserve):
    # save_var holds the inverse standard deviation (as native_batch_norm saves it).
    return native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean,
                                      save_var, update, eps, output_mask)
