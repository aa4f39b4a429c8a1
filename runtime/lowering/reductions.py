"""Reductions over dimensions: sums and statistics, extremes and their indices, scans, histograms
and segment reductions (sorting and selection are in sorting.py). PyTorch's conventions: NaN
propagates and counts as the largest value when ordering, ties pick the first index (cummax and
cummin: the last)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import check, op
from .padding import Reduce, Refuse, Scan

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("a reduction with no padding rule (a product, a variance, a count, a norm, a "
             "running scan)")

_LOWP = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _dims(x, dim):
    """Normalized reduction axes; None (all) for no dims or a 0-d input."""
    if dim is None or dim == () or dim == []:
        return None
    if isinstance(dim, int):
        dim = (dim,)
    return tuple(d % max(x.ndim, 1) for d in dim) if x.ndim else None


def _count(x, axes) -> int:
    n = 1
    for a in (range(x.ndim) if axes is None else axes):
        n *= x.shape[a]
    return n


def _isfloat(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _accum(x, _avals, i=0):
    """``x`` in the precision its reduction accumulates in: the output dtype (from meta), with
    half-precision floats accumulated in float32 as PyTorch's CPU kernels do."""
    dt = jnp.dtype(_avals[i][1])
    if dt in _LOWP:
        dt = jnp.dtype(jnp.float32)
    if jnp.issubdtype(x.dtype, jnp.complexfloating) and not jnp.issubdtype(dt, jnp.complexfloating):
        return x
    return x.astype(dt)


def _up(x):
    """Floats widened out of half precision; integers and bools as float32."""
    if not _isfloat(x) or x.dtype in _LOWP:
        return x.astype(jnp.float32)
    return x


def _idx(shape):
    return jnp.zeros(shape, jnp.int64)


# --------------------------------------------------------------------------------------------
# sums, products, means

@op("sum.default", "sum.dim_IntList", meta=True,
    pad={"sum.default": Reduce(None, 0), "sum.dim_IntList": Reduce(1, 0)})
def sum_(x, dim=None, keepdim=False, *, dtype=None, _avals):
    return jnp.sum(_accum(x, _avals), axis=_dims(x, dim), keepdims=keepdim)


@op("nansum.default", meta=True)
def nansum(x, dim=None, keepdim=False, *, dtype=None, _avals):
    if _isfloat(x):
        x = jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), x)
    return jnp.sum(_accum(x, _avals), axis=_dims(x, dim), keepdims=keepdim)


@op("prod.default", meta=True)
def prod(x, *, dtype=None, _avals):
    return jnp.prod(_accum(x, _avals))


@op("prod.dim_int", meta=True)
def prod_dim(x, dim, keepdim=False, *, dtype=None, _avals):
    return jnp.prod(_accum(x, _avals), axis=_dims(x, dim), keepdims=keepdim)


@op("mean.default", "mean.dim", meta=True,
    pad={"mean.default": Reduce(None, "mean"), "mean.dim": Reduce(1, "mean")})
def mean(x, dim=None, keepdim=False, *, dtype=None, _avals):
    return jnp.mean(_accum(x, _avals), axis=_dims(x, dim), keepdims=keepdim)


@op("count_nonzero.default", "count_nonzero.dim_IntList")
def count_nonzero(x, dim=None):
    return jnp.sum(x != 0, axis=_dims(x, dim), dtype=jnp.int64)


@op("any.default", "any.dim", "any.dims",
    pad={"any.default": Reduce(None, False), "any.dim": Reduce(1, False)})
def any_(x, dim=None, keepdim=False):
    if dim == () or dim == []:     # any/all over no dims reduce nothing (sum's [] means all)
        return x != 0
    return jnp.any(x != 0, axis=_dims(x, dim), keepdims=keepdim)


@op("all.default", "all.dim", "all.dims",
    pad={"all.default": Reduce(None, True), "all.dim": Reduce(1, True)})
def all_(x, dim=None, keepdim=False):
    if dim == () or dim == []:
        return x != 0
    return jnp.all(x != 0, axis=_dims(x, dim), keepdims=keepdim)


@op("_is_all_true.default")
def _is_all_true(x):
    # A 0-dim bool: torch.distributions' argument checks call it before .item().
    return jnp.all(x)


@op("_is_any_true.default")
def _is_any_true(x):
    return jnp.any(x)


@op("logsumexp.default", pad=Reduce(1, "-inf"))
def logsumexp(x, dim=(), keepdim=False):
    x = _up(x)
    axes = _dims(x, dim)
    m = jnp.max(x, axis=axes, keepdims=True, initial=-jnp.inf)
    m = jnp.where(jnp.isinf(m), jnp.zeros((), x.dtype), m)    # all -inf, or an inf: no shift
    s = jnp.log(jnp.sum(jnp.exp(x - m), axis=axes, keepdims=True)) + m
    return s if keepdim else jnp.squeeze(s, axes)


@op("linalg_vector_norm.default", static=True, meta=True)
def vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None, _avals):
    if dtype is not None and not jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = _accum(x, _avals)
    a = _accum(jnp.abs(x), _avals)
    axes = _dims(x, dim)
    ord = float(ord)
    if ord == float("inf"):
        return jnp.max(a, axis=axes, keepdims=keepdim)
    if ord == float("-inf"):
        return jnp.min(a, axis=axes, keepdims=keepdim)
    if ord == 0:
        return jnp.sum(a != 0, axis=axes, keepdims=keepdim).astype(a.dtype)
    if ord == 1:
        return jnp.sum(a, axis=axes, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axes, keepdims=keepdim))
    return jnp.sum(a ** ord, axis=axes, keepdims=keepdim) ** (1.0 / ord)


# --------------------------------------------------------------------------------------------
# variance and standard deviation

def _moments(x, dim, correction, keepdim):
    """(variance, mean) over ``dim`` with Bessel's ``correction`` (may be a traced number)."""
    x = _up(x)
    axes = _dims(x, dim)
    n = _count(x, axes)
    m = jnp.mean(x, axis=axes, keepdims=True)
    d = x - m
    if jnp.issubdtype(d.dtype, jnp.complexfloating):
        sq = jnp.real(d) ** 2 + jnp.imag(d) ** 2
    else:
        sq = d * d
    s = jnp.sum(sq, axis=axes, keepdims=keepdim)
    if correction is None:
        correction = 1
    var = s / jnp.maximum(n - correction, 0)
    return var, (m if keepdim else jnp.squeeze(m, axes))


def _corr(unbiased):
    return 1 if unbiased else 0


def _variants(packet, post):
    """var/std/var_mean/std_mean over their default, dim and correction overloads."""
    def default(x, unbiased=True):
        return post(*_moments(x, None, _corr(unbiased), False))

    def dim_(x, dim=None, unbiased=True, keepdim=False):
        return post(*_moments(x, dim, _corr(unbiased), keepdim))

    def correction(x, dim=None, *, correction=None, keepdim=False):
        return post(*_moments(x, dim, correction, keepdim))
    op(f"{packet}.default")(default)
    op(f"{packet}.dim")(dim_)
    op(f"{packet}.correction")(correction)


_variants("var", lambda v, m: v)
_variants("std", lambda v, m: jnp.sqrt(v))
_variants("var_mean", lambda v, m: (v, m))
_variants("std_mean", lambda v, m: (jnp.sqrt(v), m))


# --------------------------------------------------------------------------------------------
# extremes

@op("amax.default", pad=Reduce(1, "-inf"))
def amax(x, dim=(), keepdim=False):
    return jnp.max(x, axis=_dims(x, dim), keepdims=keepdim)


@op("amin.default", pad=Reduce(1, "+inf"))
def amin(x, dim=(), keepdim=False):
    return jnp.min(x, axis=_dims(x, dim), keepdims=keepdim)


@op("max.default", pad=Reduce(None, "-inf"))
def max_(x):
    return jnp.max(x)


@op("min.default", pad=Reduce(None, "+inf"))
def min_(x):
    return jnp.min(x)


@op("aminmax.default")
def aminmax(x, *, dim=None, keepdim=False):
    axes = _dims(x, dim)
    return jnp.min(x, axis=axes, keepdims=keepdim), jnp.max(x, axis=axes, keepdims=keepdim)


def _arg(fn, x, dim, keepdim):
    if x.ndim == 0:
        return jnp.zeros((), jnp.int64)
    if dim is None:
        r = fn(x.reshape(-1))
        return r.reshape((1,) * x.ndim) if keepdim else r
    return fn(x, axis=dim % x.ndim, keepdims=keepdim)


@op("argmax.default", pad=Reduce(1, "-inf", index=True))
def argmax(x, dim=None, keepdim=False):
    # jnp.argmax picks the first NaN, then the first of tied maxima: PyTorch's rule.
    return _arg(jnp.argmax, x, dim, keepdim)


@op("argmin.default", pad=Reduce(1, "+inf", index=True))
def argmin(x, dim=None, keepdim=False):
    return _arg(jnp.argmin, x, dim, keepdim)


@op("max.dim", pad=Reduce(1, "-inf"))
def max_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, _idx(())
    return jnp.max(x, axis=dim % x.ndim, keepdims=keepdim), _arg(jnp.argmax, x, dim, keepdim)


@op("min.dim", pad=Reduce(1, "+inf"))
def min_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, _idx(())
    return jnp.min(x, axis=dim % x.ndim, keepdims=keepdim), _arg(jnp.argmin, x, dim, keepdim)


# --------------------------------------------------------------------------------------------
# scans

@op("cumsum.default", meta=True, pad=Scan())
def cumsum(x, dim, *, dtype=None, _avals):
    x = _accum(x, _avals)
    return x if x.ndim == 0 else jnp.cumsum(x, axis=dim % x.ndim)


@op("cumprod.default", meta=True, pad=Scan())
def cumprod(x, dim, *, dtype=None, _avals):
    x = _accum(x, _avals)
    return x if x.ndim == 0 else jnp.cumprod(x, axis=dim % x.ndim)


@op("logcumsumexp.default", "_logcumsumexp.default")
def logcumsumexp(x, dim):
    x = _up(x)
    return x if x.ndim == 0 or x.size == 0 else lax.cumlogsumexp(x, axis=dim % x.ndim)


def _cum_extreme(x, dim, better):
    """Running extreme with its index: NaN wins and sticks, ties take the later index."""
    if x.ndim == 0:
        return x, _idx(())
    dim = dim % x.ndim
    if x.size == 0:
        return x, _idx(x.shape)
    idx = lax.broadcasted_iota(jnp.int64, x.shape, dim)
    isf = _isfloat(x)

    def comb(a, b):    # a: the earlier run, b: the later one
        (av, ai), (bv, bi) = a, b
        take = better(bv, av) | (bv == av)
        if isf:
            take = jnp.isnan(bv) | (take & ~jnp.isnan(av))
        return jnp.where(take, bv, av), jnp.where(take, bi, ai)
    return lax.associative_scan(comb, (x, idx), axis=dim)


@op("cummax.default")
def cummax(x, dim):
    return _cum_extreme(x, dim, jnp.greater)


@op("cummin.default")
def cummin(x, dim):
    return _cum_extreme(x, dim, jnp.less)


# --------------------------------------------------------------------------------------------
# histograms and segment reductions

def _edges(lo, hi, bins, dt):
    """torch.linspace(lo, hi, bins + 1): from the left for the first half, from the right for
    the second."""
    i = jnp.arange(bins + 1, dtype=dt)
    step = (hi - lo) / bins
    return jnp.where(i < (bins + 1) // 2, lo + step * i, hi - step * (bins - i))


def _data_range(x, lo, hi, widen):
    """[lo, hi], the data's range when lo == hi, widened each way when that is one value."""
    if x.size:
        same = lo == hi
        lo, hi = jnp.where(same, jnp.min(x), lo), jnp.where(same, jnp.max(x), hi)
    one = lo == hi
    return jnp.where(one, lo - widen, lo), jnp.where(one, hi + widen, hi)


@op("histc.default")
def histc(x, bins=100, min=0, max=0):
    """PyTorch's CPU histc: ``bins`` equal bins over [min, max] (the data's range when min ==
    max, widened by 1 each way when that is one value); CUDA's for integers (CPU refuses them):
    bin ``(x - min) * bins // (max - min)``, ``max`` in the last bin, counts in the input's dtype."""
    x = x.reshape(-1)
    if jnp.issubdtype(x.dtype, jnp.integer):
        lo, hi = _data_range(x, jnp.asarray(min, x.dtype), jnp.asarray(max, x.dtype), 1)
        wide = jnp.int64 if jnp.iinfo(x.dtype).bits <= 32 else x.dtype
        pos = (x.astype(wide) - lo) * bins // jnp.maximum(hi - lo, 1).astype(wide)
        pos = jnp.clip(pos, 0, bins - 1)
        ok = (x >= lo) & (x <= hi)
        return jnp.zeros(bins, x.dtype).at[pos].add(ok.astype(x.dtype))
    lo, hi = _data_range(x, jnp.asarray(min, x.dtype), jnp.asarray(max, x.dtype), 1)
    edges = _edges(lo, hi, bins, x.dtype)
    # CPU's histc bins by linear interpolation between the outer edges, without histogram's
    # search over the edges: bin = trunc((x - left) * bins / (right - left)), each step rounded
    # to the input's dtype (16-bit floats round after every operation, as c10's types do)
    left, right = edges[0], edges[-1]
    r = (lambda v: v) if x.dtype not in (jnp.bfloat16, jnp.float16) else (
        lambda v: v.astype(x.dtype).astype(jnp.float32))
    xf, lf, rf = (v.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else v
                  for v in (x, left, right))
    t = r(r(r(xf - lf) * jnp.asarray(bins, xf.dtype)) / r(rf - lf))
    ok = (x >= left) & (x <= right)
    pos = jnp.clip(jnp.where(ok, jnp.trunc(t), 0).astype(jnp.int64), 0, bins - 1)
    return jnp.zeros(bins, x.dtype).at[pos].add(ok.astype(x.dtype))


def _segments_1d(data, lengths, reduce, initial):
    """segment_reduce along axis 0 of ``data`` with 1-D ``lengths`` (PyTorch's CPU kernel: the
    reduction starts from ``initial`` when given; an empty segment is ``initial``, else the
    reduction's identity, NaN for mean)."""
    import jax.ops as jops
    s = lengths.shape[0]
    ids = jnp.searchsorted(jnp.cumsum(lengths), jnp.arange(data.shape[0]), side="right")
    n = lengths.reshape((s,) + (1,) * (data.ndim - 1)).astype(data.dtype)
    if reduce in ("sum", "mean"):
        v = jops.segment_sum(data, ids, s)
        if initial is not None:
            v = v + initial
        if reduce == "mean":
            empty = jnp.asarray(jnp.nan if initial is None else initial, data.dtype)
            v = jnp.where(n > 0, v / jnp.where(n > 0, n, 1), empty)
        return v
    if reduce == "prod":
        v = jops.segment_prod(data, ids, s)
        return v if initial is None else v * initial
    f, g = (jops.segment_max, jnp.maximum) if reduce == "max" else (jops.segment_min, jnp.minimum)
    v = f(data, ids, s)
    # NaN propagates as in PyTorch's kernel (XLA's scatter-max may drop it)
    nan = jops.segment_max(jnp.isnan(data).astype(jnp.int8), ids, s) > 0
    v = jnp.where(nan, jnp.nan, v)
    return v if initial is None else g(v, jnp.asarray(initial, data.dtype))


@op("segment_reduce.default")
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False,
                   initial=None):
    if lengths is None:
        lengths = offsets[..., 1:] - offsets[..., :-1]
    axis %= data.ndim
    f = lambda d, l: _segments_1d(d, l, reduce, initial)   # noqa: E731
    for _ in range(lengths.ndim - 1):                     # batch dims before ``axis``
        f = jax.vmap(f)
    return f(data, lengths)


@op("_segment_reduce_backward.default")
def segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0,
                            initial=None):
    if lengths is None:
        lengths = offsets[..., 1:] - offsets[..., :-1]
    grad = grad.astype(data.dtype)
    if reduce != "prod":      # JAX's own gradients match PyTorch's (max/min: ties share evenly)
        def fwd(d):
            return segment_reduce(d, reduce, lengths=lengths, axis=axis, initial=initial)
        return jax.vjp(fwd, data)[1](grad)[0]

    def prod_1d(g, d, l):
        # d/dx_i of the product: the product of the others (a lone zero's is the nonzero product)
        import jax.ops as jops
        s = l.shape[0]
        ids = jnp.searchsorted(jnp.cumsum(l), jnp.arange(d.shape[0]), side="right")
        zero = d == 0
        nz = jops.segment_prod(jnp.where(zero, 1, d), ids, s)
        if initial is not None:
            nz = nz * initial
        nzero = jops.segment_sum(zero.astype(jnp.int32), ids, s)
        gi, nzi, nzeroi = (jnp.take(a, ids, axis=0, mode="fill", fill_value=0)
                           for a in (g, nz, nzero))
        others = jnp.where(zero, jnp.where(nzeroi == 1, nzi, 0),
                           jnp.where(nzeroi > 0, 0, nzi / jnp.where(zero, 1, d)))
        return gi * others
    f = prod_1d
    for _ in range(lengths.ndim - 1):
        f = jax.vmap(f)
    return f(grad, data, lengths)


# NOTE [device asserts]: ``torch._assert_async`` (TorchTitan's RoPE check, ``torch.compile``'s
# runtime asserts) checks on the device, as CUDA does: a flag (NOTE [index checks]) that the host
# reads at the next sync, where CPU's error is raised. The tensor's element count is checked when
# the op is recorded (deferfuse/composed.py), as CPU raises at once.
@op("_assert_async.default", "_assert_async.msg", static=True)
def assert_async(x, assert_msg="Expected Tensor with single nonzero value, but got zero"):
    check(~_nonzero_bits(x), RuntimeError, assert_msg)
    return ()


def _nonzero_bits(x):
    """``x != 0`` on the bits, so that a subnormal float counts as nonzero (XLA compares floats
    with subnormals flushed to zero; CPU does not)."""
    if jnp.iscomplexobj(x):
        return _nonzero_bits(jnp.real(x)) | _nonzero_bits(jnp.imag(x))
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x != 0
    bits = lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
    return (bits & ~jnp.asarray(1 << (x.dtype.itemsize * 8 - 1), bits.dtype)) != 0
