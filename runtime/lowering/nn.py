"""nn ops: convolution, normalization, softmax, embedding, dropout, and the backward ops autograd
calls for them (losses and glu: losses.py; pooling and upsampling: pooling.py; attention:
attention.py).

Backward ops of linear or awkward forwards (convolution, pooling, upsampling, glu, attention) are
``jax.vjp`` of the forward lowering: exact, and XLA drops the cotangents an ``output_mask`` leaves out.
Reductions over many values (norms, softmax, losses) compute in float32 for 16-bit inputs, as
PyTorch's CPU kernels do; the caller casts every output to PyTorch's dtype.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from jax import lax

from . import check_index, op


# --------------------------------------------------------------------------------------------
# helpers

def _acc(x):
    """``x`` in its accumulation dtype: float32 for 16-bit floats and integers, else itself."""
    if x.dtype in (jnp.float16, jnp.bfloat16) or not jnp.issubdtype(x.dtype, jnp.inexact):
        return x.astype(jnp.float32)
    return x


def _tup(v, n, default=None):
    """An int / int[] argument expanded to ``n`` entries (``[]`` -> ``default``)."""
    if v is None or (isinstance(v, (tuple, list)) and len(v) == 0):
        v = default
    if isinstance(v, int):
        return (v,) * n
    v = tuple(int(a) for a in v)
    return v * n if len(v) == 1 else v


def _reduce(loss, reduction):
    """PyTorch's loss reduction: 0 none, 1 mean, 2 sum."""
    if reduction == 1:
        return jnp.mean(loss)
    if reduction == 2:
        return jnp.sum(loss)
    return loss


def _sum_to(g, shape):
    """Sum a broadcast gradient back down to ``shape``."""
    shape = tuple(shape)
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(i + lead for i, s in enumerate(shape)
                                     if s == 1 and g.shape[i + lead] != 1)
    return jnp.sum(g, axis=axes, keepdims=True).reshape(shape) if axes else g.reshape(shape)


def _grad_scale(grad_output, reduction, n):
    """The cotangent of each element of an unreduced loss of ``n`` elements."""
    if reduction == 1:
        return grad_output / n
    return grad_output


def _zeros(aval):
    return jnp.zeros(aval[0], aval[1])


# --------------------------------------------------------------------------------------------
# convolution

def _conv(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    nd = w.ndim - 2
    unbatched = x.ndim == nd + 1
    if unbatched:
        x = x[None]
    stride, padding = _tup(stride, nd, 1), _tup(padding, nd, 0)
    dilation, output_padding = _tup(dilation, nd, 1), _tup(output_padding, nd, 0)
    sp = "DHW"[3 - nd:]
    spec = ("NC" + sp, "OI" + sp, "NC" + sp)
    if transposed:
        # The gradient of a convolution with respect to its input: dilate the input by the
        # stride, pad by dilation*(k-1)-padding, and convolve with the flipped, I/O-swapped kernel.
        cin, cout_g, ks = w.shape[0], w.shape[1], w.shape[2:]
        wt = w.reshape((groups, cin // groups, cout_g) + ks)
        wt = jnp.swapaxes(wt, 1, 2).reshape((groups * cout_g, cin // groups) + ks)
        wt = jnp.flip(wt, axis=tuple(range(2, 2 + nd)))
        pads = [(d * (k - 1) - p, d * (k - 1) - p + op_)
                for k, p, d, op_ in zip(ks, padding, dilation, output_padding)]
        dn = lax.conv_dimension_numbers(x.shape, wt.shape, spec)
        out = lax.conv_general_dilated(x, wt.astype(x.dtype), (1,) * nd, pads, lhs_dilation=stride,
                                       rhs_dilation=dilation, dimension_numbers=dn,
                                       feature_group_count=groups)
    else:
        dn = lax.conv_dimension_numbers(x.shape, w.shape, spec)
        out = lax.conv_general_dilated(x, w.astype(x.dtype), stride, [(p, p) for p in padding],
                                       rhs_dilation=dilation, dimension_numbers=dn,
                                       feature_group_count=groups)
    if b is not None:
        out = out + b.astype(out.dtype).reshape((1, -1) + (1,) * nd)
    return out[0] if unbatched else out


@op("convolution.default", "_convolution.default")
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
                *_flags):
    return _conv(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


@op("convolution_backward.default")
def convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation,
                         transposed, output_padding, groups, output_mask):
    def f(x, w):
        return _conv(x, w, None, stride, padding, dilation, transposed, output_padding, groups)
    gi = gw = gb = None
    if output_mask[0] or output_mask[1]:
        _, vjp = jax.vjp(f, input, weight)
        gi, gw = vjp(grad_output.astype(input.dtype))
    if output_mask[2]:
        axes = (0,) + tuple(range(2, grad_output.ndim))
        if grad_output.ndim == weight.ndim - 1:          # unbatched
            axes = tuple(range(1, grad_output.ndim))
        gb = jnp.sum(_acc(grad_output), axis=axes)
    return (gi if output_mask[0] else None, gw if output_mask[1] else None, gb)


@op("_weight_norm_interface_backward.default")
def _weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    # w = v * g / |v| (norms over every dim but ``dim``, kept as size 1), as PyTorch's CPU kernel.
    axes = tuple(i for i in range(saved_v.ndim) if i != dim % saved_v.ndim)
    gw, v, g, n = _acc(grad_w), _acc(saved_v), _acc(saved_g), _acc(saved_norms)
    s = jnp.sum(gw * v, axis=axes, keepdims=True)
    grad_g = s / n
    grad_v = (g / n) * gw - (g / n) * (grad_g / n) * v
    return grad_v.astype(saved_v.dtype), grad_g.astype(saved_g.dtype)


# --------------------------------------------------------------------------------------------
# softmax

@op("_softmax.default")
def _softmax(self, dim, half_to_float):
    if self.ndim == 0:
        return jnp.ones((), _acc(self).dtype)
    return jax.nn.softmax(_acc(self), axis=dim)


@op("_log_softmax.default")
def _log_softmax(self, dim, half_to_float):
    if self.ndim == 0:
        return jnp.zeros((), _acc(self).dtype)
    return jax.nn.log_softmax(_acc(self), axis=dim)


@op("_softmax_backward_data.default")
def _softmax_backward_data(grad_output, output, dim, input_dtype):
    g, y = _acc(grad_output), _acc(output)
    if y.ndim == 0:
        return g * 0
    return y * (g - jnp.sum(g * y, axis=dim, keepdims=True))


@op("_log_softmax_backward_data.default")
def _log_softmax_backward_data(grad_output, output, dim, input_dtype):
    g, y = _acc(grad_output), _acc(output)
    if y.ndim == 0:
        return g * 0
    return g - jnp.exp(y) * jnp.sum(g, axis=dim, keepdims=True)


# --------------------------------------------------------------------------------------------
# normalization

def _norm_backward(g, xhat, rstd, axes):
    """d(loss)/dx of xhat = (x - mean(x)) * rstd over ``axes``, given g = d(loss)/d(xhat)."""
    mg = jnp.mean(g, axis=axes, keepdims=True)
    mgx = jnp.mean(g * xhat, axis=axes, keepdims=True)
    return rstd * (g - mg - xhat * mgx)


@op("native_layer_norm.default")
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    x = _acc(input)
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out, mean, rstd


@op("native_layer_norm_backward.default")
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias,
                               output_mask):
    x, g = _acc(input), _acc(grad_out)
    k = len(normalized_shape)
    axes = tuple(range(x.ndim - k, x.ndim))
    batch = tuple(range(x.ndim - k))
    xhat = (x - mean) * rstd
    gi = gw = gb = None
    if output_mask[0]:
        gx = g * weight if weight is not None else g
        gi = _norm_backward(gx, xhat, rstd, axes)
    if output_mask[1]:
        gw = jnp.sum(g * xhat, axis=batch)
    if output_mask[2]:
        gb = jnp.sum(g, axis=batch)
    return gi, gw, gb


def _per_channel(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


@op("native_group_norm.default")
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    x = _acc(input).reshape(N, group, C // group * HxW)
    mean = jnp.mean(x, axis=2, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=2, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    out = ((x - mean) * rstd).reshape(N, C, HxW)
    if weight is not None:
        out = out * weight.reshape(1, C, 1)
    if bias is not None:
        out = out + bias.reshape(1, C, 1)
    return out.reshape(input.shape), mean.reshape(N, group), rstd.reshape(N, group)


@op("native_group_norm_backward.default")
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    x = _acc(input).reshape(N, group, C // group * HxW)
    g = _acc(grad_out).reshape(N, C, HxW)
    mean, rstd = mean.reshape(N, group, 1), rstd.reshape(N, group, 1)
    xhat = (x - mean) * rstd
    gi = gw = gb = None
    if output_mask[0]:
        gx = g * weight.reshape(1, C, 1) if weight is not None else g
        gi = _norm_backward(gx.reshape(x.shape), xhat, rstd, (2,)).reshape(input.shape)
    if output_mask[1]:
        gw = jnp.sum(g * xhat.reshape(N, C, HxW), axis=(0, 2))
    if output_mask[2]:
        gb = jnp.sum(g, axis=(0, 2))
    return gi, gw, gb


def _bn_train(x, weight, bias, eps):
    axes = (0,) + tuple(range(2, x.ndim))
    mean = jnp.mean(x, axis=axes)
    var = jnp.mean(jnp.square(x - _per_channel(mean, x.ndim)), axis=axes)
    invstd = lax.rsqrt(var + eps)
    return _bn_apply(x, weight, bias, mean, invstd), mean, var, invstd


def _bn_apply(x, weight, bias, mean, invstd):
    out = (x - _per_channel(mean, x.ndim)) * _per_channel(invstd, x.ndim)
    if weight is not None:
        out = out * _per_channel(weight, x.ndim)
    if bias is not None:
        out = out + _per_channel(bias, x.ndim)
    return out


def _bn_eval(x, weight, bias, running_mean, running_var, eps):
    invstd = lax.rsqrt(_acc(running_var) + eps)
    return _bn_apply(x, weight, bias, _acc(running_mean), invstd)


def _saved(avals, k, v):
    """Saved statistic ``k`` as meta shapes it (PyTorch returns empty ones in eval mode)."""
    shape = avals[k][0]
    return v if tuple(v.shape) == tuple(shape) else jnp.zeros(shape, avals[k][1])


@op("_native_batch_norm_legit_functional.default", meta=True)
def _native_batch_norm_legit_functional(input, weight, bias, running_mean, running_var, training,
                                        momentum, eps, *, _avals):
    x = _acc(input)
    if not training:
        out = _bn_eval(x, weight, bias, running_mean, running_var, eps)
        return (out, _zeros(_avals[1]), _zeros(_avals[2]), running_mean, running_var)
    out, mean, var, invstd = _bn_train(x, weight, bias, eps)
    n = x.size // x.shape[1]
    new_mean = (1 - momentum) * running_mean + momentum * mean
    new_var = (1 - momentum) * running_var + momentum * var * (n / max(n - 1, 1))
    return out, _saved(_avals, 1, mean), _saved(_avals, 2, invstd), new_mean, new_var


@op("_native_batch_norm_legit_no_training.default", meta=True)
def _native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum,
                                         eps, *, _avals):
    out = _bn_eval(_acc(input), weight, bias, running_mean, running_var, eps)
    return out, _zeros(_avals[1]), _zeros(_avals[2])


@op("native_batch_norm_backward.default")
def native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean,
                               save_invstd, train, eps, output_mask):
    x, g = _acc(input), _acc(grad_out)
    nd = x.ndim
    axes = (0,) + tuple(range(2, nd))
    if train:
        mean, invstd = _acc(save_mean), _acc(save_invstd)
    else:
        mean, invstd = _acc(running_mean), lax.rsqrt(_acc(running_var) + eps)
    mean_b, invstd_b = _per_channel(mean, nd), _per_channel(invstd, nd)
    xhat = (x - mean_b) * invstd_b
    w = _per_channel(weight, nd) if weight is not None else None
    gi = gw = gb = None
    if output_mask[0]:
        gx = g * w if w is not None else g
        gi = _norm_backward(gx, xhat, invstd_b, axes) if train else gx * invstd_b
    if output_mask[1]:
        gw = jnp.sum(g * xhat, axis=axes)
    if output_mask[2]:
        gb = jnp.sum(g, axis=axes)
    return gi, gw, gb


@op("batch_norm_backward.default")
def batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_var,
                        update, eps, output_mask, reserve):
    # save_var holds the inverse standard deviation (as native_batch_norm saves it).
    return native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean,
                                      save_var, update, eps, output_mask)


# --------------------------------------------------------------------------------------------
# embedding

@op("embedding.default")
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    check_index(indices, weight.shape[0], allow_negative=False)
    return jnp.take(weight, indices, axis=0)


@op("embedding_dense_backward.default")
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    idx = indices.reshape(-1)
    g = _acc(grad_output).reshape(idx.shape[0], -1)
    if padding_idx >= 0:
        g = jnp.where((idx != padding_idx)[:, None], g, 0)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[idx].add(1)
        g = g / counts[idx][:, None]
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
# dropout

@op("native_dropout.default", rng=True)
def native_dropout(input, p, train, *, key):
    if train is False:
        return input, jnp.ones(input.shape, jnp.bool_)
    if isinstance(p, (int, float)):
        scale = 1.0 / (1.0 - p) if p < 1 else 0.0
    else:
        scale = jnp.where(p < 1, 1.0 / (1.0 - p), 0.0)
    keep = jax.random.bernoulli(key, 1.0 - p, input.shape)
    return input * keep.astype(input.dtype) * jnp.asarray(scale, _acc(input).dtype), keep


@op("native_dropout_backward.default")
def native_dropout_backward(grad_output, mask, scale):
    return grad_output * mask.astype(grad_output.dtype) * jnp.asarray(scale, _acc(grad_output).dtype)


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
    bag = jnp.searchsorted(offsets[:nb], pos, side="right") - 1
    valid = (bag >= 0) & (indices != padding_idx) if padding_idx >= 0 else bag >= 0
    if include_last_offset:
        valid = valid & (pos < offsets[-1])
    bag = jnp.where(valid, bag, nb)                  # nb: dropped by the segment ops
    count = jax.ops.segment_sum(valid.astype(jnp.int64), bag, nb)
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


# --------------------------------------------------------------------------------------------
# grid_sampler_2d: PyTorch's forward decomposes into ops that are lowered; its backward has no
# decomposition, so it is the vjp of this forward (PyTorch's CPU kernel: grid_sampler_unnormalize,
# compute_source_index, bilinear / nearest (round half to even) / bicubic (A = -0.75) taps, taps out
# of bounds read 0)

def _gs_unnormalize(coord, size, align):
    return (coord + 1) / 2 * (size - 1) if align else ((coord + 1) * size - 1) / 2


def _gs_reflect(coord, twice_low, twice_high):
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    coord = jnp.abs(coord - low)
    extra = jnp.fmod(coord, span)
    flips = jnp.floor(coord / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + low, span - extra + low)


def _gs_pad(coord, size, padding, align):
    """Border clips to the edge; reflection mirrors at the edges (then clips, as PyTorch does)."""
    if padding == 1:
        return jnp.clip(coord, 0, size - 1)
    if padding == 2:
        coord = _gs_reflect(coord, 0, 2 * (size - 1)) if align else _gs_reflect(coord, -1, 2 * size - 1)
        return jnp.clip(coord, 0, size - 1)
    return coord


def _gs_taps(inp, idx):
    """inp (N, C, *spatial) at integer coordinates ``idx`` (x first: the last spatial dim), each
    (N, *out): (N, C, *out), 0 outside."""
    n, c = inp.shape[:2]
    sizes = inp.shape[2:][::-1]                 # W, H (, D): the order of the grid's coordinates
    inside, flat, stride = True, 0, 1
    for i, size in zip(idx, sizes):
        inside = inside & (i >= 0) & (i < size)
        flat = flat + jnp.clip(i, 0, size - 1) * stride
        stride *= size
    vals = jnp.take_along_axis(inp.reshape(n, c, -1), flat.astype(jnp.int32).reshape(n, 1, -1),
                               axis=2)
    return jnp.where(inside[:, None], vals.reshape(n, c, *idx[0].shape[1:]), 0)


def _cubic_weights(t, a=-0.75):
    def near(x):
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return far(t + 1), near(t), near(1 - t), far(2 - t)


def _grid_sample(inp, grid, mode, padding, align):
    """2-D (N, C, H, W) or 3-D (N, C, D, H, W) input; the grid's last axis is x, y (, z)."""
    sizes = inp.shape[2:][::-1]
    coords = [_gs_unnormalize(grid[..., k], size, align) for k, size in enumerate(sizes)]
    if mode == 2:                       # bicubic (2-D only): padding applies to each tap
        (ix, iy), (w, h) = coords, sizes
        x0, y0 = jnp.floor(ix), jnp.floor(iy)
        wx, wy = _cubic_weights(ix - x0), _cubic_weights(iy - y0)
        out = 0
        for j in range(4):
            yj = _gs_pad(y0 - 1 + j, h, padding, align).astype(jnp.int64)
            for i in range(4):
                xi = _gs_pad(x0 - 1 + i, w, padding, align).astype(jnp.int64)
                out = out + _gs_taps(inp, (xi, yj)) * (wx[i] * wy[j])[:, None]
        return out
    coords = [_gs_pad(c, size, padding, align) for c, size in zip(coords, sizes)]
    if mode == 1:
        return _gs_taps(inp, [jnp.round(c).astype(jnp.int64) for c in coords])
    lows = [jnp.floor(c) for c in coords]
    fracs = [c - lo for c, lo in zip(coords, lows)]
    lows = [lo.astype(jnp.int64) for lo in lows]
    out = 0
    for corner in itertools.product((0, 1), repeat=len(coords)):   # (bi/tri)linear
        wgt = 1
        for up, t in zip(corner, fracs):
            wgt = wgt * (t if up else 1 - t)
        out = out + _gs_taps(inp, [lo + up for lo, up in zip(lows, corner)]) * wgt[:, None]
    return out


@op("grid_sampler_2d_backward.default")
def grid_sampler_2d_backward(grad_output, inp, grid, interpolation_mode, padding_mode,
                             align_corners, output_mask):
    x, g = _acc(inp), _acc(grid)
    _, vjp = jax.vjp(lambda a, b: _grid_sample(a, b, interpolation_mode, padding_mode,
                                               align_corners), x, g)
    gi, gg = vjp(_acc(grad_output))
    return (gi if output_mask[0] else None), gg


@op("grid_sampler_3d.default")
def grid_sampler_3d(inp, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sample(_acc(inp), _acc(grid), interpolation_mode, padding_mode, align_corners)


@op("grid_sampler_3d_backward.default")
def grid_sampler_3d_backward(grad_output, inp, grid, interpolation_mode, padding_mode,
                             align_corners, output_mask):
    return grid_sampler_2d_backward(grad_output, inp, grid, interpolation_mode, padding_mode,
                                    align_corners, output_mask)
