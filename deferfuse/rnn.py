"""Recurrent layers in bfloat16 and float16, computed as CPU computes them.

PyTorch's recurrent ops (``aten::lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``, ``lstm_cell``,
``gru_cell``) are composites whose C++ picks an algorithm by device (ATen's ``RNN.cpp``). On
CUDA, XPU and PrivateUse1 devices (``tpu`` is one) each step computes its two gate products and
calls a fused cell (``_thnn_fused_lstm_cell``: gates summed and activated in float32, one rounding
per output). On CPU:

- the input's gate product of every step is computed at once (``linear`` over the sequence), and
  each cell is a chain of unfused ops (``linear(h).add_(x)``, ``sigmoid_``, ``tanh_``, ``mul``,
  ``add_``), each rounding to the dtype;
- ``aten::lstm`` runs oneDNN's LSTM instead, layer by layer (``mkldnn_rnn_layer``), when oneDNN
  is enabled and has the dtype on this processor (``_is_mkldnn_bf16_supported``: on x86,
  AVX-512 BW/VL/DQ or AVX-NE-CONVERT; float16 only without autograd) and the LSTM has no
  projections: gates in float32 from float32 products, the cell state rounded to the dtype after
  every step, the activated gates rounded for the backward pass, whose gate gradients are
  rounded before their products.

In half precision the two differ by several ulps on small hidden states, so for bfloat16 and
float16 inputs the kernels here (for the AutogradPrivateUse1 key) run CPU's algorithm on tpu: the
same unfused ops in the same order (autograd differentiates them as on CPU), or the same
``mkldnn_rnn_layer`` ops, lowered in ``runtime/lowering/rnn.py`` with oneDNN's arithmetic. Which
one is CPU's own decision on this host (``_cpu_uses_onednn``).

A float32 ``aten::lstm`` over a padded sequence runs oneDNN on CPU too; here it runs the same
``mkldnn_rnn_layer`` per layer-direction (a ``lax.scan`` over the time steps) instead of
PyTorch's composite, which records three ops per time step (two gate products and the fused
cell) and as many again in the backward pass: a 35-step LSTM was 105 forward ops that step
detection could mistake for a loop, each recorded on the host. Other dtypes, packed sequences,
and inputs CPU's composite would reject, go through PyTorch's composite (the fused cells).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

from .tensor import PLAIN, TpuTensor

aten = torch.ops.aten
_HALF = (torch.bfloat16, torch.float16)
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_functorch_level = torch._C._functorch.maybe_current_level
_ONEDNN_LSTM = 2        # ideep::rnn_kind::LSTM, mkldnn_rnn_layer's ``mode``
_lib = None


def _onednn_has(dtype) -> bool:
    """Whether oneDNN on this processor computes ``dtype`` (ATen's mkldnn_bf16_device_check /
    mkldnn_fp16_device_check; each a cheap query, asked per call rather than cached here)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def _cpu_uses_onednn(input, has_projections: bool) -> bool:
    """Whether CPU's ``aten::lstm`` would run oneDNN for a half-precision ``input`` (ATen's
    ``use_mkldnn``: oneDNN enabled, the dtype supported, float16 only without autograd, no
    projections, a non-empty input)."""
    if has_projections or input.numel() == 0 or not torch._C._get_mkldnn_enabled():
        return False
    if input.dtype == torch.float16 and torch.is_grad_enabled():
        return False
    return _onednn_has(input.dtype)


def _ours(tensors, dtypes=_HALF) -> bool:
    """tpu tensors of one dtype among ``dtypes`` (half precision unless told), outside functorch
    and forward-mode AD."""
    dt = tensors[0].dtype
    if dt not in dtypes:
        return False
    for t in tensors:
        if t is not None and ((type(t) is not TpuTensor and not _plain(t)) or t.dtype != dt):
            return False
    return forward_ad._current_level < 0 and _functorch_level() is None


def _plain(t) -> bool:
    """A plain tpu tensor (DEFERFUSE_TENSOR=plain, docs/cxx-plan.md); never without the flag."""
    f = PLAIN.is_plain
    return f is not None and isinstance(t, torch.Tensor) and f(t)


class _Params:
    """One layer-direction's weights (ATen's ``CellParams``)."""
    __slots__ = ("w_ih", "w_hh", "b_ih", "b_hh", "w_hr")

    def __init__(self, w_ih, w_hh, b_ih=None, b_hh=None, w_hr=None):
        self.w_ih, self.w_hh, self.b_ih, self.b_hh, self.w_hr = w_ih, w_hh, b_ih, b_hh, w_hr

    def linear_ih(self, x):
        return F.linear(x, self.w_ih, self.b_ih)

    def linear_hh(self, h):
        return F.linear(h, self.w_hh, self.b_hh)

    def matmul_hr(self, h):
        return h if self.w_hr is None else torch.matmul(h, self.w_hr.t())


def _gather_params(params, has_biases: bool, has_projections: bool = False) -> list:
    n = (4 if has_biases else 2) + (1 if has_projections else 0)
    if len(params) % n:
        return None
    out = []
    for k in range(0, len(params), n):
        p = params[k:k + n]
        if has_biases:
            out.append(_Params(p[0], p[1], p[2], p[3], p[4] if has_projections else None))
        else:
            out.append(_Params(p[0], p[1], None, None, p[2] if has_projections else None))
    return out


# ---------------------------------------------------------------------------------------------
# CPU's cells: ``pre`` when the input's gate product is already computed (a layer's steps)

def _lstm_cell(x, hidden, p, pre):
    hx, cx = hidden
    gates = p.linear_hh(hx).add_(x if pre else p.linear_ih(x))
    i, f, g, o = gates.unsafe_chunk(4, 1)
    i, f, g, o = i.sigmoid_(), f.sigmoid_(), g.tanh_(), o.sigmoid_()
    cy = (f * cx).add_(i * g)
    hy = o * cy.tanh()
    return p.matmul_hr(hy), cy


def _gru_cell(x, h, p, pre):
    ig = (x if pre else p.linear_ih(x)).unsafe_chunk(3, 1)
    hg = p.linear_hh(h).unsafe_chunk(3, 1)
    r = hg[0].add_(ig[0]).sigmoid_()
    z = hg[1].add_(ig[1]).sigmoid_()
    n = ig[2].add(hg[2].mul_(r)).tanh_()
    return (h - n).mul_(z).add_(n)


def _simple_cell(act):
    def cell(x, h, p, pre):
        return act(p.linear_hh(h).add_(x if pre else p.linear_ih(x)))
    return cell


_tanh_cell, _relu_cell = _simple_cell(torch.tanh), _simple_cell(torch.relu)


def _out(hidden):
    return hidden[0] if isinstance(hidden, tuple) else hidden


def _slice(hidden, start, end):
    if isinstance(hidden, tuple):
        return tuple(h.narrow(0, start, end - start) for h in hidden)
    return hidden.narrow(0, start, end - start)


def _concat(hiddens):
    if isinstance(hiddens[0], tuple):
        return tuple(torch.cat(list(h), 0) for h in zip(*hiddens))
    return torch.cat(hiddens, 0)


_NO_STEPS = "Expected sequence length to be larger than 0 in RNN"


# ---------------------------------------------------------------------------------------------
# CPU's layers: padded (a [T, B, I] input) and packed (data and batch sizes)

def _steps(cell, steps, hidden, p):
    outs = []
    for x in steps:
        hidden = cell(x, hidden, p, True)
        outs.append(_out(hidden))
    return outs, hidden


def _full_layer(cell, x, hidden, p):
    outs, hidden = _steps(cell, p.linear_ih(x).unbind(0), hidden, p)
    if not outs:
        raise RuntimeError(_NO_STEPS)
    return torch.stack(outs, 0), hidden


def _full_bidir_layer(cell, x, hidden, p):
    fw, fw_h = _steps(cell, p[0].linear_ih(x).unbind(0), hidden[0], p[0])
    if not fw:
        raise RuntimeError(_NO_STEPS)
    rev, rev_h = _steps(cell, p[1].linear_ih(x).unbind(0)[::-1], hidden[1], p[1])
    fw = torch.stack(fw, 0)
    return torch.cat([fw, torch.stack(rev[::-1], 0)], fw.dim() - 1), (fw_h, rev_h)


def _packed_layer(cell, data, sizes, hidden, p):
    xw = p.linear_ih(data)
    outs, done = [], []
    off, last = 0, sizes[0]
    for b in sizes:
        x = xw.narrow(0, off, b)
        off += b
        if last > b:
            done.append(_slice(hidden, b, last))
            hidden = _slice(hidden, 0, b)
        last = b
        hidden = cell(x, hidden, p, True)
        outs.append(_out(hidden))
    done.append(hidden)
    return torch.cat(outs, 0), _concat(done[::-1])


def _reversed_packed_layer(cell, data, sizes, hidden0, p):
    xw = p.linear_ih(data)
    outs = []
    off, last = data.size(0), sizes[-1]
    hidden = _slice(hidden0, 0, last)
    for b in reversed(sizes):
        if b > last:
            hidden = _concat([hidden, _slice(hidden0, last, b)])
        x = xw.narrow(0, off - b, b)
        off -= b
        last = b
        hidden = cell(x, hidden, p, True)
        outs.append(_out(hidden))
    return torch.cat(outs[::-1], 0), hidden


def _packed_bidir_layer(cell, data, sizes, hidden, p):
    fw, fw_h = _packed_layer(cell, data, sizes, hidden[0], p[0])
    rev, rev_h = _reversed_packed_layer(cell, data, sizes, hidden[1], p[1])
    return torch.cat([fw, rev], -1), (fw_h, rev_h)


def _stack(layer, x, hiddens, params, num_layers, dropout, train, bidirectional):
    """ATen's ``apply_layer_stack`` over ``_rnn_impl``: each layer (pairs of directions when
    bidirectional), dropout between layers; the final hidden state of each layer-direction."""
    if bidirectional:
        hiddens = [(hiddens[k], hiddens[k + 1]) for k in range(0, len(hiddens), 2)]
        params = [(params[k], params[k + 1]) for k in range(0, len(params), 2)]
    final = []
    for layer_i in range(num_layers):
        x, h = layer(x, hiddens[layer_i], params[layer_i])
        final.extend(h if bidirectional else (h,))
        if dropout != 0 and train and layer_i < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    return x, final


def _padded(cell, x, hiddens, params, num_layers, dropout, train, bidirectional):
    layer = functools.partial(_full_bidir_layer if bidirectional else _full_layer, cell)
    return _stack(layer, x, hiddens, params, num_layers, dropout, train, bidirectional)


def _packed(cell, data, batch_sizes, hiddens, params, num_layers, dropout, train, bidirectional):
    sizes = [int(b) for b in batch_sizes.tolist()]
    base = _packed_bidir_layer if bidirectional else _packed_layer

    def layer(x, h, p):
        return base(cell, x, sizes, h, p)
    return _stack(layer, data, hiddens, params, num_layers, dropout, train, bidirectional)


def _lstm_onednn(x, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                 batch_first):
    """CPU's oneDNN LSTM (ATen's ``mkldnn_rnn``): one ``mkldnn_rnn_layer`` per layer-direction."""
    x = (x.transpose(0, 1) if batch_first else x).contiguous()
    h0, c0 = hx[0].contiguous(), hx[1].contiguous()
    dirs = 2 if bidirectional else 1
    n = 4 if has_biases else 2
    hys, cys = [], []
    for layer_i in range(num_layers):
        outs = []
        for d in range(dirs):
            k = layer_i * dirs + d
            w = params[k * n:(k + 1) * n]
            b_ih = w[2] if has_biases else torch.zeros(w[0].shape, dtype=w[0].dtype,
                                                       device=w[0].device)
            b_hh = w[3] if has_biases else torch.zeros(w[1].shape, dtype=w[1].dtype,
                                                       device=w[1].device)
            y, hy, cy, _ = aten.mkldnn_rnn_layer(
                x, w[0], w[1], b_ih, b_hh, h0[k], c0[k], d > 0, [], _ONEDNN_LSTM, h0.size(2),
                num_layers, has_biases, bidirectional, batch_first, train)
            outs.append(y)
            hys.append(hy)
            cys.append(cy)
        x = outs[0] if dirs == 1 else torch.cat(outs, -1)
        if dropout != 0 and train and layer_i < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    return x.transpose(0, 1) if batch_first else x, torch.stack(hys, 0), torch.stack(cys, 0)


# ---------------------------------------------------------------------------------------------
# The AutogradPrivateUse1 kernels

def _lstm_hidden_ok(hx, num_layers, bidirectional) -> bool:
    want = num_layers * (2 if bidirectional else 1)
    return (len(hx) == 2 and hx[0].dim() == 3 and hx[1].dim() == 3 and hx[0].size(0) == want
            and hx[1].size(0) == want)


def lstm_input(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
               batch_first):
    """``aten::lstm.input``."""
    if (input.dim() == 3 and _ours([input, *hx, *params], _HALF + (torch.float32,))
            and _lstm_hidden_ok(hx, num_layers, bidirectional)):
        proj = hx[0].size(2) != hx[1].size(2)
        if _cpu_uses_onednn(input, proj):
            return _lstm_onednn(input, hx, params, has_biases, num_layers, dropout, train,
                                bidirectional, batch_first)
        ps = _gather_params(params, has_biases, proj) if input.dtype in _HALF else None
        if ps is not None:
            x = input.transpose(0, 1) if batch_first else input
            hiddens = list(zip(hx[0].unbind(0), hx[1].unbind(0)))
            out, final = _padded(_lstm_cell, x, hiddens, ps, num_layers, dropout, train,
                                 bidirectional)
            return (out.transpose(0, 1) if batch_first else out,
                    torch.stack([h for h, _ in final], 0), torch.stack([c for _, c in final], 0))
    return aten.lstm.input._op_dk(_COMPOSITE, input, hx, params, has_biases, num_layers, dropout,
                                  train, bidirectional, batch_first)


def lstm_data(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
              bidirectional):
    """``aten::lstm.data`` (a packed sequence; CPU never runs oneDNN for one)."""
    if (data.dim() == 2 and _ours([data, *hx, *params])
            and _lstm_hidden_ok(hx, num_layers, bidirectional)):
        ps = _gather_params(params, has_biases, hx[0].size(2) != hx[1].size(2))
        if ps is not None:
            hiddens = list(zip(hx[0].unbind(0), hx[1].unbind(0)))
            out, final = _packed(_lstm_cell, data, batch_sizes, hiddens, ps, num_layers, dropout,
                                 train, bidirectional)
            return (out, torch.stack([h for h, _ in final], 0),
                    torch.stack([c for _, c in final], 0))
    return aten.lstm.data._op_dk(_COMPOSITE, data, batch_sizes, hx, params, has_biases,
                                 num_layers, dropout, train, bidirectional)


def _one_hidden(name, cell):
    """``aten::{gru,rnn_tanh,rnn_relu}.input`` and ``.data``."""
    packet = getattr(aten, name)

    def input_kernel(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                     batch_first):
        if input.dim() == 3 and hx.dim() == 3 and _ours([input, hx, *params]):
            ps = _gather_params(params, has_biases)
            if ps is not None and hx.size(0) == len(ps):
                x = input.transpose(0, 1) if batch_first else input
                out, final = _padded(cell, x, list(hx.unbind(0)), ps, num_layers, dropout, train,
                                     bidirectional)
                return out.transpose(0, 1) if batch_first else out, torch.stack(final, 0)
        return packet.input._op_dk(_COMPOSITE, input, hx, params, has_biases, num_layers,
                                   dropout, train, bidirectional, batch_first)

    def data_kernel(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
                    bidirectional):
        if data.dim() == 2 and hx.dim() == 3 and _ours([data, hx, *params]):
            ps = _gather_params(params, has_biases)
            if ps is not None and hx.size(0) == len(ps):
                out, final = _packed(cell, data, batch_sizes, list(hx.unbind(0)), ps, num_layers,
                                     dropout, train, bidirectional)
                return out, torch.stack(final, 0)
        return packet.data._op_dk(_COMPOSITE, data, batch_sizes, hx, params, has_biases,
                                  num_layers, dropout, train, bidirectional)
    return input_kernel, data_kernel


def _cell_ok(input, hidden, w_ih, w_hh, gates) -> bool:
    """Shapes CPU's cell checks accept (otherwise the composite raises CPU's error)."""
    hs = w_hh.size(1) if w_hh.dim() == 2 else -1
    return (input.dim() == 2 and w_ih.dim() == 2 and input.size(1) == w_ih.size(1)
            and w_ih.size(0) == gates * hs and w_hh.size(0) == gates * hs
            and all(h.dim() == 2 and h.size(0) == input.size(0) and h.size(1) == hs
                    for h in hidden))


def lstm_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """``aten::lstm_cell`` (``nn.LSTMCell``)."""
    if (len(hx) == 2 and _ours([input, *hx, w_ih, w_hh, b_ih, b_hh])
            and _cell_ok(input, hx, w_ih, w_hh, 4)):
        return _lstm_cell(input, tuple(hx), _Params(w_ih, w_hh, b_ih, b_hh), False)
    return aten.lstm_cell.default._op_dk(_COMPOSITE, input, hx, w_ih, w_hh, b_ih, b_hh)


def gru_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """``aten::gru_cell`` (``nn.GRUCell``)."""
    if _ours([input, hx, w_ih, w_hh, b_ih, b_hh]) and _cell_ok(input, [hx], w_ih, w_hh, 3):
        return _gru_cell(input, hx, _Params(w_ih, w_hh, b_ih, b_hh), False)
    return aten.gru_cell.default._op_dk(_COMPOSITE, input, hx, w_ih, w_hh, b_ih, b_hh)


def register() -> None:
    global _lib
    from .engine import engine
    held = engine.interrupts.around     # NOTE [interrupt safety] (runtime/interrupts.py)
    _lib = torch.library.Library("aten", "IMPL")
    key = "AutogradPrivateUse1"
    _lib.impl("lstm.input", held(lstm_input), key)
    _lib.impl("lstm.data", held(lstm_data), key)
    for name, cell in (("gru", _gru_cell), ("rnn_tanh", _tanh_cell), ("rnn_relu", _relu_cell)):
        inp, data = _one_hidden(name, cell)
        _lib.impl(f"{name}.input", held(inp), key)
        _lib.impl(f"{name}.data", held(data), key)
    _lib.impl("lstm_cell", held(lstm_cell), key)
    _lib.impl("gru_cell", held(gru_cell), key)
