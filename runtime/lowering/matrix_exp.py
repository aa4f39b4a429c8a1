"""The matrix exponential, by PyTorch's own algorithm.

NOTE [matrix_exp as CPU computes it]: PyTorch's ``linalg_matrix_exp`` is the Taylor scheme of
Bader, Blanes and Casas (Mathematics 7, 1174, 2019), not the Pade one of ``jax.scipy``'s
``expm``: on ill-conditioned inputs the two round differently by more than a float32 comparison
allows. Its steps, followed here:

- a 1x1 matrix is ``exp`` of its entry; an empty one is itself;
- a single matrix (the batch dims multiply to 1) takes the lowest Taylor degree of 1, 2, 4, 8, 12
  whose bound (``_THETAS``, by precision) its 1-norm does not pass, each polynomial evaluated with
  the paper's few products (``_t1`` ... ``_t12``); a norm at or above the degree-12 bound takes
  degree 18 with scaling and squaring; a NaN norm gives NaN everywhere;
- a batch of several takes degree 18 with scaling and squaring for every matrix: scaled by 2^-s,
  s = max(ceil(log2(norm / theta_18)), 0), then squared s times (a matrix whose s is not finite
  is squared none), each matrix by its own s.

On CPU PyTorch evaluates the sums of products without fused multiply-adds, and its bmm
multiplies small matrices (n^3 < 400) one sum over k at a time, in order; larger ones go to MKL,
whose real products of sizes up to 10 sum in the same order where measured (8x8 bit for bit, and
10x10 in float64; 97% of float32 10x10 elements), its complex ones and larger sizes in orders of
their own. XLA's CPU compiler contracts a product and a following sum into an FMA, so the
products are spelled out rounded (``_rounded``) and the products of matrices up to 10x10 summed
in k order (``_mm``): then real and complex matrices up to 7x7 give CPU's bits, single or
batched, in every degree (tests/test_ops_linalg.py); larger ones XLA's dot. Half precision runs
in float32 and rounds once (CPU's own half-precision kernel is broken: docs/dtypes.md).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import op
from .padding import Refuse
from .precision import HALF

PAD = Refuse("a matrix function mixes every position of its input")

# The 1-norm bounds of degrees 1, 2, 4, 8, 12, 18 (the paper's, as PyTorch lists them), for
# single precision (float32, complex64) and double.
_THETAS = {4: (1.192092800768788e-07, 5.978858893805233e-04, 5.116619363445086e-02,
               5.800524627688768e-01, 1.461661507209034e+00, 3.010066362817634e+00),
           8: (2.220446049250313e-16, 2.580956802971767e-08, 3.397168839976962e-04,
               4.991228871115323e-02, 2.996158913811580e-01, 1.090863719290036e+00)}

# Degree 12: B_i = sum_j _B12[i][j] * A^j over (I, A, A^2, A^3).
_B12 = ((9.0198e-16, 0.46932117595418237389, -0.20099424927047284052, -0.04623946134063071740),
        (5.31597895759871264183, 1.19926790417132231573, 0.01179296240992997031,
         0.01108844528519167989),
        (0.18188869982170434744, 0.05502798439925399070, 0.09351590770535414968,
         0.00610700528898058230),
        (-2.0861320e-13, -0.13181061013830184015, -0.02027855540589259079,
         -0.00675951846863086359))
# Degree 18: B_i over (I, A, A^2, A^3, A^6).
_B18 = ((0., -1.00365581030144618291e-01, -8.02924648241156932449e-03,
         -8.92138498045729985177e-04, 0.),
        (0., 3.97849749499645077844e-01, 1.36783778460411720168e+00, 4.98289622525382669416e-01,
         -6.37898194594723280150e-04),
        (-1.09676396052962061844e+01, 1.68015813878906206114e+00, 5.71779846478865511061e-02,
         -6.98210122488052056106e-03, 3.34975017086070470649e-05),
        (-9.04316832390810593223e-02, -6.76404519071381882256e-02, 6.75961301770459654925e-02,
         2.95552570429315521194e-02, -1.39180257516060693404e-05),
        (0., 0., -9.23364619367118555360e-02, -1.69364939002081722752e-02,
         -1.40086798182036094347e-05))


def _t8_coefficients(real):
    """Degree 8's constants, rounded to ``real`` where PyTorch's single-precision code keeps them
    (its sqrt(177) and 2/3 are stored in the precision, the rest computed in double from them)."""
    r = lambda v: float(real(v))
    s, x3 = r(0.1330413469565007072504e+2), r(2. / 3.)
    return (r(x3 * ((1. + s) / 88.)), r(x3 * ((1. + s) / 352.)), x3,
            r((-271. + 29. * s) / (315. * x3)), r((-11. + 11. * s) / (1260. * x3)),
            r((-99. + 11. * s) / (5040. * x3)), r((89. - s) / (5040. * x3)),
            r((857. - 58. * s) / 630.))


def _rounded(p):
    """``p``, a product, rounded before whatever adds it: the select (an identity) keeps XLA's CPU
    compiler from fusing it with a following sum into an FMA (NOTE [matrix_exp as CPU computes
    it])."""
    return jnp.where(jnp.isnan(p), jnp.asarray(np.nan, p.dtype), p)


def _mul(x, y):
    """``x * y`` rounded, complex as c10::complex multiplies (four rounded real products)."""
    if not jnp.iscomplexobj(x) and not jnp.iscomplexobj(y):
        return _rounded(x * y)
    if not jnp.iscomplexobj(x):
        return lax.complex(_rounded(x * y.real), _rounded(x * y.imag))
    return lax.complex(_rounded(x.real * y.real) - _rounded(x.imag * y.imag),
                       _rounded(x.real * y.imag) + _rounded(x.imag * y.real))


def _combine(coefficients, mats):
    """sum_j c_j * M_j, summed in order from the first (``_compute_linear_combination``), the
    coefficients in the matrices' real precision."""
    real = jnp.finfo(mats[0].dtype).dtype.type
    acc = None
    for c, m in zip(coefficients, mats):
        t = _mul(jnp.asarray(real(c)), m)
        acc = t if acc is None else acc + t
    return acc


def _mm(x, y):
    """A batch of matrix products, as PyTorch's CPU bmm computes them."""
    n = x.shape[-1]
    if n > 10:
        return jnp.matmul(x, y, precision=lax.Precision.HIGHEST)
    acc = _mul(x[..., :, 0, None], y[..., None, 0, :])
    for k in range(1, n):
        acc = acc + _mul(x[..., :, k, None], y[..., None, k, :])
    return acc


def _eye(a):
    return jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)


def _t1(a, real):
    return _eye(a) + a


def _t2(a, real):
    return (_eye(a) + a) + _mm(a, a) / 2


def _t4(a, real):
    i, a2 = _eye(a), _mm(a, a)
    x = _mm(a2, _combine((1 / 2., 1 / 6., 1 / 24.), (i, a, a2)))
    return _combine((1., 1., 0., 1.), (i, a, a2, x))


def _t8(a, real):
    x1, x2, x3, x4, x5, x6, x7, y2 = _t8_coefficients(real)
    i, a2 = _eye(a), _mm(a, a)
    a4 = _mm(a2, _combine((x1, x2), (a, a2)))
    a8 = _mm(_combine((x3, 1.), (a2, a4)), _combine((x4, x5, x6, x7), (i, a, a2, a4)))
    return _combine((1., 1., y2, 0., 1.), (i, a, a2, a4, a8))


def _t12(a, real):
    i, a2 = _eye(a), _mm(a, a)
    b = [_combine(row, (i, a, a2, _mm(a, a2))) for row in _B12]
    a6 = b[2] + _mm(b[3], b[3])
    return b[0] + _mm(b[1] + a6, a6)


def _t18(a, real):
    i, a2 = _eye(a), _mm(a, a)
    a3 = _mm(a, a2)
    b = [_combine(row, (i, a, a2, a3, _mm(a3, a3))) for row in _B18]
    a9 = b[3] + _mm(b[0], b[4])
    return b[1] + _mm(b[2] + a9, a9)


def _ceil_log2(x):
    """ceil(log2(x)) of a real ``x`` as CPU computes it, its log2 rounded to ``x``'s precision:
    exact at powers of two (XLA's log2 is not), float32's rounded from float64."""
    mantissa, exponent = jnp.frexp(x)
    log2 = (jnp.log2(x.astype(jnp.float64)).astype(jnp.float32) if x.dtype == jnp.float32
            else jnp.log2(x))
    return jnp.where(mantissa == 0.5, (exponent - 1).astype(x.dtype), jnp.ceil(log2))


def _t18_scaled(a, norm, real, theta):
    """Degree 18 of each matrix scaled by 2^-s, squared s times (the module's note)."""
    s = jnp.maximum(_ceil_log2(norm / real(theta)), 0)
    # 2^-s exactly (XLA's exp2 is not exact at integers)
    times = jnp.where(jnp.isfinite(s), s, 0).astype(jnp.int32)
    scale = jnp.where(jnp.isfinite(s), jnp.ldexp(jnp.ones_like(s), -times),
                      jnp.where(s > 0, 0, np.nan).astype(s.dtype))[:, None, None]
    m = _t18(lax.complex(a.real * scale, a.imag * scale) if jnp.iscomplexobj(a) else a * scale,
             real)

    def square(state):
        k, m = state
        return k + 1, jnp.where((k < times)[:, None, None], _mm(m, m), m)
    return lax.while_loop(lambda st: st[0] < jnp.max(times), square, (jnp.int32(0), m))[1]


def _norm1(a):
    """max over columns of the column's sum of |a_ij|, summed down the rows in order."""
    col = jnp.abs(a)
    if a.shape[-1] ** 3 < 400:
        total = col[..., 0, :]
        for i in range(1, a.shape[-2]):
            total = total + col[..., i, :]
        return jnp.max(total, axis=-1)
    return jnp.max(jnp.sum(col, axis=-2), axis=-1)


def _mexp(a):
    shape = a.shape
    a = a.reshape((-1,) + shape[-2:])
    if a.shape[0] == 0:
        return a.reshape(shape)
    real = jnp.finfo(a.dtype).dtype.type
    theta = [real(t) for t in _THETAS[np.dtype(real).itemsize]]
    norm = _norm1(a)
    if a.shape[0] > 1:
        return _t18_scaled(a, norm, real, theta[5]).reshape(shape)
    n = norm[0]
    degree = sum((n > t).astype(jnp.int32) for t in theta[:4])
    branch = jnp.where(jnp.isnan(n), 6, jnp.where(n >= theta[4], 5, degree))
    branches = [lambda m, f=f: f(m, real) for f in (_t1, _t2, _t4, _t8, _t12)]
    branches += [lambda m: _t18_scaled(m, norm, real, theta[5]),
                 lambda m: jnp.full_like(m, np.nan)]
    return lax.switch(branch, branches, a).reshape(shape)


@op("linalg_matrix_exp.default")
def linalg_matrix_exp(a):
    n = a.shape[-1]
    if n == 0:
        return a
    if a.dtype in HALF:
        return linalg_matrix_exp(a.astype(jnp.float32)).astype(a.dtype)
    if n == 1:
        return jnp.exp(a)
    return _mexp(a)
