"""``F.scaled_dot_product_attention`` on tpu tensors as one fused op, as CPU eager runs it.

PyTorch picks an attention kernel per device in C++ (``_fused_sdp_choice``), and a Python backend
cannot register one: on PrivateUse1 it always takes the math path, 20-25 small ops forward and as
many backward (scale, transpose, matmuls as expand/view/bmm, a causal mask built and filled,
softmax). CPU eager, for the same inputs, calls ``_scaled_dot_product_flash_attention_for_cpu``:
one op, one backward op. A kernel for the AutogradPrivateUse1 key makes tpu do what CPU does: the
same flash op (lowered in ``runtime/lowering/attention.py``) on the inputs CPU's flash kernel takes, and
PyTorch's own composite (the math path) on every other input, so errors and gradients are CPU's.

The inference fast paths of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``
(``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd``: taken under ``no_grad`` in
eval mode, on every device PyTorch supports, PrivateUse1 included) are single CPU kernels with no
composite; ``DECOMPOSITIONS`` writes them as the ops CPU's kernels run, so they are recorded and
fused instead of running on CPU. Nested tensors still go to CPU.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_lib = None


def _flash_ok(q, k, v, mask, dropout_p, enable_gqa) -> bool:
    """CPU's rule for its flash kernel (``use_flash_attention_cpp`` in PyTorch's sdp_utils_cpp):
    dense 4-D inputs of one floating dtype, equal head dims, no dropout, nonzero lengths, heads
    equal (or a multiple, with enable_gqa), a 2-D or 4-D mask that needs no gradient (with
    is_causal too: the kernel applies both)."""
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
    if _flash_ok(query, key, value, attn_mask, dropout_p, enable_gqa):
        return _FLASH(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return _SDPA._op_dk(_COMPOSITE, query, key, value, attn_mask, dropout_p, is_causal,
                        scale=scale, enable_gqa=enable_gqa)


def _heads(x, b, h, dh):
    return x.reshape(b, -1, h, dh).transpose(1, 2)


def native_mha(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight,
               proj_bias, mask=None, need_weights=True, average_attn_weights=True, mask_type=None):
    """CPU's math path of ``_native_multi_head_attention`` (the projection, scores scaled by
    1/sqrt(head dim), a boolean mask where True hides a key; a row with every key hidden is NaN,
    as on CPU): (output, attention weights averaged over heads when asked, or None when not
    needed)."""
    if query.is_nested or key.is_nested or value.is_nested:
        return NotImplemented
    b, d, h = query.shape[0], embed_dim, num_head
    dh = d // h
    w, bias = qkv_weight, qkv_bias
    q = aten.linear(query, w[:d], bias[:d])
    k = aten.linear(key, w[d:2 * d], bias[d:2 * d])
    v = aten.linear(value, w[2 * d:], bias[2 * d:])
    q, k, v = _heads(q, b, h, dh) * (dh ** -0.5), _heads(k, b, h, dh), _heads(v, b, h, dh)
    scores = q @ k.transpose(-2, -1)
    if mask is not None:
        if mask.dtype != torch.bool:
            mask = mask.to(torch.bool)
        if mask_type == 1:      # key padding: (batch, keys)
            mask = mask.reshape(mask.shape[0], 1, 1, mask.shape[-1])
        scores = scores.masked_fill(mask, float("-inf"))
    p = aten._softmax(scores, -1, False)
    out = (p @ v).transpose(1, 2).reshape(b, -1, d)
    out = aten.linear(out, proj_weight, proj_bias)
    if not need_weights:
        return out, None        # an undefined tensor, as CPU's kernel returns
    if average_attn_weights:
        p = p.sum(1) / h
    return out, p


def transformer_encoder_layer(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight,
                              proj_bias, use_gelu, norm_first, eps, norm_weight_1, norm_bias_1,
                              norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2,
                              ffn_bias_2, mask=None, mask_type=None):
    """CPU's ``_transformer_encoder_layer_fwd``: attention and feed-forward blocks, each with a
    residual, layer norm before (``norm_first``) or after."""
    if src.is_nested:
        return NotImplemented
    if src.numel() == 0:
        return torch.empty_like(src)

    def norm(x, w, b):
        return aten.layer_norm(x, [embed_dim], w, b, eps)
    x = norm(src, norm_weight_1, norm_bias_1) if norm_first else src
    x = native_mha(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                   mask, False, True, mask_type)[0] + src
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    res = x
    if norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    x = aten.linear(x, ffn_weight_1, ffn_bias_1)
    x = aten.gelu(x) if use_gelu else aten.relu(x)
    x = aten.linear(x, ffn_weight_2, ffn_bias_2) + res
    if not norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    return x


def flash_forward_into(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                       is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                       window_size_right=None, seqused_k=None, alibi_slopes=None,
                       block_table=None, num_splits=None):
    """CUDA's ``_flash_attention_forward_no_dropout_inplace`` (``varlen_attn_out``): the flash
    forward (lowered on tpu) written into ``out``; its log-sum-exp returned."""
    res = aten._flash_attention_forward(
        query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
        return_debug_mask, scale=scale, window_size_left=window_size_left,
        window_size_right=window_size_right, seqused_k=seqused_k, alibi_slopes=alibi_slopes,
        block_table=block_table, num_splits=num_splits)
    out.copy_(res[0])
    return res[1]


DECOMPOSITIONS = {aten._native_multi_head_attention.default: native_mha,
                  aten._transformer_encoder_layer_fwd.default: transformer_encoder_layer}
_INTO = getattr(aten, "_flash_attention_forward_no_dropout_inplace", None)
if _INTO is not None:       # (looked up defensively: not in every torch version)
    DECOMPOSITIONS[_INTO.default] = flash_forward_into


def register() -> None:
    global _lib
    _lib = torch.library.Library("aten", "IMPL")
    from .engine import engine
    # NOTE [interrupt safety] (runtime/interrupts.py)
    _lib.impl("scaled_dot_product_attention", engine.interrupts.around(sdpa), "AutogradPrivateUse1")
