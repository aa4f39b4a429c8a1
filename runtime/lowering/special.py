"""Special functions: modified Bessel functions of the second kind and the orthogonal polynomials
(Chebyshev, Hermite, Laguerre, Legendre), in pure JAX. Shared dtype helpers come from pointwise.py.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import op
from .pointwise import _bc, _common, _unary  # noqa: F401


# --------------------------------------------------------------------------------------------
# modified Bessel functions of the second kind: e^x K_nu(x) = int_0^inf exp(-x (cosh t - 1))
# cosh(nu t) dt by the trapezoidal rule, which converges geometrically for this smooth, double-
# exponentially decaying integrand; the step shrinks as 1/sqrt(x) where the integrand narrows.

def _kve(x, nu: int, n: int = 100):
    pos = jnp.where(x > 0, x, 1)
    h = jnp.minimum(0.25, lax.rsqrt(jnp.where(jnp.isinf(pos), 1, pos)))[..., None]
    k = jnp.arange(n, dtype=x.dtype)
    t = k * h
    f = jnp.exp(-pos[..., None] * (2 * jnp.sinh(t / 2) ** 2)) * jnp.where(k == 0, 0.5, 1.0) * h
    if nu:
        f = f * jnp.cosh(nu * t)
    v = jnp.sum(f, axis=-1)
    # x < 1e-4: the series' leading terms (the quadrature would need a longer range)
    lg = jnp.log(pos / 2) + np.euler_gamma
    small = (-lg * (1 + pos * pos / 4) + pos * pos / 4 if nu == 0
             else 1 / pos + pos / 2 * lg - pos / 4) * jnp.exp(pos)
    v = jnp.where(pos < 1e-4, small, v)
    v = jnp.where(x == 0, jnp.inf, jnp.where((x < 0) | jnp.isnan(x), jnp.nan, v))
    return jnp.where(jnp.isinf(x) & (x > 0), 0, v)


@_unary("special_scaled_modified_bessel_k0.default")
def scaled_modified_bessel_k0(x):
    return _kve(x, 0)


@_unary("special_scaled_modified_bessel_k1.default")
def scaled_modified_bessel_k1(x):
    return _kve(x, 1)


@_unary("special_modified_bessel_k0.default")
def modified_bessel_k0(x):
    return _kve(x, 0) * jnp.exp(-x)


@_unary("special_modified_bessel_k1.default")
def modified_bessel_k1(x):
    return _kve(x, 1) * jnp.exp(-x)


# --------------------------------------------------------------------------------------------
# orthogonal polynomials P_n(x), n an integer (truncated from the tensor's value): PyTorch's
# three-term recurrences, special values and closed forms (ATen/native/Math.h), the recurrence
# run as one masked loop up to the largest n.

def _poly_args(x, n):
    ct, (x, n) = _common(x, n, float_=True)
    x, n = _bc(x, n)
    return x, jnp.trunc(n).astype(jnp.int64)


def _recur(x, n, q1, step):
    """P_n from P_0 = 1, P_1 = q1, P_m = step(m, P_{m-2}, P_{m-1}) (m = 2..n); n >= 0."""
    one = jnp.ones_like(x)
    nmax = jnp.max(n) if n.size else jnp.asarray(0, n.dtype)

    def body(c):
        m, p, q = c
        live = m <= n
        r = step(m.astype(x.dtype), p, q)
        return m + 1, jnp.where(live, q, p), jnp.where(live, r, q)
    _, _, q = lax.while_loop(lambda c: c[0] <= nmax, body, (jnp.asarray(2, n.dtype), one, q1))
    return jnp.where(n == 0, one, q)


def _alt(n, v):
    """v for even n, -v for odd n."""
    return jnp.where(n % 2 == 0, v, -v)


def _chebyshev(kind: str, shifted: bool):
    """Chebyshev T/U/V/W (shifted: of 2x - 1)."""
    big = {"t": 6, "u": 6 if shifted else 8, "v": 6 if shifted else 8, "w": 4 if shifted else 8}[kind]

    def low(x, n):
        x, n = _poly_args(x, n)
        y = x + x - 1 if shifted else x
        at1, atm1 = (x == 1, x == 0) if shifted else (x == 1, x == -1)
        nf = n.astype(x.dtype)
        q1 = {"t": y, "u": y + y, "v": y + y - 1, "w": y + y + 1}[kind]
        v = _recur(y, n, q1, lambda m, p, q: (y + y) * q - p)
        a = jnp.arccos(jnp.clip(y, -1, 1))
        if kind == "t":
            closed, e1, em1 = jnp.cos(nf * a), 1.0, _alt(n, 1.0)
        elif kind == "u":
            s = jnp.sin(a)
            closed = jnp.where(s != 0, jnp.sin((nf + 1) * a) / s, (nf + 1) * jnp.cos((nf + 1) * a) / y)
            e1, em1 = nf + 1, _alt(n, nf + 1)
        elif kind == "v":
            closed = jnp.where(jnp.sin(a / 2) != 1, jnp.cos((nf + 0.5) * a) / jnp.cos(a / 2),
                               _alt(n, nf + nf + 1))
            e1, em1 = 1.0, _alt(n, nf + nf + 1)
        else:
            closed = jnp.where(jnp.cos(a / 2) != 1, jnp.sin((nf + 0.5) * a) / jnp.sin(a / 2),
                               jnp.where(y > 0, nf + nf + 1, _alt(n, 1.0)))
            e1, em1 = nf + nf + 1, _alt(n, 1.0)
        v = jnp.where((n > big) & (jnp.abs(y) < 1), closed, v)
        v = jnp.where(atm1, em1, v)
        v = jnp.where(at1, e1, v)
        return jnp.where(n < 0, 0, v)
    return low


for _k in "tuvw":
    for _sh in (False, True):
        _nm = f"special_{'shifted_' if _sh else ''}chebyshev_polynomial_{_k}"
        op(f"{_nm}.default", f"{_nm}.x_scalar", f"{_nm}.n_scalar")(_chebyshev(_k, _sh))


@op("special_hermite_polynomial_h.default", "special_hermite_polynomial_h.x_scalar",
    "special_hermite_polynomial_h.n_scalar")
def hermite_h(x, n):
    x, n = _poly_args(x, n)
    return _hermite(x, n, _recur(x, n, x + x, lambda m, p, q: (x + x) * q - (m + m - 2) * p))


@op("special_hermite_polynomial_he.default", "special_hermite_polynomial_he.x_scalar",
    "special_hermite_polynomial_he.n_scalar")
def hermite_he(x, n):
    x, n = _poly_args(x, n)
    return _hermite(x, n, _recur(x, n, x, lambda m, p, q: x * q - (m - 1) * p))


def _hermite(x, n, v):
    """Both Hermite kinds: 0 for n < 0 and, as PyTorch, nan past its degree limit."""
    limit = 512 if x.dtype == np.float64 else 128
    return jnp.where(n < 0, 0, jnp.where(n > limit, jnp.nan, v))


@op("special_laguerre_polynomial_l.default", "special_laguerre_polynomial_l.x_scalar",
    "special_laguerre_polynomial_l.n_scalar")
def laguerre_l(x, n):
    x, n = _poly_args(x, n)
    v = _recur(x, n, 1 - x, lambda m, p, q: ((m + m - 1 - x) * q - (m - 1) * p) / m)
    return jnp.where(n < 0, 0, jnp.where(x == 0, 1, v))


@op("special_legendre_polynomial_p.default", "special_legendre_polynomial_p.x_scalar",
    "special_legendre_polynomial_p.n_scalar")
def legendre_p(x, n):
    x, n = _poly_args(x, n)
    v = _recur(x, n, x, lambda m, p, q: ((m + m - 1) * x * q - (m - 1) * p) / m)
    v = jnp.where(jnp.abs(x) == 1, jnp.where(x > 0, 1, _alt(n, 1.0)), v)
    return jnp.where(n < 0, 0, v)
