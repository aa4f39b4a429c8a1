"""Activations and their backwards, with PyTorch's CPU kernel formulas computed in opmath (float32
for half types). Shared dtype helpers come from pointwise.py.
"""
from __future__ import annotations

import math  # noqa: F401

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax  # noqa: F401

from . import op
from .padding import Pointwise, Refuse
from .precision import acc, round_to
from .pointwise import _cast, _common, _isinexact, _opmath, _rt, _scale  # noqa: F401

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("not tagged pointwise by PyTorch (a backward, a random activation)")


# --------------------------------------------------------------------------------------------
# activations (PyTorch's CPU kernel formulas, computed in opmath)

def _act(x):
    return _cast(x, _opmath(np.dtype(x.dtype))) if _isinexact(x.dtype) else x


@op("relu.default")
def relu(x):
    return jnp.maximum(x, jnp.zeros((), x.dtype))


@op("relu6.default")
def relu6(x):
    return hardtanh(x, 0, 6)


@op("hardtanh.default")
def hardtanh(x, min_val=-1, max_val=1):
    x = _act(x)
    return jnp.minimum(jnp.maximum(x, _cast(min_val, x.dtype)), _cast(max_val, x.dtype))


@op("leaky_relu.default")
def leaky_relu(x, negative_slope=0.01):
    x = _act(x)
    return jnp.where(x > 0, x, x * _cast(negative_slope, x.dtype))


@op("rrelu_with_noise_functional.default", rng=True)
def rrelu_with_noise_functional(x, noise, lower=0.125, upper=1 / 3, training=False,
                                generator=None, *, key):
    """(output, noise) of RReLU. Training: each non-positive element is scaled by a slope drawn
    uniformly from [lower, upper], which noise records (1 for the others); evaluation: the mean
    slope, noise as it was (PyTorch's CPU kernel)."""
    xa = _act(x)
    if not training:
        return leaky_relu(x, (lower + upper) / 2), noise
    r = jax.random.uniform(key, x.shape, xa.dtype) * _cast(upper - lower, xa.dtype) \
        + _cast(lower, xa.dtype)
    neg = xa <= 0
    return jnp.where(neg, xa * r, xa), jnp.where(neg, r, jnp.ones((), xa.dtype))


@op("elu.default")
def elu(x, alpha=1, scale=1, input_scale=1):
    x = _act(x)
    neg = jnp.expm1(_scale(x, input_scale)) * _cast(alpha, x.dtype) * _cast(scale, x.dtype)
    return jnp.where(x <= 0, neg, _scale(x, scale))


@op("selu.default")
def selu(x):
    return elu(x, 1.6732632423543772848170429916717, 1.0507009873554804934193349852946)


@op("celu.default")
def celu(x, alpha=1.0):
    x = _act(x)
    return elu(x, alpha, 1, 1 / _cast(alpha, x.dtype))


@op("gelu.default")
def gelu(x, *, approximate="none"):
    x = _act(x)
    if approximate == "tanh":
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1 + jnp.tanh(inner))
    return x * 0.5 * (1 + lax.erf(x * (1 / math.sqrt(2))))


@op("silu.default")
def silu(x):
    x = _act(x)
    return x / (1 + jnp.exp(-x))


def _softplus(x):
    return jnp.where(x > 20, x, jnp.log1p(jnp.exp(x)))


@op("mish.default")
def mish(x):
    x = _act(x)
    return x * jnp.tanh(jnp.log1p(jnp.exp(x)))


@op("softplus.default")
def softplus(x, beta=1, threshold=20):
    x = _act(x)
    xb = _scale(x, beta)
    return jnp.where(xb > _cast(threshold, x.dtype), x, jnp.log1p(jnp.exp(xb)) / _cast(beta, x.dtype))


@op("hardsigmoid.default")
def hardsigmoid(x):
    x = _act(x)
    return jnp.minimum(jnp.maximum(x + 3, 0), 6) / 6


@op("hardswish.default", pad=Pointwise())
def hardswish(x):
    x = _act(x)
    return x * jnp.minimum(jnp.maximum(x + 3, 0), 6) / 6


@op("hardshrink.default")
def hardshrink(x, lambd=0.5):
    lam = _cast(_cast(lambd, x.dtype), _opmath(np.dtype(x.dtype)))   # PyTorch rounds lambd to x's dtype
    x = _act(x)
    return jnp.where((x >= -lam) & (x <= lam), jnp.zeros_like(x), x)


@op("softshrink.default")
def softshrink(x, lambd=0.5):
    x = _act(x)
    lam = _cast(lambd, x.dtype)
    return jnp.where(x > lam, x - lam, jnp.where(x < -lam, x + lam, x * 0))


@op("threshold.default")
def threshold(x, threshold, value):
    x = _act(x)
    return jnp.where(x <= _cast(threshold, x.dtype), _cast(value, x.dtype), x)


# --------------------------------------------------------------------------------------------
# activation backwards (grad first; same formulas as PyTorch's CPU kernels)

def _gx(g, x):
    _, (g, x) = _common(g, x)
    return g, x


@op("threshold_backward.default")
def threshold_backward(g, x, threshold):
    g, x = _gx(g, x)
    return jnp.where(x <= _cast(threshold, x.dtype), jnp.zeros_like(g), g)


@op("gelu_backward.default")
def gelu_backward(g, x, *, approximate="none"):
    g, x = _gx(g, x)
    if approximate == "tanh":
        beta = math.sqrt(2) * (2 / math.sqrt(math.pi)) * 0.5
        kappa = 0.044715
        x_sq = x * x
        inner = beta * (x + kappa * x_sq * x)
        t = jnp.tanh(inner)
        left = 0.5 * x
        right = 1 + t
        left_d = 0.5 * right
        right_d = left * (1 - t * t) * (beta * (1 + 3 * kappa * x_sq))
        return g * (left_d + right_d)
    cdf = 0.5 * (1 + lax.erf(x * (1 / math.sqrt(2))))
    pdf = jnp.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
    return g * (cdf + x * pdf)


@op("silu_backward.default")
def silu_backward(g, x):
    g, x = _gx(g, x)
    s = 1 / (1 + jnp.exp(-x))
    return g * s * (1 + x * (1 - s))


@op("sigmoid_backward.default")
def sigmoid_backward(g, y):
    rt, (g, y) = _common(g, y)
    if rt == jnp.float16:
        # CPU's float16 kernel computes in float16 (each of its three steps rounds); its
        # bfloat16 one in float32, as here.
        g, y = acc(g), acc(y)
        return round_to(round_to(g * round_to(1 - y, jnp.float16), jnp.float16) * y, jnp.float16)
    return g * (1 - y) * y


@op("tanh_backward.default")
def tanh_backward(g, y):
    g, y = _gx(g, y)
    return g * (1 - y * y)


@op("leaky_relu_backward.default", pad=Pointwise())
def leaky_relu_backward(g, x, negative_slope, self_is_result):
    g, x = _gx(g, x)
    return jnp.where(x > 0, g, g * _cast(negative_slope, g.dtype))


@op("elu_backward.default", pad=Pointwise())
def elu_backward(g, alpha, scale, input_scale, is_result, x):
    g, x = _gx(g, x)
    negcoef = _cast(alpha, g.dtype) * _cast(scale, g.dtype)
    poscoef = _cast(scale, g.dtype)
    negiptcoef = _cast(input_scale, g.dtype)
    if is_result:
        neg = g * negiptcoef * (x + negcoef)
    else:
        neg = g * negiptcoef * negcoef * jnp.exp(x * negiptcoef)
    return jnp.where(x <= 0, neg, g * poscoef)


@op("hardtanh_backward.default", pad=Pointwise())
def hardtanh_backward(g, x, min_val, max_val):
    g, x = _gx(g, x)
    return jnp.where((x <= _cast(min_val, x.dtype)) | (x >= _cast(max_val, x.dtype)), jnp.zeros_like(g), g)


@op("softplus_backward.default", pad=Pointwise())
def softplus_backward(g, x, beta, threshold):
    g, x = _gx(g, x)
    xb = _scale(x, beta)
    z = jnp.exp(xb)
    return jnp.where(xb > _cast(threshold, x.dtype), g, g * z / (z + 1))


@op("hardswish_backward.default", pad=Pointwise())
def hardswish_backward(g, x):
    g, x = _gx(g, x)
    return jnp.where(x <= -3, jnp.zeros_like(g), jnp.where(x < 3, g * (x / 3 + 0.5), g))


@op("hardsigmoid_backward.default", pad=Pointwise())
def hardsigmoid_backward(g, x):
    g, x = _gx(g, x)
    return jnp.where((x > -3) & (x < 3), g / 6, jnp.zeros_like(g))


@op("mish_backward.default", pad=Pointwise())
def mish_backward(g, x):
    g, x = _gx(g, x)
    s = 1 / (1 + jnp.exp(-x))
    t = jnp.tanh(jnp.log1p(jnp.exp(x)))
    return g * (t + x * s * (1 - t * t))


@op("hardshrink_backward.default", "softshrink_backward.default", pad=Pointwise())
def shrink_backward(g, x, lambd):
    ct = _rt(g, x)
    lam = _cast(_cast(lambd, ct), _opmath(ct))       # PyTorch rounds lambd to the tensors' dtype
    g, x = _gx(g, x)
    return jnp.where((x >= -lam) & (x <= lam), jnp.zeros_like(g), g)


@op("logit_backward.default")
def logit_backward(g, x, eps=None):
    g, x = _gx(g, x)
    d = g / (x * (1 - x))
    if eps is None:
        return jnp.where((x < 0) | (x > 1), jnp.full_like(g, jnp.nan), d)
    lo = _cast(eps, x.dtype)
    return jnp.where((x < lo) | (x > 1 - lo), jnp.zeros_like(g), d)
