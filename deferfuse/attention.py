"""``F.scaled_dot_product_attention`` on tpu tensors as one fused op, as CPU eager runs it.

PyTorch picks an attention kernel per device in C++ (``_fused_sdp_choice``), and a Python backend
cannot register one: on PrivateUse1 it always takes the math path, 20-25 small ops forward and as
many backward (scale, transpose, matmuls as expand/view/bmm, a causal mask built and filled,
softmax). CPU eager, for the same inputs, calls ``_scaled_dot_product_flash_attention_for_cpu``:
one op, one backward op. A kernel for the AutogradPrivateUse1 key makes tpu do what CPU does: the
same flash op (lowered in ``runtime/lowering/nn.py``) on the inputs CPU's flash kernel takes, and
PyTorch's own composite (the math path) on every other input, so errors and gradients are CPU's.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_lib = None


def _flash_ok(q, k, v, mask, dropout_p, is_causal, enable_gqa) -> bool:
    """CPU's rule for its flash kernel (``use_flash_attention_cpp`` in PyTorch's sdp_utils_cpp):
    dense 4-D inputs of one floating dtype, equal head dims, no dropout, nonzero lengths, heads
    equal (or a multiple, with enable_gqa), a 2-D or 4-D mask that needs no gradient."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or dropout_p != 0.0:
        return False
    if not torch._C._get_flash_sdp_enabled():
        return False
    dt = q.dtype
    if dt not in _FLASH_DTYPES or k.dtype != dt or v.dtype != dt:
        return False
    if q.is_nested or q.shape[-1] != k.shape[-1] or q.shape[-1] != v.shape[-1]:
        return False
    if q.shape[0] != k.shape[0] or q.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        return False
    if q.shape[1] != k.shape[1] and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
        return False
    if 0 in (q.shape[-2], k.shape[-2], q.shape[-1]):
        return False
    if mask is not None:
        if mask.dim() not in (2, 4) or mask.requires_grad:
            return False
        if mask.dtype != torch.bool and mask.dtype != dt:
            return False
    return True


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
         enable_gqa=False):
    if _flash_ok(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        return _FLASH(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return _SDPA._op_dk(_COMPOSITE, query, key, value, attn_mask, dropout_p, is_causal,
                        scale=scale, enable_gqa=enable_gqa)


def register() -> None:
    global _lib
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("scaled_dot_product_attention", sdpa, "AutogradPrivateUse1")
