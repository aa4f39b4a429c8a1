"""Half-precision arithmetic where PyTorch's CPU kernels round it.

PyTorch's CPU kernels compute bfloat16 and float16 in float32 ("opmath") and round to the tensor's
dtype where each kernel says: once at the end for most ops, after a step for others (a statistic
stored in a half-precision tensor, a per-batch ``addmm_``, ``c10::Half`` arithmetic). XLA's CPU
backend fuses elementwise chains and may keep intermediates in float32 or contract ``a * b + c``
into one FMA, so a lowering cannot rely on the dtype of its intermediates to round them: it
computes in float32 (``acc``) and calls ``round_to`` where CPU rounds. ``lax.reduce_precision`` is
an HLO op of its own, which XLA keeps (a float16 -> float32 convert pair it may fold away).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_F16_MIN_NORMAL = 2.0 ** -14


def is_half(dtype) -> bool:
    """bfloat16 or float16."""
    return jnp.dtype(dtype) in HALF


def acc(x):
    """``x`` in float32 when it is bfloat16 or float16 (PyTorch's opmath type), else itself."""
    return x.astype(jnp.float32) if x.dtype in HALF else x


def dot_inputs(*xs):
    """The operands of a half-precision product accumulated in float32
    (``preferred_element_type=float32``), as the dot is to see them. NOTE [half dots on CPU]: XLA's
    CPU compiler decides early that such a dot runs in its YNNPACK fusion (the only CPU kernel for
    bfloat16 x bfloat16 = float32), and may later fold a transpose into the dot through a select
    (``where(mask, x.transpose(1, 2), 0) @ y``, a bucket's masked operand), which the fusion then
    refuses: the plain dot kernel raises "Unsupported element type for DotThunk::Execute: BF16 x
    BF16 = F32" when the program runs. On the CPU platform the operands pass an optimization
    barrier, which nothing is folded through; the product is the same, and a transposed operand
    then reaches the YNNPACK kernel instead of a float32 one (not slower where measured)."""
    if not any(x.dtype in HALF for x in xs):
        return xs
    from ..platform import name
    return tuple(lax.optimization_barrier(tuple(xs))) if name() == "cpu" else xs


def round_to(x, dtype):
    """``x`` (float32) rounded to the nearest ``dtype`` value, kept in float32; a no-op unless
    ``dtype`` is bfloat16 or float16. Subnormal float16 values are kept (``reduce_precision``
    alone flushes them to zero)."""
    dtype = jnp.dtype(dtype)
    if dtype == HALF[0]:
        return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
    if dtype == HALF[1]:
        normal = lax.reduce_precision(x, exponent_bits=5, mantissa_bits=10)
        # Below the smallest normal, float16 values are the multiples of 2^-24 (exact in float32).
        sub = jnp.round(x * 2.0 ** 24) * 2.0 ** -24
        return jnp.where(jnp.abs(x) < _F16_MIN_NORMAL, sub, normal)
    return x
