"""``Tensor.as_subclass`` and ``torch.Tensor._make_subclass`` on ``tpu`` tensors.

NOTE [tpu subclasses]: PyTorch's ``as_subclass(cls)`` makes an alias of the tensor (a new
TensorImpl over the same storage) and binds it to a new Python object of type ``cls``
(``THPVariable_NewWithVar``); ``_make_subclass`` does the same with a detached alias. A ``tpu``
tensor is a wrapper subclass: the alias's TensorImpl is made by our ``__torch_dispatch__`` and is
already bound to a ``TpuTensor``, so PyTorch refuses ("already associated to a python object of
type TpuTensor"); and an object of a plain ``cls`` could not run ops (a wrapper needs a class with
a ``__torch_dispatch__``). So the result's class is the *tpu class* of ``cls``: a class made once
per ``cls`` (``tpu_class``) whose bases are ``(cls, TpuTensor)``, named as ``cls``. Its instances
are instances of ``cls`` (and of ``nn.Parameter`` for a Parameter subclass), with ``cls``'s
methods, ``__slots__`` and ``__torch_function__``, over the same storage (NOTE [storage model]),
so a write through one is seen by the other. ``as_subclass`` keeps the autograd graph through a
one-line ``autograd.Function`` (the gradient passes through); ``_make_subclass`` makes a leaf.

Ops: the tpu class's ``__torch_function__`` calls ``cls``'s with ``cls`` in place of the tpu class,
so its results are made with ``as_subclass(cls)`` as on CPU (a ``cpu()`` result becomes a CPU
``cls``). At the dispatch level ``route.torch_dispatch`` sees a class other than ``TpuTensor``
and hands the op to ``run``: each instance of a tpu class becomes a plain ``TpuTensor`` over the
same storage for the op (every path inside checks ``type(t) is TpuTensor``), the op's results that
are those plain tensors become the instances again (``add_`` returns ``self``), and a change the op
made to a tensor itself (``t_()``, ``set_``) is copied back. A plain ``TpuTensor`` costs nothing
for this: the class check is one comparison.

Differs from CPU: ``type(r) is cls`` is False (``isinstance`` holds); the result of
``as_subclass`` is not a view in autograd's sense, so an in-place op on it is not refused when its
input is a leaf that requires grad.
"""
from __future__ import annotations

import copyreg
import inspect

import torch
import torch.utils._pytree as pytree

from .engine import engine
from .tensor import TpuTensor, make

_NO_PYTHON = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | \
    torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot)
_classes = engine.subclasses    # user class -> its tpu class (weak keys)


def tpu_class(cls: type) -> type:
    """The class of a ``tpu`` tensor that is a ``cls`` (NOTE [tpu subclasses])."""
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a type (got {type(cls).__name__})")
    if not issubclass(cls, torch.Tensor):
        raise TypeError("Creating a Tensor subclass from a class that does not inherit from Tensor "
                        "is not possible. Make sure your class inherits from Tensor.")
    if cls is torch.Tensor or issubclass(cls, TpuTensor):
        return TpuTensor if cls is torch.Tensor else cls
    t = _classes.get(cls)
    if t is None:
        ns = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "_tpu_user": cls,
              "__doc__": cls.__doc__}
        tf = inspect.getattr_static(cls, "__torch_function__")
        if tf is torch._C._disabled_torch_function_impl:
            ns["__torch_function__"] = tf
        else:
            ns["__torch_function__"] = classmethod(_user_torch_function)
        # Pickled as CPU pickles the class (its state without ours, NOTE [tpu checkpoints]).
        if inspect.getattr_static(cls, "__getstate__", None) is object.__getstate__:
            ns["__getstate__"] = _getstate
        if inspect.getattr_static(cls, "__reduce_ex__") is torch.Tensor.__reduce_ex__:
            ns["__reduce_ex__"] = _reduce_ex
        t = _classes[cls] = type(cls)(cls.__name__, (cls, TpuTensor), ns)
    return t


def _user_torch_function(cls, func, types, args=(), kwargs=None):
    # The user's class's __torch_function__, as if its own instances were the arguments.
    user = cls._tpu_user
    types = tuple(getattr(t, "_tpu_user", t) for t in types)
    return user.__torch_function__(func, types, args, kwargs or {})


_OURS = frozenset(("_s", "_chain", "_sig", "_dyn", "_inner_t", "_is_param"))


def _getstate(self):
    """The instance's state as ``object.__getstate__`` gives it, without deferfuse's own
    attributes (the storage, the view chain)."""
    d = {k: v for k, v in self.__dict__.items() if k not in _OURS}
    slots = {k: getattr(self, k) for k in copyreg._slotnames(type(self)) if hasattr(self, k)}
    return (d or None, slots) if slots else d


def _reduce_ex(self, proto):
    """As ``torch.Tensor.__reduce_ex__`` pickles a subclass: its tensor (a tpu tensor's rebuild,
    serialization.py), then its class and state (``_rebuild_from_type_v2``)."""
    from .serialization import reduce_tensor
    func, args = reduce_tensor(_new(self, TpuTensor, self.requires_grad), proto)
    return torch._tensor._rebuild_from_type_v2, (func, self._tpu_user, args, _getstate(self))


def _new(x, cls: type, requires_grad: bool):
    """A tensor of class ``cls`` (a tpu class or ``TpuTensor``) over ``x``'s storage and view."""
    if cls is TpuTensor:
        t = make(x._s, x._chain, x.shape, x.stride(), x.storage_offset(), x.dtype, x._sig)
        if requires_grad:
            t.requires_grad_(True)
    else:
        t = torch.Tensor._make_wrapper_subclass(
            cls, x.shape, strides=x.stride(), storage_offset=x.storage_offset(), dtype=x.dtype,
            layout=torch.strided, device=x.device, requires_grad=requires_grad)
        t._s, t._chain, t._sig = x._s, x._chain, x._sig
    if x._dyn:
        t._dyn = x._dyn
    return t


class _Alias(torch.autograd.Function):
    """``as_subclass`` in the autograd graph: its gradient is the gradient of its result."""

    @staticmethod
    def forward(ctx, x, cls):
        return _new(x, cls, False)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def as_subclass(self, cls):
    """``Tensor.as_subclass`` on a tpu tensor (NOTE [tpu subclasses])."""
    t = tpu_class(cls)
    if self.requires_grad and torch.is_grad_enabled():
        return _Alias.apply(self, t)
    return _new(self, t, self.requires_grad)


def make_subclass(cls, data, require_grad=False, **kwargs):
    """``torch.Tensor._make_subclass`` of a tpu tensor: a leaf of class ``cls`` over ``data``'s
    storage. ``nn.Parameter`` itself gives a tpu tensor marked as a parameter, as
    ``nn.Parameter(tpu_tensor)`` does."""
    if kwargs:
        raise NotImplementedError(
            f"torch.Tensor._make_subclass of a tpu tensor with {', '.join(kwargs)}: these options "
            "are for C++-level subclasses; a tpu tensor can be made a subclass without them")
    if cls is torch.nn.Parameter:
        t = _new(data, TpuTensor, bool(require_grad))
        t._is_param = True
        return t
    return _new(data, tpu_class(cls), bool(require_grad))


# --- ops on instances of tpu classes --------------------------------------------------------------

def run(dispatch, func, types, args, kwargs):
    """``dispatch`` (route.torch_dispatch) of ``func`` whose arguments include instances of tpu
    classes: run on plain ``TpuTensor``s over the same storages (NOTE [tpu subclasses])."""
    pairs = []

    def plain(a):
        if type(a) is TpuTensor:
            return a
        p = _new(a, TpuTensor, False)
        pairs.append((a, p))
        return p
    args, kwargs = pytree.tree_map_only(TpuTensor, plain, (args, kwargs))
    out = dispatch(TpuTensor, func, types, args, kwargs)
    back = {}
    for a, p in pairs:
        back[id(p)] = a
        if p._s is not a._s or p._chain is not a._chain or p._sig != a._sig or p._dyn != a._dyn:
            # The op changed the tensor itself (t_(), set_()): so does its instance.
            a._s, a._chain, a._sig = p._s, p._chain, p._sig
            if p._dyn or a._dyn:
                a._dyn = p._dyn
            with torch._C._ExcludeDispatchKeyGuard(_NO_PYTHON):
                torch.ops.aten.as_strided_.default(a, p.shape, p.stride(), p.storage_offset())
    if not back:
        return out
    return pytree.tree_map_only(TpuTensor, lambda t: back.get(id(t), t), out)


def install() -> None:
    """``as_subclass`` on tpu tensors; ``torch.Tensor._make_subclass`` and ``nn.Parameter`` (for
    its subclasses) of tpu tensors."""
    TpuTensor.as_subclass = as_subclass
    orig = torch.Tensor._make_subclass
    if not getattr(orig, "_deferfuse", False):
        # The signature of Dynamo's stand-in for the original (it checks them against each other).
        def _make_subclass(cls, data, requires_grad=False, **kwargs):
            if isinstance(data, TpuTensor):
                return make_subclass(cls, data, requires_grad, **kwargs)
            return orig(cls, data, requires_grad, **kwargs)
        _make_subclass._deferfuse = True
        _make_subclass.__doc__ = orig.__doc__
        torch.Tensor._make_subclass = staticmethod(_make_subclass)
    P = torch.nn.Parameter
    new = P.__new__
    if not getattr(new, "_deferfuse", False):
        # A Parameter subclass of a tpu tensor is made by _make_subclass, as of a CPU or CUDA
        # tensor (PyTorch's own path for other tensor types returns the data's type).
        def __new__(cls, data=None, requires_grad=True):
            if cls is not P and isinstance(data, TpuTensor):
                return torch.Tensor._make_subclass(cls, data, requires_grad)
            return new(cls, data, requires_grad)
        __new__._deferfuse = True
        P.__new__ = staticmethod(__new__)
