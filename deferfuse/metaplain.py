"""Meta answers without ``torch._dynamo``.

NOTE [meta without dynamo]: most elementwise ops' meta kernels are PyTorch's Python references (``torch._refs.add``),
registered for the Meta key as a few wrappers (``out_wrapper``; for unary ops one that takes
Python numbers) around ``torch._disable_dynamo`` around the reference with its type promotion. That
Dynamo wrapper imports ``torch._dynamo`` the first time one is called, to wrap the reference so
that a Dynamo trace skips it: about 1.5 s on a quiet machine (several under load), paid by a tpu
script's first elementwise op and by nothing else it does (CPU eager never runs these kernels).
Nothing here runs under Dynamo, so:

- ``kernel(func)``: where the kernel the dispatcher runs for Meta is such a Python reference (it
  was registered by ``torch._meta_registrations``, not in C++) and its wrappers above the Dynamo
  one only pass their arguments on (``out`` not given, the first argument not a Python number;
  a call where one would do more goes through the dispatcher), the reference is called from below
  the Dynamo wrapper: the same function on the same arguments. Found through each wrapper's
  closure, not ``__wrapped__`` (``torch._refs``' binary ops point it elsewhere).
- ``answer(func, args, kwargs)``: a few kernels meet a Dynamo wrapper *inside* (a decomposition
  calling other ops: ``native_layer_norm``, ``linear``, ``gelu``, ``div``, ``mean``). For their plain cases
  (contiguous inputs of one floating dtype, no ``out``) the answer is written here: the output
  sizes, contiguous strides and dtypes their kernels give; any other case (None) runs the kernel.
  ``tests/test_meta.py`` compares every rule with the kernel over broadcasts, ranks, dtypes and
  scalar kinds, and debug mode and ``DEFERFUSE_CROSS_CHECK=1`` compare each answer with the
  kernel's as it is made.

A script whose ops all answer either way never imports ``torch._dynamo``; one that uses another
such op still imports it there, as before.
"""
from __future__ import annotations

import torch

from .scheduler.cache import Cache
from .tensor import TpuTensor

aten = torch.ops.aten
_KERNELS = Cache("meta kernels", 4096)      # op -> what the meta inference calls for it


def _wrapper_codes():
    """(codes of wrappers that pass a kernel's arguments on, code of the Dynamo wrapper), or
    Nones (another torch: every kernel runs through the dispatcher)."""
    try:
        from torch._compile import _disable_dynamo
        from torch._prims_common import TensorLikeType
        from torch._prims_common.wrappers import elementwise_unary_scalar_wrapper, out_wrapper

        def probe(a: TensorLikeType) -> TensorLikeType:
            return a
        return ((out_wrapper()(probe).__code__, elementwise_unary_scalar_wrapper(probe).__code__),
                _disable_dynamo(probe).__code__)
    except Exception:
        return None, None


_PASS_CODES, _NO_DYNAMO_CODE = _wrapper_codes()


def kernel(func):
    """What to call for ``func``'s meta kernel on meta arguments."""
    k = _KERNELS.get(func)
    if k is None:
        k = _KERNELS[func] = _unwrapped(func) or func
    return k


def _closed(fn, name: str):
    """The value ``fn`` holds in its closure under ``name``."""
    return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents


def _unwrapped(func):
    if _PASS_CODES is None:
        return None
    try:
        top = fn = func.py_kernels.get(torch._C.DispatchKey.Meta)
        while fn is not None and getattr(fn, "__code__", None) in _PASS_CODES:
            if "pass_is_out" in fn.__code__.co_freevars and _closed(fn, "pass_is_out"):
                return None         # it calls with ``is_out=``: not a plain pass
            fn = _closed(fn, "fn")
        if fn is top or getattr(fn, "__code__", None) is not _NO_DYNAMO_CODE:
            return None
        ref = _closed(fn, "fn")
        line = next((ln for ln in torch._C._dispatch_dump_table(func.name()).splitlines()
                     if ln.startswith("Meta:")), "")
        if not callable(ref) or "torch/_meta_registrations.py" not in line.replace("\\", "/"):
            return None
    except Exception:
        return None

    def call(*args, **kwargs):
        if "out" in kwargs or (args and isinstance(args[0], (int, float, complex))):
            return func(*args, **kwargs)
        return ref(*args, **kwargs)
    return call


# --------------------------------------------------------------------------- plain answers
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _contig(shape) -> tuple:
    """PyTorch's contiguous strides of ``shape``."""
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(st))


def _plain(t, dtype=None) -> bool:
    """A tpu tensor, contiguous (every stride PyTorch's), of a floating dtype (``dtype`` if
    given)."""
    return (type(t) is TpuTensor and t.dtype in _FLOATS and (dtype is None or t.dtype == dtype)
            and tuple(t.stride()) == _contig(t.shape))


def _desc(shape, dtype):
    shape = tuple(shape)
    return (shape, _contig(shape), dtype)


def _broadcast(a, b):
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and x != 1 and y != 1:
            return None
        out.append(y if x == 1 else x)
    return tuple(out)


def _linear(input, weight, bias=None):
    if not (_plain(input) and _plain(weight, input.dtype) and weight.dim() == 2
            and input.dim() >= 1 and input.shape[-1] == weight.shape[1]):
        return None
    if bias is not None and not (_plain(bias, input.dtype) and tuple(bias.shape) ==
                                 (weight.shape[0],)):
        return None
    return "one", (_desc(tuple(input.shape[:-1]) + (weight.shape[0],), input.dtype),)


def _layer_norm(input, normalized_shape, weight, bias, eps):
    ns = tuple(normalized_shape)
    if not (_plain(input) and 1 <= len(ns) <= input.dim()
            and tuple(input.shape[input.dim() - len(ns):]) == ns):
        return None
    for p in (weight, bias):
        if p is not None and not (_plain(p, input.dtype) and tuple(p.shape) == ns):
            return None
    axis = input.dim() - len(ns)
    stat = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    lead = tuple(input.shape[:axis]) + (1,) * len(ns)
    return "tuple", (_desc(input.shape, input.dtype), _desc(lead, stat), _desc(lead, stat))


def _gelu(input, approximate="none"):
    if not (_plain(input) and approximate in ("none", "tanh")):
        return None
    return "one", (_desc(input.shape, input.dtype),)


def _div(a, b):
    if not _plain(a):
        return None
    if type(b) in (int, float):
        return ("one", (_desc(a.shape, a.dtype),)) if a.dim() >= 1 else None
    if not _plain(b, a.dtype):
        return None
    shape = _broadcast(a.shape, b.shape)
    return None if shape is None else ("one", (_desc(shape, a.dtype),))


def _mean(input, dim, keepdim=False, dtype=None):
    if not _plain(input) or dtype is not None or input.dim() == 0:
        return None
    dims = [dim] if type(dim) is int else list(dim) if type(dim) in (list, tuple) else None
    n = input.dim()
    if not dims or any(type(d) is not int or not -n <= d < n for d in dims):
        return None
    dims = {d % n for d in dims}
    if len(dims) != len([d % n for d in (dim if type(dim) in (list, tuple) else [dim])]):
        return None     # a dim named twice: the kernel's error
    shape = [1 if i in dims else s for i, s in enumerate(input.shape)
             if keepdim or i not in dims]
    return "one", (_desc(shape, input.dtype),)


_ANSWERS = {aten.linear.default: _linear, aten.native_layer_norm.default: _layer_norm,
            aten.gelu.default: _gelu, aten.div.Tensor: _div, aten.mean.dim: _mean}


def answer(func, args, kwargs):
    """``func``'s (structure, descs) for a plain case of the ops above, or None."""
    rule = _ANSWERS.get(func)
    if rule is None or "out" in kwargs:
        return None
    try:
        return rule(*args, **kwargs)
    except TypeError:       # arguments this rule does not take: the kernel answers
        return None
