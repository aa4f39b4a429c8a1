"""Embedding ops: embedding, embedding_bag and the backward ops autograd calls for them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import check_index, op
from .padding import Embedding, Refuse, ZeroPadded
from .nn import _acc, _zeros
from .precision import is_half, round_to

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("a bag, a renorm or a backward with no padding rule")


# --------------------------------------------------------------------------------------------
# embedding

@op("embedding.default", pad=Embedding(index=1, table=0))
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    check_index(indices, weight.shape[0], allow_negative=False)
    return jnp.take(weight, indices, axis=0)


# NOTE [half embedding backward]: PyTorch's CPU kernel (``embedding_dense_backward_cpu``,
# aten/src/ATen/native/Embedding.cpp) adds each token's gradient row into its weight row in token
# order, one ``add_`` of the weight's dtype at a time: in bfloat16 and float16 every partial sum
# is rounded to the dtype (1000 additions of 1 stop at 256 in bfloat16), whatever the number of
# threads (they split the weight rows, not the tokens). On XLA's CPU platform the lowering adds in
# that order and rounds at the same points (a scan over the tokens sorted stably by row, each
# row's chain restarting at zero), so a half-precision model's embedding gradients are CPU's bit
# for bit. On a TPU or GPU, where a scan over every token is slow, the float32 sum rounded once
# stays (CUDA's kernel also sums in float32); docs/dtypes.md gives both sides' error. With
# ``scale_grad_by_freq`` the float32 sum stays too: CPU divides some rows by another row's count
# there (docs/coverage.md), so its values are not the ones to follow.


def _cpu_order(dtype) -> bool:
    """NOTE [half embedding backward] applies: a half dtype on XLA's CPU platform."""
    from ..platform import name
    return is_half(dtype) and name() == "cpu"


def _rows_in_order(g, idx, num_weights, dtype):
    """Sum of the rows of ``g`` (float32, one per token) into ``num_weights`` rows by ``idx``, each
    weight row's terms added in token order with every partial sum rounded to ``dtype`` (NOTE
    [half embedding backward])."""
    order = jnp.argsort(idx, stable=True)
    s = idx[order]
    gs = g[order]
    start = jnp.concatenate([jnp.ones((1,), bool), s[1:] != s[:-1]])
    end = jnp.concatenate([s[1:] != s[:-1], jnp.ones((1,), bool)])

    def step(total, xs):
        first, row = xs
        total = round_to(jnp.where(first, 0.0, total) + row, dtype)
        return total, total

    zero = jnp.zeros(g.shape[1:], jnp.float32)
    _, sums = lax.scan(step, zero, (start, gs))
    last = jnp.where(end[:, None], sums, 0.0)
    return jnp.zeros((num_weights, g.shape[1]), jnp.float32).at[s].add(last)


@op("embedding_dense_backward.default",
    pad=ZeroPadded(inputs=(0, 1), unless=(4, "scale_grad_by_freq")))
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    idx = indices.reshape(-1)
    g = _acc(grad_output).reshape(idx.shape[0], -1)
    if padding_idx >= 0:
        g = jnp.where((idx != padding_idx)[:, None], g, 0)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[idx].add(1)
        g = g / counts[idx][:, None]
    elif _cpu_order(grad_output.dtype) and idx.shape[0] and g.shape[1]:
        # NOTE [half embedding backward]
        return _rows_in_order(g, idx, num_weights, grad_output.dtype)
    return jnp.zeros((num_weights, g.shape[1]), g.dtype).at[idx].add(g)


@op("embedding_renorm_.default")
def embedding_renorm_(self, indices, max_norm, norm_type):
    """Rows of ``self`` that ``indices`` name and whose norm exceeds max_norm, scaled down to it."""
    x = _acc(self)
    if isinstance(norm_type, (int, float)) and norm_type == 2:
        norm = jnp.sqrt(jnp.sum(x * x, axis=1))
    else:
        norm = jnp.sum(jnp.abs(x) ** norm_type, axis=1) ** (1.0 / norm_type)
    hit = jnp.zeros((x.shape[0],), jnp.bool_).at[indices.reshape(-1)].set(True)
    scale = jnp.where(hit & (norm > max_norm), max_norm / (norm + 1e-7), 1.0)
    return x * scale[:, None]


# --------------------------------------------------------------------------------------------
# embedding_bag: bags of rows summed / averaged / maxed (PyTorch's CPU kernel: indices equal to
# ``padding_idx`` are left out, an empty bag is zeros; the aux outputs are what its backward reads)

def _fit(v, aval):
    """``v`` when meta gives it this shape, else zeros of meta's shape (an output the mode does
    not define)."""
    return v if tuple(v.shape) == tuple(aval[0]) else _zeros(aval)


@op("_embedding_bag_forward_only.default", "_embedding_bag.default", meta=True)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1, *, _avals):
    if indices.ndim == 2:
        b, l = indices.shape
        offsets = jnp.arange(0, b * l, l, dtype=indices.dtype) if l else jnp.zeros(b, indices.dtype)
        indices = indices.reshape(-1)
    n, nb = indices.shape[0], _avals[0][0][0]
    pos = jnp.arange(n)
    bag, valid, count = _bags(indices, offsets, nb, padding_idx)   # bag nb: dropped by segment ops
    rows = _acc(weight)[indices]
    if mode == 2:
        out = jax.ops.segment_max(jnp.where(valid[:, None], rows, -jnp.inf), bag, nb)
        out = jnp.where(count[:, None] > 0, out, 0)
        hit = (rows == out[jnp.clip(bag, 0, nb - 1)]) & valid[:, None]
        # the first index attaining the max, per bag and column
        first = jax.ops.segment_min(jnp.where(hit, pos[:, None], n), bag, nb)
        arg = jnp.where(count[:, None] > 0, indices[jnp.clip(first, 0, max(n - 1, 0))], 0)
    else:
        if per_sample_weights is not None:
            rows = rows * _acc(per_sample_weights)[:, None]
        out = jax.ops.segment_sum(jnp.where(valid[:, None], rows, 0), bag, nb)
        if mode == 1:
            out = out / jnp.maximum(count, 1)[:, None].astype(out.dtype)
        arg = jnp.zeros_like(count)
    offset2bag = jnp.searchsorted(offsets[:nb], pos, side="right") - 1
    size = count if mode else jnp.zeros_like(count)
    return (out, _fit(offset2bag.astype(jnp.int64), _avals[1]), _fit(size, _avals[2]),
            _fit(arg.astype(jnp.int64), _avals[3]))


def _bags(indices, offsets, nb, padding_idx):
    """Per index: its bag (``nb`` where it counts in none) and whether it counts; per bag: how many
    indices count (PyTorch's offset2bag and bag_size, rebuilt: its forward leaves offset2bag empty
    in some modes, and its backward then rebuilds it the same way)."""
    n = indices.shape[0]
    pos = jnp.arange(n)
    bag = jnp.searchsorted(offsets[:nb], pos, side="right") - 1
    valid = bag >= 0
    if offsets.shape[0] > nb:           # include_last_offset: indices past the last offset count in none
        valid = valid & (pos < offsets[nb])
    if padding_idx >= 0:
        valid = valid & (indices != padding_idx)
    bag = jnp.where(valid, bag, nb)
    return bag, valid, jax.ops.segment_sum(valid.astype(jnp.int64), bag, nb)


@op("_embedding_bag_backward.default")
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, max_idx, num_weights,
                           by_freq, mode, sparse, psw=None, padding_idx=-1):
    if sparse:
        raise NotImplementedError("embedding_bag with sparse=True: tpu tensors are dense only; "
                                  "use nn.EmbeddingBag(..., sparse=False)")
    bag, valid, count = _bags(indices, offsets, grad.shape[0], padding_idx)
    return _bag_grad(grad, indices, bag, valid, count, max_idx, num_weights, by_freq, mode, psw,
                     padding_idx)


@op("_embedding_bag_dense_backward.default")
def embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, max_idx, num_weights,
                                 by_freq, mode, psw=None, padding_idx=-1):
    nb = grad.shape[0]
    valid = (indices != padding_idx) if padding_idx >= 0 else jnp.ones(indices.shape, bool)
    bag = jnp.where(valid, offset2bag, nb)
    count = jax.ops.segment_sum(valid.astype(jnp.int64), bag, nb)
    return _bag_grad(grad, indices, bag, valid, count, max_idx, num_weights, by_freq, mode, psw,
                     padding_idx)


def _bag_grad(grad, indices, bag, valid, count, max_idx, num_weights, by_freq, mode, psw,
              padding_idx):
    """The dense gradient of embedding_bag's weight (PyTorch's CPU kernel: sum and mean scatter each
    bag's gradient to its rows, mean divided by the bag's size; max sends it to the rows that
    attained the max; ``scale_grad_by_freq`` divides by how often each row is named)."""
    nb, d = grad.shape
    g = _acc(grad)
    out = jnp.zeros((num_weights, d), g.dtype)
    if mode == 2:
        rows = jnp.where((count > 0)[:, None], max_idx, num_weights)     # empty bags: dropped
        if padding_idx >= 0:
            rows = jnp.where(rows == padding_idx, num_weights, rows)
        cols = jnp.broadcast_to(jnp.arange(d), (nb, d))
        return out.at[rows, cols].add(g, mode="drop")
    at = jnp.clip(bag, 0, nb - 1)
    rows = g[at]
    if mode == 1:
        rows = rows / jnp.maximum(count, 1)[at][:, None].astype(g.dtype)
    if psw is not None:
        rows = rows * _acc(psw)[:, None]
    if by_freq:
        freq = jnp.zeros((num_weights,), g.dtype).at[indices].add(1)
        rows = rows / freq[indices][:, None]
    return out.at[indices].add(jnp.where(valid[:, None], rows, 0))


@op("_embedding_bag_per_sample_weights_backward.default")
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode,
                                              padding_idx=-1):
    """d(loss)/d(per_sample_weights[i]): the dot of index i's bag gradient with its row (sum mode
    only, as in PyTorch)."""
    nb = grad.shape[0]
    bag, valid, _ = _bags(indices, offsets, nb, padding_idx)
    dots = jnp.sum(_acc(grad)[jnp.clip(bag, 0, nb - 1)] * _acc(weight)[indices], axis=1)
    return jnp.where(valid, dots, 0)
