"""``torch.autocast("tpu", dtype=torch.bfloat16)``: PyTorch's autocast op lists on the tpu device.

PyTorch has no autocast kernels for PrivateUse1, so every op would fail under autocast. This
registers a fallthrough for the AutocastPrivateUse1 key and, for the ops of PyTorch's CPU autocast
policy, kernels that cast floating-point tensor arguments (to the autocast dtype for the
lower-precision list, to float32 for the float32 list) and run the op below autocast.
"""
from __future__ import annotations

import torch

_KEY = "AutocastPrivateUse1"
# PyTorch's CPU autocast policy (aten/src/ATen/autocast_mode.cpp), by op name (all overloads).
LOWER_PRECISION = (
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "addbmm",
    "linear", "_convolution", "matmul", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "prelu", "scaled_dot_product_attention", "_native_multi_head_attention")
FLOAT32 = (
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "quantile", "nanquantile",
    "stft", "cdist", "trace", "view_as_complex", "cholesky", "cholesky_inverse", "cholesky_solve",
    "inverse", "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d", "max_unpool2d",
    "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d",
    "replication_pad1d", "replication_pad2d", "replication_pad3d", "mse_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss",
    "smooth_l1_loss", "cross_entropy_loss", "l1_loss", "huber_loss", "margin_ranking_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "ctc_loss", "kl_div",
    "multilabel_margin_loss", "binary_cross_entropy_with_logits")

_libs: list = []


def _cast(x, dtype):
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() and x.dtype != dtype and x.dtype != torch.float64 and \
                x.device.type == "tpu":
            return x.to(dtype)
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype) for y in x)
    return x


def _kernel(op, to_lower: bool):
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

    def k(*args, **kwargs):
        dtype = torch.get_autocast_dtype("tpu") if to_lower else torch.float32
        args, kwargs = _cast(args, dtype), {n: _cast(v, dtype) for n, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(keyset):
            return op(*args, **kwargs)
    return k


def register() -> None:
    lib = torch.library.Library("_", "IMPL")   # noqa: TOR901 (a backend fallback)
    lib.fallback(torch.library.fallthrough_kernel, _KEY)
    _libs.append(lib)
    aten_lib = torch.library.Library("aten", "IMPL")
    _libs.append(aten_lib)
    for names, lower in ((LOWER_PRECISION, True), (FLOAT32, False)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for ov in packet.overloads():
                op = getattr(packet, ov)
                full = name + ("" if ov == "default" else "." + ov)
                try:
                    aten_lib.impl(full, _kernel(op, lower), _KEY)
                except RuntimeError:
                    pass    # already has a kernel for this key on this torch version
