"""Loss functions (nll, mse, l1, smooth l1, huber, binary cross-entropy) and glu, with the backward
ops autograd calls for them. As in nn.py: sums over many values compute in float32 for 16-bit
inputs, as PyTorch's CPU kernels do, and glu's backward is ``jax.vjp`` of its forward.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import check, check_index, op
from .padding import Refuse, Targets
from .nn import _acc, _grad_scale, _reduce, _sum_to
from .precision import HALF, acc, round_to

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("a loss with no padding rule for its reduction")


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


@op("nll_loss_forward.default", "nll_loss2d_forward.default",
    pad=Targets(target=1, ignore=4, zero=(0,), probs=0))
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    check_index(jnp.where(target == ignore_index, 0, target), self.shape[0 if self.ndim == 1 else 1],
                IndexError, "Target {index} is out of bounds.",
                allow_negative=False)
    picked, w, _, _ = _nll_parts(self, target, weight, ignore_index)
    loss = -picked * w
    if reduction == 0:
        return loss, jnp.zeros((), loss.dtype)
    total = jnp.sum(w)
    out = jnp.sum(loss)
    return (out / total if reduction == 1 else out), total


@op("nll_loss_backward.default", "nll_loss2d_backward.default",
    pad=Targets(target=2, ignore=5, zero=(0, 1), probs=1))
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
    if self.dtype == jnp.bfloat16:
        # CPU's bfloat16 kernel works in bfloat16, each step (delta too) rounded; its float16
        # kernel in float32.
        r = functools.partial(round_to, dtype=self.dtype)
        d, delta = r(jnp.abs(acc(self) - acc(target))), r(jnp.asarray(delta, jnp.float32))
        loss = jnp.where(d < delta, r(r(0.5 * d) * d), r(delta * r(d - r(0.5 * delta))))
        return _reduce(loss, reduction)
    d = jnp.abs(acc(self) - acc(target))
    return _reduce(jnp.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta)), reduction)


@op("soft_margin_loss.default")
def soft_margin_loss(self, target, reduction=1):
    # CPU: neg, mul, exp, log1p as separate kernels, each rounding to the dtype (an exponent that
    # overflows float16 gives inf, as there), then the reduction in float32. PyTorch's
    # decomposition computes all of it in float32.
    r = functools.partial(round_to, dtype=jnp.result_type(self, target))
    loss = r(jnp.log1p(r(jnp.exp(r(-acc(self) * acc(target))))))
    return _reduce(loss, reduction)


@op("soft_margin_loss_backward.default")
def soft_margin_loss_backward(grad_output, self, target, reduction):
    # CPU: z = exp(-target * input); grad = target * z * -norm / (1 + z) * grad_output, one kernel
    # per step, each rounding to the dtype.
    r = functools.partial(round_to, dtype=jnp.result_type(self, target))
    x, t, g = acc(self), acc(target), acc(grad_output)
    norm = r(jnp.float32(-1.0 / x.size if reduction == 1 else -1.0))
    z = r(jnp.exp(r(-t * x)))
    return r(r(r(r(t * z) * norm) / r(z + 1)) * g)


@op("huber_loss_backward.default")
def huber_loss_backward(grad_output, self, target, reduction, delta):
    d = self - target
    s = jnp.clip(d, -delta, delta)
    return _sum_to(s * _grad_scale(grad_output, reduction, d.size), self.shape)


@op("binary_cross_entropy.default")
def binary_cross_entropy(self, target, weight=None, reduction=1):
    if self.dtype in HALF:
        # CPU's kernel works in the dtype: each log, clamp, product and difference rounded, then
        # the weight in a kernel of its own (rounded), then the reduction in float32.
        r = functools.partial(round_to, dtype=self.dtype)
        x, t = acc(self), acc(target)
        log_x = jnp.maximum(r(jnp.log(x)), -100.0)
        log_1mx = jnp.maximum(r(jnp.log1p(-x)), -100.0)
        loss = r(r(r(t - 1) * log_1mx) - r(t * log_x))
        if weight is not None:
            loss = r(loss * acc(weight))
        return _reduce(loss, reduction)
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
    if self.dtype in HALF:
        # CPU: a * (1 / (1 + exp(-b))) in float32, rounded once (jax's half-precision sigmoid
        # rounds before the product: 45% of a conformer's GLU outputs were an ulp off CPU's).
        a, b = jnp.split(acc(self), 2, axis=dim)
        return a * (1 / (1 + jnp.exp(-b)))
    a, b = jnp.split(self, 2, axis=dim)
    return a * jax.nn.sigmoid(b)


@op("glu_backward.default")
def glu_backward(grad_output, self, dim):
    if self.dtype in HALF:
        # CPU: sigmoid(b) into the first half (rounded), then (1 - s) * s * a * grad in float32
        # (rounded), and the first half times grad (rounded).
        r = functools.partial(round_to, dtype=self.dtype)
        a, b = jnp.split(acc(self), 2, axis=dim)
        g = acc(grad_output)
        sig = r(jax.nn.sigmoid(b))
        return jnp.concatenate([r(sig * g), r((1 - sig) * sig * a * g)], axis=dim)
    _, vjp = jax.vjp(lambda x: glu(x, dim), self)
    return vjp(grad_output.astype(self.dtype))[0]


# --------------------------------------------------------------------------------------------
# margin losses (PyTorch's CPU kernels: a hinge counts where it is > 0, divided by the class count);
# the backward ops are the vjp of these forwards

def _classes(x) -> int:
    """The class count of a margin loss's input: (N, C), (C,) or a 0-d input (one class)."""
    return x.shape[-1] if x.ndim else 1


def _multi_margin(x, target, p, margin, weight):
    """Per-sample loss of multi_margin_loss; x (N, C), (C,) or 0-d."""
    x2 = _acc(x).reshape(-1, _classes(x))
    t = target.reshape(-1)
    c = x2.shape[1]
    picked = jnp.take_along_axis(x2, t[:, None], axis=1)
    z = margin - picked + x2
    h = jnp.where(z > 0, z if p == 1 else z * z, 0)
    if weight is not None:
        h = h * _acc(weight)[t][:, None]
    h = jnp.where(jnp.arange(c)[None, :] == t[:, None], 0, h)     # j == target: left out
    loss = jnp.sum(h, axis=1) / c
    return loss if x.ndim == 2 else loss.reshape(())


@op("multi_margin_loss.default")
def multi_margin_loss(self, target, p=1, margin=1, weight=None, reduction=1):
    check(jnp.any((target < 0) | (target >= _classes(self))), RuntimeError, "target out of range")
    return _reduce(_multi_margin(self, target, p, margin, weight), reduction)


@op("multi_margin_loss_backward.default")
def multi_margin_loss_backward(grad_output, self, target, p, margin, weight=None, reduction=1):
    out, vjp = jax.vjp(lambda x: _reduce(_multi_margin(x, target, p, margin, weight), reduction),
                       _acc(self))
    return vjp(_acc(grad_output).reshape(out.shape))[0]     # a 1-D input's loss: (1,) or ()


def _multilabel_targets(target, c):
    """(targets as (N, C) with 0 where not valid, valid: before the row's first -1, is_target)."""
    t = target.reshape(-1, c)
    valid = jnp.cumprod(t >= 0, axis=1).astype(bool)
    ts = jnp.where(valid, t, 0)
    return ts, valid, jnp.any(valid[:, :, None] & (ts[:, :, None] == jnp.arange(c)), axis=1)


def _multilabel_margin(x, target):
    """Per-sample loss of multilabel_margin_loss: each target class up to the first -1 against each
    class that is not a target."""
    x2 = _acc(x).reshape(-1, _classes(x))
    c = x2.shape[1]
    ts, valid, is_target = _multilabel_targets(target, c)
    picked = jnp.take_along_axis(x2, ts, axis=1)                  # (N, C): x at each target entry
    z = 1 - picked[:, :, None] + x2[:, None, :]                   # (N, target entry, class)
    h = jnp.where((z > 0) & valid[:, :, None] & ~is_target[:, None, :], z, 0)
    loss = jnp.sum(h, axis=(1, 2)) / c
    return loss if x.ndim == 2 else loss.reshape(())


@op("multilabel_margin_loss_forward.default")
def multilabel_margin_loss_forward(self, target, reduction):
    """(loss, is_target). PyTorch's own decomposition of this op reads past a row's first -1 (a
    row [1, 1, 4, -1, 0] lost 3.53 where CPU's kernel says 1.16), so it is lowered here."""
    check(jnp.any((target < -1) | (target >= _classes(self))), RuntimeError,
          "argument #2 'target' is out of range")
    loss = _reduce(_multilabel_margin(self, target), reduction)
    is_target = _multilabel_targets(target, _classes(self))[2]
    return loss, is_target.reshape(self.shape).astype(self.dtype)


@op("multilabel_margin_loss_backward.default")
def multilabel_margin_loss_backward(grad_output, self, target, reduction, is_target):
    out, vjp = jax.vjp(lambda x: _reduce(_multilabel_margin(x, target), reduction), _acc(self))
    return vjp(_acc(grad_output).reshape(out.shape))[0]


# --------------------------------------------------------------------------------------------
# CTC loss: PyTorch's CPU kernels (LossCTC.cpp), vectorized over the batch and the extended target
# (blank, l1, blank, l2, ..., blank): the alpha recursion forward and the beta recursion backward
# as scans over time, each step's log-sum-exp of up to three predecessors written as CPU writes it
# (the largest subtracted, 0 when all are -inf). States past a sample's 2 * length and times past
# its input length hold -inf (CPU leaves them unwritten; nothing reads them).

def _ctc_targets(targets, target_lengths, lmax: int):
    """(N, lmax) padded targets from 2-D targets or 1-D concatenated ones (static lengths)."""
    n = len(target_lengths)
    if targets.ndim == 2:
        return targets[:, :lmax].astype(jnp.int32)
    offs = [sum(target_lengths[:i]) for i in range(n)]
    idx = jnp.asarray([[min(offs[b] + j, max(targets.shape[0] - 1, 0)) for j in range(lmax)]
                       for b in range(n)], jnp.int32).reshape(n, lmax)
    return targets[idx].astype(jnp.int32) if targets.shape[0] else jnp.zeros((n, lmax), jnp.int32)


def _ctc_setup(log_probs, targets, target_lengths, blank, lmax):
    n = log_probs.shape[1]
    s = 2 * lmax + 1
    tg = _ctc_targets(targets, target_lengths, lmax)
    sidx = jnp.arange(s)
    prime = jnp.where(sidx % 2 == 0, blank, tg[:, jnp.clip((sidx - 1) // 2, 0, max(lmax - 1, 0))]
                      if lmax else blank)
    prime = jnp.broadcast_to(prime, (n, s)).astype(jnp.int32)
    lpg = jnp.take_along_axis(log_probs, jnp.broadcast_to(prime[None], (log_probs.shape[0], n, s)),
                              axis=2)                                   # (T, N, S)
    tl = jnp.asarray(target_lengths, jnp.int32).reshape(n)
    live = sidx[None, :] <= 2 * tl[:, None]                             # (N, S)
    return prime, lpg, tl, live, sidx


def _lse3(a, b, c):
    m = jnp.maximum(jnp.maximum(a, b), c)
    m = jnp.where(m == -jnp.inf, 0, m)
    return jnp.log(jnp.exp(a - m) + jnp.exp(b - m) + jnp.exp(c - m)) + m


def _shift(x, k, fill=-jnp.inf):
    """x[..., s - k] at s (k > 0) or x[..., s + |k|] (k < 0), ``fill`` where out of range."""
    pad = jnp.full(x.shape[:-1] + (abs(k),), fill, x.dtype)
    return (jnp.concatenate([pad, x[..., :-k]], -1) if k > 0
            else jnp.concatenate([x[..., -k:], pad], -1))


@op("_ctc_loss.default")
def ctc_loss_forward(log_probs, targets, input_lengths, target_lengths, blank=0,
                     zero_infinity=False):
    t_len, n, _ = log_probs.shape
    lmax = max(list(target_lengths) + [0])
    prime, lpg, tl, live, sidx = _ctc_setup(log_probs, targets, target_lengths, blank, lmax)
    il = jnp.asarray(input_lengths, jnp.int32).reshape(n)
    ninf = jnp.asarray(-jnp.inf, log_probs.dtype)
    first = jnp.where((sidx[None] == 0) | ((sidx[None] == 1) & (tl[:, None] > 0)), lpg[0], ninf)
    first = jnp.where(il[:, None] > 0, first, ninf)
    three = (sidx[None] > 1) & (prime != _shift(prime, 2, -1))

    def step(prev, xs):
        t, lp_t = xs
        new = _lse3(prev, _shift(prev, 1), jnp.where(three, _shift(prev, 2), ninf)) + lp_t
        new = jnp.where(live & (t < il)[:, None], new, ninf)
        return new, new
    if t_len > 1:
        _, rest = lax.scan(step, first, (jnp.arange(1, t_len), lpg[1:]))
        alpha = jnp.concatenate([first[None], rest], 0)                 # (T, N, S)
    else:
        alpha = first[None]
    last = alpha[jnp.clip(il - 1, 0, t_len - 1), jnp.arange(n)]         # (N, S)
    bidx = jnp.arange(n)
    l1 = last[bidx, 2 * tl]
    l2 = jnp.where(tl > 0, last[bidx, jnp.maximum(2 * tl - 1, 0)], ninf)
    m = jnp.maximum(l1, l2)
    m = jnp.where(m == -jnp.inf, 0, m)
    ll = jnp.where(tl > 0, jnp.log(jnp.exp(l1 - m) + jnp.exp(l2 - m)) + m, last[:, 0])
    ll = jnp.where(il > 0, ll, jnp.where(tl == 0, 0, ninf))
    return -ll, jnp.transpose(alpha, (1, 0, 2))


@op("_ctc_loss_backward.default")
def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood,
                      log_alpha, blank, zero_infinity=False):
    t_len, n, c = log_probs.shape
    lmax = (log_alpha.shape[2] - 1) // 2
    prime, lpg, tl, live, sidx = _ctc_setup(log_probs, targets, target_lengths, blank, lmax)
    il = jnp.asarray(input_lengths, jnp.int32).reshape(n)
    ninf = jnp.asarray(-jnp.inf, log_probs.dtype)
    # s + 2 is another label than s (and s < 2L - 1): the beta recursion's third summand
    three = (sidx[None] < 2 * tl[:, None] - 1) & (_shift(prime, -2, -1) != prime)
    below = sidx[None] < 2 * tl[:, None]

    def step(nxt, xs):
        t, lp_t = xs
        rec = _lse3(nxt, jnp.where(below, _shift(nxt, -1), ninf),
                    jnp.where(three, _shift(nxt, -2), ninf)) + lp_t
        init = jnp.where((sidx[None] == 2 * tl[:, None])
                         | ((sidx[None] == 2 * tl[:, None] - 1) & (tl[:, None] > 0)), lp_t, ninf)
        new = jnp.where((t == il - 1)[:, None], init, jnp.where((t < il - 1)[:, None], rec, ninf))
        new = jnp.where(live, new, ninf)
        return new, new
    _, beta = lax.scan(step, jnp.full((n, prime.shape[1]), -jnp.inf, log_probs.dtype),
                       (jnp.arange(t_len), lpg), reverse=True)           # (T, N, S)
    alpha = jnp.transpose(log_alpha, (1, 0, 2))
    lab = jnp.where(live[None] & (jnp.arange(t_len)[:, None, None] < il[None, :, None]),
                    alpha + beta, ninf)
    # per label, CPU's running log-sum over the states carrying it, s from 2L down to 0 (an
    # empty sum is -inf and takes the first term as it is): the same additions in the same order,
    # which matters where the gradient's two terms nearly cancel
    bi = jnp.arange(n)[None, :]

    def gather(acc, xs):
        lab_s, p_s = xs                                   # (T, N), (N,)
        cur = acc[:, bi[0], p_s]                          # (T, N)
        m = jnp.maximum(cur, lab_s)
        both = jnp.log(jnp.exp(cur - m) + jnp.exp(lab_s - m)) + m
        new = jnp.where(cur == -jnp.inf, lab_s, both)
        return acc.at[:, bi[0], p_s].set(new), None
    lcab, _ = lax.scan(gather, jnp.full((t_len, n, c), -jnp.inf, lab.dtype),
                       (jnp.moveaxis(lab, 2, 0), prime.T), reverse=True)
    nll = neg_log_likelihood[None, :, None]
    res = (jnp.exp(log_probs) - jnp.exp(lcab + nll - log_probs)) * grad[None, :, None]
    res = jnp.where(jnp.arange(t_len)[:, None, None] < il[None, :, None], res, 0)
    if zero_infinity:
        res = jnp.where((neg_log_likelihood == jnp.inf)[None, :, None], 0, res)
    return res
