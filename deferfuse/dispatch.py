"""Every aten op on a ``tpu`` tensor comes here: meta inference, writes, and then the op runs
(strict/debug eager) or is recorded (defer); view ops go on to ``views.py``.

The hot path is ``torch_dispatch`` -> ``_run``: build the op's structural key by hand (no
tree_map), look it up, and either call the cached per-op jit or append a node to the pending trace.
"""
from __future__ import annotations

import operator
import sys

import numpy as np
import torch

from . import state
from .opinfo import decompose, op_info
from .runtime import execute
from .runtime.dtypes import to_np_dtype
from .runtime.node import SS, TS, build
from .runtime import transfer
from .record import user_site
from .scheduler.records import Value, sig_id
from .tensor import Storage, TpuTensor, make
from .views import ALIAS_OPS, run_alias, run_view

aten = torch.ops.aten
_trace = state.trace
_SIG = operator.attrgetter("_sig")
_VAL = operator.attrgetter("_s.val")
_DEV = operator.attrgetter("_s.device")
_TPU_ONLY = {TpuTensor}
_PLAIN = {int, float, bool, type(None)}     # list items _encode keeps as they are (static)
_SPECIAL_SCALARS = {0, 1, -1, 2, 0.5, 0.0, 1.0, -1.0, 2.0}
_CACHE: dict = {}       # op key -> _Entry


class _Entry:
    """What one op structure needs at run time, computed on its first call."""
    __slots__ = ("fn", "jit", "out", "khash", "name", "key", "res_avals", "msgs", "fast", "made")


def user_frame() -> str:
    """'file:line' of the innermost caller outside torch and deferfuse."""
    return user_site(sys._getframe(1))


# --------------------------------------------------------------------------------------------
# building blocks

def new_tensor(val: Value, device: int, dtype, size, stride, chain=(), offset=0, storage=None,
               sig=None):
    st = storage if storage is not None else Storage(val, device, dtype)
    t = make(st, chain, size, stride, offset, dtype, sig)
    if storage is None and val.node is not None:
        state.trace.track(st)
    return t


def read(t: TpuTensor):
    """The concrete JAX array of ``t`` (its view applied), running pending work first."""
    v = t._s.val
    if v.array is None:
        state.sync("cpu")
        v = t._s.val
        if v.array is None:
            transfer.materialize_empty(v, t._s.device)
    if not t._chain:
        return v.array
    return execute.read_view(v.array, t._chain)


def to_cpu(t: TpuTensor, reason: str = "cpu") -> torch.Tensor:
    """A CPU copy of ``t`` (a sync point in defer mode)."""
    if t._s.val.node is not None:
        state.sync(reason, want=t._s.val)
    elif state.trace.nodes and state.backward_cut():
        # NOTE [backward cut]: the value was computed before the pending trace (a loss whose
        # forward pass ran at backward()): dispatch the trace, wait for none of it.
        state.sync(reason, later=True)
    arr = read(t)
    out = transfer.to_torch(arr, t.dtype)
    return out.reshape(t.shape) if out.shape != t.shape else out


def _device_error(a, b):
    return RuntimeError("Expected all tensors to be on the same device, but found at least two "
                        f"devices, {a} and {b}! Move the {b} tensor with .to('{a}') first.")


def _const_value(cpu: torch.Tensor, device: int) -> Value:
    return transfer.host_value(cpu, device)


# --------------------------------------------------------------------------------------------
# the generic op path

_ROUTE: dict = {}   # id(OpOverload) -> (handler(func, info, args, kwargs), OpInfo, the OpOverload)


def torch_dispatch(cls, func, types, args=(), kwargs=None):
    """``TpuTensor.__torch_dispatch__`` itself (one Python frame less per op than a wrapper)."""
    # Keyed by id: OpOverload.__hash__ is Python code, and this runs for every op. The entry
    # keeps the OpOverload alive, so its id is never reused.
    r = _ROUTE.get(id(func))
    if r is None:
        r = _ROUTE[id(func)] = _route(func)
    try:
        return r[0](func, r[1], args, kwargs or {})
    except ForeignSubclass:
        return NotImplemented
    except BaseException as e:
        if torch._C._current_autograd_node() is None:
            raise
        # NOTE [errors in backward]: a Python exception leaving __torch_dispatch__ inside the
        # autograd engine is still pending when the engine's stream guard, unwinding, calls the
        # Python device guard of PrivateUse1 (a noexcept call): the interpreter aborted
        # ("terminate called without an active exception"), or run_backward returned a SystemError
        # without a message. (NotImplemented does not help: PyTorch's "all handlers returned
        # NotImplemented" is a Python exception too.) So the error is kept and the op returns an
        # empty CPU tensor: the engine's own checks of it fail in C++, which unwinds safely, and
        # backward() and autograd.grad (device.py) raise the kept error instead.
        BACKWARD_ERRORS.append(e)
        return torch.empty(0)


BACKWARD_ERRORS: list = []    # errors of ops run by the autograd engine (NOTE [errors in backward])
_NO_DISPATCH = torch._C._disabled_torch_dispatch_impl


class ForeignSubclass(Exception):
    """An argument is another tensor subclass wrapping a tpu tensor (DTensor's
    AsyncCollectiveTensor): __torch_dispatch__ returns NotImplemented so that its own runs first."""


def dispatch(func, args, kwargs):
    return torch_dispatch(None, func, None, args, kwargs)


def _route(func):
    info = op_info(func)
    h = _SPECIAL.get(func)
    if h is not None:
        return (lambda func, info, args, kwargs: h(func, args, kwargs)), info, func
    kind = info.kind
    if kind == "lowered" or kind == "self_mut" or kind == "func_mut":
        return _run, info, func
    if func in ALIAS_OPS:
        return run_alias, info, func
    if kind == "view":
        return run_view, info, func
    if kind == "decomp":
        return _decomp, info, func
    if kind == "data_dependent":
        return (lambda func, info, args, kwargs:
                _fallback(func, info, args, kwargs, "data-dependent shape")), info, func
    if kind == "unsupported_view":
        return _unsupported_view, info, func
    return (lambda func, info, args, kwargs: _fallback(func, info, args, kwargs, "no lowering")), \
        info, func


def _decomp(func, info, args, kwargs):
    out = decompose(func, args, kwargs)
    if out is NotImplemented:
        return _fallback(func, info, args, kwargs, "no lowering")
    return out


def _unsupported_view(func, info, args, kwargs):
    raise NotImplementedError(
        f"{info.name} is a view op with no lowering on the tpu device; a copy would break "
        "aliasing, so it is not run on CPU. Call .clone() or .contiguous() on its result's "
        "input first, or file an issue")


def _encode(a, info_scalar: bool, tensors: list, scalars: list, static: bool, device: list):
    """One argument -> its template entry (hashable), appending tensor and scalar inputs."""
    ta = type(a)
    if ta is TpuTensor:
        d = a._s.device
        if device[0] is None:
            device[0] = d
        elif device[0] != d:
            raise _device_error(f"tpu:{device[0]}", f"tpu:{d}")
        tensors.append(a)
        return (TS, len(tensors) - 1)
    if ta is float or ta is int:
        if info_scalar and not static and a not in _SPECIAL_SCALARS:
            scalars.append(a)
            return (SS, len(scalars) - 1, ta)
        return a
    if ta is list or ta is tuple:
        if a and type(a[0]) is TpuTensor and set(map(type, a)) == _TPU_ONLY:
            # A tensor list on one device (foreach ops: a whole optimizer group): one pass.
            d = a[0]._s.device
            if (device[0] is None or device[0] == d) and len(set(map(_DEV, a))) == 1:
                device[0] = d
                n = len(tensors)
                tensors.extend(a)
                return _ts_range(n, len(a))
        elif (static or not info_scalar) and set(map(type, a)) <= _PLAIN:
            return tuple(a)     # sizes, strides, dims: what the loop below would give, in one call
        return tuple([_encode(x, info_scalar, tensors, scalars, static, device) for x in a])
    if isinstance(a, torch.Tensor):
        if isinstance(a, TpuTensor):
            tensors.append(a)
            return (TS, len(tensors) - 1)
        if a.dim() == 0 and a.device.type == "cpu":
            # PyTorch lets 0-dim CPU tensors mix with any device: move the value over.
            t = new_tensor(_const_value(a, device[0] or 0), device[0] or 0, a.dtype, (), ())
            tensors.append(t)
            return (TS, len(tensors) - 1)
        if getattr(type(a), "__torch_dispatch__", _NO_DISPATCH) is not _NO_DISPATCH:
            raise ForeignSubclass       # its own __torch_dispatch__ unwraps it: let it run
        raise _device_error(f"tpu:{device[0] or 0}", str(a.device))
    if ta is torch.device and a.type == "tpu":
        if device[0] is None:
            device[0] = a.index or 0
        return ("\0dev",)
    return a


_TS_RANGES: dict = {}


def _ts_range(start: int, n: int) -> tuple:
    """The template of a tensor list that is tensor inputs start .. start+n-1 (cached)."""
    r = _TS_RANGES.get((start, n))
    if r is None:
        r = _TS_RANGES[(start, n)] = tuple([(TS, i) for i in range(start, start + n)])
    return r


def _run(func, info, args, kwargs):
    gen = None
    if kwargs and info.low.rng and kwargs.get("generator") is not None:
        # NOTE [generators]: a CPU torch.Generator seeds this op (one draw from it makes a JAX key);
        # the device's own key is left alone. It used to be ignored, and a new generator object
        # made a new cache entry: another compile per call.
        gen = kwargs["generator"]
        kwargs = dict(kwargs, generator=None)
    tensors: list = []
    scalars: list = []
    device = [None]
    low = info.low
    static = low.static
    sp = info.scalar_pos
    targs = []
    i = 0
    for a in args:
        ta = type(a)
        if ta is TpuTensor:     # the common case, inlined from _encode
            d = a._s.device
            if device[0] is None:
                device[0] = d
            elif device[0] != d:
                raise _device_error(f"tpu:{device[0]}", f"tpu:{d}")
            targs.append((TS, len(tensors)))
            tensors.append(a)
        elif ta is float or ta is int:     # inlined from _encode too
            if i in sp and not static and a not in _SPECIAL_SCALARS:
                targs.append((SS, len(scalars), ta))
                scalars.append(a)
            else:
                targs.append(a)
        else:
            targs.append(_encode(a, i in sp, tensors, scalars, static, device))
        i += 1
    targs = tuple(targs)
    if kwargs:
        skw = info.scalar_kw
        tkw = tuple((k, _encode(v, k in skw, tensors, scalars, static, device))
                    for k, v in kwargs.items() if k not in info.mut_kw or info.kind == "self_mut")
    else:
        tkw = ()
    if info.kind == "func_mut" and info.mut_kw:
        # out= tensors: written, never passed to the functional lowering.
        for n in info.mut_kw:
            if n in kwargs:
                _encode(kwargs[n], False, tensors, scalars, True, device)
    # OpInfo, not the OpOverload: OpOverload.__hash__ is Python code, object hashing is not.
    # Scalar inputs' types are in targs/tkw already: (SS, index, type).
    key = (info, targs, tkw, tuple(map(_SIG, tensors)))
    entry = _CACHE.get(key)
    if entry is None:
        try:
            entry = _compile_entry(func, info, args, kwargs, key, targs, tkw, tensors)
        except NotImplementedError as e:
            # No meta kernel, or an output shape that depends on the data (boolean masks).
            msg = str(e)
            why = "data-dependent shape" if ("nonzero" in msg or "data-dependent" in msg
                                             or "dynamic" in msg.lower()) else "no meta kernel"
            _CACHE[key] = entry = why
    if entry.__class__ is str:
        return _fallback(func, info, args, kwargs, entry)
    dev = device[0] or 0
    # Inputs: each tensor's base value; a mutated input that is overwritten whole is not read.
    mut = entry.out[1]
    ins = list(map(_VAL, tensors))
    if info.overwrites and mut:
        for m in mut:
            if not tensors[m]._chain:
                ins[m] = None
    fast = entry.fast
    if fast is not None and state.MODE == "defer":
        # The common case, inlined from run_node and _bind: record an op with one new output.
        if fast.__class__ is tuple:
            st = Storage(_trace.record(entry, ins, scalars)[0], dev, fast[0])
            _trace.storages.append(st.wr)
            return make(st, (), fast[1], fast[2], 0, fast[0], fast[3])
        # Several new outputs (layer norm, a backward op, a foreach op): the same, per output.
        stor = _trace.storages
        res = []
        for m, v in zip(fast, _trace.record(entry, ins, scalars)):
            if m is None:
                res.append(None)
            else:
                st = Storage(v, dev, m[0])
                stor.append(st.wr)
                res.append(make(st, (), m[1], m[2], 0, m[0], m[3]))
        return res if entry.out[0][0] == "list" else tuple(res)
    if low.rng:
        ins.append(state.rng_storage(dev).val if gen is None else state.generator_key(gen, dev))
    outs = state.run_node(entry, ins, scalars, dev)
    return _bind(func, info, entry, outs, tensors, args, kwargs, dev, gen is None)


def _bind(func, info, entry, outs, tensors, args, kwargs, dev, device_key=True):
    out_meta, mut, rng = entry.out[0], entry.out[1], entry.out[2]
    if rng and device_key:
        st = state.rng_storage(dev)
        state.trace.track_mut(st, outs[-1])
        st.val = outs[-1]
    if mut:
        for k, m in enumerate(mut):
            st = tensors[m]._s
            state.trace.track_mut(st, outs[k])
            st.val = outs[k]
        rets = info.returns
        if not rets:
            return None
        res = []
        for r in rets:
            if r is None:
                res.append(None)
            elif r[2]:
                res.append(kwargs[r[1]])
            else:
                res.append(args[r[0]])
        if len(res) == 1:
            return res[0]
        return tuple(res)
    structure, metas = out_meta
    if structure == "none":     # an op declared "-> ()" (_linalg_check_errors ...)
        return None
    # entry.made: (dtype, size, stride or None, _sig) per output
    made = [None if m is None else new_tensor(v, dev, m[0], m[1], m[2], sig=m[3])
            for m, v in zip(entry.made, outs)]
    if structure == "one":
        return made[0]
    if structure == "list":
        return made
    return tuple(made)


def _compile_entry(func, info, args, kwargs, key, targs, tkw, tensors):
    from .meta import infer
    out = infer(func, args, kwargs)
    e = _Entry()
    e.name = info.name
    # hash(-1) == hash(-2) in CPython: mix in the text of the key so such keys never collide.
    e.khash = hash((key, repr(key)))
    mut = ()
    if info.kind in ("self_mut", "func_mut"):
        mut_objs = [args[i] for i in info.mut_pos if i < len(args)] + \
                   [kwargs[n] for n in info.mut_kw if n in kwargs]
        flat = []
        for o in mut_objs:
            flat.extend(o if isinstance(o, (list, tuple)) else [o])
        mut = tuple(next(j for j, t in enumerate(tensors) if t is o) for o in flat if o is not None)
        structure, metas = out
        for m, d in zip(mut, metas):
            if d is not None and tuple(d[0]) != tuple(tensors[m].shape):
                raise RuntimeError(
                    f"{info.name}: the out= tensor has shape {list(tensors[m].shape)} but the result "
                    f"has shape {list(d[0])}; tpu tensors cannot be resized in place, so pass an out= "
                    "tensor of the result's shape (or drop out=)")
        out_avals = tuple((tuple(tensors[m].shape), to_np_dtype(tensors[m].dtype)) for m in mut)
        metas = ()
        structure = None
    else:
        structure, metas = out
        out_avals = tuple(None if m is None else (tuple(m[0]), to_np_dtype(m[2])) for m in metas)
    bases = tuple((t._s.val.shape, t._s.val.dtype) for t in tensors)
    chains = tuple(t._chain for t in tensors)
    e.fn = build(info.low, targs, tkw, chains, bases, mut, info.kind == "self_mut", out_avals)
    e.out = ((structure, metas), mut, info.low.rng, out_avals)
    e.jit = None
    e.key = key
    res = [tuple(bases[m]) for m in mut] if mut else [a for a in out_avals]
    if info.low.rng:
        res.append(((2,), np.dtype(np.uint32)))
    e.res_avals = tuple(None if a is None else (a[0], a[1], _nbytes(a[0], a[1])) for a in res)
    # One new output and nothing written or random: _run's fast path in defer mode takes
    # (dtype, size, stride or None when contiguous, the output tensor's _sig).
    made = []
    for m in metas:
        if m is None:
            made.append(None)
            continue
        size, stride, dtype = tuple(m[0]), tuple(m[1]), m[2]
        made.append((dtype, size, None if stride == _contig(size) else stride,
                     sig_id((size, dtype, (), size, stride, dtype))))
    e.made = tuple(made)
    e.fast = None
    if not mut and not info.low.rng:
        if structure == "one" and made[0] is not None:
            e.fast = made[0]        # a tuple (dtype, size, stride, sig)
        elif structure in ("tuple", "list"):
            e.fast = made           # a list: one such tuple (or None) per output
    _CACHE[key] = e
    return e


def from_cpu(c: torch.Tensor, device: int = 0, dtype=None) -> TpuTensor:
    """A new tpu tensor holding a copy of the CPU tensor ``c``."""
    if dtype is not None and c.dtype != dtype:
        c = c.to(dtype)
    v = transfer.host_value(c, device)
    return new_tensor(v, device, c.dtype, tuple(c.shape), _contig(c.shape))


def _nbytes(shape, dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def _contig(shape):
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def copy_into(dst: TpuTensor, src) -> TpuTensor:
    """``dst.copy_(src)`` for any src (tpu tensor, CPU tensor), through the lowered copy_."""
    if isinstance(src, torch.Tensor) and type(src) is not TpuTensor:
        if (not dst._chain and src.dtype == dst.dtype and src.shape == dst.shape
                and dst._s.val.shape == tuple(src.shape)):
            # All of dst's storage is overwritten by a host tensor (``x.to("tpu")`` is an empty
            # tensor and this copy): the storage takes the transferred value itself, with no copy
            # op recorded or run. Ops recorded before read the old value, as they should.
            dst._s.val = transfer.host_value(src, dst._s.device)
            return dst
        src = from_cpu(src, dst._s.device)
    return _run(aten.copy_.default, op_info(aten.copy_.default), (dst, src), {})


from .fallback import fallback as _fallback  # noqa: E402  (it uses the helpers above)
from .specials import SPECIAL as _SPECIAL  # noqa: E402  (specials use the helpers above)

TpuTensor.__torch_dispatch__ = classmethod(torch_dispatch)
