"""``F.linear`` (every ``nn.Linear``) on tpu tensors as one op forward and one op backward.

``aten::linear`` is a composite: on every device it becomes ``t`` + ``addmm`` (2-D input) or
``view`` + ``t`` + ``addmm`` + ``view`` (3-D, as in a transformer), and its backward is as many
nodes again (``AddmmBackward0``'s two ``mm`` and a ``t``, ``sum`` for the bias, ``TBackward0``,
``ViewBackward0``). CPU pays about 3 µs per op for that; a Python backend pays its dispatch cost
(15-25 µs) per op, so a linear layer cost more in dispatch than in arithmetic. A kernel for the
AutogradPrivateUse1 key makes it one recorded op (``aten.linear``, lowered in
``runtime/lowering/linear.py``) with one backward node, ``LinearBackward``, that records one op
(``aten.linear_backward``: the input, weight and bias gradients it is asked for).

Only inputs CPU's composite takes without complaint come here: a floating input of at least one
dimension, a 2-D weight of its dtype whose columns match, no bias or a 1-D bias of the output size.
Everything else (and forward-mode AD, functorch transforms, nested tensors) goes through PyTorch's
own composite; mismatched shapes or dtypes raise CPU's own error (``cpuwords.cpu_error``). With
``create_graph=True`` the backward computes with differentiable ops (matmul, mm, sum), so a second
backward works.

The difference a user can see: ``grad_fn`` is ``LinearBackward`` where CPU shows
``AddmmBackward0`` or ``ViewBackward0``.
"""
from __future__ import annotations

import torch
from torch.autograd import forward_ad

from .cpuwords import cpu_error
from .tensor import TpuTensor, is_tpu

aten = torch.ops.aten
_LINEAR = aten.linear.default
_BACKWARD = aten.linear_backward.default
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)
_below_autograd = torch._C._AutoDispatchBelowAutograd
_functorch_level = torch._C._functorch.maybe_current_level
_lib = None


def _fused_ok(x, w, b) -> bool:
    if ((type(x) is not TpuTensor and not is_tpu(x)) or (type(w) is not TpuTensor and not is_tpu(w))
            or (b is not None and type(b) is not TpuTensor and not is_tpu(b))):
        # A tensor subclass over tpu tensors (DTensor) has rules for aten ops, none for ours.
        return False
    if w.dim() != 2 or x.dim() == 0 or x.is_nested:
        return False
    dt = x.dtype
    if dt not in _FLOATS or w.dtype != dt or x.shape[-1] != w.shape[1]:
        return False
    if b is not None and dt in _HALF and x.dim() != 2 and not x.is_contiguous():
        # CPU's composite fuses the bias into the product (addmm: one rounding) for a 2-D or a
        # contiguous input, and otherwise adds it to the rounded product (matmul, then add): the
        # composite does the same here, so half-precision results match CPU's bit for bit.
        return False
    if b is not None and (b.dim() != 1 or b.dtype != dt or b.shape[0] != w.shape[0]):
        return False
    return forward_ad._current_level < 0 and _functorch_level() is None


class Linear(torch.autograd.Function):
    """One linear op and its one backward op (``grad_fn``: ``LinearBackward``)."""

    @staticmethod
    def forward(ctx, x, w, b):
        nx, nw, nb = ctx.needs_input_grad
        # What each gradient reads: the weight for the input's, the input for the weight's and
        # the bias's (linear_backward gives those two together).
        ctx.save_for_backward(x if nw or nb else None, w if nx else None)
        ctx.x_shape = x.shape
        ctx.has_bias = b is not None
        with _below_autograd():
            return _LINEAR(x, w, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad
        nb = nb and ctx.has_bias
        if torch.is_grad_enabled():
            # create_graph=True: differentiable ops (linear_backward has no derivative).
            g2 = g.reshape(-1, g.shape[-1])
            return (g.matmul(w) if nx else None,
                    g2.t().mm(x.reshape(-1, x.shape[-1])) if nw else None,
                    g2.sum(0) if nb else None)
        if x is None:       # a frozen weight: the input's gradient needs only its shape
            x = g.new_zeros(()).expand(ctx.x_shape)
        gx, gw, gb = _BACKWARD(x, g, g if w is None else w, [nx, nw, nb])
        return gx, gw if nw else None, gb if nb else None


# Function.apply less its Python wrapper (default-argument binding, functorch's dead-wrapper
# unwrapping: a pytree walk per call); _fused_ok has ruled functorch out already.
_apply = super(torch.autograd.Function, Linear).apply


def linear(input, weight, bias=None):
    """The AutogradPrivateUse1 kernel of ``aten::linear``."""
    if not _fused_ok(input, weight, bias):
        if input.dim() and weight.dim() and (
                input.dtype != weight.dtype or input.shape[-1] != weight.shape[-1]
                or (bias is not None and (bias.dtype != input.dtype or bias.dim() and (
                    bias.shape[-1] not in (1, weight.shape[0]))))):
            # CPU's composite's own message (on tpu: the meta kernels' wording).
            err = cpu_error(torch.nn.functional.linear, (input, weight, bias))
            if err is not None:
                raise type(err)(str(err))
        return _LINEAR._op_dk(_COMPOSITE, input, weight, bias)
    if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _apply(input, weight, bias)
    with _below_autograd():
        return _LINEAR(input, weight, bias)


def register() -> None:
    global _lib
    _lib = torch.library.Library("aten", "IMPL")
    from .engine import engine
    # NOTE [interrupt safety] (runtime/interrupts.py)
    _lib.impl("linear", engine.interrupts.around(linear), "AutogradPrivateUse1")
