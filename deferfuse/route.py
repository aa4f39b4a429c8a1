"""The entry of the op path: which path runs an aten op (the generic op path, a view, a special, a
decomposition, or the CPU fallback), decided once per op.

Ops reach it as ``TpuTensor`` ops: the router (plain.py, NOTE [plain router]) gives each op the C++
kernel does not record to ``TpuTensor.__torch_dispatch__``, which this module makes the C record
path (NOTE [C record path] in _fastpath.c) over ``torch_dispatch`` below. ``TpuTensor`` is the op
path's argument type, never a user's tensor (NOTE [tensor representation] in plain.py).
"""
from __future__ import annotations

import _thread
import warnings

import torch
import torch.utils._pytree as pytree

from .dispatch import Fallback, ResizeOuts, _local, _run
from .engine import engine, user_error
from .fallback import fallback
from .opinfo import decompose, op_info
from .opkey import CpuTensorArg, ForeignSubclass, OtherDevice
from .fbgemm import handlers as fbgemm_handlers
from .packed import handlers as packed_handlers
from .scheduler import records
from .specials import SPECIAL, _h_foreach_inplace, _h_to_copy, register as register_specials, resize
from .tensor import TpuTensor, as_tpu
from .views import ALIAS_OPS, run_alias, run_view

_held = engine.interrupts
_get_ident = _thread.get_ident
_routes = engine.routes     # id(OpOverload) -> (handler(func, info, args, kwargs), OpInfo, op)
_mode = torch._C._get_dispatch_mode


def _in_base_mode(run):
    """NOTE [views in inference mode]: a view of a normal tensor taken under
    ``torch.inference_mode()`` is a normal tensor (PyTorch's view ops then give it the base's
    version counter, which an inference tensor cannot take: "Cannot set version_counter for
    inference tensor"). A tensor made in inference mode is an inference tensor, so the view of a
    normal base is made with inference mode off, as CPU's view kernels make theirs from the base."""
    def view(func, info, args, kwargs):
        if _inference_on():
            base = args[0]
            if isinstance(base, torch.Tensor) and not base.is_inference():
                with torch.inference_mode(False):
                    return run(func, info, args, kwargs)
        return run(func, info, args, kwargs)
    return view


_inference_on = torch.is_inference_mode_enabled
_view = _in_base_mode(run_view)         # the routes of view ops (one object: the C path knows it)
_alias = _in_base_mode(run_alias)


def torch_dispatch(cls, func, types, args=(), kwargs=None):
    """The Python path of ``TpuTensor.__torch_dispatch__`` (the C record path hands it every call
    it does not take). A signal that arrives meanwhile is handled when it returns (NOTE [interrupt
    safety])."""
    main = _get_ident() == _held.main
    if main:
        _held.depth += 1
    try:
        # Keyed by id: OpOverload.__hash__ is Python code, and this runs for every op. The route
        # keeps the OpOverload alive, so its id is never reused.
        r = _routes.get(id(func))
        if r is None:
            r = _routes[id(func)] = _route(func)
        kwargs = kwargs or {}
        try:
            return r[0](func, r[1], args, kwargs)
        except ForeignSubclass:
            return NotImplemented
        except OtherDevice as d:
            try:
                return _on_other_device(func, r, args, kwargs, d)
            except BaseException as e:
                err = e
        except CpuTensorArg as e:
            err = RuntimeError(*e.args)     # PyTorch's type
            moved = _cpu_indices(func, args, kwargs)
            if moved is not None:
                try:
                    return r[0](func, r[1], *moved)
                except CpuTensorArg as e:   # values on CPU too: the device error stands
                    err = RuntimeError(*e.args)
                except BaseException as e:
                    err = e
        except Fallback as f:
            try:
                return fallback(func, r[1], args, kwargs, f.why)
            except BaseException as e:
                err = e
        except ResizeOuts as ro:
            try:
                return _resized(func, r, args, kwargs, ro.outs)
            except BaseException as e:
                err = e
        except BaseException as e:
            err = e
        if torch._C._current_autograd_node() is None:
            raise user_error(err)       # NOTE [user frames] (engine.py)
        # NOTE [errors in backward]: a Python exception leaving __torch_dispatch__ inside the
        # autograd engine is still pending when the engine's stream guard, unwinding, calls the
        # Python device guard of PrivateUse1 (a noexcept call): the interpreter aborted
        # ("terminate called without an active exception"), or run_backward returned a
        # SystemError without a message. (NotImplemented does not help: PyTorch's "all handlers
        # returned NotImplemented" is a Python exception too.) So the error is kept and the op
        # returns an empty CPU tensor: the engine's own checks of it fail in C++, which unwinds
        # safely, and backward() and autograd.grad (device.py) raise the kept error instead.
        _local.ts.backward_errors.append(err)
        return torch.empty(0)
    finally:
        if main:
            _held.depth -= 1
            if not _held.depth and _held.held:
                _held.deliver()


def _resized(func, r, args, kwargs, outs):
    """Resize ``out=`` tensors to the result's shape with CPU's warning (a tensor with elements is
    resized too, deprecated), then run the op again."""
    for t, shape in outs:
        if t.numel():
            warnings.warn(
                f"An output with one or more elements was resized since it had shape "
                f"{list(t.shape)}, which does not match the required output shape {list(shape)}. "
                "This behavior is deprecated, and in a future PyTorch release outputs will not be "
                "resized unless they have zero elements. You can explicitly reuse an out tensor t "
                "by resizing it, inplace, to zero elements with t.resize_(0).", UserWarning,
                stacklevel=3)
        resize(t, shape)
    return r[0](func, r[1], args, kwargs)


def dispatch(func, args, kwargs):
    """Run ``func`` as if it had reached ``__torch_dispatch__`` (PrivateUse1 kernels use this)."""
    return torch_dispatch(None, func, None, args, kwargs)


def _route(func):
    info = op_info(func)
    h = SPECIAL.get(func)
    if h is None and func.namespace == "fbgemm":
        # FBGEMM's ops (TorchRec's): registered on first sight, so that deferfuse never imports
        # fbgemm_gpu itself (fbgemm.py).
        register_specials(fbgemm_handlers())
        h = SPECIAL.get(func)
    elif h is None and func.namespace == "torch_attn":
        # varlen attention's custom ops: their boundaries padded to a bucket (packed.py)
        register_specials(packed_handlers())
        h = SPECIAL.get(func)
    if h is _h_foreach_inplace:
        return _foreach, info, func
    if h is _h_to_copy:
        return _to_copy, info, func
    if h is not None:
        return (lambda func, info, args, kwargs: h(func, args, kwargs)), info, func
    kind = info.kind
    if kind == "lowered" or kind == "self_mut" or kind == "func_mut":
        return _run, info, func
    if func in ALIAS_OPS:
        return _alias, info, func
    if kind == "view":
        return _view, info, func
    if kind == "decomp":
        return _decomp, info, func
    if kind == "data_dependent":
        return _data_dependent, info, func
    if kind == "unsupported_view":
        return _unsupported_view, info, func
    return _no_lowering, info, func


def _on_other_device(func, r, args, kwargs, d: OtherDevice):
    """``func`` on tensors of tpu:i with ``device=`` another device, whose result PyTorch puts on
    that device (it was left on tpu:i). ``*_like`` and ``new_*`` read only their input's metadata:
    they run on the device asked for, over empty stand-ins of their inputs (CPU's generator for a
    ``rand_like(..., device="cpu")``, as on CPU); any other op (``linspace`` of tensors) is run
    beside its inputs and its result moved."""
    name = func._schema.name
    if name.endswith("_like") or name.startswith("aten::new_"):
        def stand_in(a):
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=d.there)
        return func(*pytree.tree_map_only(TpuTensor, stand_in, args), **kwargs)
    here = torch.device("tpu", d.here)

    def on_here(a):
        return here if type(a) is torch.device and a.type == "tpu" else a
    out = r[0](func, r[1], [on_here(a) for a in args], {k: on_here(v) for k, v in kwargs.items()})
    return pytree.tree_map_only(TpuTensor, lambda t: t.to(d.there), out)


def _foreach(func, info, args, kwargs):
    """An in-place foreach op (specials._h_foreach_inplace); a route of its own, so that the C
    record path knows it (it takes the calls whose written tensors have distinct storages)."""
    return _h_foreach_inplace(func, args, kwargs)


def _to_copy(func, info, args, kwargs):
    """``_to_copy`` (specials._h_to_copy), a route of its own for the C record path (it takes a
    cast on the tensor's own device)."""
    return _h_to_copy(func, args, kwargs)


_INDEX_PUT = frozenset((torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
                        torch.ops.aten._index_put_impl_.default))


def _cpu_indices(func, args, kwargs):
    """PyTorch's indexing ops move CPU index tensors to the indexed tensor's device (CUDA's
    ``x[cpu_index]``, ``x[cpu_index] = v`` and their backward): ``(args, kwargs)`` with the index
    tensors of ``index_put``'s family moved to ``self``'s tpu device, or None where ``func`` is
    another op or nothing moves (the device error stands). ``aten.index`` does the same in its
    handler (datadep._h_index)."""
    if func not in _INDEX_PUT or len(args) < 2 or type(args[0]) is not TpuTensor:
        return None
    indices = args[1]
    if not any(isinstance(i, torch.Tensor) and type(i) is not TpuTensor and i.device.type == "cpu"
               for i in indices):
        return None
    here = args[0].device
    # (as_tpu: .to() makes a plain tensor, NOTE [mixed arguments])
    moved = [as_tpu(i.to(here)) if isinstance(i, torch.Tensor) and type(i) is not TpuTensor else i
             for i in indices]
    return (args[0], moved, *args[2:]), kwargs


def _data_dependent(func, info, args, kwargs):
    raise Fallback("data-dependent shape")


def _no_lowering(func, info, args, kwargs):
    raise Fallback("no lowering")


def _decomp(func, info, args, kwargs):
    out = decompose(func, args, kwargs)
    if out is NotImplemented:
        raise Fallback("no lowering")
    return out


def _unsupported_view(func, info, args, kwargs):
    raise NotImplementedError(
        f"{info.name} is a view op with no lowering on the tpu device; a copy would break "
        "aliasing, so it is not run on CPU. Call .clone() or .contiguous() on its result's "
        "input first, or file an issue")


def c_record_objects(py_dispatch=torch_dispatch) -> dict:
    """What the C record path works on (``_fastpath.setup``'s argument): the engine's objects, and
    ``py_dispatch``, the Python path it hands every uncommon call to."""
    from . import dispatch as d, opkey, tensor as t, views
    from .config import config
    from .engine import ThreadState
    from .runtime.node import SS, TS, const
    FAKE = torch._C._TorchDispatchModeKey.FAKE
    from .runtime.viewchain import DSELECT, DSLICE
    from .scheduler.records import Node, Value
    return dict(
        TpuTensor=TpuTensor, py_dispatch=py_dispatch, routes=_routes, run=_run,
        get_mode=_mode, fake_key=FAKE, interrupts=_held, local=_local,
        lock_acquire=engine.lock.acquire, lock_release=engine.lock.release, ops=engine.ops,
        TS=TS, SS=SS, special_scalars=opkey._SPECIAL_SCALARS, const=const, Value=Value, Node=Node,
        Storage=t.Storage, wrap=t._wrap, strided=t._STRIDED, devices=t._DEVICES, config=config,
        sources=engine.sources, dtype_type=torch.dtype, memory_format_type=torch.memory_format,
        layout_type=torch.layout, view=_view, alias=_alias, foreach=_foreach, to_copy=_to_copy,
        views=engine.views,
        aliases=engine.aliases, moving=(*views._MOVING, torch.ops.aten.unbind.int),
        inference_on=_inference_on, Tensor=torch.Tensor, select=torch.ops.aten.select.int,
        slice=torch.ops.aten.slice.Tensor, DSELECT=DSELECT, DSLICE=DSLICE, ThreadState=ThreadState,
        Entry=d.Entry)


def _c_record_path():
    """``TpuTensor.__torch_dispatch__``: the C record path (NOTE [C record path] in
    deferfuse/_fastpath.c), whose every uncommon case is ``torch_dispatch``; ``torch_dispatch``
    itself where the extension was not built (a source tree used without ``pip install``)."""
    try:
        from . import _fastpath
    except ImportError as e:
        import warnings
        warnings.warn(f"deferfuse: the C record path is not built ({e}); recording runs in Python "
                      "(slower). Reinstall deferfuse (pip install) to build it.", RuntimeWarning)
        return torch_dispatch
    _fastpath.setup(c_record_objects())
    _fastpath.value_finalizer(records._account, records.Padded)     # NOTE [value finalizer] (_fastpath.c)
    return _fastpath.dispatch


TpuTensor.__torch_dispatch__ = classmethod(_c_record_path())
