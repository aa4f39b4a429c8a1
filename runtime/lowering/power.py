"""``pow``: PyTorch's integer power (wrapping square-and-multiply), its CPU kernel's special
exponents, half-precision bases and exponents as CPU rounds them, and complex pow as glibc's cpow
(NOTE [complex pow]).

Apart from binary.py because it is one op with its own arithmetic: C99's complex log, exp and
product, per-dtype exponent tables and run-time branches on a traced exponent, none of which the
other elementwise ops use. The dtype helpers come from pointwise.py, as binary.py's do.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import op
from .padding import Refuse
from .pointwise import (_BOOL, _bc, _cast, _cdiv, _cmul, _int_like, _iscomplex, _isint, _opmath,
                        _py, _rt, _weak)
from .precision import round_to

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py): binary.py's
PAD = Refuse("not tagged pointwise by PyTorch (a prims op, a Scalar overload)")

def _ipow(a, b):
    """PyTorch's integer power (c10 powi): wrapping square-and-multiply; b < 0 gives 0 unless |a| is 1."""
    dt = np.dtype(a.dtype)
    a, b = jnp.broadcast_arrays(a, b)
    signed = jnp.issubdtype(dt, jnp.signedinteger)
    bits = dt.itemsize * 8 - (1 if signed else 0)

    def body(_, c):
        r, base, e = c
        r = jnp.where((e & 1) != 0, r * base, r)
        return r, base * base, e >> 1

    e = jnp.maximum(b, 0) if signed else b
    r, _, _ = lax.fori_loop(0, bits, body, (jnp.ones_like(a), a, e))
    if not signed:
        return r
    one = jnp.ones_like(a)
    neg = jnp.where(a == 1, one, jnp.where(a == -1, jnp.where((b & 1) != 0, -one, one), jnp.zeros_like(a)))
    return jnp.where(b < 0, neg, r)


@op("pow.Tensor_Tensor", "pow.Tensor_Scalar", "pow.Scalar", "pow_.Tensor")
def pow_(x, y):
    ct = _rt(x, y)
    if ct == _BOOL or _isint(ct):
        cd = _int_like(ct)
        xc = _cast(x, cd)
        if _py(y) and not isinstance(y, bool) and y >= 0:
            return lax.integer_pow(xc, int(y))
        return _ipow(xc, _cast(y, cd))
    cd = _opmath(ct)
    xc, yc = _cast(x, cd), _cast(y, cd)
    if _iscomplex(cd) and _py(x) and x == 1:
        return jnp.ones_like(yc)        # CPU's pow(1, exponent) fills ones, whatever the exponent
    if ct in _HALF_POW and _weak(x) and not _weak(y):
        # A scalar base: CPU's pow has no scalar case (mul and add keep a scalar's float value):
        # the base is a tensor of the result's dtype first (10000 ** x is 9984 ** x in bfloat16).
        xc = _cast(_cast(x, ct), cd)
    if _py(y) and not _py(x):
        if ct in _HALF_POW:
            return _half_pow_scalar(xc, y, ct)
        special = (_CPOW_SPECIAL if _iscomplex(cd) else _POW_SPECIAL).get(y)
        return special(xc) if special is not None else _power(xc, yc)
    if not _py(x) and _weak(y) and ct in _HALF_POW:
        return _half_pow_scalar(xc, y, ct)
    if not _py(x) and _weak(y):
        # A traced scalar exponent: PyTorch's CPU kernel special-cases these exponents (they differ
        # from pow at -0 and -inf); pick the branch at run time.
        sp = _CPOW_SPECIAL if _iscomplex(cd) else _POW_SPECIAL
        branches = [lambda b: _power(b, yc)] + [sp[k] for k in _POW_KEYS]
        idx = sum(jnp.where(yc == k, i + 1, 0) for i, k in enumerate(_POW_KEYS))
        return lax.switch(idx, branches, xc)
    return _power(xc, yc)


def _power(x, y):
    return _cpow(x, y) if _iscomplex(np.dtype(x.dtype)) else jnp.power(x, y)


# NOTE [complex pow]: CPU's complex pow (other than the exponents above) is libstdc++'s std::pow,
# glibc's cpow: cexp(y * clog(x)), the product spelled out (NOTE [complex products]) and clog and
# cexp with C99's Annex G rules at zeros, infinities and NaNs: 0 ** 2.5 is 0 - 0i (clog(0) is
# -inf, the product -inf + nan i, cexp of which is a zero), inf ** 2.5 is inf + nan i, 0 ** 0 with
# a tensor exponent is nan + nan i. XLA's complex pow gives nan + nan i or inf + 0i there.

def _clog(x):
    """C99 clog: log|x| + i arg(x) (clog(-0 + 0i) is -inf + pi i; |x| is inf when a part is)."""
    re, im = jnp.real(x), jnp.imag(x)
    ar, ai = jnp.abs(re), jnp.abs(im)
    big, small = jnp.maximum(ar, ai), jnp.minimum(ar, ai)
    safe = jnp.where(big == 0, 1, big)
    mag = big * jnp.sqrt(1 + (small / safe) ** 2)
    mag = jnp.where(jnp.isinf(ar) | jnp.isinf(ai), jnp.inf, jnp.where(big == 0, 0, mag))
    return lax.complex(jnp.log(mag), jnp.arctan2(im, re))


def _cexp(z):
    """C99 cexp: e^a (cos b + i sin b) with Annex G's rules when a or b is not finite."""
    a, b = jnp.real(z), jnp.imag(z)
    fin_b = jnp.isfinite(b)
    ea = jnp.exp(jnp.where(jnp.isinf(a) & (a > 0), 0, a))   # e^a, and 1 for a = +inf (a sign)
    c, s = jnp.cos(jnp.where(fin_b, b, 0)), jnp.sin(jnp.where(fin_b, b, 0))
    re, im = ea * c, ea * s
    nan = jnp.full_like(a, jnp.nan)
    inf = jnp.full_like(a, jnp.inf)
    zero = jnp.zeros_like(a)
    # a = +inf: b = 0 -> inf + b i; b finite -> inf cis(b); b inf or nan -> inf + nan i
    pinf = jnp.isinf(a) & (a > 0)
    re = jnp.where(pinf, jnp.where(fin_b, jnp.where(b == 0, inf, inf * c), inf), re)
    im = jnp.where(pinf, jnp.where(fin_b, jnp.where(b == 0, b, inf * s), nan), im)
    # a = -inf: b finite -> +0 cis(b); b inf or nan -> 0 + (0 with b's sign) i
    ninf = jnp.isinf(a) & (a < 0)
    re = jnp.where(ninf, jnp.where(fin_b, zero * c, zero), re)
    im = jnp.where(ninf, jnp.where(fin_b, zero * s, jnp.copysign(zero, b)), im)
    # a nan: b = 0 -> nan + b i, else nan + nan i; a finite, b inf or nan -> nan + nan i
    an = jnp.isnan(a)
    re = jnp.where(an | (jnp.isfinite(a) & ~fin_b), nan, re)
    im = jnp.where(an, jnp.where(b == 0, b, nan), jnp.where(jnp.isfinite(a) & ~fin_b, nan, im))
    return lax.complex(re, im)


def _cmul_c99(x, y):
    """C's complex product (GCC's __mulsc3, C99 Annex G): CPU's product (``_cmul``), and where both
    parts are NaN but an operand is infinite, the infinity recovered."""
    p = _cmul(x, y)
    re, im = jnp.real(p), jnp.imag(p)
    a, b, c, d = _bc(jnp.real(x), jnp.imag(x), jnp.real(y), jnp.imag(y))
    one = jnp.ones_like(a)
    zero = jnp.zeros_like(a)
    box = lambda v: jnp.copysign(jnp.where(jnp.isinf(v), one, zero), v)    # noqa: E731
    unnan = lambda v: jnp.where(jnp.isnan(v), jnp.copysign(zero, v), v)     # noqa: E731
    inf_ab, inf_cd = jnp.isinf(a) | jnp.isinf(b), jnp.isinf(c) | jnp.isinf(d)
    a2, b2 = jnp.where(inf_ab, box(a), a), jnp.where(inf_ab, box(b), b)
    c2, d2 = jnp.where(inf_ab, unnan(c), c), jnp.where(inf_ab, unnan(d), d)
    c2, d2 = jnp.where(inf_cd, box(c2), c2), jnp.where(inf_cd, box(d2), d2)
    a2, b2 = jnp.where(inf_cd, unnan(a2), a2), jnp.where(inf_cd, unnan(b2), b2)
    over = ~(inf_ab | inf_cd) & (jnp.isinf(a * c) | jnp.isinf(b * d) | jnp.isinf(a * d)
                                 | jnp.isinf(b * c))
    a2, b2, c2, d2 = (jnp.where(over, unnan(v), v) for v in (a2, b2, c2, d2))
    redo = jnp.isnan(re) & jnp.isnan(im) & (inf_ab | inf_cd | over)
    re = jnp.where(redo, jnp.inf * (a2 * c2 - b2 * d2), re)
    im = jnp.where(redo, jnp.inf * (a2 * d2 + b2 * c2), im)
    return lax.complex(re, im)


def _cpow(x, y):
    """CPU's complex pow (NOTE [complex pow]), in the input's precision as glibc's cpowf/cpow."""
    return _cexp(_cmul_c99(y, _clog(x)))


_POW_SPECIAL = {0: lambda b: jnp.ones_like(b), 1: lambda b: b, 2: lambda b: b * b,
                3: lambda b: b * b * b, -2: lambda b: 1 / (b * b), 0.5: jnp.sqrt, -0.5: lax.rsqrt,
                -1: lambda b: 1 / b}
# A complex tensor to these Python exponents: CPU's kernel takes products and quotients, each as
# its complex arithmetic computes them (NOTE [complex products]).
_CPOW_SPECIAL = {0: lambda b: jnp.ones_like(b), 1: lambda b: b, 2: lambda b: _cmul(b, b),
                 3: lambda b: _cmul(_cmul(b, b), b), -2: lambda b: _cdiv(1, _cmul(b, b)),
                 0.5: jnp.sqrt, -0.5: lambda b: _cdiv(1, jnp.sqrt(b)), -1: lambda b: _cdiv(1, b)}
_POW_KEYS = (3, -2, -0.5)     # traced exponents worth a branch (the others arrive as Python numbers)
_HALF_POW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _half_pow_scalar(xc, y, ct):
    """A half-precision tensor to a scalar's power (a Python number, or the weak 0-d value one
    arrives as), as CPU's pow kernel computes it: the exponent first converted to the tensor's
    dtype (``exp_scalar.to<scalar_t>()``); bfloat16 takes sqrt, rsqrt, reciprocal and square in
    float32 with one rounding, but ``x ** 3`` and ``x ** -2`` in bfloat16 arithmetic (``base *
    base * base``, ``1 / (base * base)``: a rounding per step); every other exponent is float32
    ``pow`` rounded once (float16: all of them). gelu_new's ``x ** 3.0`` differed from CPU on a
    fifth of its elements."""
    if _py(y):
        k = float(np.asarray(y, dtype=ct))
        if ct == _HALF_POW[0] and k in _BF16_POW:
            return _BF16_POW[k](xc)
        return jnp.power(xc, np.float32(k))
    e = y.astype(ct).astype(jnp.float32)
    if ct == _HALF_POW[1]:
        return jnp.power(xc, e)
    keys = tuple(_BF16_POW)
    idx = sum(jnp.where(e == k, i + 1, 0) for i, k in enumerate(keys))
    return lax.switch(idx, [lambda b: jnp.power(b, e)] + [_BF16_POW[k] for k in keys], xc)


def _bf16(v):
    return round_to(v, jnp.bfloat16)


# CPU's bfloat16 pow kernel by exponent (NOTE: the result is rounded once more, a no-op, after).
_BF16_POW = {0.5: jnp.sqrt, -0.5: lambda b: 1 / jnp.sqrt(b), -1: lambda b: 1 / b,
             2: lambda b: b * b, 3: lambda b: _bf16(_bf16(b * b) * b),
             -2: lambda b: _bf16(1 / _bf16(b * b))}
