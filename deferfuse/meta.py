"""Shape, stride and dtype of an op's outputs from PyTorch's meta kernels, never by running it.

Results are cached with the op's structural key by the dispatcher, so this runs once per structure.
"""
from __future__ import annotations

import re
import threading
import warnings

import torch

from . import metaplain as plain
from .config import config
from .metasize import SizeRules
from .scheduler.cache import Cache
from .tensor import TpuTensor

aten = torch.ops.aten
_META = torch.device("meta")
_GROUPED_MM = getattr(getattr(aten, "_grouped_mm", None), "default", None)
try:
    from torch._meta_registrations import _create_grouped_mm_output_tensor as _grouped_mm_out
except ImportError:     # another torch: its own meta kernel decides
    _grouped_mm_out = None


def _to_meta(a):
    if type(a) is TpuTensor:
        numel = 1
        for s in a._s.val.shape:
            numel *= s
        if a._chain:
            # A view: place it in a meta storage as large as its base, at its offset.
            return torch.empty(max(numel, a.storage_offset() + 1), dtype=a.dtype, device=_META).as_strided(
                a.shape, a.stride(), a.storage_offset())
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=_META)
    if isinstance(a, (list, tuple)):
        return type(a)(_to_meta(x) for x in a)
    if isinstance(a, torch.device) and a.type == "tpu":
        return _META
    if isinstance(a, torch.Tensor) and a.device.type != "cpu":
        return a
    return a


def _desc(m):
    if m is None:
        return None
    if not isinstance(m, torch.Tensor):
        raise NotImplementedError(f"non-tensor output {type(m).__name__}")
    return (tuple(m.shape), tuple(m.stride()), m.dtype)


def _empty_reduction_error(func, args, kwargs):
    """The error CPU raises for a reduction without identity (max, min, median, mode ...) over an
    empty dim, from shapes alone, raised at the call in every mode (meta kernels raise another
    type or none, and a lowering's own check would only fire inside a region, at the sync)."""
    name, pos, default, as_given = _EMPTY_CHECKED[func]
    shape = tuple(args[0].shape)
    dims = None
    if pos is not None:
        dims = args[pos] if pos is not _KW and len(args) > pos else kwargs.get("dim", default)
        if isinstance(dims, int):
            dims = (dims,)
        dims = tuple(dims) if dims else None
    if dims is None:
        if any(s == 0 for s in shape):
            if func in (aten.argmax.default, aten.argmin.default):
                return IndexError(f"{name}(): Expected reduction dim to be specified for "
                                  "input.numel() == 0.")
            if func is aten.aminmax.default:
                return RuntimeError("aminmax(): cannot compute aminmax over an empty dimension as "
                                    "the operation has no identity.")
            return RuntimeError(f"{name}(): Expected reduction dim to be specified for input.numel() "
                                "== 0. Specify the reduction dim with the 'dim' argument.")
        return None
    for d in dims:
        if shape and -len(shape) <= d < len(shape) and shape[d] == 0:
            what = "aminmax:" if func is aten.aminmax.default else f"{name}():"   # (CPU's wording)
            return IndexError(f"{what} Expected reduction dim {d if as_given else d % len(shape)} "
                              "to have non-zero size.")
    return None


_KW = "keyword-only"
# op -> (name in the message, position of dim (None: all dims; _KW: a keyword-only dim), its
# default, dim printed as given)
_EMPTY_CHECKED = {
    aten.max.default: ("max", None, None, False), aten.min.default: ("min", None, None, False),
    aten.max.dim: ("max", 1, None, False), aten.min.dim: ("min", 1, None, False),
    aten.amax.default: ("amax", 1, (), True), aten.amin.default: ("amin", 1, (), True),
    aten.aminmax.default: ("aminmax", _KW, None, False),
    aten.median.dim: ("median", 1, None, False), aten.nanmedian.dim: ("median", 1, None, False),
    aten.mode.default: ("mode", 1, -1, False), aten.kthvalue.default: ("kthvalue", 2, -1, False),
    aten.argmax.default: ("argmax", 1, None, False), aten.argmin.default: ("argmin", 1, None, False),
}


# Products whose CPU kernels require one dtype; their meta kernels check shapes only, so mixed
# float/double operands would be silently promoted (mm, addmm, mv ...) or refused in other words.
_SAME_DTYPE = {getattr(aten, n).default for n in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv",
                                                  "addmv", "dot", "vdot", "matmul")}


def _stand_in(a, written=False):
    """A CPU tensor of ``a``'s shape and dtype with no memory behind it (zero strides); one an op
    writes gets memory of its own (CPU refuses to write to overlapping elements before it checks
    shapes, and ``torch.empty`` touches no page until something is written)."""
    if isinstance(a, torch.Tensor):
        if written:
            return torch.empty(a.shape, dtype=a.dtype)
        return torch.zeros((), dtype=a.dtype).expand(a.shape)
    if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
        return type(a)(_stand_in(x) for x in a)
    if isinstance(a, torch.device) and a.type == "tpu":
        return torch.device("cpu")
    return a


# The exceptions PyTorch raises for bad arguments. NotImplementedError (a RuntimeError) is left
# alone: it says an op has no meta kernel or no lowering, which the dispatcher handles.
_ARG_ERRORS = (RuntimeError, IndexError, ValueError, TypeError)


def cpu_error(fn, args, kwargs=None, written=()):
    """CPU's own error for these operands, or None: ``fn`` run on CPU stand-ins of the same shapes
    and dtypes, whose checks raise before any arithmetic (only call it for operands CPU refuses:
    where it accepts them, it computes on the stand-ins). ``written``: positions and keyword names
    of the arguments the op writes."""
    try:
        fn(*[_stand_in(a, i in written) for i, a in enumerate(args)],
           **{k: _stand_in(v, k in written) for k, v in (kwargs or {}).items()})
    except NotImplementedError as e:
        # CPU's "not implemented for 'Float'" dtype refusals; not a missing kernel (CPU has one).
        return e if "not implemented for" in str(e) else None
    except _ARG_ERRORS as e:
        return e
    return None


def _as_cpu_raised(err):
    """``err`` again, raised at the call: the same type and message, without CPU's frames."""
    try:
        new = type(err)(str(err))
    except Exception:           # an exception type that takes other arguments
        new = err
    # CPU's NotImplementedError ("not implemented for 'Float'") is not a missing meta kernel:
    # the dispatcher raises it rather than falling back to CPU.
    new.deferfuse_cpu_words = True
    return new


def _written(func) -> tuple:
    out = _WRITTEN.get(func)
    if out is None:
        out = _WRITTEN[func] = tuple(
            i if not a.kwarg_only else a.name for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write)
    return out


_WRITTEN: dict = {}


def raise_like_cpu(func, args, kwargs, meta_error):
    """NOTE [CPU's words]: a meta kernel refused these operands; raise what CPU raises for them
    (its type and message: "mat1 and mat2 shapes cannot be multiplied (3x4 and 5x6)" where the
    meta kernel says "a and b must have same reduction dim"), or the meta kernel's error where CPU
    does not refuse stand-ins (checks that depend on strides)."""
    err = cpu_error(func, args, kwargs, _written(func))
    if err is None:
        raise meta_error
    raise _as_cpu_raised(err) from None


# Arguments CPU requires to hold integer indices, which meta kernels (index_select, index_add,
# index_put ...) or lowerings take as they are: found by name in each op's schema.
_INDEX_NAMES = ("index", "indices")
_INDEX_ARGS: dict = {}
_INDEX_OK = (torch.int64, torch.int32)


def _index_args(func) -> tuple:
    out = _INDEX_ARGS.get(func)
    if out is None:
        name = func._schema.name
        names = _INDEX_NAMES + (("target",) if "nll_loss" in name else ())
        out = _INDEX_ARGS[func] = tuple(
            (i, a.name, a.kwarg_only) for i, a in enumerate(func._schema.arguments)
            if a.name in names and "Tensor" in str(a.type))
    return out


def _bad_index(func, args, kwargs) -> bool:
    for i, name, kw_only in _index_args(func):
        v = kwargs.get(name) if kw_only or len(args) <= i else args[i]
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor) and t.dtype not in _INDEX_OK and not (
                    t.dtype in (torch.bool, torch.uint8) and isinstance(v, (list, tuple))):
                return True
    return False


# Arguments whose dtype must be self's (index_add's source, scatter's src, index_put's values,
# masked_scatter's source): their meta kernels take any dtype and promote.
_SAME_AS_SELF = ("source", "src", "values")


def _source_dtype_differs(func, args, kwargs) -> bool:
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    for i, a in enumerate(func._schema.arguments):
        if a.name in _SAME_AS_SELF:
            v = kwargs.get(a.name) if a.kwarg_only or len(args) <= i else args[i]
            if isinstance(v, torch.Tensor) and v.dtype != args[0].dtype:
                return True
    return False


_INT_ONLY = {getattr(aten, n) for n in ("bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not",
                                        "bitwise_left_shift", "bitwise_right_shift", "gcd", "lcm")
             if hasattr(aten, n)}


def _cast_refused(func, args, kwargs) -> bool:
    """An in-place (or out=) pointwise op whose result type cannot be cast to the tensor it writes
    (``bool_t.mul_(float_t)``, ``long_t.mul_(2.5)``): CPU refuses, meta kernels do not all."""
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
    written, inputs = [], []
    for i, a in enumerate(func._schema.arguments):
        v = kwargs.get(a.name) if a.kwarg_only or len(args) <= i else args[i]
        if a.alias_info is not None and a.alias_info.is_write:
            if isinstance(v, torch.Tensor):
                written.append(v)
                if i == 0:
                    inputs.append(_to_meta(v))
        elif isinstance(v, torch.Tensor) or (
                # a Scalar, or a number PyTorch passed for a Tensor argument (x.mul_(2.5))
                isinstance(v, (bool, int, float, complex)) and a.name not in ("alpha", "value")
                and isinstance(a.type, (torch.NumberType, torch.OptionalType, torch.TensorType))):
            inputs.append(_to_meta(v))
    if not written or not inputs:
        return False
    try:
        _, result = elementwise_dtypes(*inputs,
                                       type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
    except Exception:
        return False
    return any(not torch.can_cast(result, w.dtype) for w in written)


def _check_like_cpu(func, args, kwargs) -> None:
    """NOTE [CPU's words]: dtype checks CPU makes and meta kernels skip, so the op was computed
    anyway (an in-place cast, a source of another dtype) or failed in its lowering with JAX's
    words (a float index, a float bitwise op). Each test is a cheap look at dtypes; only when it
    finds one does CPU run on stand-ins to say what it raises."""
    suspect = (_bad_index(func, args, kwargs) or _source_dtype_differs(func, args, kwargs)
               or (func.overloadpacket in _INT_ONLY and any(
                   isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex())
                   for a in args))
               or (_written(func) and torch.Tag.pointwise in func.tags
                   and _cast_refused(func, args, kwargs)))
    if suspect:
        err = cpu_error(func, args, kwargs, _written(func))
        if err is not None:
            raise _as_cpu_raised(err) from None


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
    return "one", (_desc(_loss_out(self, reduction)),)


def _multilabel_margin_rule(self, target, reduction):
    err = cpu_error(aten.multilabel_margin_loss_forward.default, (self, target, reduction))
    if err is not None:
        raise err
    is_target = torch.empty(self.shape, dtype=self.dtype, device="meta")
    return "tuple", (_desc(_loss_out(self, reduction)), _desc(is_target))


def _like_self_rule(grad_output, self, *args, **kwargs):
    """A backward op whose gradient has its input's shape and dtype (contiguous)."""
    return "one", (_desc(torch.empty(self.shape, dtype=self.dtype, device="meta")),)


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
    out = _desc(torch.empty_like(_to_meta(input)))
    run = [None if r is None else (tuple(r.shape), (1,), r.dtype) for r in (running_mean, running_var)]
    return "tuple", (out, stat, stat, run[0], run[1])


def _bn_no_training_rule(input, weight, bias, running_mean, running_var, momentum, eps):
    dt = _stat_dtype((aten.native_batch_norm.default, (input, weight, bias, running_mean,
                                                       running_var, False, momentum, eps)),
                     input, weight, bias, running_mean, running_var)
    return "tuple", (_desc(torch.empty_like(_to_meta(input))), ((0,), (1,), dt), ((0,), (1,), dt))


def _with_stat_dtype(func, params, stat_outputs):
    """``func``'s meta outputs with its saved statistics (``stat_outputs``) in ``_stat_dtype``."""
    def rule(*args, **kwargs):
        structure, descs = _meta_outputs(func, args, kwargs)
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
    return "tuple", (_desc(refl), _desc(tau))


def _ctc_backward_rule(grad, log_probs, *args, **kwargs):
    """_ctc_loss_backward: a contiguous gradient shaped as ``log_probs``."""
    return "one", (_desc(torch.empty(log_probs.shape, dtype=log_probs.dtype, device="meta")),)


# Ops whose meta kernel is missing (GRU, the margin losses' backward ops) or fails on valid input
# (LSTM without biases): shape rules here, as PyTorch's CPU and CUDA kernels shape their outputs
# (see runtime/lowering/rnn.py, losses.py).
_RULES = {aten._thnn_fused_lstm_cell.default: _lstm_cell_rule,
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


# Ops whose meta kernel takes any ``dim`` (the lowering then failed inside a region, or sort took
# the dim modulo the rank and answered): (position of dim, its default); CPU raises IndexError.
_DIM_CHECKED = {aten._softmax.default: (1, None), aten.sort.default: (1, -1),
                aten.sort.stable: (_KW, -1)}


# std and var refuse integer tensors on CPU; their meta kernels take them (var_mean then fails on
# mean's dtype with another message).
_FLOAT_ONLY = {getattr(aten, n).correction for n in ("var", "std", "var_mean", "std_mean")
               if hasattr(aten, n)}


def _check_dim(func, args, kwargs) -> None:
    pos, default = _DIM_CHECKED[func]
    dim = args[pos] if pos is not _KW and len(args) > pos else kwargs.get("dim", default)
    n = max(args[0].dim(), 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], "
                         f"but got {dim})")


def _tiny(a):
    """A CPU stand-in of ``a`` with every dimension at most 1 (tensors), recursively."""
    if isinstance(a, torch.Tensor):
        return torch.zeros([min(s, 1) for s in a.shape], dtype=a.dtype, device="cpu")
    if isinstance(a, (list, tuple)):
        return type(a)(_tiny(x) for x in a)
    if isinstance(a, torch.device) and a.type == "tpu":
        return torch.device("cpu")
    if isinstance(a, str) and (a == "tpu" or a.startswith("tpu:")):
        return "cpu"
    return a


def _dtype_sig(a):
    if isinstance(a, torch.Tensor):
        return a.dtype
    if isinstance(a, (list, tuple)):
        return tuple(_dtype_sig(x) for x in a)
    if isinstance(a, torch.dtype):
        return a
    return type(a)


# The wording of CPU kernels that refuse a dtype ("abs_cpu" not implemented for 'Bool'; "the `-`
# operator, with a bool tensor is not supported"); other errors of the stand-ins are about their
# shapes or values, not the dtypes.
_DTYPE_REFUSAL = re.compile(r"not implemented for '|(with|on) (a|two) bool tensors? (is|are) not "
                            r"supported")
_DTYPE_ERRORS = Cache("dtype support", 4096)    # (op, dtypes of its arguments) -> error or None
_PROBING = threading.local()                    # this thread is running a dtype probe
# CPU kernels that crash on stand-ins (oneDNN reads their real shapes; CTC's backward indexes its
# inputs by the real lengths, unchecked; embedding_bag with ``include_last_offset`` reads past
# one-element stand-ins, a segfault): never probed.
_NO_STAND_INS = {o for o in (getattr(getattr(aten, p, None), ov, None) for p, ov in (
    ("mkldnn_rnn_layer", "default"), ("mkldnn_rnn_layer_backward", "default"),
    ("_ctc_loss", "default"), ("_ctc_loss", "Tensor"), ("_ctc_loss_backward", "default"),
    ("_ctc_loss_backward", "Tensor"), ("_embedding_bag", "default"),
    ("_embedding_bag_forward_only", "default"), ("_embedding_bag_backward", "default"),
    ("_embedding_bag_dense_backward", "default"),
    ("_embedding_bag_per_sample_weights_backward", "default"))) if o is not None}


# Ops CPU refuses for integer tensors and CUDA accepts, which code written for accelerators calls
# with integers on any device but CPU (transformers' MoE layers count tokens per expert with an
# integer ``histc`` off CPU): tpu accepts them, as CUDA does.
_ACCELERATOR_INT_OK = {aten.histc.default}
# Ops CPU refuses for bfloat16 and float16 and CUDA computes, which models call in half precision
# on any device but CPU (transformers' cosmos3_edge resizes its position grid with an antialiased
# interpolate, upcast to float32 on CPU only): tpu computes them, as CUDA does (the lowering
# accumulates in float32 and rounds once, as CPU's float32 result cast back would).
_ACCELERATOR_HALF_OK = {o for o in (getattr(getattr(aten, p, None), ov, None) for p in (
    "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa", "_upsample_bilinear2d_aa_backward",
    "_upsample_bicubic2d_aa_backward") for ov in ("default", "vec")) if o is not None}


def dtype_error(func, args, kwargs):
    """CPU's refusal of these dtypes (``"abs_cpu" not implemented for 'Bool'``), or None. Meta
    kernels check shapes, not which dtypes a CPU kernel implements, so a tpu op would compute what
    CPU refuses. Found by running the CPU kernel once per op and argument dtypes on stand-ins of
    at most one element per dimension (other errors from those stand-ins are ignored)."""
    if func in _ACCELERATOR_INT_OK and isinstance(args[0], torch.Tensor) and not (
            args[0].is_floating_point() or args[0].is_complex() or args[0].dtype == torch.bool):
        return None
    if func in _ACCELERATOR_HALF_OK and isinstance(args[0], torch.Tensor) and args[0].dtype in (
            torch.bfloat16, torch.float16):
        return None
    key = (func, tuple(_dtype_sig(a) for a in args),
           tuple((k, _dtype_sig(v)) for k, v in kwargs.items()))
    err = _DTYPE_ERRORS.get(key, 0)
    if err == 0:
        if getattr(_PROBING, "on", False):
            # A probe that reaches a tpu op again (a composite making tensors of its own, a
            # default device) is not probed in turn: it would recurse without end.
            return None
        err = None
        if not (torch.Tag.nondeterministic_seeded in func.tags or "generator" in kwargs
                or func in _NO_STAND_INS):
            _PROBING.on = True
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    func(*[_tiny(a) for a in args], **{k: _tiny(v) for k, v in kwargs.items()})
            except (NotImplementedError, RuntimeError) as e:
                if _DTYPE_REFUSAL.search(str(e)):
                    err = e
            except Exception:
                pass
            finally:
                _PROBING.on = False
        _DTYPE_ERRORS[key] = err
    return err


def infer(func, args, kwargs):
    """(structure, [(size, stride, dtype) or None per output]) of ``func``'s outputs; bad
    arguments raise what CPU raises (NOTE [CPU's words])."""
    _check_like_cpu(func, args, kwargs)
    try:
        return _infer(func, args, kwargs)
    except NotImplementedError:
        raise
    except _ARG_ERRORS as e:
        raise_like_cpu(func, args, kwargs, e)


def _infer(func, args, kwargs):
    rule = _RULES.get(func)
    if rule is not None:
        return rule(*args, **kwargs)
    if func in _DIM_CHECKED:
        _check_dim(func, args, kwargs)
    if func in _FLOAT_ONLY and not (args[0].is_floating_point() or args[0].is_complex()):
        err = cpu_error(func, args, kwargs)     # their meta kernels take integer tensors
        if err is not None:
            raise err
    if func in _EMPTY_CHECKED:
        err = _empty_reduction_error(func, args, kwargs)
        if err is not None:
            raise err
    if func in _SAME_DTYPE and len({a.dtype for a in args if isinstance(a, torch.Tensor)}) > 1:
        err = cpu_error(func, args, kwargs)
        if err is not None:
            raise RuntimeError(str(err))
    return _meta_outputs(func, args, kwargs)


def _meta_outputs(func, args, kwargs):
    """(structure, descs) of ``func``'s outputs from its meta kernel (NOTE [meta memo])."""
    key = memo.key(func, args, kwargs)
    if key is not None:
        r = memo.get(key)
        if r is not None:
            return r
    rk = sizes.key(func, args, kwargs) if config.meta_rules else None
    if rk is not None:
        r = sizes.derive(rk)
        if r is not None:
            _cross_check(func, args, kwargs, r, _run_meta,
                         "derived by rule", "NOTE [sizes by rule] in deferfuse/metasize.py; "
                         "DEFERFUSE_META_RULES=0 turns the rules off")
            sizes.derived += 1
            if key is not None:
                memo.put(key, r)
            return r
    r = _run_meta(func, args, kwargs)
    if rk is not None:
        sizes.learn(rk, r)
    if key is not None:
        memo.put(key, r)
    return r


def _cross_check(func, args, kwargs, r, kernel, how: str, where: str) -> None:
    """In debug mode or with ``DEFERFUSE_CROSS_CHECK=1``: a rule's answer ``r`` for ``func`` must
    equal what ``kernel`` gives on the same arguments."""
    if config.cross_check or config.mode == "debug":
        exact = kernel(func, args, kwargs)
        if exact != r:
            raise AssertionError(
                f"deferfuse internal error: {func}'s outputs {how} {r} differ from its meta "
                f"kernel's {exact} ({where})")


def _run_meta(func, args, kwargs):
    # NOTE [meta without dynamo] (metaplain.py)
    r = plain.answer(func, args, kwargs) if config.meta_plain else None
    if r is not None:
        _cross_check(func, args, kwargs, r, _kernel_outputs, "answered by rule",
                     "NOTE [meta without dynamo] in deferfuse/metaplain.py")
        return r
    return _kernel_outputs(func, args, kwargs)


_CPU_SCALAR_VALUE = {aten.masked_fill.Tensor, aten.masked_fill_.Tensor}


def _cpu_scalar(a) -> bool:
    return isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() == 0


def _kernel_outputs(func, args, kwargs):
    margs = [_to_meta(a) for a in args]
    mkw = {k: _to_meta(v) for k, v in kwargs.items()}
    if func is _GROUPED_MM and _grouped_mm_out is not None:
        # Its meta kernel copies CUDA's bfloat16-only check; CPU eager (and the lowering) take
        # any float dtype, and transformers' MoE layers call it on tpu: use the shape rule alone.
        a, b = margs[0], margs[1]
        offs = margs[2] if len(margs) > 2 else mkw.get("offs")
        dt = (margs[4] if len(margs) > 4 else mkw.get("out_dtype")) or a.dtype
        return "one", (_desc(_grouped_mm_out(a, b, offs, dt)),)
    if func in _CPU_SCALAR_VALUE and len(margs) > 2 and _cpu_scalar(margs[2]):
        # masked_fill's value may be a CPU scalar tensor on an accelerator (PyTorch's reference
        # allows it for PrivateUse1, but not for the meta tensor standing in for ours)
        margs[2] = torch.empty((), dtype=margs[2].dtype, device=_META)
    if not func._schema.returns:      # in-place ops declared "-> ()" (_foreach_add_ ...)
        try:
            func(*margs, **mkw)           # checks the arguments; there is nothing to infer
        except NotImplementedError:
            pass                          # no meta kernel (_fused_sgd_, _fused_adagrad_)
        return "none", ()
    out = (plain.kernel(func) if config.meta_plain else func)(*margs, **mkw)
    if isinstance(out, torch.Tensor):
        return "one", (_desc(out),)
    if isinstance(out, list):
        return "list", tuple(_desc(m) for m in out)
    if isinstance(out, tuple):
        return "tuple", tuple(_desc(m) for m in out)
    raise NotImplementedError(f"{func} returned {type(out).__name__}")


class MetaMemo:
    """NOTE [meta memo]: what the meta kernels answered, kept on disk for the next process.

    A second process of the same script computes every op's output shapes again before it can find
    its programs in the store (NOTE [program store] in runtime/diskcache.py): nanoGPT's sampling
    loop makes 757 op signatures (each length a new one), and running their meta kernels (with
    PyTorch importing ``torch._dynamo`` at the first elementwise reference) took about half of
    its second process's call. Answers are kept by a description of the op and its arguments that
    is the same in every process (op, default dtype, each tpu tensor's sizes, strides, offset,
    dtype, base and conjugate/negative bits, every other argument's value with its type); an
    argument with no such description (a CPU tensor, whose values a meta kernel may read; a
    generator) is never kept. Only answers are kept, never errors, and the file is keyed by the
    torch version and this module's source. Written once at exit (merged with what another
    process wrote meanwhile, replaced atomically), at most ``capacity`` entries."""

    def __init__(self, capacity: int = 1 << 15):
        self.capacity = capacity
        self.path = None
        self.table = None       # loaded on first use
        self.new = {}
        self.hits = self.misses = 0

    def enable(self, folder: str) -> None:
        import atexit
        import hashlib
        import os
        h = hashlib.sha256(torch.__version__.encode())
        with open(__file__, "rb") as f:
            h.update(f.read())
        self.path = os.path.join(folder, f"meta-{h.hexdigest()[:24]}.pkl")
        atexit.register(self.save)

    def _load(self) -> dict:
        import pickle
        try:
            with open(self.path, "rb") as f:
                t = pickle.load(f)
            return t if isinstance(t, dict) else {}
        except Exception:
            return {}

    def key(self, func, args, kwargs):
        if self.path is None:
            return None
        try:
            return (str(func), str(torch.get_default_dtype()), _stable(args), _stable(kwargs))
        except _Unkept:
            return None

    def get(self, key):
        if self.table is None:
            self.table = self._load()
        r = self.table.get(key)
        if r is None:
            self.misses += 1
        else:
            self.hits += 1
        return r

    def put(self, key, value) -> None:
        if len(self.table) < self.capacity:
            self.table[key] = value
            self.new[key] = value

    def save(self) -> None:
        if not self.new or self.path is None:
            return
        import pickle
        from .runtime.diskcache import write_atomic
        try:
            table = self._load()
            for k, v in self.new.items():
                if len(table) >= self.capacity:
                    break
                table[k] = v
            write_atomic(self.path, pickle.dumps(table, protocol=pickle.HIGHEST_PROTOCOL))
            self.new = {}
        except Exception:
            pass


class _Unkept(Exception):
    pass


_PLAIN = (int, float, bool, str, complex, type(None))
_NAMED = (torch.dtype, torch.device, torch.layout, torch.memory_format)


def _stable(x):
    t = type(x)
    if t in _PLAIN:
        return (t.__name__, x)
    if t is TpuTensor:
        return ("T", tuple(x.shape), tuple(x.stride()), x.storage_offset(), str(x.dtype),
                tuple(x._s.val.shape), bool(x._chain), x.is_conj(), x.is_neg())
    if t is tuple or t is list:
        return (t.__name__,) + tuple(_stable(y) for y in x)
    if t is dict:
        return ("dict",) + tuple((k, _stable(v)) for k, v in sorted(x.items()))
    if isinstance(x, _NAMED):
        return (t.__name__, str(x))
    raise _Unkept(t.__name__)


memo = MetaMemo()
sizes = SizeRules()        # NOTE [sizes by rule]


# Views that return several outputs become one slice/select step per output.
def _split_steps(func, base, args, kwargs, outs):
    dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    dim = dim % max(base.dim(), 1)
    steps = []
    if func in (aten.unbind.int,):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0) % max(base.dim(), 1)
        return [(aten.select.int, (dim, i), ()) for i in range(len(outs))]
    start = 0
    for o in outs:
        n = o.shape[dim]
        steps.append((aten.slice.Tensor, (dim, start, start + n, 1), ()))
        start += n
    return steps


from .opinfo import MULTI_VIEWS as _MULTI  # noqa: E402


def _static(x):
    if isinstance(x, list):
        return tuple(_static(y) for y in x)
    return x


def infer_view(func, args, kwargs):
    """[(size, stride, offset, dtype, step)] of a view op's outputs; step None for an alias. Bad
    arguments raise what CPU raises (NOTE [CPU's words])."""
    try:
        return _infer_view(func, args, kwargs)
    except NotImplementedError:
        raise
    except _ARG_ERRORS as e:
        raise_like_cpu(func, args, kwargs, e)


def _infer_view(func, args, kwargs):
    base = args[0]
    m = _to_meta(base)
    out = func(m, *[_to_meta(a) for a in args[1:]], **{k: _to_meta(v) for k, v in kwargs.items()})
    if func in (aten.detach.default, aten.alias.default, aten.lift_fresh.default):
        return [(tuple(out.shape), tuple(out.stride()), out.storage_offset(), out.dtype, None)]
    if isinstance(out, (list, tuple)):
        if func not in _MULTI:
            raise NotImplementedError(f"multi-output view {func}")
        steps = _split_steps(func, base, args, kwargs, out)
        return [(tuple(o.shape), tuple(o.stride()), o.storage_offset(), o.dtype, s)
                for o, s in zip(out, steps)]
    if func is aten.as_strided.default:
        size, stride = _static(args[1]), _static(args[2])
        off = args[3] if len(args) > 3 and args[3] is not None else kwargs.get("storage_offset")
        off = base.storage_offset() if off is None else off
        _check_storage_bounds(base, size, stride, off)
        step = (func, (size, stride, off, base._s.val.shape, _base_stride(base)), ())
    else:
        step = (func, tuple(_static(a) for a in args[1:]), tuple((k, _static(v)) for k, v in kwargs.items()))
    return [(tuple(out.shape), tuple(out.stride()), out.storage_offset(), out.dtype, step)]


def _check_storage_bounds(base, size, stride, offset) -> None:
    """CPU's error for an as_strided view reaching past the end of its storage (the meta kernel
    has no storage to check against)."""
    if any(n == 0 for n in size):
        return
    numel = 1
    for n in base._s.val.shape:
        numel *= n
    item = base.element_size()
    needed = (offset + sum((n - 1) * st for n, st in zip(size, stride)) + 1) * item
    if needed > numel * item:
        raise RuntimeError(
            f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset}, and "
            f"itemsize {item} requiring a storage size of {needed} are out of bounds for storage "
            f"of size {numel * item}")


def _base_stride(t):
    """NOTE [storage layout]: the strides of the tensor the storage was made for. A storage's value
    is a JAX array of that tensor's shape (row-major, logically), but ``as_strided`` offsets refer
    to memory, laid out by those strides: a channels_last tensor's memory is NHWC. The as_strided
    lowering puts the value in memory order first (runtime/lowering/views.py)."""
    if t._s.stride is not None:
        return tuple(t._s.stride)
    shape = t._s.val.shape
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(st))
