"""Matrix products."""
from __future__ import annotations

import jax.numpy as jnp

from . import op


@op("mm.default", "bmm.default", "matmul.default")
def mm(a, b):
    return jnp.matmul(a, b)


@op("addmm.default")
def addmm(bias, a, b, *, beta=1, alpha=1):
    out = jnp.matmul(a, b)
    if not (isinstance(alpha, (int, float)) and alpha == 1):
        out = out * alpha
    if isinstance(beta, (int, float)) and beta == 0:
        return out
    if not (isinstance(beta, (int, float)) and beta == 1):
        bias = bias * beta
    return out + bias
