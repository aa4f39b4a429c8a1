"""Attention: the fused ops ``F.scaled_dot_product_attention`` on tpu tensors reaches where CPU eager
takes its flash kernel (deferfuse/attention.py chooses), their backward as ``jax.vjp`` of the
forward, and ``_safe_softmax`` (the math path's softmax of fully masked rows).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import op
from .nn import _acc


def _sdpa(q, k, v, attn_mask, is_causal, scale):
    dt = _acc(q).dtype
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    if k.ndim == 4 and k.shape[1] != q.shape[1]:    # grouped-query attention (enable_gqa)
        k, v = (jnp.repeat(z, q.shape[1] // k.shape[1], axis=1) for z in (k, v))
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("...le,...se->...ls", q, k) * sc
    L, S = q.shape[-2], k.shape[-2]
    if is_causal:
        s = jnp.where(jnp.tril(jnp.ones((L, S), jnp.bool_)), s, -jnp.inf)
    if attn_mask is not None:
        s = jnp.where(attn_mask, s, -jnp.inf) if attn_mask.dtype == jnp.bool_ else s + attn_mask
    lse = jax.nn.logsumexp(s, axis=-1)
    # A row with every key masked out attends to nothing: zeros, as CPU's flash kernel gives.
    p = jnp.exp(s - jnp.where(jnp.isneginf(lse), 0, lse)[..., None])
    return jnp.einsum("...ls,...se->...le", p, v), lse


def _no_dropout(dropout_p):
    if not (isinstance(dropout_p, (int, float)) and dropout_p == 0):
        raise NotImplementedError("fused attention with dropout_p > 0 on tpu")


@op("_scaled_dot_product_flash_attention_for_cpu.default")
def sdpa_flash_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                   scale=None):
    _no_dropout(dropout_p)
    out, lse = _sdpa(query, key, value, attn_mask, is_causal, scale)
    return out, lse


@op("_scaled_dot_product_flash_attention_for_cpu_backward.default")
def sdpa_flash_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                            attn_mask=None, scale=None):
    _no_dropout(dropout_p)
    _, vjp = jax.vjp(lambda q, k, v: _sdpa(q, k, v, attn_mask, is_causal, scale)[0],
                     query, key, value)
    return vjp(_acc(grad_out))


@op("_safe_softmax.default")
def _safe_softmax(self, dim, dtype=None):
    """softmax that gives 0 (not NaN) on rows that are all -inf (fully masked attention rows)."""
    x = _acc(self)
    if x.ndim == 0:
        return jnp.ones((), x.dtype)
    dead = jnp.all(x == -jnp.inf, axis=dim, keepdims=True)
    return jnp.where(dead, 0, jax.nn.softmax(x, axis=dim))
