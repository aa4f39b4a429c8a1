"""nn ops: convolution, softmax, dropout, and the backward ops autograd calls for them
(normalizations: norms.py; losses and glu: losses.py; pooling and upsampling: pooling.py;
attention: attention.py; embedding and embedding_bag: embedding.py; grid sampling: sampling.py).

Backward ops of linear or awkward forwards (convolution, pooling, upsampling, glu, attention) are
``jax.vjp`` of the forward lowering: exact, and XLA drops the cotangents an ``output_mask`` leaves out.
Reductions over many values (norms, softmax, losses) compute in float32 for 16-bit inputs, as
PyTorch's CPU kernels do; the caller casts every output to PyTorch's dtype.
"""
from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
from jax import lax

from . import op
from .padding import Reduce, Refuse, ZeroPadded
from .precision import HALF, acc, dot_inputs, round_to

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("a convolution or a dropout across positions")


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

def _conv_transpose_slow_half(x, w, b, stride, padding, dilation, output_padding, groups):
    """CPU's half-precision transposed convolution when its oneDNN path refuses an output padding
    as large as the stride (slow_conv_transpose2d/3d): per kernel position, a product over input
    channels accumulated in float32 and rounded (the "columns" GEMM), added into the output one
    kernel position after another (col2im / col2vol, each sum rounded), then the bias (rounded)."""
    dt = x.dtype
    nd = w.ndim - 2
    n, cin = x.shape[:2]
    ins, ks, cout_g = x.shape[2:], w.shape[2:], w.shape[1]
    outs = [(i - 1) * s - 2 * p + d * (k - 1) + o + 1
            for i, s, p, d, k, o in zip(ins, stride, padding, dilation, ks, output_padding)]
    xg = x.reshape((n, groups, cin // groups) + ins)
    wg = w.reshape((groups, cin // groups, cout_g) + ks)
    out = jnp.zeros((n, groups, cout_g) + tuple(outs), jnp.float32)
    sp = "xyz"[:nd]
    for kpos in itertools.product(*[range(k) for k in ks]):
        src, dst = [slice(None)] * 3, [slice(None)] * 3
        for i, s, p, d, kp, o in zip(ins, stride, padding, dilation, kpos, outs):
            off = kp * d - p                        # the output index input 0 lands on
            lo = -(off // s) if off < 0 else 0      # the first input landing inside
            hi = min(i, (o - 1 - off) // s + 1) if o - 1 - off >= 0 else 0
            src.append(slice(lo, max(lo, hi)))
            dst.append(slice(off + lo * s, off + (max(lo, hi) - 1) * s + 1, s))
        if any(sl.stop <= sl.start for sl in src[3:]):
            continue
        contrib = jnp.einsum(f"ngi{sp},gio->ngo{sp}", *dot_inputs(
            xg[tuple(src)], wg[(slice(None),) * 3 + kpos]), preferred_element_type=jnp.float32)
        out = round_to(out.at[tuple(dst)].add(round_to(contrib, dt)), dt)
    out = out.reshape((n, groups * cout_g) + tuple(outs))
    if b is not None:
        out = round_to(out + acc(b).reshape((1, -1) + (1,) * nd), dt)
    return out


def _conv(x, w, b, stride, padding, dilation, transposed, output_padding, groups, cpu_slow=True):
    nd = w.ndim - 2
    unbatched = x.ndim == nd + 1
    if unbatched:
        x = x[None]
    stride, padding = _tup(stride, nd, 1), _tup(padding, nd, 0)
    dilation, output_padding = _tup(dilation, nd, 1), _tup(output_padding, nd, 0)
    if (cpu_slow and transposed and x.dtype in HALF and w.dtype == x.dtype
            and any(o >= s for o, s in zip(output_padding, stride))):
        out = _conv_transpose_slow_half(x, w, b, stride, padding, dilation, output_padding, groups)
        return out[0] if unbatched else out
    sp = "DHW"[3 - nd:]
    spec = ("NC" + sp, "OI" + sp, "NC" + sp)
    # Half precision: accumulate in float32 and add the bias there, rounding once (as CPU does;
    # XLA's half-precision convolution rounded before the bias was added).
    kw = {"preferred_element_type": jnp.float32} if x.dtype in HALF else {}
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
                                       feature_group_count=groups, **kw)
    else:
        dn = lax.conv_dimension_numbers(x.shape, w.shape, spec)
        out = lax.conv_general_dilated(x, w.astype(x.dtype), stride, [(p, p) for p in padding],
                                       rhs_dilation=dilation, dimension_numbers=dn,
                                       feature_group_count=groups, **kw)
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
    def f(x, w):    # gradients accumulate in float32 and round once (CPU's slow path too)
        return _conv(x, w, None, stride, padding, dilation, transposed, output_padding, groups,
                     cpu_slow=False)
    gi = gw = gb = None
    if output_mask[0] or output_mask[1]:
        out, vjp = jax.vjp(f, input, weight)
        gi, gw = vjp(grad_output.astype(out.dtype))    # (float32 for half inputs: see _conv)
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

def _last_dim(x, dim) -> bool:
    """PyTorch's CPU softmax kernels take their "last dim" path for the last dim (not for
    another whose later dims have size 1); the paths round half-precision values differently."""
    return dim % x.ndim == x.ndim - 1


# bfloat16 values in one of PyTorch's CPU vectors with AVX-512 (its x86 build's usual kernels);
# with AVX2 (16) the positions between the two vector lengths round differently.
_BF16_LANES = 32


@op("_softmax.default", pad=Reduce(1, "-inf"))
def _softmax(self, dim, half_to_float):
    if self.ndim == 0:
        return jnp.ones((), _acc(self).dtype)
    if self.dtype in HALF and not half_to_float and not _last_dim(self, dim):
        # CPU's kernel writes exp(x - max) to the half-precision output, sums it in float32
        # before rounding, then scales the rounded values by 1 / sum.
        x = acc(self)
        e = jnp.exp(x - jnp.max(x, axis=dim, keepdims=True))
        s = jnp.sum(e, axis=dim, keepdims=True)
        if self.dtype != jnp.bfloat16:
            return round_to(e, self.dtype) * (1.0 / s)
        # bfloat16 has its own kernel: vectors of positions after dim divide the float32
        # exponentials and round once; the positions left over (the tail) divide the rounded ones.
        d = dim % x.ndim
        inner = x.shape[d + 1:]
        n = math.prod(inner)
        pos = jnp.arange(n).reshape(inner)
        return jnp.where(pos < n // _BF16_LANES * _BF16_LANES, e / s, round_to(e, self.dtype) / s)
    return jax.nn.softmax(_acc(self), axis=dim)


@op("_log_softmax.default", pad=Reduce(1, "-inf"))
def _log_softmax(self, dim, half_to_float):
    if self.ndim == 0:
        return jnp.zeros((), _acc(self).dtype)
    if self.dtype in HALF and not half_to_float and _last_dim(self, dim):
        # CPU's last-dim kernel keeps the sum of exponentials and its log in the input's dtype.
        x = acc(self)
        m = jnp.max(x, axis=dim, keepdims=True)
        total = round_to(jnp.sum(jnp.exp(x - m), axis=dim, keepdims=True), self.dtype)
        return x - m - round_to(jnp.log(total), self.dtype)
    return jax.nn.log_softmax(_acc(self), axis=dim)


@op("_softmax_backward_data.default", pad=ZeroPadded(inputs=(0, 1)))
def _softmax_backward_data(grad_output, output, dim, input_dtype):
    g, y = _acc(grad_output), _acc(output)
    if y.ndim == 0:
        return g * 0
    return y * (g - jnp.sum(g * y, axis=dim, keepdims=True))


@op("_log_softmax_backward_data.default", pad=ZeroPadded(inputs=(0, 1)))
def _log_softmax_backward_data(grad_output, output, dim, input_dtype):
    g, y = _acc(grad_output), _acc(output)
    if y.ndim == 0:
        return g * 0
    return g - jnp.exp(y) * jnp.sum(g, axis=dim, keepdims=True)


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
