"""Flex attention (``torch.nn.attention.flex_attention``) on ``tpu`` tensors.

PyTorch runs ``flex_attention`` as a higher-order operator (HOP), ``flex_attention`` and, for the
gradient, ``flex_attention_backward``, whose score and mask functions are graphs. A HOP finds its
kernel for a tensor subclass in its ``python_key_table``; registering ``TpuTensor`` there (with
``HigherOrderOperator.py_impl``) gives tpu tensors PyTorch's own dense implementation
(``sdpa_dense`` and ``sdpa_dense_backward``: the scores, the score function vmapped over them, the
block mask's mask function applied as a mask, softmax, the weighted values; and their gradient
with the joint graph PyTorch derives). Its aten ops are ordinary tpu ops: recorded and fused in
defer mode, one at a time in strict mode, and, under ``torch.compile``, traced by AOTAutograd into
the graph's aten ops, so a compiled graph with flex attention is one program like any other.
``create_block_mask(..., device="tpu")`` needs nothing: it runs the mask function on tpu tensors.

NOTE [flex device check]: before it reaches the HOP, ``flex_attention`` refuses every device but
CUDA, CPU, XPU, HPU and MPS (``_validate_device``, a Python check with no registry behind it).
The one way past it without editing PyTorch is to rebind that module-level function: ours accepts
``tpu`` (backward included, as on CUDA) and calls PyTorch's for every other device, so CPU keeps
its own errors. Dynamo reads the same global while it traces ``flex_attention``; ours is marked
for it to trace through (deferfuse is on Dynamo's skip list: NOTE [dynamo skips deferfuse] in
compiled.py), so a compiled model keeps flex attention in its graph, with no break.
"""
from __future__ import annotations

import importlib
import sys

import torch


def _device_check(original):
    """``flex_attention``'s device check, accepting ``tpu`` (NOTE [flex device check])."""
    def _validate_device(query, key, value):
        if query.device.type == "tpu":
            return None
        return original(query, key, value)
    _validate_device._deferfuse = True
    return _validate_device


def register() -> None:
    """Give the flex attention HOPs their tpu kernels and let ``flex_attention`` accept tpu."""
    import torch.nn.attention.flex_attention as fa
    hops = importlib.import_module("torch._higher_order_ops.flex_attention")
    from .tensor import TpuTensor
    # (looked up defensively: private names, which another torch version may spell otherwise)
    for hop_name, impl_name in (("flex_attention", "sdpa_dense"),
                                ("flex_attention_backward", "sdpa_dense_backward")):
        hop, impl = getattr(hops, hop_name, None), getattr(hops, impl_name, None)
        if hop is not None and impl is not None and TpuTensor not in hop.python_key_table:
            hop.py_impl(TpuTensor)(impl)
    if not hasattr(fa, "_validate_device"):
        return
    if not getattr(fa._validate_device, "_deferfuse", False):
        fa._validate_device = _device_check(fa._validate_device)
    if "torch._dynamo" in sys.modules:
        for_dynamo()        # Dynamo was imported first (a script that never imports deferfuse)


def dense_impls() -> dict:
    """{flex attention HOP: PyTorch's dense implementation of it} (the kernels ``register`` gives
    ``TpuTensor``), for compiled graphs of plain tpu tensors (NOTE [flex attention in plain
    graphs] in compiled.py); empty when this torch spells them otherwise."""
    hops = importlib.import_module("torch._higher_order_ops.flex_attention")
    out = {}
    for hop_name, impl_name in (("flex_attention", "sdpa_dense"),
                                ("flex_attention_backward", "sdpa_dense_backward")):
        hop, impl = getattr(hops, hop_name, None), getattr(hops, impl_name, None)
        if hop is not None and impl is not None:
            out[hop] = impl
    return out


def for_dynamo() -> None:
    """Called when Dynamo first meets deferfuse (compiled._skip_deferfuse), which puts deferfuse
    on its skip list: the device check is marked for Dynamo to trace through (NOTE [flex device
    check]). Not at import: importing Dynamo costs seconds."""
    import torch.nn.attention.flex_attention as fa
    check = getattr(fa, "_validate_device", None)
    if getattr(check, "_deferfuse", False) and not getattr(check, "_dynamo", False):
        check = torch._dynamo.dont_skip_tracing(check)
        check._deferfuse = check._dynamo = True
        fa._validate_device = check
