"""The ``prims.*`` elementwise ops that PyTorch's decompositions land in, mapped onto the aten
lowerings of pointwise.py, unary_int.py, binary.py and power.py: their inputs already share one
dtype.

Apart from binary.py because it registers no lowering of its own: it is a table from prims ops to
lowerings other modules define (found in ``LOWERINGS`` once those are registered), so it is
imported after them (``FAMILIES`` in __init__.py).
"""
from __future__ import annotations

import jax.numpy as jnp
import torch

from . import LOWERINGS, Lowering
from .binary import (_bitwise, _compare, _shift_left, _shift_right, add, atan2, div, fmax, fmin,
                     fmod, gcd, hypot, igamma, igammac, maximum, minimum, mul, nextafter, remainder,
                     sub, where, zeta)
from .padding import Refuse
from .pointwise import _BOOL, _cast, _int_like, _isint, _rt, _tdiv, _uf, frexp
from .power import pow_
from .unary_int import abs_, bitwise_not, conj_physical, isfinite, neg, round_, sign, signbit

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py): binary.py's
PAD = Refuse("not tagged pointwise by PyTorch (a prims op, a Scalar overload)")


def _prims_div(x, y):
    ct = _rt(x, y)
    if ct == _BOOL or _isint(ct):
        ct = _int_like(ct)
        return _tdiv(_cast(x, ct), _cast(y, ct))
    return div(x, y)


def _prims_where(c, x, y):
    return where(c, x, y)


def _unary_low(name):
    return LOWERINGS[getattr(torch.ops.aten, name).default].fn


_PRIMS = {
    "abs": abs_, "neg": neg, "sign": sign, "signbit": signbit, "floor": _unary_low("floor"),
    "ceil": _unary_low("ceil"), "trunc": _unary_low("trunc"), "round": round_,
    "bitwise_not": bitwise_not, "isfinite": isfinite, "conj_physical": conj_physical,
    "reciprocal": _unary_low("reciprocal"), "digamma": _unary_low("digamma"),
    "exp": _unary_low("exp"), "exp2": _unary_low("exp2"), "expm1": _unary_low("expm1"),
    "log": _unary_low("log"), "log2": _unary_low("log2"), "log10": _unary_low("log10"),
    "log1p": _unary_low("log1p"), "sqrt": _unary_low("sqrt"), "rsqrt": _unary_low("rsqrt"),
    "sin": _unary_low("sin"), "cos": _unary_low("cos"), "tan": _unary_low("tan"),
    "asin": _unary_low("asin"), "acos": _unary_low("acos"), "atan": _unary_low("atan"),
    "sinh": _unary_low("sinh"), "cosh": _unary_low("cosh"), "tanh": _unary_low("tanh"),
    "asinh": _unary_low("asinh"), "acosh": _unary_low("acosh"), "atanh": _unary_low("atanh"),
    "erf": _unary_low("erf"), "erfc": _unary_low("erfc"), "erf_inv": _unary_low("erfinv"),
    "lgamma": _unary_low("lgamma"), "bessel_i0": _unary_low("i0"),
    "bessel_i0e": _unary_low("special_i0e"), "bessel_i1": _unary_low("special_i1"),
    "bessel_i1e": _unary_low("special_i1e"), "ndtri": _unary_low("special_ndtri"),
    "erfcx": _unary_low("special_erfcx"),
    "spherical_bessel_j0": _unary_low("special_spherical_bessel_j0"),
    "cbrt": lambda x: jnp.cbrt(_uf(x)),
    "frexp": frexp,
    "add": add, "sub": sub, "mul": mul, "div": _prims_div, "remainder": remainder, "fmod": fmod,
    "pow": pow_, "atan2": atan2, "hypot": hypot, "maximum": maximum, "minimum": minimum,
    "fmax": fmax, "fmin": fmin, "nextafter": nextafter, "gcd": gcd, "zeta": zeta,
    "igamma": igamma, "igammac": igammac,
    "bitwise_and": _bitwise(jnp.bitwise_and), "bitwise_or": _bitwise(jnp.bitwise_or),
    "bitwise_xor": _bitwise(jnp.bitwise_xor), "shift_left": _bitwise(_shift_left),
    "shift_right_arithmetic": _bitwise(_shift_right),
    "eq": _compare(jnp.equal), "ne": _compare(jnp.not_equal), "lt": _compare(jnp.less),
    "le": _compare(jnp.less_equal), "gt": _compare(jnp.greater), "ge": _compare(jnp.greater_equal),
    "where": _prims_where,
}
for _name, _fn in _PRIMS.items():
    _p = getattr(torch.ops.prims, _name, None)
    _o = getattr(_p, "default", None) if _p is not None else None
    if _o is not None and _o not in LOWERINGS:
        LOWERINGS[_o] = Lowering(_fn)
