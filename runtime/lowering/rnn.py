"""The fused LSTM and GRU cells PyTorch's recurrent layers call on an accelerator.

``nn.LSTM``, ``nn.GRU``, ``nn.LSTMCell`` and ``nn.GRUCell`` compute each time step's gates with two
matmuls and then, on CUDA, XPU and PrivateUse1 devices (``tpu`` is one), call a fused cell:
``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell``, whose backward ops are
``_thnn_fused_lstm_cell_backward_impl`` / ``_thnn_fused_gru_cell_backward``. PyTorch has kernels
for them on CUDA only (CPU takes an unfused path), so without these lowerings a recurrent layer
failed on tpu. The arithmetic is that of PyTorch's CUDA kernels (``aten/src/ATen/native/cuda/RNN.cu``):
gates in float32 for 16-bit inputs, and the same workspace layout, which the backward reads:

- LSTM: workspace ``[i, f, g, o]`` (activated gates, ``4H`` per row);
- GRU: workspace ``[r, z, n, hx, hn + b_hn]`` (``5H`` per row).

For bfloat16 and float16 inputs ``deferfuse/rnn.py`` runs CPU's algorithm instead: unfused ops, or
oneDNN's LSTM layer (``mkldnn_rnn_layer`` and its backward), lowered at the end of this module.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax import nn as jnn

from . import op
from .padding import Batched, Refuse
from .nn import _acc
from .precision import acc, round_to

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("a recurrent layer over time steps: no padding rule")


def _gates(input_gates, hidden_gates, input_bias, hidden_bias, k):
    """The ``k`` pre-activation gate blocks (each ``[B, H]``), summed in float32 as CUDA does."""
    g = _acc(input_gates) + _acc(hidden_gates)
    if input_bias is not None:
        g = g + _acc(input_bias) + _acc(hidden_bias)
    return jnp.split(g, k, axis=1)


@op("_thnn_fused_lstm_cell.default")
def _thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    i, f, g, o = _gates(input_gates, hidden_gates, input_bias, hidden_bias, 4)
    i, f, g, o = jnn.sigmoid(i), jnn.sigmoid(f), jnp.tanh(g), jnn.sigmoid(o)
    cy = f * _acc(cx) + i * g
    hy = o * jnp.tanh(cy)
    dt = input_gates.dtype
    return hy.astype(dt), cy.astype(dt), jnp.concatenate([i, f, g, o], axis=1).astype(dt)


@op("_thnn_fused_lstm_cell_backward_impl.default")
def _thnn_fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    if grad_hy is None and grad_cy is None:
        return None, None, None
    i, f, g, o = (_acc(w) for w in jnp.split(workspace, 4, axis=1))
    go = _acc(grad_hy) if grad_hy is not None else 0.0
    gc = _acc(grad_cy) if grad_cy is not None else 0.0
    t = jnp.tanh(_acc(cy))
    gcx = go * o * (1 - t * t) + gc
    grad_gates = jnp.concatenate([gcx * g * (1 - i) * i, gcx * _acc(cx) * (1 - f) * f,
                                  gcx * i * (1 - g * g), go * t * (1 - o) * o], axis=1)
    dt = workspace.dtype
    grad_gates = grad_gates.astype(dt)
    grad_bias = jnp.sum(_acc(grad_gates), axis=0).astype(dt) if has_bias else None
    return grad_gates, (gcx * f).astype(dt), grad_bias


@op("_thnn_fused_gru_cell.default")
def _thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    ir, ii, in_ = jnp.split(_acc(input_gates), 3, axis=1)
    hr, hi, hn = jnp.split(_acc(hidden_gates), 3, axis=1)
    if input_bias is not None:
        b1r, b1i, b1n = jnp.split(_acc(input_bias), 3)
        b2r, b2i, b2n = jnp.split(_acc(hidden_bias), 3)
        ir, ii, in_ = ir + hr + b1r + b2r, ii + hi + b1i + b2i, in_ + b1n
        hn = hn + b2n
    else:
        ir, ii = ir + hr, ii + hi
    r, z = jnn.sigmoid(ir), jnn.sigmoid(ii)
    n = jnp.tanh(in_ + r * hn)
    h = _acc(hx)
    hy = n + z * (h - n)
    dt = input_gates.dtype
    return hy.astype(dt), jnp.concatenate([r, z, n, h, hn], axis=1).astype(dt)


@op("_thnn_fused_gru_cell_backward.default")
def _thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hx, hn = (_acc(w) for w in jnp.split(workspace, 5, axis=1))
    go = _acc(grad_hy)
    gz = go * (hx - n) * (1 - z) * z
    gn = go * (1 - z) * (1 - n * n)
    gr = gn * hn * (1 - r) * r
    dt = workspace.dtype
    grad_input = jnp.concatenate([gr, gz, gn], axis=1).astype(dt)
    grad_hidden = jnp.concatenate([gr, gz, gn * r], axis=1).astype(dt)
    gbi = gbh = None
    if has_bias:
        gbi = jnp.sum(_acc(grad_input), axis=0).astype(dt)
        gbh = jnp.sum(_acc(grad_hidden), axis=0).astype(dt)
    return grad_input, grad_hidden, (go * z).astype(dt), gbi, gbh


# ---------------------------------------------------------------------------------------------
# oneDNN's LSTM layer (``mkldnn_rnn_layer``): what CPU's ``aten::lstm`` runs for bfloat16 (and
# float16 without autograd) on a processor oneDNN supports it on; ``deferfuse/rnn.py`` emits it
# for tpu where CPU would. oneDNN's arithmetic, reproduced bit for bit in bfloat16 and float16:
#
# - forward: the bias is ``b_ih + b_hh`` rounded to the dtype (PyTorch adds them in the dtype);
#   each step's gates are float32 sums of float32 products (all steps' input products at once,
#   then the hidden product) plus the bias, activated in float32; the cell state is rounded to
#   the dtype after every step (its workspace copy is in the dtype), the hidden state
#   ``o * tanh(c)`` (of the unrounded c) too; the activated gates are kept rounded for the
#   backward pass;
# - backward: gradients flow in float32; each step's gate gradients are rounded to the dtype
#   before their products (the input's, the previous hidden state's and the weights') and their
#   sum (the bias's); the results are float32 (autograd rounds them to the parameters' dtype).

_HI = lax.Precision.HIGHEST


def _live(input, steps):
    """Which time steps of ``input`` are real: all, or the first ``steps`` (NOTE [padded
    steps])."""
    return lax.iota(jnp.int32, input.shape[0]) < steps


def _onednn_states(input, w0, w1, w2, w3, hx, cx, reverse, has_biases, steps=None):
    """The forward recurrence: per step (in time order) the rounded gates, the previous hidden
    and cell states and the new ones; and the final states. ``steps``: NOTE [padded steps]."""
    dt = input.dtype
    n_batch, hidden = input.shape[1], w1.shape[1]
    x = acc(input)
    live = None
    if steps is not None:
        live = _live(input, steps)
        x = jnp.where(live[:, None, None], x, jnp.zeros((), x.dtype))
    bias = round_to(acc(w2) + acc(w3), dt) if has_biases else jnp.zeros((4 * hidden,), x.dtype)
    layer = jnp.einsum("tbi,gi->tbg", x, acc(w0), precision=_HI)
    wh = acc(w1)

    def step(carry, xs):
        h, c = carry
        xg, ok = xs
        g = xg + jnp.dot(h, wh.T, precision=_HI) + bias
        i, f, gg, o = jnp.split(g, 4, axis=1)
        i, f, gg, o = jnn.sigmoid(i), jnn.sigmoid(f), jnp.tanh(gg), jnn.sigmoid(o)
        c_new = f * c + i * gg
        h_new = round_to(o * jnp.tanh(c_new), dt)
        c_new = round_to(c_new, dt)
        gates = tuple(round_to(v, dt) for v in (i, f, gg, o))
        if ok is not None:      # a padded step keeps the state as it was
            h_new, c_new = jnp.where(ok, h_new, h), jnp.where(ok, c_new, c)
        return (h_new, c_new), (gates, h, c, h_new, c_new)

    h0 = acc(hx).reshape(n_batch, hidden)
    c0 = acc(cx).reshape(n_batch, hidden)
    return lax.scan(step, (h0, c0), (layer, live), reverse=reverse)


def _onednn_check(mode, batch_sizes):
    if mode != 2 or batch_sizes:
        raise NotImplementedError("mkldnn_rnn_layer: only an LSTM over a padded sequence is "
                                  "lowered (the only one PyTorch's CPU LSTM runs)")


# Padded: each batch row is its own recurrence (the batch is dim -2 of every tensor of these
# ops: the sequence, the states, the gradients); the backward pass sums the weight gradients
# over it, with the padding of its inputs set to 0 (zero states and gradients give zero gate
# gradients).
#
# NOTE [padded steps]: a padded time dim (dim 0: word_language_model's ragged last bptt chunk,
# ``source[i:i + min(bptt, len(source) - 1 - i)]``) runs with the exact count of steps
# (``_steps``, from Batched's ``steps``): a padded step keeps the states as they were, so the
# final states are those after the last real step, in either direction (a reversed layer starts
# in the padding and carries its initial states through it unchanged); the padded steps' input is
# set to 0 (never trusted), and the backward pass gives them no gate gradients and carries the
# state gradients through them unchanged, so the weight gradients sum over real steps only.
_BATCH = Batched(dims=(0, -2), fixed=(1, 2, 3, 4), zero=True, steps=0)


@op("mkldnn_rnn_layer.default", pad=_BATCH)
def mkldnn_rnn_layer(input, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden_size,
                     num_layers, has_biases, bidirectional, batch_first, train, _steps=None):
    _onednn_check(mode, batch_sizes)
    dt = input.dtype
    (h, c), (_, _, _, ys, _) = _onednn_states(input, w0, w1, w2, w3, hx, cx, reverse, has_biases,
                                              _steps)
    return (ys.astype(dt), h.reshape(hx.shape).astype(dt), c.reshape(cx.shape).astype(dt),
            jnp.zeros((0,), jnp.uint8))


# NOTE [gates from the output]: the backward pass does not run the forward recurrence again. The
# hidden state each step started from is in the forward pass's ``output`` (the step before's
# output, or ``hx`` for the first step; with padded steps, NOTE [padded steps], the padding of
# ``output`` is never read: a reversed layer's last real step starts from ``hx``), so every
# step's gates come from two products over all steps at once, as CPU's oneDNN keeps them in its
# workspace; only the cell states are a recurrence, elementwise (``_cells``).
# The input's gradient is one product over all steps after the backward scan. Before, the backward
# program ran the forward scan (a product per step) and then the backward one with two products
# per step: one scan of 35 steps fewer for word_language_model's layer. The sums may differ from
# the forward pass's in their last bits (products blocked otherwise), well inside CPU's tolerance.
def _cells(i, f, g, c0, dt, live, reverse):
    """Each step's cell state before and after it, from the activated gates (unrounded, as the
    forward pass uses them); a padded step keeps the state (NOTE [padded steps])."""
    def step(c, xs):
        ii, ff, gg, ok = xs
        c_new = round_to(ff * c + ii * gg, dt)
        if ok is not None:
            c_new = jnp.where(ok, c_new, c)
        return c_new, (c, c_new)
    _, (c_prev, c_new) = lax.scan(step, c0, (i, f, g, live), reverse=reverse)
    return c_prev, c_new


@op("mkldnn_rnn_layer_backward.default", pad=_BATCH)
def mkldnn_rnn_layer_backward(input, w0, w1, w2, w3, hx, cx, output, hy, cy, grad_output,
                              grad_hy, grad_cy, reverse, mode, hidden_size, num_layers,
                              has_biases, train, bidirectional, batch_sizes, batch_first,
                              workspace, _steps=None):
    _onednn_check(mode, batch_sizes)
    dt = input.dtype
    steps, n_batch, hidden = input.shape[0], input.shape[1], w1.shape[1]
    live = None if _steps is None else _live(input, _steps)
    x = acc(input)
    if live is not None:
        x = jnp.where(live[:, None, None], x, jnp.zeros((), x.dtype))
    # NOTE [gates from the output]
    h0 = acc(hx).reshape(1, n_batch, hidden)
    hs = acc(output)
    h_prev = jnp.concatenate([hs[1:], h0]) if reverse else jnp.concatenate([h0, hs[:-1]])
    if live is not None:
        # A padded step's output is not read (a bucket's input holds anything there): a reversed
        # layer's last real step started from ``hx``, and padded steps start from 0.
        if reverse:
            nxt = jnp.concatenate([live[1:], jnp.zeros((1,), live.dtype)])
            h_prev = jnp.where(nxt[:, None, None], h_prev, h0)
        h_prev = jnp.where(live[:, None, None], h_prev, jnp.zeros((), h_prev.dtype))
    bias = round_to(acc(w2) + acc(w3), dt) if has_biases else jnp.zeros((4 * hidden,), x.dtype)
    wi, wh = acc(w0), acc(w1)
    pre = (jnp.einsum("tbi,gi->tbg", x, wi, precision=_HI)
           + jnp.einsum("tbh,gh->tbg", h_prev, wh, precision=_HI)) + bias
    i, f, g, o = jnp.split(pre, 4, axis=2)
    i, f, g, o = jnn.sigmoid(i), jnn.sigmoid(f), jnp.tanh(g), jnn.sigmoid(o)
    c_prev, c_new = _cells(i, f, g, acc(cx).reshape(n_batch, hidden), dt, live, reverse)
    gates = tuple(round_to(v, dt) for v in (i, f, g, o))
    zeros = jnp.zeros((n_batch, hidden), jnp.float32)
    gy = jnp.zeros((steps, n_batch, hidden), jnp.float32) if grad_output is None \
        else acc(grad_output).astype(jnp.float32)
    dh0 = zeros if grad_hy is None else acc(grad_hy).reshape(n_batch, hidden).astype(jnp.float32)
    dc0 = zeros if grad_cy is None else acc(grad_cy).reshape(n_batch, hidden).astype(jnp.float32)

    def step(carry, xs):
        dh, dc = carry
        (i, f, g, o), cp, ct, dy, ok = xs
        tc = jnp.tanh(ct)
        dht = dy + dh
        dct = dc + (1 - tc * tc) * o * dht
        dg = jnp.concatenate([g * dct * ((1 - i) * i), cp * dct * ((1 - f) * f),
                              i * dct * (1 - g * g), tc * dht * ((1 - o) * o)], axis=1)
        dg = round_to(dg, dt)
        dh_new, dc_new = jnp.dot(dg, wh, precision=_HI), dct * f
        if ok is not None:      # NOTE [padded steps]: nothing from a padded step
            dg = jnp.where(ok, dg, jnp.zeros((), dg.dtype))
            dh_new, dc_new = jnp.where(ok, dh_new, dh), jnp.where(ok, dc_new, dc)
        return (dh_new, dc_new), dg

    # The backward pass walks the steps in the other order than the forward one.
    (dh, dc), dgs = lax.scan(step, (dh0, dc0), (gates, c_prev, c_new, gy, live),
                             reverse=not reverse)
    dx = jnp.einsum("tbg,gi->tbi", dgs, wi, precision=_HI)
    dw_ih = jnp.einsum("tbg,tbi->gi", dgs, x, precision=_HI)
    dw_hh = jnp.einsum("tbg,tbh->gh", dgs, h_prev, precision=_HI)
    db = jnp.sum(dgs, axis=(0, 1))
    return dx, dw_ih, dw_hh, db, db, dh.reshape(hx.shape), dc.reshape(cx.shape)
