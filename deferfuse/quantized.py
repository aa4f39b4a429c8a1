"""Quantized matmuls on ``tpu`` tensors: the ``out_dtype`` higher-order operator.

NOTE [out_dtype on tpu]: torchao's int8 paths (``Int8DynamicActivationInt8WeightConfig``,
``torchao.kernel.intmm.safe_int_mm``) multiply int8 by int8 into int32 with
``torch.ops.higher_order.out_dtype(aten.mm.default, torch.int32, a, b)``. A HOP finds its kernel
for a tensor subclass in its ``python_key_table``; with no entry for ``TpuTensor`` it raises
``NotImplementedError``. Eager torchao catches that and multiplies in float32, which is inexact
once a dot product's sum passes 2**24 (CPU multiplies in int32); under ``torch.compile`` the error
fails the graph. Registered here, tpu tensors get PyTorch's own dense rule: the arguments promoted
to the output dtype (int8 to int32), the op, the result cast. Those are ordinary tpu ops (recorded
and fused in defer mode), so ``int8 @ int8 -> int32`` is one integer dot product in XLA, exact
and wrapping as CPU's. Under ``torch.compile`` AOTAutograd keeps ``out_dtype`` as a node of the
graph (its proxy rule); the compiled backend runs such a node through the same rule.
"""
from __future__ import annotations

import importlib


def register() -> None:
    """Give the ``out_dtype`` HOP its tpu kernel (NOTE [out_dtype on tpu])."""
    from .tensor import TpuTensor
    # (looked up defensively: a private module, which another torch version may lay out otherwise)
    try:
        mod = importlib.import_module("torch._higher_order_ops.out_dtype")
    except ImportError:
        return
    hop, dense = getattr(mod, "out_dtype", None), getattr(mod, "out_dtype_fallback", None)
    if hop is None or dense is None or TpuTensor in hop.python_key_table:
        return

    def out_dtype_tpu(op, output_dtype, *args):
        return dense(op, output_dtype, *args)
    hop.py_impl(TpuTensor)(out_dtype_tpu)
