"""_foreach_* ops (the optimizers' and clip_grad_norm_'s default paths).

The functional overloads (lists in, list out) are lowered; their in-place forms (``_foreach_add_``)
are derived by the runtime. Each element is computed as PyTorch's per-tensor op would: half types
in float32 (PyTorch's opmath), formulas in PyTorch's operation order (addcmul, addcdiv, lerp).
Scalar lists (``Scalar[]``) may hold Python numbers or traced values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import op
from .binary import _plus
from .padding import Refuse

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("a list op over many tensors: no padding rule")


def _up(x):
    """PyTorch's opmath type: half types compute in float32."""
    x = jnp.asarray(x)
    return x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x


def _f(x):
    """Floating view of an integer/bool input, for ops PyTorch computes in float."""
    x = _up(x)
    return x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)


def _is_one(a):
    return isinstance(a, (int, float)) and a == 1


# --------------------------------------------------------------------------------------------
# unary

def _unary(fn, floating):
    def lower(xs):
        return [fn(_f(x) if floating else _up(x)) for x in xs]
    return lower


def _frac(x):
    return x - jnp.trunc(x)


def _round(x):
    return jnp.round(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x


_UNARY = {
    "abs": (jnp.abs, False), "neg": (jnp.negative, False), "sign": (jnp.sign, False),
    "ceil": (jnp.ceil, False), "floor": (jnp.floor, False), "round": (_round, False),
    "trunc": (jnp.trunc, False), "frac": (_frac, False),
    "sqrt": (jnp.sqrt, True), "rsqrt": (lax.rsqrt, True), "exp": (jnp.exp, True),
    "expm1": (jnp.expm1, True), "log": (jnp.log, True), "log1p": (jnp.log1p, True),
    "log2": (jnp.log2, True), "log10": (jnp.log10, True), "reciprocal": (lambda x: 1 / x, True),
    "sigmoid": (jax.nn.sigmoid, True), "sin": (jnp.sin, True), "cos": (jnp.cos, True),
    "tan": (jnp.tan, True), "asin": (jnp.arcsin, True), "acos": (jnp.arccos, True),
    "atan": (jnp.arctan, True), "sinh": (jnp.sinh, True), "cosh": (jnp.cosh, True),
    "tanh": (jnp.tanh, True), "erf": (lax.erf, True), "erfc": (lax.erfc, True),
    "lgamma": (lax.lgamma, True),
}
for _name, (_fn, _fl) in _UNARY.items():
    op(f"_foreach_{_name}.default")(_unary(_fn, _fl))


@op("_foreach_clone.default")
def _foreach_clone(xs, *, memory_format=None):
    return list(xs)


@op("_foreach_copy.default")
def _foreach_copy(xs, srcs, non_blocking=False):
    return [jnp.broadcast_to(s, x.shape).astype(x.dtype) for x, s in zip(xs, srcs)]


@op("_foreach_zero_.default")
def _foreach_zero_(xs):
    return [jnp.zeros((), jnp.float32) if x is None else jnp.zeros_like(x) for x in xs]


# --------------------------------------------------------------------------------------------
# binary: List (tensor lists), Scalar, ScalarList, Tensor (one tensor for all)

def _add(x, y, alpha=1):
    if x.dtype == jnp.bool_ and jnp.asarray(y).dtype == jnp.bool_ and _is_one(alpha):
        return jnp.logical_or(x, y)
    if _is_one(alpha) and _number(x, y):     # NOTE [signed zero addends] (binary.py)
        return _plus(_up(x), x, jnp.asarray(y, _up(x).dtype), y)
    return _up(x) + (_up(y) if _is_one(alpha) else alpha * _up(y))


def _sub(x, y, alpha=1):
    if _is_one(alpha) and _number(x, y):
        return _plus(_up(x), x, jnp.asarray(y, _up(x).dtype), y, neg=True)
    return _up(x) - (_up(y) if _is_one(alpha) else alpha * _up(y))


def _number(x, y) -> bool:
    """``y`` is a Python number added to a floating or complex ``x``."""
    return (isinstance(y, (int, float, complex)) and not isinstance(y, bool)
            and jnp.issubdtype(x.dtype, jnp.complexfloating if isinstance(y, complex)
                               else jnp.inexact))


def _mul(x, y):
    if x.dtype == jnp.bool_ and jnp.asarray(y).dtype == jnp.bool_:
        return jnp.logical_and(x, y)
    return _up(x) * _up(y)


def _div(x, y):
    return jnp.true_divide(_f(x), _up(y))


def _maximum(x, y):
    return jnp.maximum(_up(x), _up(y))


def _minimum(x, y):
    return jnp.minimum(_up(x), _up(y))


def _pow(x, y):
    return jnp.power(_up(x), _up(y))


def _binary(fn):
    def lower_list(xs, ys, **kw):
        return [fn(x, y, **kw) for x, y in zip(xs, ys)]

    def lower_scalar(xs, s, **kw):
        return [fn(x, s, **kw) for x in xs]

    def lower_scalars(xs, ss, **kw):
        return [fn(x, s, **kw) for x, s in zip(xs, ss)]

    return lower_list, lower_scalar, lower_scalars


for _name, _fn in (("add", _add), ("sub", _sub), ("mul", _mul), ("div", _div),
                   ("maximum", _maximum), ("minimum", _minimum), ("clamp_min", _maximum),
                   ("clamp_max", _minimum), ("pow", _pow)):
    _l, _s, _sl = _binary(_fn)
    op(f"_foreach_{_name}.List")(_l)
    op(f"_foreach_{_name}.Scalar", *([f"_foreach_{_name}.Tensor"] if _name in ("add", "mul", "div")
                                      else []))(_s)
    op(f"_foreach_{_name}.ScalarList")(_sl)


@op("_foreach_pow.ScalarAndTensor")
def _foreach_pow_scalar_and_tensor(s, xs):
    return [jnp.power(s, _up(x)) for x in xs]


# --------------------------------------------------------------------------------------------
# ternary

def _addcmul(x, a, b, v):
    if _is_one(v):
        return _up(x) + _up(a) * _up(b)
    return _up(x) + v * _up(a) * _up(b)


def _addcdiv(x, a, b, v):
    if _is_one(v):
        return _up(x) + _f(a) / _up(b)
    return _up(x) + v * _f(a) / _up(b)


def _ternary(fn, name):
    def scalar(xs, t1, t2, value=1):
        return [fn(x, a, b, value) for x, a, b in zip(xs, t1, t2)]

    def scalars(xs, t1, t2, values):
        return [fn(x, a, b, v) for x, a, b, v in zip(xs, t1, t2, values)]

    def tensor(xs, t1, t2, values):
        return [fn(x, a, b, values[i]) for i, (x, a, b) in enumerate(zip(xs, t1, t2))]

    op(f"_foreach_{name}.Scalar")(scalar)
    op(f"_foreach_{name}.ScalarList")(scalars)
    op(f"_foreach_{name}.Tensor")(tensor)


_ternary(_addcmul, "addcmul")
_ternary(_addcdiv, "addcdiv")


def _lerp(x, e, w):
    """PyTorch's lerp: from the start for |w| < 0.5, from the end otherwise."""
    x, e, w = _up(x), _up(e), _up(w)
    d = e - x
    return jnp.where(jnp.abs(w) < 0.5, x + w * d, e - d * (1 - w))


@op("_foreach_lerp.List")
def _foreach_lerp_list(xs, es, ws):
    return [_lerp(x, e, w) for x, e, w in zip(xs, es, ws)]


@op("_foreach_lerp.Scalar")
def _foreach_lerp_scalar(xs, es, w):
    return [_lerp(x, e, w) for x, e in zip(xs, es)]


@op("_foreach_lerp.ScalarList")
def _foreach_lerp_scalars(xs, es, ws):
    return [_lerp(x, e, w) for x, e, w in zip(xs, es, ws)]


# --------------------------------------------------------------------------------------------
# reductions (one 0-d tensor per input)

def _acc(x, dtype):
    """x in the accumulation type: ``dtype`` when given, else float32 for half types."""
    if dtype is not None:
        from ..dtypes import to_np_dtype
        return x.astype(to_np_dtype(dtype))
    return _f(x)


def _norm(x, ord, dtype=None):
    a = jnp.abs(_acc(x, dtype))
    if ord == float("inf"):
        return jnp.max(a) if a.size else jnp.zeros((), a.dtype)
    if ord == float("-inf"):
        return jnp.min(a)
    if ord == 0:
        return jnp.sum((a != 0).astype(a.dtype))
    if ord == 1:
        return jnp.sum(a)
    if ord == 2:
        return jnp.sqrt(jnp.sum(a * a))
    return jnp.power(jnp.sum(jnp.power(a, ord)), 1.0 / ord)


@op("_foreach_norm.Scalar", static=True)
def _foreach_norm(xs, ord=2, dtype=None):
    return [_norm(x, ord, dtype) for x in xs]


@op("_foreach_powsum.Scalar", static=True)
def _foreach_powsum(xs, ord=2, dtype=None):
    out = []
    for x in xs:
        a = jnp.abs(_acc(x, dtype))
        if ord == 0:
            out.append(jnp.sum((a != 0).astype(a.dtype)))
        elif ord == 1:
            out.append(jnp.sum(a))
        elif ord == 2:
            out.append(jnp.sum(a * a))
        else:
            out.append(jnp.sum(jnp.power(a, ord)))
    return out


@op("_foreach_max.default")
def _foreach_max(xs):
    return [jnp.max(x) for x in xs]


@op("_foreach_mm.default")
def _foreach_mm(xs, ys):
    return [jnp.matmul(x, y) for x, y in zip(xs, ys)]
