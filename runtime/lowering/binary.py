"""Elementwise ops of two or more inputs: binary arithmetic with PyTorch's type promotion,
bitwise, logical and comparison ops, clamp and friends. ``pow`` is in power.py, and the
``prims.*`` elementwise ops that PyTorch's decompositions land in are mapped onto these lowerings
in prims.py. The dtype helpers they share come from pointwise.py.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
from jax import lax

from . import op
from .padding import Pointwise, Refuse
from .pointwise import (_BOOL, _bc, _cast, _cdiv, _cmul, _common, _int_like, _integral_only,
                        _iscomplex, _isfloat, _isinexact, _isint, _nz, _opmath, _py, _rem, _rt,
                        _scale, _tdiv, _zeta)
from .precision import round_to

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("not tagged pointwise by PyTorch (a prims op, a Scalar overload)")

# --------------------------------------------------------------------------------------------
# binary arithmetic

def _cscale(y, alpha):
    """``alpha * y`` as add and sub scale their second operand: a complex product even by 1."""
    if _iscomplex(np.dtype(y.dtype)):
        return _cmul(_cast(1 if alpha is None else alpha, y.dtype), y)
    return _scale(y, alpha)


# NOTE [signed zero addends]: XLA's simplifier folds ``A + 0`` and ``A - 0`` into ``A`` when the
# zero is a constant of the program, whatever its sign, and a Python number baked into the program
# (``0``, ``0.0``: NOTE [typed constants]) is one. IEEE addition is not the identity there:
# -0.0 + 0.0 is +0.0 (and so is -0.0 - (-0.0)), which CPU computes, while the folded program
# returns -0.0. A baked addend goes through an optimization barrier, which the simplifier cannot
# see through, so the addition is computed. A complex addition of a constant is folded even behind
# a barrier (measured), so a complex sum with a baked operand is computed on its real and imaginary
# parts, each constant part behind a barrier. The barriers are on 0-d constants: they cost nothing,
# and a traced operand is never behind one.

def _baked(orig, v) -> bool:
    return _py(orig) and not isinstance(orig, bool) and _isinexact(np.dtype(v.dtype))


def _plus(x, x0, y, y0, neg=False):
    """``x + y`` (``x - y`` with ``neg``) of compute-dtype values made from ``x0``, ``y0``: a baked
    Python-number operand is not folded away (NOTE [signed zero addends])."""
    bx, by = _baked(x0, x), _baked(y0, y)
    if not (bx or by):
        return x - y if neg else x + y
    opq = lax.optimization_barrier
    if _iscomplex(np.dtype(x.dtype)) or _iscomplex(np.dtype(y.dtype)):
        xs = [jnp.real(x), jnp.imag(x)]
        ys = [jnp.real(y), jnp.imag(y)]
        xs = [opq(p) if bx else p for p in xs]
        ys = [opq(p) if by else p for p in ys]
        return lax.complex(*_bc(*[a - b if neg else a + b for a, b in zip(xs, ys)]))
    x, y = (opq(x) if bx else x), (opq(y) if by else y)
    return x - y if neg else x + y


@op("add.Tensor", "add.Scalar")
def add(x, y, alpha=1):
    x0, y0 = x, y
    ct, (x, y) = _common(x, y)
    if ct == _BOOL:
        return jnp.logical_or(x, jnp.logical_and(y, _nz(alpha)))
    return _plus(x, x0, _cscale(y, alpha), y0)


@op("sub.Tensor", "sub.Scalar")
def sub(x, y, alpha=1):
    x0, y0 = x, y
    ct, (x, y) = _common(x, y)
    if _iscomplex(ct):      # CPU's sub is add with -alpha (NOTE [complex products])
        return _plus(x, x0, _cscale(y, -(1 if alpha is None else alpha)), y0)
    return _plus(x, x0, _scale(y, alpha), y0, neg=True)


@op("rsub.Tensor", "rsub.Scalar", pad=Pointwise())
def rsub(x, y, alpha=1):
    x0, y0 = x, y
    ct, (x, y) = _common(x, y)
    if _iscomplex(ct):
        return _plus(y, y0, _cscale(x, -(1 if alpha is None else alpha)), x0)
    return _plus(y, y0, _scale(x, alpha), x0, neg=True)


@op("mul.Tensor", "mul.Scalar")
def mul(x, y):
    ct, (x, y) = _common(x, y)
    if ct == _BOOL:
        return jnp.logical_and(x, y)
    if _iscomplex(ct):
        return _cmul(x, y)
    return x * y


@op("div.Tensor", "div.Scalar", "true_divide.Tensor", "true_divide.Scalar")
def div(x, y):
    ct, (x, y) = _common(x, y, float_=True)
    if _iscomplex(ct):
        return _cdiv(x, y)
    shape = jnp.broadcast_shapes(jnp.shape(x), jnp.shape(y))
    if jnp.shape(y) != shape and _isfloat(np.dtype(x.dtype)) and _exact_division():
        # NOTE [broadcast division]
        y = lax.optimization_barrier(jnp.broadcast_to(y, shape))
    return x / y


def _exact_division() -> bool:
    """NOTE [broadcast division]: XLA rewrites a division by a broadcast value (a scalar, a row of
    scales) into a product with its reciprocal, which is one ulp off PyTorch's quotient in about
    three float32 values in four (CPU divides each element). A quantizer's ``w / scale`` then
    rounds some values to the next integer: torchao's int8 weights quantized on tpu differed from
    CPU's in 39 of 8192. On the CPU platform the divisor is broadcast behind an optimization
    barrier, which XLA's simplifier cannot see through, so each element is divided and the
    quotient is CPU's. It costs a buffer the size of the result for the broadcast divisor, and
    about no time (XLA's division is vectorized; dividing in float64 instead cost about three
    times the float32 time). TPU's and GPU's float32 division is not CPU's anyway, so there the
    rewrite stays."""
    from ..platform import name
    return name() == "cpu"


def _floordiv(x, y):
    """PyTorch's floor division (c10 div_floor_*) on same-dtype compute values."""
    dt = np.dtype(x.dtype)
    if _isint(dt):
        q = _tdiv(x, y)
        if not jnp.issubdtype(dt, jnp.signedinteger):
            return q
        r = _rem(x, y)
        return jnp.where((r != 0) & ((r < 0) != (y < 0)), q - 1, q)
    mod = _rem(x, y)
    d = (x - mod) / y
    d = jnp.where((mod != 0) & ((y < 0) != (mod < 0)), d - 1, d)
    fl = jnp.floor(d)
    fl = jnp.where(d - fl > 0.5, fl + 1, fl)
    res = jnp.where(d != 0, fl, jnp.copysign(jnp.zeros((), dt), x / y))
    return jnp.where(y == 0, x / y, res)


@op("div.Tensor_mode", "div.Scalar_mode")
def div_mode(x, y, *, rounding_mode=None):
    if rounding_mode is None:
        return div(x, y)
    ct = _int_like(_rt(x, y))
    x, y = _cast(x, _opmath(ct)), _cast(y, _opmath(ct))
    if rounding_mode == "floor":
        return _floordiv(x, y)
    if _isint(ct):
        return _tdiv(x, y)
    return jnp.trunc(x / y)


@op("floor_divide.default", "floor_divide.Scalar", "floor_divide_.Tensor")
def floor_divide(x, y):
    ct = _int_like(_rt(x, y))
    return _floordiv(_cast(x, _opmath(ct)), _cast(y, _opmath(ct)))


@op("remainder.Tensor", "remainder.Scalar", "remainder.Scalar_Tensor")
def remainder(x, y):
    ct = _int_like(_rt(x, y))
    x, y = _cast(x, _opmath(ct)), _cast(y, _opmath(ct))
    r = _rem(x, y)
    if _isint(ct) and not jnp.issubdtype(ct, jnp.signedinteger):
        return r
    return jnp.where((r != 0) & ((r < 0) != (y < 0)), r + y, r)


@op("fmod.Tensor", "fmod.Scalar")
def fmod(x, y):
    ct = _int_like(_rt(x, y))
    return _rem(_cast(x, _opmath(ct)), _cast(y, _opmath(ct)))


@op("atan2.default")
def atan2(x, y):
    _, (x, y) = _common(x, y, float_=True)
    return jnp.arctan2(x, y)


@op("hypot.default")
def hypot(x, y):
    _, (x, y) = _common(x, y, float_=True)
    return jnp.hypot(x, y)


@op("maximum.default", "max.other")
def maximum(x, y):
    ct, (x, y) = _common(x, y, opmath=False)
    if ct == _BOOL:
        return jnp.logical_or(x, y)
    return jnp.maximum(x, y)


@op("minimum.default", "min.other")
def minimum(x, y):
    ct, (x, y) = _common(x, y, opmath=False)
    if ct == _BOOL:
        return jnp.logical_and(x, y)
    return jnp.minimum(x, y)


@op("fmax.default")
def fmax(x, y):
    ct, (x, y) = _common(x, y, opmath=False)
    if ct == _BOOL:
        return jnp.logical_or(x, y)
    return jnp.fmax(x, y) if _isfloat(ct) else jnp.maximum(x, y)


@op("fmin.default")
def fmin(x, y):
    ct, (x, y) = _common(x, y, opmath=False)
    if ct == _BOOL:
        return jnp.logical_and(x, y)
    return jnp.fmin(x, y) if _isfloat(ct) else jnp.minimum(x, y)


@op("copysign.Tensor", "copysign.Scalar")
def copysign(x, y):
    _, (x, y) = _common(x, y, float_=True)
    return jnp.copysign(x, y)


@op("nextafter.default")
def nextafter(x, y):
    _, (x, y) = _common(x, y, float_=True, opmath=False)
    return lax.nextafter(*_bc(x, y))


@op("logaddexp.default")
def logaddexp(x, y):
    _, (x, y) = _common(x, y, float_=True)
    m = jnp.maximum(x, y)
    return jnp.where(jnp.isinf(x) & (x == y), x, m + jnp.log1p(jnp.exp(-jnp.abs(x - y))))


@op("logaddexp2.default")
def logaddexp2(x, y):
    _, (x, y) = _common(x, y, float_=True)
    m = jnp.maximum(x, y)
    return jnp.where(jnp.isinf(x) & (x == y), x,
                     m + jnp.log1p(jnp.exp2(-jnp.abs(x - y))) * (1 / math.log(2)))


@op("ldexp.Tensor")
def ldexp(x, y):
    _, (x, y) = _common(x, y, float_=True)
    return x * jnp.exp2(y)


# --------------------------------------------------------------------------------------------
# bitwise, logical, comparison

def _bitwise(f):
    def low(x, y):
        ct, (x, y) = _common(x, y, opmath=False)
        _integral_only(f.__name__, ct)
        return f(x, y)
    low.__name__ = f.__name__
    return low


op("bitwise_and.Tensor", "bitwise_and.Scalar", "bitwise_and.Scalar_Tensor",
   "__and__.Tensor", "__and__.Scalar")(_bitwise(jnp.bitwise_and))
op("bitwise_or.Tensor", "bitwise_or.Scalar", "bitwise_or.Scalar_Tensor",
   "__or__.Tensor", "__or__.Scalar")(_bitwise(jnp.bitwise_or))
op("bitwise_xor.Tensor", "bitwise_xor.Scalar", "bitwise_xor.Scalar_Tensor",
   "__xor__.Tensor", "__xor__.Scalar")(_bitwise(jnp.bitwise_xor))


def _shift_left(x, y):
    nbits = np.dtype(x.dtype).itemsize * 8
    x, y = _bc(x, y.astype(x.dtype))
    out = (y < 0) | (y >= nbits) if jnp.issubdtype(x.dtype, jnp.signedinteger) else (y >= nbits)
    return jnp.where(out, jnp.zeros_like(x), lax.shift_left(x, jnp.where(out, 0, y).astype(x.dtype)))


def _shift_right(x, y):
    dt = np.dtype(x.dtype)
    nbits = dt.itemsize * 8
    x, y = _bc(x, y.astype(dt))
    if jnp.issubdtype(dt, jnp.signedinteger):
        out = (y < 0) | (y >= nbits)
        return lax.shift_right_arithmetic(x, jnp.where(out, nbits - 1, y).astype(dt))
    out = y >= nbits
    return jnp.where(out, jnp.zeros_like(x), lax.shift_right_logical(x, jnp.where(out, 0, y).astype(dt)))


op("bitwise_left_shift.Tensor", "bitwise_left_shift.Tensor_Scalar", "bitwise_left_shift.Scalar_Tensor",
   "__lshift__.Tensor", "__lshift__.Scalar")(_bitwise(_shift_left))
op("bitwise_right_shift.Tensor", "bitwise_right_shift.Tensor_Scalar", "bitwise_right_shift.Scalar_Tensor",
   "__rshift__.Tensor", "__rshift__.Scalar")(_bitwise(_shift_right))


@op("logical_and.default")
def logical_and(x, y):
    return jnp.logical_and(_nz(x), _nz(y))


@op("logical_or.default")
def logical_or(x, y):
    return jnp.logical_or(_nz(x), _nz(y))


@op("logical_xor.default")
def logical_xor(x, y):
    return jnp.logical_xor(_nz(x), _nz(y))


def _compare(f):
    def low(x, y):
        _, (x, y) = _common(x, y, opmath=False)
        return f(x, y)
    low.__name__ = f.__name__
    return low


op("eq.Tensor", "eq.Scalar")(_compare(jnp.equal))
op("ne.Tensor", "ne.Scalar")(_compare(jnp.not_equal))
op("lt.Tensor", "lt.Scalar")(_compare(jnp.less))
op("le.Tensor", "le.Scalar")(_compare(jnp.less_equal))
op("gt.Tensor", "gt.Scalar")(_compare(jnp.greater))
op("ge.Tensor", "ge.Scalar")(_compare(jnp.greater_equal))


@op("where.self", "where.ScalarSelf", "where.ScalarOther", "where.Scalar", pad=Pointwise())
def where(c, x, y):
    _, (x, y) = _common(x, y, opmath=False)
    return jnp.where(_nz(c), x, y)


# --------------------------------------------------------------------------------------------
# clamp and friends

@op("clamp.default", "clamp.Tensor")
def clamp(x, min=None, max=None):
    _, (x, lo, hi) = _common(x, min, max, opmath=False)
    if lo is not None:
        x = jnp.maximum(x, lo)
    if hi is not None:
        x = jnp.minimum(x, hi)
    return x


@op("clamp_min.default", "clamp_min.Tensor")
def clamp_min(x, min):
    return clamp(x, min, None)


@op("clamp_max.default", "clamp_max.Tensor")
def clamp_max(x, max):
    return clamp(x, None, max)


@op("lerp.Scalar", "lerp.Tensor")
def lerp(x, end, weight):
    _, (x, end, w) = _common(x, end, weight)
    small = jnp.abs(w) < 0.5
    return jnp.where(small, x + w * (end - x), end - (end - x) * (1 - w))


@op("addcmul.default")
def addcmul(x, t1, t2, *, value=1):
    ct, (x, t1, t2) = _common(x, t1, t2)
    if ct == _BOOL:
        return jnp.logical_or(x, jnp.logical_and(t1, t2) & _nz(value))
    return x + _scale(t1, value) * t2


@op("addcdiv.default")
def addcdiv(x, t1, t2, *, value=1):
    _, (x, t1, t2) = _common(x, t1, t2)
    return x + _scale(t1, value) / t2


@op("heaviside.default")
def heaviside(x, v):
    ct, (x, v) = _common(x, v, opmath=False)
    return jnp.where(x == 0, v, (x > 0).astype(ct))


@op("gcd.default")
def gcd(x, y):
    ct, (x, y) = _common(x, y, opmath=False)
    _integral_only("gcd", ct)
    return jnp.gcd(x, y)


@op("lcm.default")
def lcm(x, y):
    ct, (x, y) = _common(x, y, opmath=False)
    _integral_only("lcm", ct)
    g = jnp.gcd(x, y)
    return jnp.where(g == 0, jnp.zeros_like(x), jnp.abs(x // jnp.where(g == 0, 1, g) * y))


@op("xlogy.Tensor", "xlogy.Scalar_Self", "xlogy.Scalar_Other")
def xlogy(x, y):
    ct, (x, y) = _common(x, y, float_=True)
    # CPU's std::log of a half-precision value returns one: rounded before the product.
    lg = round_to(jnp.log(y), ct)
    return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, jnp.zeros_like(x), x * lg))


@op("special_xlog1py.default", "special_xlog1py.self_scalar", "special_xlog1py.other_scalar")
def xlog1py(x, y):
    ct, (x, y) = _common(x, y, float_=True)
    lg = round_to(jnp.log1p(y), ct)        # rounded before the product, as in xlogy
    return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, jnp.zeros_like(x), x * lg))


@op("special_zeta.default", "special_zeta.self_scalar", "special_zeta.other_scalar")
def zeta(x, q):
    _, (x, q) = _common(x, q, float_=True)
    return _zeta(x, q)


@op("complex.default")
def complex_(real, imag):
    return lax.complex(*_bc(real, imag))


@op("polar.default")
def polar(r, theta):
    r, theta = _bc(r, theta)
    return lax.complex(r * jnp.cos(theta), r * jnp.sin(theta))


def _igamma_edges(a, x, v, lower):
    """PyTorch's (SciPy's) boundary values for the regularized incomplete gamma functions."""
    one, zero = (1.0, 0.0) if lower else (0.0, 1.0)
    v = jnp.where(jnp.isinf(x), one, v)
    v = jnp.where(jnp.isinf(a), jnp.where(jnp.isinf(x), jnp.nan, zero), v)
    v = jnp.where(x == 0, zero, v)
    v = jnp.where(a == 0, jnp.where(x > 0, one, jnp.nan), v)
    return jnp.where((x < 0) | (a < 0), jnp.nan, v)


@op("igamma.default")
def igamma(a, x):
    _, (a, x) = _common(a, x, float_=True)
    return _igamma_edges(a, x, jss.gammainc(a, x), True)


@op("igammac.default")
def igammac(a, x):
    _, (a, x) = _common(a, x, float_=True)
    return _igamma_edges(a, x, jss.gammaincc(a, x), False)
