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
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import nn as jnn

from . import op
from .nn import _acc


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
