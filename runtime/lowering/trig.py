"""sin, cos, tan, asin, acos and atan for float32 (16-bit floats compute in float32): vectorizable
jnp code.

XLA's CPU backend emits a scalar routine per element for ``sine``/``cosine``/``tan``: 4-9 ms per
million float32 values here, where PyTorch's vectorized kernels take 0.3-0.5 ms and every other
unary op about as long as a copy. This is a plain polynomial XLA fuses and vectorizes (0.7 ms),
within 1 ulp of PyTorch's CPU results (tests/test_ops_pointwise.py; every float32 nearest a
multiple of pi/2 up to 2**26 was checked once, by hand):

- range reduction in float64: j = round(x * 2/pi), r = x - j*pi/2 with pi/2 split into four parts
  (Cody and Waite), the first three of 27 bits so that j times each is exact for |j| < 2**26;
- Taylor polynomials of sin and cos on |r| <= pi/4 in float64 (error below 1e-11), the result
  picked by the quadrant j mod 4 (tan: sin/cos or -cos/sin) and rounded once to the output dtype.

atan reduces to |u| <= tan(pi/8) (1/a past 1, then (t-1)/(t+1)) for a 14-term series in float64,
and asin and acos are atan(a / sqrt((1-a)(1+a))): exact everywhere, so no check (XLA's routines:
9-17 ms per million, these 3.5-7, PyTorch 0.35-0.5).

CPU only: TPUs and GPUs evaluate these in hardware or vectorized libraries, and float64 is slow
(TPU: emulated) there. Past |x| > 2**26 the float64 reduction loses bits, so an input holding any
such value (or an inf) takes XLA's exact routine instead, through ``lax.cond`` (one check of the
whole input). Small inputs go straight to XLA's routine too: the check and the conditional are not
worth it there.
"""
from __future__ import annotations

import math
from decimal import Decimal, localcontext

import jax
import jax.numpy as jnp
from jax import lax

from .. import platform

FAST_MIN_SIZE = 1 << 14     # elements below which XLA's own routine is used
_LIMIT = float(2 ** 26)     # |x| beyond which the reduction below is not exact enough


def _split(v: float, bits: int) -> float:
    m, e = math.frexp(v)
    return math.ldexp(math.floor(m * 2 ** bits), e - bits)


_P: list = []   # pi/2 = P[0] + P[1] + P[2] + P[3]: 27 significant bits each but the last
with localcontext() as _ctx:
    _ctx.prec = 50
    _half_pi = Decimal("3.14159265358979323846264338327950288419716939937510") / 2
    for _k in range(4):
        _rest = _half_pi - sum((Decimal(p) for p in _P), Decimal(0))
        _P.append(_split(float(_rest), 27) if _k < 3 else float(_rest))
_SIN = [(-1) ** k / math.factorial(2 * k + 1) for k in range(1, 7)]    # r**3 .. r**13
_COS = [(-1) ** k / math.factorial(2 * k) for k in range(1, 8)]        # r**2 .. r**14


def _horner(coefs, r2):
    p = coefs[-1]
    for c in reversed(coefs[:-1]):
        p = p * r2 + c
    return p


def _sin_cos_quadrant(x):
    xd = x.astype(jnp.float64)
    j = jnp.round(xd * (2 / math.pi))
    r = (((xd - j * _P[0]) - j * _P[1]) - j * _P[2]) - j * _P[3]
    r2 = r * r
    s = r + r * r2 * _horner(_SIN, r2)
    c = 1 + r2 * _horner(_COS, r2)
    return s, c, j.astype(jnp.int32) & 3


def _fast_sin(x):
    s, c, q = _sin_cos_quadrant(x)
    out = jnp.where(q == 0, s, jnp.where(q == 1, c, jnp.where(q == 2, -s, -c)))
    return jnp.where(x == 0, x, out.astype(x.dtype))      # keeps sin(-0.0) == -0.0


def _fast_cos(x):
    s, c, q = _sin_cos_quadrant(x)
    return jnp.where(q == 0, c, jnp.where(q == 1, -s, jnp.where(q == 2, -c, s))).astype(x.dtype)


def _fast_tan(x):
    s, c, q = _sin_cos_quadrant(x)
    out = jnp.where((q & 1) == 0, s / c, -c / s)
    return jnp.where(x == 0, x, out.astype(x.dtype))


_ATAN = [(-1) ** k / (2 * k + 1) for k in range(1, 15)]     # u**3 .. u**29
_TAN_PI_8 = math.tan(math.pi / 8)


def _atan64(a):
    """atan of a float64 array ``a >= 0`` (or nan/inf): 1/a past 1, then (t-1)/(t+1) past tan(pi/8),
    so the series runs on |u| <= 0.4142 (14 terms: error below 1e-12)."""
    inv = a > 1
    t = jnp.where(inv, 1 / a, a)
    big = t > _TAN_PI_8
    u = jnp.where(big, (t - 1) / (t + 1), t)
    u2 = u * u
    r = u + u * u2 * _horner(_ATAN, u2)
    r = jnp.where(big, math.pi / 4 + r, r)
    return jnp.where(inv, math.pi / 2 - r, r)


def _fast_atan(x):
    xd = x.astype(jnp.float64)
    return jnp.copysign(_atan64(jnp.abs(xd)), xd).astype(x.dtype)


def _asin64(xd):
    """asin(|x|) of a float64 array."""
    a = jnp.abs(xd)
    return _atan64(a / jnp.sqrt((1 - a) * (1 + a)))


def _fast_asin(x):
    xd = x.astype(jnp.float64)
    return jnp.copysign(_asin64(xd), xd).astype(x.dtype)


def _fast_acos(x):
    xd = x.astype(jnp.float64)
    asin = _asin64(xd)
    return jnp.where(xd < 0, math.pi / 2 + asin, math.pi / 2 - asin).astype(x.dtype)


def _cpu_fast(fast, exact, limit=None):
    """``fast`` for float32 inputs of FAST_MIN_SIZE elements or more on the CPU backend with float64
    on, else ``exact``; with a ``limit``, an input holding any |x| > limit takes ``exact``."""
    def f(x):
        if (x.dtype != jnp.float32 or x.size < FAST_MIN_SIZE or platform.name() != "cpu"
                or jax.dtypes.canonicalize_dtype(jnp.float64) != jnp.float64):   # no float64
            return exact(x)
        if limit is None:
            return fast(x)
        return lax.cond(jnp.any(jnp.abs(x) > limit), exact, fast, x)
    return f


sin = _cpu_fast(_fast_sin, jnp.sin, _LIMIT)
cos = _cpu_fast(_fast_cos, jnp.cos, _LIMIT)
tan = _cpu_fast(_fast_tan, jnp.tan, _LIMIT)
atan = _cpu_fast(_fast_atan, jnp.arctan)      # exact for every input: no range check
asin = _cpu_fast(_fast_asin, jnp.arcsin)
acos = _cpu_fast(_fast_acos, jnp.arccos)
