"""Elementwise ops. Outputs are cast to PyTorch's dtype by the caller (runtime/node.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import op


def _f(x):
    """Floating view of an integer/bool input, for ops PyTorch computes in float."""
    return x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)


@op("add.Tensor", "add.Scalar")
def add(x, y, alpha=1):
    if not (isinstance(alpha, (int, float)) and alpha == 1):
        y = y * alpha
    if getattr(x, "dtype", None) == jnp.bool_ and getattr(y, "dtype", None) == jnp.bool_:
        return jnp.logical_or(x, y)
    return jnp.add(x, y)


@op("sub.Tensor", "sub.Scalar", "rsub.Tensor", "rsub.Scalar")
def sub(x, y, alpha=1):
    if not (isinstance(alpha, (int, float)) and alpha == 1):
        y = y * alpha
    return jnp.subtract(x, y)


def _rsub(x, y, alpha=1):
    return sub(y, x, alpha)


from . import LOWERINGS, aten, Lowering  # noqa: E402
for _o in (aten.rsub.Tensor, aten.rsub.Scalar):
    LOWERINGS[_o] = Lowering(_rsub)


@op("mul.Tensor", "mul.Scalar")
def mul(x, y):
    if getattr(x, "dtype", None) == jnp.bool_ and getattr(y, "dtype", None) == jnp.bool_:
        return jnp.logical_and(x, y)
    return jnp.multiply(x, y)


@op("div.Tensor", "div.Scalar")
def div(x, y):
    return jnp.true_divide(x, y)


@op("div.Tensor_mode", "div.Scalar_mode")
def div_mode(x, y, rounding_mode=None):
    if rounding_mode is None:
        return jnp.true_divide(x, y)
    xa, ya = jnp.asarray(x), jnp.asarray(y)
    if jnp.issubdtype(jnp.result_type(xa, ya), jnp.integer):
        if rounding_mode == "floor":
            return jnp.floor_divide(x, y)
        q = lax.div(*jnp.broadcast_arrays(*[a.astype(jnp.result_type(xa, ya)) for a in (xa, ya)]))
        return q
    q = jnp.true_divide(x, y)
    return jnp.floor(q) if rounding_mode == "floor" else jnp.trunc(q)


@op("neg.default")
def neg(x):
    return jnp.negative(x)


@op("abs.default")
def abs_(x):
    return jnp.abs(x)


@op("exp.default")
def exp(x):
    return jnp.exp(_f(x))


@op("log.default")
def log(x):
    return jnp.log(_f(x))


@op("sqrt.default")
def sqrt(x):
    return jnp.sqrt(_f(x))


@op("rsqrt.default")
def rsqrt(x):
    return lax.rsqrt(_f(x))


@op("sin.default")
def sin(x):
    return jnp.sin(_f(x))


@op("cos.default")
def cos(x):
    return jnp.cos(_f(x))


@op("tanh.default")
def tanh(x):
    return jnp.tanh(_f(x))


@op("sigmoid.default")
def sigmoid(x):
    return jax.nn.sigmoid(_f(x))


@op("relu.default")
def relu(x):
    return jnp.maximum(x, jnp.zeros((), x.dtype))


@op("pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar")
def pow_(x, y):
    if isinstance(y, (int, float)) and y == 2:
        return x * x
    if isinstance(y, (int, float)) and y == 0.5:
        return jnp.sqrt(_f(x))
    return jnp.power(x, y)


@op("where.self")
def where(c, x, y):
    return jnp.where(c, x, y)


@op("eq.Tensor", "eq.Scalar")
def eq(x, y):
    return jnp.equal(x, y)


@op("ne.Tensor", "ne.Scalar")
def ne(x, y):
    return jnp.not_equal(x, y)


@op("lt.Tensor", "lt.Scalar")
def lt(x, y):
    return jnp.less(x, y)


@op("le.Tensor", "le.Scalar")
def le(x, y):
    return jnp.less_equal(x, y)


@op("gt.Tensor", "gt.Scalar")
def gt(x, y):
    return jnp.greater(x, y)


@op("ge.Tensor", "ge.Scalar")
def ge(x, y):
    return jnp.greater_equal(x, y)


@op("maximum.default")
def maximum(x, y):
    return jnp.maximum(x, y)


@op("minimum.default")
def minimum(x, y):
    return jnp.minimum(x, y)


@op("clamp.default", "clamp.Tensor")
def clamp(x, min=None, max=None):
    if min is not None:
        x = jnp.maximum(x, jnp.asarray(min, x.dtype) if not hasattr(min, "dtype") else min)
    if max is not None:
        x = jnp.minimum(x, jnp.asarray(max, x.dtype) if not hasattr(max, "dtype") else max)
    return x


@op("logical_not.default")
def logical_not(x):
    return jnp.logical_not(x)


@op("reciprocal.default")
def reciprocal(x):
    return 1.0 / _f(x)
