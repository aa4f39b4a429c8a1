"""Unary elementwise ops that keep integer dtypes (neg, abs, sign, rounding, the is* tests,
bitwise and logical not ...), with the dtype helpers of pointwise.py."""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from . import op
from .padding import Refuse
from .pointwise import _BOOL, _cast, _integral_only, _iscomplex, _isfloat, _isinexact, _nz, _uf

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("not tagged pointwise by PyTorch (a prims op)")


@op("neg.default")
def neg(x):
    return jnp.negative(x)


@op("abs.default")
def abs_(x):
    if x.dtype == _BOOL:
        return x
    return jnp.abs(x)


@op("sign.default")
def sign(x):
    if x.dtype == _BOOL:
        return x
    if _isfloat(x.dtype):
        return jnp.where(jnp.isnan(x), jnp.zeros_like(x), jnp.sign(x))
    return jnp.sign(x)


@op("sgn.default")
def sgn(x):
    if _iscomplex(x.dtype):
        a = jnp.abs(x)
        return jnp.where(a == 0, jnp.zeros_like(x), x / jnp.where(a == 0, 1, a).astype(x.dtype))
    return sign(x)


def _int_identity(f):
    def low(x):
        return x if not _isinexact(x.dtype) else f(x)
    low.__name__ = f.__name__
    return low


op("floor.default")(_int_identity(jnp.floor))
op("ceil.default")(_int_identity(jnp.ceil))
op("trunc.default", "fix.default")(_int_identity(jnp.trunc))


@op("round.default")
def round_(x):
    return x if not _isinexact(x.dtype) else jnp.round(x)


@op("round.decimals")
def round_decimals(x, *, decimals=0):
    if not _isinexact(x.dtype):
        return x
    if decimals == 0:
        return jnp.round(x)
    x = _uf(x)
    if decimals > 0:
        p = jnp.asarray(10.0 ** decimals, x.dtype)
        return jnp.round(x * p) / p
    p = jnp.asarray(10.0 ** -decimals, x.dtype)
    return jnp.round(x / p) * p


@op("frac.default")
def frac(x):
    return x - jnp.trunc(x)


@op("nan_to_num.default")
def nan_to_num(x, nan=None, posinf=None, neginf=None):
    if not _isinexact(x.dtype):
        return x
    if _iscomplex(x.dtype):
        return lax.complex(nan_to_num(jnp.real(x), nan, posinf, neginf),
                           nan_to_num(jnp.imag(x), nan, posinf, neginf))
    fi = jnp.finfo(x.dtype)
    nan = jnp.zeros((), x.dtype) if nan is None else _cast(nan, x.dtype)
    posinf = jnp.asarray(fi.max, x.dtype) if posinf is None else _cast(posinf, x.dtype)
    neginf = jnp.asarray(fi.min, x.dtype) if neginf is None else _cast(neginf, x.dtype)
    return jnp.where(jnp.isnan(x), nan, jnp.where(x == jnp.inf, posinf, jnp.where(x == -jnp.inf, neginf, x)))


def _false(x):
    return jnp.zeros(x.shape, _BOOL)


@op("isnan.default")
def isnan(x):
    return jnp.isnan(x) if _isinexact(x.dtype) else _false(x)


@op("isinf.default")
def isinf(x):
    return jnp.isinf(x) if _isinexact(x.dtype) else _false(x)


@op("isfinite.default")
def isfinite(x):
    return jnp.isfinite(x) if _isinexact(x.dtype) else jnp.ones(x.shape, _BOOL)


@op("isposinf.default")
def isposinf(x):
    return x == jnp.inf if _isfloat(x.dtype) else _false(x)


@op("isneginf.default")
def isneginf(x):
    return x == -jnp.inf if _isfloat(x.dtype) else _false(x)


@op("signbit.default")
def signbit(x):
    if _isfloat(x.dtype):
        return jnp.signbit(x)
    if x.dtype == _BOOL or not jnp.issubdtype(x.dtype, jnp.signedinteger):
        return _false(x)
    return x < 0


@op("angle.default")
def angle(x):
    if _iscomplex(x.dtype):
        return jnp.angle(x)
    x = _uf(x)
    a = jnp.where(x < 0, jnp.asarray(math.pi, x.dtype), jnp.zeros((), x.dtype))
    return jnp.where(jnp.isnan(x), x, a)


@op("conj_physical.default", "_conj_physical.default")
def conj_physical(x):
    return jnp.conj(x) if _iscomplex(x.dtype) else x


@op("bitwise_not.default")
def bitwise_not(x):
    _integral_only("bitwise_not", x.dtype)
    return jnp.logical_not(x) if x.dtype == _BOOL else jnp.bitwise_not(x)


@op("logical_not.default")
def logical_not(x):
    return jnp.logical_not(_nz(x))
