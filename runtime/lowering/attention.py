"""Attention: the fused ops ``F.scaled_dot_product_attention`` on tpu tensors reaches where CPU eager
takes its flash kernel (deferfuse/attention.py chooses), their backward as ``jax.vjp`` of the
forward, and ``_safe_softmax`` (the math path's softmax of fully masked rows).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import op
from .padding import Attention, Batched, Reduce, Refuse
from .nn import _acc
from .precision import HALF, round_to

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("an attention kernel with no padding rule")


def _scores(q, k, is_causal, attn_mask, scale):
    """(the masked, scaled attention scores q k^T, the scale)."""
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("...le,...se->...ls", q, k) * sc
    L, S = q.shape[-2], k.shape[-2]
    if is_causal:
        s = jnp.where(jnp.tril(jnp.ones((L, S), jnp.bool_)), s, -jnp.inf)
    if attn_mask is not None:
        s = jnp.where(attn_mask, s, -jnp.inf) if attn_mask.dtype == jnp.bool_ else s + attn_mask
    return s, sc


def _sdpa(q, k, v, attn_mask, is_causal, scale, exact_half=True):
    half = q.dtype if q.dtype in HALF and exact_half else None
    dt = _acc(q).dtype
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    if k.ndim == 4 and k.shape[1] != q.shape[1]:    # grouped-query attention (enable_gqa)
        k, v = (jnp.repeat(z, q.shape[1] // k.shape[1], axis=1) for z in (k, v))
    s, sc = _scores(q, k, is_causal, attn_mask, scale)
    if half is not None:
        return _flash_half(s, v, half)
    lse = jax.nn.logsumexp(s, axis=-1)
    # A row with every key masked out attends to nothing: zeros, as CPU's flash kernel gives.
    p = jnp.exp(s - jnp.where(jnp.isneginf(lse), 0, lse)[..., None])
    return jnp.einsum("...ls,...se->...le", p, v), lse


def _flash_half(s, v, dt):
    """CPU's flash attention for a half-precision query: keys in blocks of up to 512; per block the
    exponentials exp(s - running max) are rounded to the dtype for the product with v, while their
    float32 sum, the running output and the final division stay float32."""
    n = s.shape[-1]
    split = 512 if n >= 512 else n
    m = jnp.full(s.shape[:-1], -jnp.inf, jnp.float32)
    total = jnp.zeros(s.shape[:-1], jnp.float32)
    out = jnp.zeros(s.shape[:-1] + v.shape[-1:], jnp.float32)
    for lo in range(0, n, max(split, 1)):
        sb, vb = s[..., lo:lo + split], v[..., lo:lo + split, :]
        m_new = jnp.maximum(m, jnp.max(sb, axis=-1))
        safe = jnp.where(jnp.isneginf(m_new), 0, m_new)
        p = jnp.exp(sb - safe[..., None])
        fix = jnp.where(jnp.isneginf(m), 0, jnp.exp(m - safe))
        total = total * fix + jnp.sum(p, axis=-1)
        out = out * fix[..., None] + jnp.einsum("...ls,...se->...le", round_to(p, dt), vb)
        m = m_new
    dead = total == 0                       # every key masked: zeros, as on CPU
    out = jnp.where(dead[..., None], 0, out / jnp.where(dead, 1, total)[..., None])
    lse = jnp.where(dead, -jnp.inf, m + jnp.log(jnp.where(dead, 1, total)))
    return out, lse


def _no_dropout(dropout_p):
    if not (isinstance(dropout_p, (int, float)) and dropout_p == 0):
        raise NotImplementedError("fused attention with dropout_p > 0 on tpu")


@op("_scaled_dot_product_flash_attention_for_cpu.default", pad=Attention())
def sdpa_flash_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                   scale=None):
    _no_dropout(dropout_p)
    out, lse = _sdpa(query, key, value, attn_mask, is_causal, scale)
    return out, lse


# (each batch and head its own attention: a padded batch reaches padded gradients only)
@op("_scaled_dot_product_flash_attention_for_cpu_backward.default",
    pad=Batched(dims=(0, 1), fixed=(6,)))
def sdpa_flash_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                            attn_mask=None, scale=None):
    _no_dropout(dropout_p)
    if query.dtype in HALF and key.shape[-3:-2] == query.shape[-3:-2]:
        return _flash_half_backward(grad_out, query, key, value, out, logsumexp, is_causal,
                                    attn_mask, scale)
    _, vjp = jax.vjp(lambda q, k, v: _sdpa(q, k, v, attn_mask, is_causal, scale, False)[0],
                     query, key, value)
    return vjp(_acc(grad_out))


def _flash_half_backward(grad_out, query, key, value, out, lse, is_causal, attn_mask, scale):
    """CPU's flash attention backward for a half-precision query: the probabilities rebuilt in
    float32 from the saved logsumexp, rowsum(grad_out * out) from the saved (rounded) output, and
    the probabilities and the gradient of the scores rounded to the dtype before the products
    that give the gradients of value, query and key (float32 accumulation, one rounding each).
    The blocks CPU adds gradients over (queries past its split size, keys past 512) are not
    modelled: one rounding per gradient."""
    dt = query.dtype
    q, k, v, do, o = (_acc(z) for z in (query, key, value, grad_out, out))
    s, sc = _scores(q, k, is_causal, attn_mask, scale)
    lse = lse.astype(jnp.float32)
    p = jnp.exp(s - jnp.where(jnp.isneginf(lse), 0, lse)[..., None])
    p = jnp.where(jnp.isneginf(lse)[..., None], 0, p)
    dsum = jnp.sum(do * o, axis=-1, keepdims=True)
    dv = jnp.einsum("...ls,...le->...se", round_to(p, dt), do)
    ds = round_to(p * (jnp.einsum("...le,...se->...ls", do, v) - dsum), dt)
    dq = sc * jnp.einsum("...ls,...se->...le", ds, k)
    dk = sc * jnp.einsum("...ls,...le->...se", ds, q)
    return dq.astype(dt), dk.astype(dt), dv.astype(dt)


@op("_safe_softmax.default", pad=Reduce(1, "-inf"))
def _safe_softmax(self, dim, dtype=None):
    """softmax that gives 0 (not NaN) on rows that are all -inf (fully masked attention rows)."""
    x = _acc(self)
    if x.ndim == 0:
        return jnp.ones((), x.dtype)
    dead = jnp.all(x == -jnp.inf, axis=dim, keepdims=True)
    return jnp.where(dead, 0, jax.nn.softmax(x, axis=dim))


def _segments(cu, n):
    """For each of ``n`` packed tokens: its sequence (``len(cu) - 1`` past the last one) and its
    position in it, from the cumulative lengths ``cu``; and each sequence's length."""
    i = jnp.arange(n)
    seg = jnp.searchsorted(cu[1:], i, side="right")
    start = cu[jnp.minimum(seg, cu.shape[0] - 1)]
    return seg, i - start, cu[1:] - cu[:-1]


def _varlen(q, k, v, cu_q, cu_k, is_causal, scale, left, right):
    """Flash attention over packed sequences (FlashAttention's varlen convention): ``q`` (total_q,
    Hq, D), ``k``/``v`` (total_k, Hk, D), token i of sequence b attending to the keys of b alone;
    causal and window masks aligned at each sequence's end (key j sees query i when
    j <= i + len_k - len_q). Returns (output (total_q, Hq, Dv), logsumexp (Hq, total_q)); a query
    that sees no key gives zeros."""
    dt = _acc(q).dtype
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    if k.shape[1] != q.shape[1]:
        k, v = (jnp.repeat(z, q.shape[1] // k.shape[1], axis=1) for z in (k, v))
    sq, pq, lq = _segments(cu_q, q.shape[0])
    sk, pk, lk = _segments(cu_k, k.shape[0])
    nseq = lq.shape[0]
    shift = (jnp.concatenate([lk - lq, jnp.zeros((1,), lk.dtype)]))[jnp.minimum(sq, nseq)]
    diag = pq + shift                       # the key position level with each query
    ok = (sq[:, None] == sk[None, :]) & (sq[:, None] < nseq)
    if is_causal:
        right = 0
    if right is not None and right >= 0:
        ok &= pk[None, :] <= diag[:, None] + right
    if left is not None and left >= 0:
        ok &= pk[None, :] >= diag[:, None] - left
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("qhd,khd->hqk", q, k) * sc
    s = jnp.where(ok[None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isneginf(lse), 0, lse)[..., None])
    return jnp.einsum("hqk,khd->qhd", p, v), lse


def _dense_as_varlen(q, k, v, is_causal, scale, left, right):
    """The batched form (B, L, H, D) as packed sequences of equal length."""
    b, lq, lk = q.shape[0], q.shape[1], k.shape[1]
    cu_q = jnp.arange(b + 1, dtype=jnp.int32) * lq
    cu_k = jnp.arange(b + 1, dtype=jnp.int32) * lk
    out, lse = _varlen(q.reshape((-1,) + q.shape[2:]), k.reshape((-1,) + k.shape[2:]),
                       v.reshape((-1,) + v.shape[2:]), cu_q, cu_k, is_causal, scale, left, right)
    return (out.reshape(q.shape[:3] + v.shape[-1:]),
            lse.reshape(lse.shape[0], b, lq).transpose(1, 0, 2))


def _flash(q, k, v, cu_q, cu_k, is_causal, scale, left, right):
    if cu_q is None:
        return _dense_as_varlen(q, k, v, is_causal, scale, left, right)
    return _varlen(q, k, v, cu_q, cu_k, is_causal, scale, left, right)


def _flash_unsupported(seqused_k=None, alibi_slopes=None, block_table=None):
    for name, x in (("seqused_k", seqused_k), ("alibi_slopes", alibi_slopes),
                    ("block_table", block_table)):
        if x is not None:
            raise NotImplementedError(f"_flash_attention_forward with {name} on tpu")


@op("_flash_attention_forward.default", meta=True)
def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                            is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                            window_size_right=None, seqused_k=None, alibi_slopes=None,
                            block_table=None, num_splits=None, _avals=None):
    """CUDA's flash attention (``varlen_attn``, TorchTitan's varlen attention): packed sequences
    given by their cumulative lengths, or a (B, L, H, D) batch; sliding windows. The random state
    and the debug mask it also returns are zeros of their shapes (no dropout)."""
    _no_dropout(dropout_p)
    _flash_unsupported(seqused_k, alibi_slopes, block_table)
    out, lse = _flash(query, key, value, cum_seq_q, cum_seq_k, is_causal, scale,
                      window_size_left, window_size_right)
    rest = tuple(jnp.zeros(a[0], a[1]) for a in _avals[2:])
    return (out.astype(query.dtype), lse) + rest


@op("_flash_attention_backward.default")
def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                             max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                             window_size_left=None, window_size_right=None):
    _no_dropout(dropout_p)
    _, vjp = jax.vjp(lambda q, k, v: _flash(q, k, v, cum_seq_q, cum_seq_k, is_causal, scale,
                                            window_size_left, window_size_right)[0],
                     query, key, value)
    return tuple(g.astype(x.dtype) for g, x in zip(vjp(_acc(grad_out)), (query, key, value)))
