"""Elementwise ops of one input: unary float math (sin/cos/tan and inverses: trig.py; the unary
ops that keep integer dtypes: unary_int.py); and the dtype helpers every elementwise family shares. Binary
arithmetic, comparisons and clamps are in binary.py (pow in power.py), the ``prims.*`` mapping in
prims.py, activations in activations.py, special functions in special.py.

Outputs are cast to PyTorch's dtype by the caller (runtime/node.py); what a lowering must get right
is the dtype it COMPUTES in. ``_rt`` reproduces ``torch.result_type`` over the JAX inputs (Python
numbers and the weak-typed 0-d values they arrive as count as wrapped scalars, 0-d arrays as 0-dim
tensors), and ``_opmath`` computes float16/bfloat16 in float32 as PyTorch's CPU kernels do. Integer
and bool inputs to float math compute in the default float dtype.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
import torch
from jax import lax

from ..dtypes import NP_TO_TORCH, TORCH_TO_NP
from . import op, trig
from .padding import Refuse
from .precision import round_to

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("not tagged pointwise by PyTorch (a prims op, a special function)")

# --------------------------------------------------------------------------------------------
# dtype helpers (all static: they look at dtypes and Python values, never at traced data)

_BOOL = np.dtype(np.bool_)
_I64 = np.dtype(np.int64)
_F32 = np.dtype(np.float32)
_HALF = (np.dtype(np.float16), np.dtype(jnp.bfloat16))


def _py(x) -> bool:
    return isinstance(x, (bool, int, float, complex))


def _weak(x) -> bool:
    """A wrapped number: a Python scalar, or the weak-typed 0-d value one arrives as."""
    if _py(x):
        return True
    return x.ndim == 0 and bool(getattr(jax.typeof(x), "weak_type", False))


def _default_float() -> np.dtype:
    return TORCH_TO_NP[torch.get_default_dtype()]


def _default_complex() -> np.dtype:
    return np.dtype(np.complex128) if _default_float() == np.float64 else np.dtype(np.complex64)


def _isfloat(dt) -> bool:
    return jnp.issubdtype(dt, jnp.floating)


def _iscomplex(dt) -> bool:
    return jnp.issubdtype(dt, jnp.complexfloating)


def _isinexact(dt) -> bool:
    return jnp.issubdtype(dt, jnp.inexact)


def _isint(dt) -> bool:
    return jnp.issubdtype(dt, jnp.integer)


def _dtype_of(x) -> np.dtype:
    if isinstance(x, bool):
        return _BOOL
    if isinstance(x, int):
        return _I64
    if isinstance(x, float):
        return np.dtype(np.float64)
    if isinstance(x, complex):
        return np.dtype(np.complex128)
    return np.dtype(x.dtype)


def _promote(a, b):
    if a is None:
        return b
    if b is None or a == b:
        return a
    return TORCH_TO_NP[torch.promote_types(NP_TO_TORCH[a], NP_TO_TORCH[b])]


def _combine(higher, lower):
    """c10's combine_categories: a lower-priority operand wins only with a higher category."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    if _iscomplex(higher):
        return higher
    if _iscomplex(lower):
        if _isfloat(higher):
            return np.dtype(np.complex128) if higher == np.float64 else np.dtype(np.complex64)
        return lower
    if _isfloat(higher):
        return higher
    if higher == _BOOL or _isfloat(lower):
        return _promote(higher, lower)
    return higher


def _rt(*xs) -> np.dtype:
    """torch.result_type over tensors (jax arrays) and scalars; None entries are ignored."""
    dim = zero = wrapped = None
    for x in xs:
        if x is None:
            continue
        dt = _dtype_of(x)
        if _weak(x):
            if _iscomplex(dt):
                dt = _default_complex()
            elif _isfloat(dt):
                dt = _default_float()
            wrapped = _promote(wrapped, dt)
        elif x.ndim == 0:
            zero = _promote(zero, dt)
        else:
            dim = _promote(dim, dt)
    return _combine(dim, _combine(zero, wrapped))


def _opmath(dt) -> np.dtype:
    """The dtype PyTorch's CPU kernels compute in: float32 for float16/bfloat16."""
    return _F32 if dt in _HALF else dt


def _int_like(ct):
    return _I64 if ct == _BOOL else ct


def _to_float(dt) -> np.dtype:
    """The float dtype a float op computes in for inputs of dtype ``dt``."""
    return dt if _isinexact(dt) else _default_float()


def _cast(x, dt):
    if x is None:
        return None
    if _py(x):
        if isinstance(x, int) and not isinstance(x, bool) and _isint(dt):
            return jnp.asarray(x, _I64).astype(dt)     # wraps like a C cast (uint8 and -1)
        if isinstance(x, complex) and not _iscomplex(dt):
            x = x.real
        return jnp.asarray(x, dt)
    return x if x.dtype == dt else x.astype(dt)


def _common(*xs, float_=False, opmath=True):
    """(result dtype, inputs cast to the dtype the op computes in)."""
    ct = _rt(*xs)
    if float_:
        ct = _to_float(ct)
    cd = _opmath(ct) if opmath else ct
    return ct, [_cast(x, cd) for x in xs]


def _uf(x):
    """A unary float op's input in its compute dtype."""
    return _cast(x, _opmath(_to_float(np.dtype(x.dtype))))


def _is(v, n) -> bool:
    """``v`` is the Python number ``n`` (a traced scalar never is)."""
    return _py(v) and not isinstance(v, bool) and v == n


def _scale(y, alpha):
    if alpha is None or _is(alpha, 1):
        return y
    return y * _cast(alpha, y.dtype)


def _bc(*xs):
    """Broadcast to one shape (jax.lax ops do not broadcast)."""
    return jnp.broadcast_arrays(*xs)


# NOTE [complex products]: PyTorch's CPU kernels multiply complex numbers component by component,
# (a + bi)(c + di) = (ac - bd) + (ad + bc)i, a real operand promoted to c + 0i first, and add and
# sub compute ``x + alpha * y`` with that product even when alpha is 1: an infinite component
# times a zero one is NaN, so (inf + 0i) * 1 is inf + nan i and (1 + 1i) + (inf + 0i) is
# inf + nan i on CPU (measured, every size: the vectorized and the scalar loops agree). XLA
# folds a product by the constant 1 away and adds without the product: ``_cmul`` spells the
# product out in real arithmetic, which XLA keeps (it does not fold a float times 0).

def _cmul(x, y):
    """The complex product as CPU computes it (NOTE [complex products])."""
    x, y = jnp.asarray(x), jnp.asarray(y)
    a, b, c, d = jnp.real(x), jnp.imag(x), jnp.real(y), jnp.imag(y)
    return lax.complex(*_bc(a * c - b * d, a * d + b * c))


def _cdiv(x, y):
    """The complex quotient as CPU computes it: c10::complex's division (numpy's scaled one, a real
    divisor promoted to c + 0i), so (inf + 0i) / 2 is inf + nan i and a division by zero divides
    each component by zero (NOTE [complex products])."""
    x, y = jnp.asarray(x), jnp.asarray(y)
    a, b, c, d = _bc(jnp.real(x), jnp.imag(x), jnp.real(y), jnp.imag(y))
    ac, ad = jnp.abs(c), jnp.abs(d)
    rat1 = d / c
    scl1 = 1 / (c + d * rat1)
    rat2 = c / d
    scl2 = 1 / (d + c * rat2)
    zero = (ac == 0) & (ad == 0)
    first = ac >= ad                 # False when either is NaN, as in C++
    re = jnp.where(first, jnp.where(zero, a / ac, (a + b * rat1) * scl1), (a * rat2 + b) * scl2)
    im = jnp.where(first, jnp.where(zero, b / ad, (b - a * rat1) * scl1), (b * rat2 - a) * scl2)
    return lax.complex(re, im)


def _rem(x, y):
    """C fmod / truncated remainder."""
    return lax.rem(*_bc(x, y))


def _tdiv(x, y):
    """C integer division (truncates toward zero)."""
    return lax.div(*_bc(x, y))


def _nz(x):
    """Truthiness of an input, as PyTorch's logical ops read it."""
    if _py(x):
        return jnp.asarray(bool(x))
    return x if x.dtype == _BOOL else x != 0


def _integral_only(name, dt):
    """PyTorch's kernels reject float inputs here, after meta inference accepted them."""
    if _isinexact(dt):
        raise RuntimeError(f'"{name}" not implemented for \'{NP_TO_TORCH[np.dtype(dt)]}\'')


# --------------------------------------------------------------------------------------------
# unary float math

def _unary(*names):
    def deco(f):
        def low(x):
            return f(_uf(x))
        low.__name__ = f.__name__
        op(*names)(low)
        return f
    return deco


_SIMPLE_UNARY = {
    "exp.default": jnp.exp, "exp2.default": jnp.exp2, "expm1.default": jnp.expm1,
    "log.default": jnp.log, "log2.default": jnp.log2, "log10.default": jnp.log10,
    "log1p.default": jnp.log1p, "sqrt.default": jnp.sqrt, "rsqrt.default": lax.rsqrt,
    "sin.default": trig.sin, "cos.default": trig.cos, "tan.default": trig.tan,
    "asin.default": trig.asin, "acos.default": trig.acos, "atan.default": trig.atan,
    "sinh.default": jnp.sinh, "cosh.default": jnp.cosh, "tanh.default": jnp.tanh,
    "asinh.default": jnp.arcsinh, "acosh.default": jnp.arccosh, "atanh.default": jnp.arctanh,
    "erf.default": lax.erf, "erfc.default": lax.erfc, "erfinv.default": lax.erf_inv,
    "lgamma.default": lax.lgamma, "i0.default": jss.i0,
    "special_i0e.default": jss.i0e, "special_i1.default": jss.i1, "special_i1e.default": jss.i1e,
    "special_modified_bessel_i0.default": jss.i0, "special_modified_bessel_i1.default": jss.i1,
    "special_ndtr.default": jss.ndtr, "special_ndtri.default": jss.ndtri,
    "special_log_ndtr.default": jss.log_ndtr, "special_erfcx.default": jss.erfcx,
}
for _name, _fn in _SIMPLE_UNARY.items():
    _unary(_name)(_fn)


@_unary("reciprocal.default")
def reciprocal(x):
    if _iscomplex(np.dtype(x.dtype)):
        return _cdiv(1, x)          # c10::complex's 1 / x (NOTE [complex products])
    return 1 / x


@_unary("sigmoid.default")
def sigmoid(x):
    return 1 / (1 + jnp.exp(-x))


def _digamma(x):
    # PyTorch: digamma(+-0) = -+inf (JAX gives nan there).
    return jnp.where(x == 0, jnp.copysign(jnp.asarray(jnp.inf, x.dtype), -x), lax.digamma(x))


_unary("digamma.default")(_digamma)


@_unary("special_entr.default")
def entr(x):
    return jnp.where(jnp.isnan(x), x, jnp.where(x > 0, -x * jnp.log(jnp.where(x > 0, x, 1)),
                                                jnp.where(x == 0, 0, -jnp.inf))).astype(x.dtype)


@_unary("sinc.default")
def sinc(x):
    px = x * math.pi
    safe = jnp.where(x == 0, 1, px)
    return jnp.where(x == 0, jnp.ones_like(x), jnp.sin(safe) / safe)


@_unary("special_spherical_bessel_j0.default")
def spherical_j0(x):
    safe = jnp.where((x == 0) | jnp.isinf(x), 1, x)
    return jnp.where(x == 0, jnp.ones_like(x), jnp.where(jnp.isinf(x), jnp.zeros_like(x), jnp.sin(safe) / safe))


_ZETA_MAX_SHIFT = 2.0 ** 20


def _zeta(x, q):
    """Hurwitz zeta with PyTorch's (Cephes) domain: inf for x == 1 or integer q <= 0, nan for
    x < 1 or for q < 0 with non-integer x; a negative q is shifted above 0 by summing its terms."""
    dt = x.dtype
    x, q = _bc(x.astype(np.float64), q.astype(np.float64))    # PyTorch accumulates in double
    qint = (q <= 0) & (q == jnp.floor(q))                     # also -inf
    # Terms to shift q above 0 (none where the result is fixed anyway; capped so a huge negative
    # q cannot loop for ever: beyond the cap the result is nan).
    shift = (q < 0) & ~qint & (x == jnp.floor(x))
    n = jnp.where(shift, jnp.minimum(jnp.ceil(-q), _ZETA_MAX_SHIFT), jnp.zeros_like(q))

    def body(c):
        k, s = c
        return k + 1, s + jnp.where(k < n, jnp.power(q + k, -x), jnp.zeros_like(s))

    _, s = lax.while_loop(lambda c: jnp.any(c[0] < n), body, (jnp.zeros_like(q), jnp.zeros_like(q)))
    res = jss.zeta(x, q + n) + s
    res = jnp.where(shift & (-q > _ZETA_MAX_SHIFT), jnp.nan, res)
    inf = jnp.full_like(res, jnp.inf)
    nan = jnp.full_like(res, jnp.nan)
    res = jnp.where((q < 0) & (x != jnp.floor(x)), nan, res)
    # x = +inf (Cephes' series): 1 at q == 1, nan for q > 1, inf otherwise.
    res = jnp.where(x == jnp.inf, jnp.where(q == 1, 1.0, jnp.where(q > 1, jnp.nan, jnp.inf)), res)
    res = jnp.where(qint, inf, jnp.where(jnp.isnan(q), nan, res))
    return jnp.where(x == 1, inf, jnp.where(x < 1, nan, res)).astype(dt)


@op("logit.default")
def logit(x, eps=None):
    # Half precision: CPU's kernel works in the input's dtype, each step (eps too) rounded.
    r = functools.partial(round_to, dtype=x.dtype)
    x = _uf(x)
    if eps is not None:
        lo = r(_cast(eps, x.dtype))
        hi = r(1 - lo)
        x = jnp.where(x < lo, lo, jnp.where(x > hi, hi, x))
    return r(jnp.log(r(x / r(1 - x))))


def _trigamma(x):
    """PyTorch's CPU trigamma (in the input's precision): reflection below 1/2, six recurrence
    steps, then an asymptotic series."""
    pi = jnp.asarray(math.pi, x.dtype)
    refl = x < 0.5
    s = jnp.sin(pi * x)
    result = jnp.where(refl, -(pi * pi) / (s * s), jnp.zeros_like(x))
    x = jnp.where(refl, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1 / 6 - ixx * (1 / 30 - ixx * (1 / 42)))) / x
    return jnp.where(refl, -result, result)


@op("polygamma.default")
def polygamma(n, x):
    x = _uf(x)
    if n == 0:
        return _digamma(x)
    if n == 1:
        return _trigamma(x)
    # PyTorch (and Cephes): (-1)^(n+1) n! zeta(n+1, x), with zeta defined for negative x too.
    return (1.0 if n % 2 else -1.0) * math.factorial(n) * _zeta(jnp.full_like(x, n + 1), x)


@op("polygamma_.default")
def polygamma_(x, n):
    return polygamma(n, x)


@op("mvlgamma.default", "special_multigammaln.default")
def mvlgamma(x, p):
    x = _uf(x)
    out = sum(lax.lgamma(x - 0.5 * j) for j in range(p))
    return out + p * (p - 1) / 4 * math.log(math.pi)


@op("frexp.Tensor")
def frexp(x):
    dt = np.dtype(x.dtype)
    m, e = jnp.frexp(x)
    finite = jnp.isfinite(x)
    return jnp.where(finite, m, x).astype(dt), jnp.where(finite, e, 0).astype(np.int32)
