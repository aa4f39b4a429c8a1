"""``torch.autocast("tpu")``: CUDA's autocast policy on the tpu device.

PyTorch has no autocast kernels for PrivateUse1, so every op would fail under autocast. This
registers a fallthrough for the AutocastPrivateUse1 key and, for the ops of CUDA's policy
(``aten/src/ATen/autocast_mode.h``: ``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``,
``AT_FORALL_PROMOTE``, and the banned ``binary_cross_entropy``), kernels that cast as CUDA's
wrappers do, then run the op below autocast:

- lower precision: floating tensors (not float64) to the autocast dtype;
- float32: floating tensors (not float64) to float32;
- float32, output dtype: ``sum``, ``softmax``, ``cumsum`` ... get ``dtype=torch.float32`` unless
  one is given, when their first argument is a floating tensor (not float64);
- float32, appended dtype: ``norm`` runs its ``dtype`` overload with float32;
- promote: every floating tensor (not float64) to the widest floating dtype among them.

Only tensors on tpu are cast (CUDA's wrappers cast CUDA tensors only). CUDA also caches the cast
copies of float32 parameters within one autocast region; here each use casts again (the same
values and gradients, a convert op more per use; in defer mode XLA fuses it).
"""
from __future__ import annotations

import torch

_KEY = "AutocastPrivateUse1"

# CUDA's lists, "op" (default overload) or "op.overload"; cudnn_convolution and
# cudnn_convolution_transpose, CUDA-only ops, are left out.
LOWER_PRECISION = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu",
    "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm",
    "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention")
FLOAT32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar",
    "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim",
    "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa")
FLOAT32_SET_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList")
# op -> the overload it redispatches to with a dtype appended
FLOAT32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype",
                        "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
           "index_put", "tensordot", "scatter_add")
BANNED = {"binary_cross_entropy": (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast.")}

_libs: list = []
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


def _eligible(x) -> bool:
    """CUDA's ``is_eligible``: a floating tensor, not float64, on the autocast device."""
    return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
            and x.device.type == "tpu")


def _cast(x, dtype):
    if _eligible(x):
        return x if x.dtype == dtype else x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype) for y in x)
    return x


def _cast_all(args, kwargs, dtype):
    return _cast(args, dtype), {n: _cast(v, dtype) for n, v in kwargs.items()}


def _promote_type(args, kwargs):
    """CUDA's ``promote_type``: float32 if any eligible tensor is float32, else the autocast dtype
    (float64 tensors are ignored); another half-precision dtype is an error, as there."""
    low = torch.get_autocast_dtype("tpu")
    cur = low
    stack = list(args) + list(kwargs.values())
    while stack:
        x = stack.pop(0)
        if isinstance(x, (list, tuple)):
            stack[:0] = list(x)
            continue
        if not _eligible(x):
            continue
        if cur == torch.float32 or x.dtype == torch.float32:
            cur = torch.float32
        elif x.dtype != low:
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return cur


def _first_tensor(args, kwargs):
    return args[0] if args else next(iter(kwargs.values()), None)


def _kernel(op, policy, target=None):
    dtype_pos = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def run(f, args, kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return f(*args, **kwargs)

    if policy == "lower":
        def k(*args, **kwargs):
            return run(op, *_cast_all(args, kwargs, torch.get_autocast_dtype("tpu")))
    elif policy == "fp32":
        def k(*args, **kwargs):
            return run(op, *_cast_all(args, kwargs, torch.float32))
    elif policy == "fp32_set_dtype":
        def k(*args, **kwargs):
            given = (dtype_pos is not None and len(args) > dtype_pos and args[dtype_pos] is not None
                     ) or kwargs.get("dtype") is not None
            if not given and _eligible(_first_tensor(args, kwargs)):
                kwargs = dict(kwargs, dtype=torch.float32)
            return run(op, args, kwargs)
    elif policy == "fp32_append_dtype":
        def k(*args, **kwargs):
            first = _first_tensor(args, kwargs)
            out = torch.float32 if _eligible(first) else first.dtype
            return run(target, args, dict(kwargs, dtype=out))
    elif policy == "promote":
        def k(*args, **kwargs):
            return run(op, *_cast_all(args, kwargs, _promote_type(args, kwargs)))
    else:
        message = policy

        def k(*args, **kwargs):
            raise RuntimeError(message)
    return k


def policy_table() -> dict:
    """{"op.overload": policy} of every op with a tpu autocast kernel (for tests and docs)."""
    table = {}
    for names, policy in ((LOWER_PRECISION, "lower"), (FLOAT32, "fp32"),
                          (FLOAT32_SET_DTYPE, "fp32_set_dtype"),
                          (FLOAT32_APPEND_DTYPE, "fp32_append_dtype"), (PROMOTE, "promote"),
                          (BANNED, "banned")):
        for name in names:
            table[name] = policy
    return table


def _resolve(name: str):
    packet, _, overload = name.partition(".")
    p = getattr(torch.ops.aten, packet, None)
    return None if p is None else getattr(p, overload or "default", None)


def register() -> None:
    lib = torch.library.Library("_", "IMPL")   # noqa: TOR901 (a backend fallback)
    lib.fallback(torch.library.fallthrough_kernel, _KEY)
    _libs.append(lib)
    aten_lib = torch.library.Library("aten", "IMPL")
    _libs.append(aten_lib)
    from .engine import engine
    held = engine.interrupts.around     # NOTE [interrupt safety] (runtime/interrupts.py)
    for name, policy in policy_table().items():
        op = _resolve(name)
        if op is None:
            continue        # not in this torch version
        target = None
        if policy == "fp32_append_dtype":
            target = _resolve(FLOAT32_APPEND_DTYPE[name])
        elif policy == "banned":
            policy = BANNED[name]
        try:
            aten_lib.impl(name, held(_kernel(op, policy, target)), _KEY)
        except RuntimeError:
            pass    # already has a kernel for this key on this torch version
