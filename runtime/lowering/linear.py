"""``aten.linear`` and ``aten.linear_backward``: a linear layer as one op each way (the ops
``deferfuse/linear.py`` sends here instead of linear's composite of views, ``t`` and ``addmm``).

Rounding follows CPU's composite: for 2-D and 3-D inputs it is one ``addmm`` (product and bias
summed before the one rounding to half precision), for other ranks a ``matmul`` rounded and then
the bias added.
"""
from __future__ import annotations

import jax.numpy as jnp

from . import op
from .linalg import _LOWP, _mat


@op("linear.default")
def linear(x, w, b=None):
    y = _mat(x, w, "...i,oi->...o")
    if b is None:
        return y
    if x.dtype in _LOWP and x.ndim not in (2, 3):
        y = y.astype(x.dtype)
    return y + b


@op("linear_backward.default")
def linear_backward(x, g, w, mask):
    """(input grad, weight grad, bias grad), each where ``mask`` asks for it; the weight and bias
    gradients come together (as the meta kernel gives them)."""
    gx = _mat(g, w, "...o,oi->...i") if mask[0] else None
    gw = gb = None
    if mask[1] or mask[2]:
        g2 = g.reshape(-1, g.shape[-1])
        gw = _mat(g2, x.reshape(-1, x.shape[-1]), "no,ni->oi")
        gb = jnp.sum(g2, 0, dtype=jnp.float32 if g.dtype in _LOWP else None)
    return gx, gw, gb
