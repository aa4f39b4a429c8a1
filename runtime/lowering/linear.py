"""``aten.linear`` and ``aten.linear_backward``: a linear layer as one op each way (the ops
``deferfuse/linear.py`` sends here instead of linear's composite of views, ``t`` and ``addmm``).

Rounding follows CPU's composite, which is one ``addmm`` (product and bias summed before the one
rounding to half precision) for a 2-D or a contiguous input; the inputs it computes as a rounded
``matmul`` and then adds the bias to never reach this op (see ``deferfuse/linear.py``).
"""
from __future__ import annotations

import jax.numpy as jnp

from . import op
from .padding import Contract, ZeroPadded
from .linalg import _LOWP, _mat


@op("linear.default", pad=Contract(((0, -1), (1, 1))))
def linear(x, w, b=None):
    # Half precision rounds once, after the bias, as CPU's addmm does. The inputs CPU rounds twice
    # for (product, then bias: a non-contiguous input of rank other than 2) never come here:
    # deferfuse/linear.py sends them through PyTorch's composite (matmul, then add).
    y = _mat(x, w, "...i,oi->...o")
    return y if b is None else y + b


# Padded: every sum over a padded dim (rows for the weight and bias gradients, outputs for the
# input gradient) has a factor zeroed in its padding: x and g for the rows, g and w for the
# outputs; an input gradient's padded rows are padding.
@op("linear_backward.default", pad=ZeroPadded(inputs=(0, 1, 2)))
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
