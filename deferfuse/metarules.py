"""Output shapes and dtypes by rule for ops whose meta kernel is missing (GRU cells, the margin
losses' backward ops) or differs from CPU's kernel (LSTM without biases, the normalizations'
saved-statistics dtypes, batch norm's shapes, geqrf's layout): as PyTorch's CPU and CUDA kernels
shape their outputs (see runtime/lowering/rnn.py, losses.py). ``RULES`` maps an op to its rule;
a rule returns (structure, descs) as ``meta.infer`` does.
"""
from __future__ import annotations

import torch

from . import meta as _meta        # (read at call time: meta imports this module)
from .cpuwords import cpu_error

aten = torch.ops.aten


def _rnn_cell_check(name, gates, hidden_gates, prev, factor):
    if gates.dim() != 2 or tuple(gates.shape) != tuple(hidden_gates.shape) or prev.dim() != 2 \
            or gates.shape[1] != factor * prev.shape[1] or gates.shape[0] != prev.shape[0]:
        raise RuntimeError(
            f"{name}: expected 2-D input and hidden gates of one shape [B, {factor}*H] and a 2-D "
            f"previous state [B, H], got {list(gates.shape)}, {list(hidden_gates.shape)} and "
            f"{list(prev.shape)}")


def _lstm_cell_rule(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    _rnn_cell_check("_thnn_fused_lstm_cell", input_gates, hidden_gates, cx, 4)
    dt, c = input_gates.dtype, tuple(cx.shape)
    g = tuple(input_gates.shape)
    return "tuple", ((c, (c[1], 1), dt), (c, (c[1], 1), dt), (g, (g[1], 1), dt))


def _lstm_cell_backward_rule(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    if grad_hy is None and grad_cy is None:
        return "tuple", (None, None, None)
    dt, c, w = workspace.dtype, tuple(cx.shape), tuple(workspace.shape)
    return "tuple", ((w, (w[1], 1), dt), (c, (c[1], 1), dt), ((w[1],), (1,), dt) if has_bias else None)


def _gru_cell_rule(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    _rnn_cell_check("_thnn_fused_gru_cell", input_gates, hidden_gates, hx, 3)
    dt, h = input_gates.dtype, tuple(hx.shape)
    return "tuple", ((h, (h[1], 1), dt), ((h[0], 5 * h[1]), (5 * h[1], 1), dt))


def _gru_cell_backward_rule(grad_hy, workspace, has_bias):
    dt, h = workspace.dtype, tuple(grad_hy.shape)
    g = (h[0], 3 * h[1])
    b = ((g[1],), (1,), dt) if has_bias else None
    return "tuple", ((g, (g[1], 1), dt), (g, (g[1], 1), dt), (h, (h[1], 1), dt), b, b)


def _loss_out(self, reduction):
    """A margin loss's output: (N,) unreduced for a 2-D input, else a scalar (CPU's kernels; their
    meta kernels give a 1-D input's unreduced loss shape (1,))."""
    shape = (self.shape[0],) if reduction == 0 and self.dim() == 2 else ()
    return torch.empty(shape, dtype=self.dtype, device="meta")


def _multi_margin_rule(self, target, p=1, margin=1, weight=None, reduction=1):
    err = cpu_error(aten.multi_margin_loss.default, (self, target, p, margin, weight, reduction))
    if err is not None:
        raise err
    return "one", (_meta._desc(_loss_out(self, reduction)),)


def _multilabel_margin_rule(self, target, reduction):
    err = cpu_error(aten.multilabel_margin_loss_forward.default, (self, target, reduction))
    if err is not None:
        raise err
    is_target = torch.empty(self.shape, dtype=self.dtype, device="meta")
    return "tuple", (_meta._desc(_loss_out(self, reduction)), _meta._desc(is_target))


def _like_self_rule(grad_output, self, *args, **kwargs):
    """A backward op whose gradient has its input's shape and dtype (contiguous)."""
    return "one", (_meta._desc(torch.empty(self.shape, dtype=self.dtype, device="meta")),)


_HALF = (torch.bfloat16, torch.float16)


def _stat_dtype(check, input, *params):
    """CPU's dtype for a normalization's saved statistics: the input's, or float32 for a bfloat16
    or float16 input whose parameters (weight, bias, running statistics: all that are given) are
    float32 ("mixed type"). PyTorch's meta kernels follow CUDA (float32 for any half input).
    Other combinations raise CPU's own error (``check``: the op to run on CPU stand-ins)."""
    dts = {p.dtype for p in params if p is not None}
    if not dts or dts == {input.dtype}:
        return input.dtype
    if input.dtype in _HALF and dts == {torch.float32}:
        return torch.float32
    err = cpu_error(check[0], check[1])
    if err is not None:
        raise err
    return input.dtype


def _bn_rule(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """The lowered ``_native_batch_norm_legit_functional``, shaped as CPU's ``native_batch_norm``:
    saved statistics (C,) in training and (0,) in evaluation mode, in ``_stat_dtype``."""
    if running_mean is None and not training:
        raise RuntimeError("running_mean must be defined in evaluation mode")
    dt = _stat_dtype((aten.native_batch_norm.default, (input, weight, bias, running_mean,
                                                       running_var, training, momentum, eps)),
                     input, weight, bias, running_mean, running_var)
    c = (input.shape[1],) if training else (0,)
    stat = (c, (1,), dt)
    out = _meta._desc(torch.empty_like(_meta._to_meta(input)))
    run = [None if r is None else (tuple(r.shape), (1,), r.dtype) for r in (running_mean, running_var)]
    return "tuple", (out, stat, stat, run[0], run[1])


def _bn_no_training_rule(input, weight, bias, running_mean, running_var, momentum, eps):
    dt = _stat_dtype((aten.native_batch_norm.default, (input, weight, bias, running_mean,
                                                       running_var, False, momentum, eps)),
                     input, weight, bias, running_mean, running_var)
    return "tuple", (_meta._desc(torch.empty_like(_meta._to_meta(input))), ((0,), (1,), dt), ((0,), (1,), dt))


def _with_stat_dtype(func, params, stat_outputs):
    """``func``'s meta outputs with its saved statistics (``stat_outputs``) in ``_stat_dtype``."""
    def rule(*args, **kwargs):
        structure, descs = _meta._meta_outputs(func, args, kwargs)
        dt = _stat_dtype((func, args), args[0], *[args[i] if len(args) > i else None
                                                 for i in params])
        descs = tuple((d[0], d[1], dt) if i in stat_outputs and d is not None else d
                      for i, d in enumerate(descs))
        return structure, descs
    return rule


def _geqrf_rule(a):
    """geqrf: the reflectors in LAPACK's column-major layout (batches contiguous), tau per batch."""
    if a.dim() < 2 or not (a.is_floating_point() or a.is_complex()):
        err = cpu_error(aten.geqrf.default, (a,))
        if err is not None:
            raise err
    *batch, m, n = a.shape
    # a batch of transposed contiguous (n, m) matrices; tau contiguous (meta tensors give
    # PyTorch's strides, a size-0 dim counted as 1)
    refl = torch.empty((*batch, n, m), dtype=a.dtype, device="meta").mT
    tau = torch.empty((*batch, min(m, n)), dtype=a.dtype, device="meta")
    return "tuple", (_meta._desc(refl), _meta._desc(tau))


def _ctc_backward_rule(grad, log_probs, *args, **kwargs):
    """_ctc_loss_backward: a contiguous gradient shaped as ``log_probs``."""
    return "one", (_meta._desc(torch.empty(log_probs.shape, dtype=log_probs.dtype, device="meta")),)


# Ops whose meta kernel is missing (GRU, the margin losses' backward ops) or fails on valid input
# (LSTM without biases): shape rules here, as PyTorch's CPU and CUDA kernels shape their outputs
# (see runtime/lowering/rnn.py, losses.py).
RULES = {aten._thnn_fused_lstm_cell.default: _lstm_cell_rule,
          aten.geqrf.default: _geqrf_rule,
          aten._ctc_loss_backward.default: _ctc_backward_rule,
          aten._thnn_fused_lstm_cell_backward_impl.default: _lstm_cell_backward_rule,
          aten._thnn_fused_gru_cell.default: _gru_cell_rule,
          aten._thnn_fused_gru_cell_backward.default: _gru_cell_backward_rule,
          aten.multi_margin_loss.default: _multi_margin_rule,
          aten.multilabel_margin_loss_forward.default: _multilabel_margin_rule,
          aten.multi_margin_loss_backward.default: _like_self_rule,
          aten.multilabel_margin_loss_backward.default: _like_self_rule,
          # normalizations: CPU's saved-statistics dtypes (and batch norm's shapes)
          aten._native_batch_norm_legit_functional.default: _bn_rule,
          aten._native_batch_norm_legit_no_training.default: _bn_no_training_rule,
          aten.native_layer_norm.default:
              _with_stat_dtype(aten.native_layer_norm.default, (2, 3), (1, 2)),
          aten.native_group_norm.default:
              _with_stat_dtype(aten.native_group_norm.default, (1, 2), (1, 2))}
