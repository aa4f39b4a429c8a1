"""Loss functions (nll, mse, l1, smooth l1, huber, binary cross-entropy) and glu, with the backward
ops autograd calls for them. As in nn.py: sums over many values compute in float32 for 16-bit
inputs, as PyTorch's CPU kernels do, and glu's backward is ``jax.vjp`` of its forward.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import check_index, op
from .nn import _acc, _grad_scale, _reduce, _sum_to


def _nll_parts(x, target, weight, ignore_index):
    """(picked log-probability, per-element weight, one-hot of the target) for nll losses."""
    valid = target != ignore_index
    t = jnp.where(valid, target, 0)
    cdim = 0 if x.ndim == 1 else 1
    onehot = jnp.expand_dims(t, cdim) == lax.broadcasted_iota(
        t.dtype, t.shape[:cdim] + (x.shape[cdim],) + t.shape[cdim:], cdim)
    picked = jnp.sum(jnp.where(onehot, _acc(x), 0), axis=cdim)
    w = jnp.take(_acc(weight), t) if weight is not None else jnp.ones(t.shape, picked.dtype)
    w = jnp.where(valid, w, 0)
    return picked, w, onehot, cdim


@op("nll_loss_forward.default", "nll_loss2d_forward.default")
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    check_index(jnp.where(target == ignore_index, 0, target), self.shape[0 if self.ndim == 1 else 1],
                IndexError, "Target is out of bounds (a class index outside [0, C)).",
                allow_negative=False)
    picked, w, _, _ = _nll_parts(self, target, weight, ignore_index)
    loss = -picked * w
    if reduction == 0:
        return loss, jnp.zeros((), loss.dtype)
    total = jnp.sum(w)
    out = jnp.sum(loss)
    return (out / total if reduction == 1 else out), total


@op("nll_loss_backward.default", "nll_loss2d_backward.default")
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    _, w, onehot, cdim = _nll_parts(self, target, weight, ignore_index)
    g = _acc(grad_output)
    if reduction == 1:
        g = g / total_weight
    return jnp.where(onehot, jnp.expand_dims(-w * g, cdim), 0)


@op("mse_loss.default")
def mse_loss(self, target, reduction=1):
    return _reduce(jnp.square(self - target), reduction)


@op("mse_loss_backward.default")
def mse_loss_backward(grad_output, self, target, reduction):
    d = self - target
    return _sum_to(2 * d * _grad_scale(grad_output, reduction, d.size), self.shape)


@op("l1_loss.default")
def l1_loss(self, target, reduction=1):
    return _reduce(jnp.abs(self - target), reduction)


@op("smooth_l1_loss.default")
def smooth_l1_loss(self, target, reduction=1, beta=1.0):
    d = jnp.abs(self - target)
    if isinstance(beta, (int, float)) and beta == 0:
        return _reduce(d, reduction)
    return _reduce(jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta), reduction)


@op("smooth_l1_loss_backward.default")
def smooth_l1_loss_backward(grad_output, self, target, reduction, beta):
    d = self - target
    s = jnp.sign(d)
    if not (isinstance(beta, (int, float)) and beta == 0):
        s = jnp.where(jnp.abs(d) < beta, d / beta, s)
    return _sum_to(s * _grad_scale(grad_output, reduction, d.size), self.shape)


@op("huber_loss.default")
def huber_loss(self, target, reduction=1, delta=1.0):
    d = jnp.abs(self - target)
    return _reduce(jnp.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta)), reduction)


@op("huber_loss_backward.default")
def huber_loss_backward(grad_output, self, target, reduction, delta):
    d = self - target
    s = jnp.clip(d, -delta, delta)
    return _sum_to(s * _grad_scale(grad_output, reduction, d.size), self.shape)


@op("binary_cross_entropy.default")
def binary_cross_entropy(self, target, weight=None, reduction=1):
    x, t = _acc(self), _acc(target)
    loss = -(t * jnp.maximum(jnp.log(x), -100.0) + (1 - t) * jnp.maximum(jnp.log1p(-x), -100.0))
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


@op("binary_cross_entropy_backward.default")
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=1):
    x, t = _acc(self), _acc(target)
    g = _grad_scale(_acc(grad_output), reduction, x.size) * (x - t) / jnp.maximum((1 - x) * x, 1e-12)
    if weight is not None:
        g = g * weight
    return g


@op("binary_cross_entropy_with_logits.default")
def binary_cross_entropy_with_logits(self, target, weight=None, pos_weight=None, reduction=1):
    x, t = _acc(self), _acc(target)
    ls = jax.nn.log_sigmoid(x)
    if pos_weight is not None:
        loss = (1 - t) * x - ((pos_weight - 1) * t + 1) * ls
    else:
        loss = (1 - t) * x - ls
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


@op("glu.default")
def glu(self, dim=-1):
    a, b = jnp.split(self, 2, axis=dim)
    return a * jax.nn.sigmoid(b)


@op("glu_backward.default")
def glu_backward(grad_output, self, dim):
    _, vjp = jax.vjp(lambda x: glu(x, dim), self)
    return vjp(grad_output.astype(self.dtype))[0]
