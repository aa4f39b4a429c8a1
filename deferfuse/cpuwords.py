"""NOTE [CPU's words]: the errors CPU raises for bad arguments, raised at the call on tpu.

Meta kernels check shapes in their own words, and skip some checks CPU makes (dtypes an in-place
op cannot cast to, a float index, integer ``std``, a reduction over an empty dim, a dim out of
range), so a tpu op would compute what CPU refuses or fail later inside a region with JAX's words.
Each check here is a cheap look at shapes and dtypes; only when one finds a suspect does CPU run
on stand-ins of the same shapes and dtypes (no memory behind them) to say what it raises.
"""
from __future__ import annotations

import re
import threading
import warnings

import torch

from .scheduler.cache import Cache

aten = torch.ops.aten


def _meta_like(v):
    """A meta tensor of ``v``'s shape and dtype (for type promotion), or ``v`` itself."""
    if isinstance(v, torch.Tensor):
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    return v


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
ARG_ERRORS = (RuntimeError, IndexError, ValueError, TypeError)


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
    except ARG_ERRORS as e:
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
                    inputs.append(_meta_like(v))
        elif isinstance(v, torch.Tensor) or (
                # a Scalar, or a number PyTorch passed for a Tensor argument (x.mul_(2.5))
                isinstance(v, (bool, int, float, complex)) and a.name not in ("alpha", "value")
                and isinstance(a.type, (torch.NumberType, torch.OptionalType, torch.TensorType))):
            inputs.append(_meta_like(v))
    if not written or not inputs:
        return False
    try:
        _, result = elementwise_dtypes(*inputs,
                                       type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
    except Exception:
        return False
    return any(not torch.can_cast(result, w.dtype) for w in written)


def check_dtypes(func, args, kwargs) -> None:
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


def check_arguments(func, args, kwargs) -> None:
    """Before a meta kernel: CPU's error for a dim out of range, an integer ``std``/``var``, a
    reduction without identity over an empty dim, or products of mixed dtypes, raised here."""
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
