"""Matrix products (mm, bmm, addmm and their family, dot, trace, cross). Factorizations, solves and
determinants are in ``factorizations.py``.

Half-precision products accumulate in float32 and round once, beta * self + alpha * product
included (as PyTorch's CPU kernels do; ``addbmm`` rounds after each batch, as CPU's loop of
``addmm_`` does); float32 keeps XLA's default precision.
"""
from __future__ import annotations

import jax.numpy as jnp

from . import op
from .padding import Contract, Refuse
from .precision import acc, dot_inputs, round_to

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("a product with no rule for its contracted dims")

_LOWP = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _is(v, c) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == c


def _mat(a, b, spec=None):
    """a @ b (or an einsum), half precision accumulated in float32."""
    kw = {}
    if a.dtype in _LOWP:
        kw["preferred_element_type"] = jnp.float32
        a, b = dot_inputs(a, b)       # NOTE [half dots on CPU]
    if spec is not None:
        return jnp.einsum(spec, a, b, **kw)
    return jnp.matmul(a, b, **kw)


def _scalar(s, dt):
    """``s`` converted as PyTorch's kernel converts it (``Scalar.to<T>()``): integers truncate."""
    if isinstance(s, bool) or jnp.issubdtype(dt, jnp.inexact) and isinstance(s, (int, float)):
        return s
    if isinstance(s, (int, float)):
        return int(s) if jnp.issubdtype(dt, jnp.integer) else s
    return s.astype(dt)


def _axpby(bias, prod, beta, alpha, dt=None):
    """beta * bias + alpha * prod; beta == 0 ignores bias (NaN included), as PyTorch does.
    ``dt``: the dtype alpha and beta are converted to first (integers: always theirs)."""
    if prod.dtype == jnp.bool_:
        out = prod if alpha is True or _is(alpha, 1) else prod & bool(alpha)
        return out if not beta else out | bias
    if dt is None and jnp.issubdtype(bias.dtype, jnp.integer):
        dt = bias.dtype
    if dt is not None:
        alpha, beta = _scalar(alpha, dt), _scalar(beta, dt)
    if prod.dtype == jnp.float32:
        bias = acc(bias)        # a half-precision product: beta * self in float32 too
    if not _is(alpha, 1):
        prod = prod * alpha
    if _is(beta, 0) or beta is False:
        return prod
    if not _is(beta, 1):
        bias = bias * beta
    return prod + bias


def _bmat(a, b, spec):
    if a.dtype == jnp.bool_:
        return jnp.einsum(spec, a.astype(jnp.int32), b.astype(jnp.int32)) != 0
    return _mat(a, b, spec)


@op("mm.default", "bmm.default", "matmul.default",
    pad={"mm.default": Contract(((0, 1), (1, 0))), "bmm.default": Contract(((0, 2), (1, 1)))})
def mm(a, b):
    if a.dtype == jnp.bool_:
        return jnp.matmul(a.astype(jnp.int32), b.astype(jnp.int32)) != 0
    return _mat(a, b)


@op("mm.dtype", "bmm.dtype")
def mm_dtype(a, b, out_dtype):
    a, b = dot_inputs(a, b)     # NOTE [half dots on CPU]
    return jnp.matmul(a, b, preferred_element_type=jnp.float32 if a.dtype in _LOWP else None)


@op("addmm.default", pad=Contract(((1, 1), (2, 0))))
def addmm(bias, a, b, *, beta=1, alpha=1):
    return _axpby(bias, _bmat(a, b, "ij,jk->ik"), beta, alpha)


@op("addmm.dtype")
def addmm_dtype(bias, a, b, out_dtype, *, beta=1, alpha=1):
    return _axpby(bias, _mat(a, b), beta, alpha)


@op("addmv.default")
def addmv(bias, a, v, *, beta=1, alpha=1):
    return _axpby(bias, _bmat(a, v, "ij,j->i"), beta, alpha)


@op("addbmm.default")
def addbmm(bias, a, b, *, beta=1, alpha=1):
    if a.dtype not in _LOWP or a.shape[0] == 0:
        return _axpby(bias, _bmat(a, b, "bij,bjk->ik"), beta, alpha)
    # CPU adds one batch at a time (``addmm_`` per batch), rounding the sum after each.
    prods = _mat(a, b, "bij,bjk->bik")
    out = round_to(_axpby(bias, prods[0], beta, alpha), a.dtype)
    for k in range(1, a.shape[0]):
        out = round_to(_axpby(out, prods[k], 1, alpha), a.dtype)
    return out


@op("baddbmm.default", pad=Contract(((1, 2), (2, 1))))
def baddbmm(bias, a, b, *, beta=1, alpha=1):
    return _axpby(bias, _bmat(a, b, "bij,bjk->bik"), beta, alpha)


@op("baddbmm.dtype")
def baddbmm_dtype(bias, a, b, out_dtype, *, beta=1, alpha=1):
    return _axpby(bias, _mat(a, b), beta, alpha)


@op("addr.default")
def addr(bias, u, v, *, beta=1, alpha=1):
    # PyTorch's addr kernel is pointwise in the tensors' dtype, alpha and beta converted to it.
    if u.dtype == jnp.bool_:
        return _axpby(bias, u[:, None] & v[None, :], beta, alpha)
    dt = jnp.result_type(bias, u, v)
    if dt in _LOWP:
        # Each product and sum rounds to the dtype, and so do alpha and beta (c10::Half and
        # c10::BFloat16 arithmetic in CPU's kernel).
        r = lambda x: round_to(x, dt)   # noqa: E731
        prod = r(r(r(jnp.float32(alpha)) * acc(u)[:, None]) * acc(v)[None, :])
        if _is(beta, 0) or beta is False:
            return prod
        return r(r(r(jnp.float32(beta)) * acc(bias)) + prod)
    alpha, beta = _scalar(alpha, dt), _scalar(beta, dt)
    prod = u[:, None] if _is(alpha, 1) else alpha * u[:, None]
    return _axpby(bias, prod * v[None, :], beta, 1)


@op("mv.default", pad=Contract(((0, 1), (1, 0))))
def mv(a, v):
    return _bmat(a, v, "ij,j->i")


@op("dot.default", pad=Contract(((0, 0), (1, 0))))
def dot(a, b):
    return _bmat(a, b, "i,i->")


@op("vdot.default")
def vdot(a, b):
    return _mat(jnp.conj(a), b, "i,i->")


@op("trace.default")
def trace(x):
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.astype(jnp.int64)
    elif x.dtype in _LOWP:
        x = x.astype(jnp.float32)
    return jnp.trace(x)


@op("linalg_cross.default")
def linalg_cross(a, b, *, dim=-1):
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    a, b = jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)
    dt = jnp.result_type(a, b)
    if dt in _LOWP:
        # CPU's kernel rounds each product, then the difference (half-precision arithmetic).
        d = dim % len(shape)
        a, b = jnp.moveaxis(acc(a), d, 0), jnp.moveaxis(acc(b), d, 0)
        r = lambda x: round_to(x, dt)   # noqa: E731
        out = jnp.stack([r(r(a[(i + 1) % 3] * b[(i + 2) % 3]) - r(a[(i + 2) % 3] * b[(i + 1) % 3]))
                         for i in range(3)])
        return jnp.moveaxis(out, 0, d)
    return jnp.cross(a, b, axis=dim % len(shape))
