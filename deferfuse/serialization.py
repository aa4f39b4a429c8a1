"""Checkpoints of ``tpu`` tensors, ``torch.load(f, map_location=...)``, and the storage paths that
would crash the interpreter.

NOTE [tpu checkpoints]: ``torch.save`` records a ``tpu`` tensor as PyTorch records a tensor of any
device without storage (XLA's, a PrivateUse1 backend's): a call to
``torch._utils._rebuild_device_tensor_from_cpu_tensor(cpu_copy, dtype, "tpu:0", requires_grad)``,
a ``Parameter`` wrapped in ``torch._utils._rebuild_parameter``. Both are on the ``weights_only``
unpickler's allowlist, and nothing in the file names deferfuse, so:

- ``torch.load(f)`` (``weights_only=True``) restores the tensors on the ``tpu`` device they were
  saved from, as CUDA checkpoints come back on CUDA; the autoload entry point loads deferfuse
  when the first one is made, so the loading script needs no ``import deferfuse``;
- ``map_location="cpu"``, a ``torch.device``, a dict (``{"tpu:0": "cpu"}``) and a callable
  (``lambda storage, loc: storage``) work as for CUDA checkpoints, where deferfuse is installed
  or not;
- where deferfuse is not installed (or autoload is off and it was not imported), loading without
  ``map_location`` fails in PyTorch's parsing of the device string ``tpu:0``; ``torch.load``
  there is PyTorch's own, so that message cannot be ours (docs/troubleshooting.md gives the fix).

Tensors that shared a storage (a view and its base) are saved as separate copies, as for every
device without storage; one tensor object saved twice (tied weights) stays one object.

A ``tpu`` tensor has no PyTorch storage (it is a wrapper over a JAX array), and PrivateUse1 has no
allocator a Python backend can register: anything that makes a storage on ``tpu``
(``torch.UntypedStorage(n, device="tpu")``, ``storage.to("tpu")``) dereferenced a null allocator
and killed the process. ``torch.load`` with ``map_location`` naming ``tpu`` does exactly that for
every tensor in the file, and ``map_location=device`` is how device-agnostic code loads a
checkpoint. Here:

- ``torch.load`` with ``map_location`` a ``tpu`` device (a string, a ``torch.device``, or a dict
  whose every target is one) loads on CPU and moves what it loaded to that device: tensors (a
  ``Parameter`` stays one; tensors that were one object stay one), and modules with ``.to``;
- making a storage on ``tpu`` any other way raises a RuntimeError that says what to do instead.
"""
from __future__ import annotations

import collections
import copy
import functools

import torch
import torch._utils

from .dispatch import to_cpu
from .storage import STORAGE_HELP, untyped_storage
from .tensor import TpuTensor



class _Saved:
    """Pickles as the rebuild call it holds (the argument of ``_rebuild_parameter``); the file
    never names this class."""

    __slots__ = ("call",)

    def __init__(self, call):
        self.call = call

    def __reduce_ex__(self, proto):
        return self.call


def reduce_tensor(t, proto=2):
    """``TpuTensor.__reduce_ex__``: see NOTE [tpu checkpoints]."""
    cpu = to_cpu(t.detach(), "save")
    is_param = getattr(t, "_is_param", False)
    call = (torch._utils._rebuild_device_tensor_from_cpu_tensor,
            (cpu, t.dtype, str(t.device), t.requires_grad and not is_param))
    if is_param:
        return (torch._utils._rebuild_parameter,
                (_Saved(call), t.requires_grad, collections.OrderedDict()))
    return call


def _restore_location_with_callable(orig):
    """``torch._utils._get_restore_location`` (which PyTorch's rebuild of a tensor without
    storage asks where to put it) also for a callable ``map_location``, which it refuses: the
    callable gets an empty CPU storage and the saved location, as ``torch.load`` gives it each
    storage; what it returns says where the tensor goes (``None``: where it was saved)."""
    @functools.wraps(orig)
    def wrapper(device):
        loc = torch.serialization._serialization_tls.map_location
        if callable(loc) and not isinstance(loc, (dict, str, torch.device)):
            moved = loc(torch.UntypedStorage(0), device)
            return device if moved is None else moved.device
        return orig(device)
    wrapper._deferfuse = True
    return wrapper


def _tpu_target(map_location):
    """The tpu device ``map_location`` sends everything to, or None."""
    loc = map_location
    if isinstance(loc, dict):
        targets = {str(v) for v in loc.values()}
        if len(targets) != 1:
            return None
        loc = targets.pop()
    if isinstance(loc, (str, torch.device)):
        try:
            dev = torch.device(loc)
        except (RuntimeError, TypeError):
            return None
        return dev if dev.type == "tpu" else None
    return None


def _move(obj, device, memo):
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        with torch.no_grad():
            out = obj.to(device)
        if isinstance(obj, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=obj.requires_grad)
        elif obj.requires_grad and obj.is_leaf:
            out.requires_grad_(True)
    elif isinstance(obj, torch.nn.Module):
        out = obj.to(device)
    elif isinstance(obj, dict):
        out = copy.copy(obj)    # its type and attributes (a state dict's _metadata)
        for k, v in obj.items():
            out[k] = _move(v, device, memo)
    elif isinstance(obj, list):
        out = [_move(v, device, memo) for v in obj]
    elif isinstance(obj, tuple):
        items = [_move(v, device, memo) for v in obj]
        out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    else:
        return obj
    memo[id(obj)] = out
    return out


def _wrap_load(load):
    @functools.wraps(load)
    def wrapper(f, map_location=None, *args, **kwargs):
        dev = _tpu_target(map_location)
        if dev is None:
            return load(f, map_location, *args, **kwargs)
        return _move(load(f, "cpu", *args, **kwargs), dev, {})
    wrapper._deferfuse = True
    return wrapper


def _refuse_storage_to(to):
    @functools.wraps(to)
    def wrapper(self, device, non_blocking=False):
        if torch.device(device).type == "tpu":
            raise RuntimeError(STORAGE_HELP)
        return to(self, device, non_blocking)
    wrapper._deferfuse = True
    return wrapper


def _refuse_tpu(*args, **kwargs):
    raise RuntimeError(STORAGE_HELP)


def _untyped_storage_new(cls, *args, device=None, **kwargs):
    if device is not None and torch.device(device).type == "tpu":
        raise RuntimeError(STORAGE_HELP)
    if device is not None:
        kwargs["device"] = device
    return torch._C.StorageBase.__new__(cls, *args, **kwargs)


def register() -> None:
    import torch.serialization
    import torch.storage
    TpuTensor.__reduce_ex__ = reduce_tensor
    TpuTensor.untyped_storage = untyped_storage
    if not getattr(torch._utils._get_restore_location, "_deferfuse", False):
        torch._utils._get_restore_location = _restore_location_with_callable(
            torch._utils._get_restore_location)
    if not getattr(torch.load, "_deferfuse", False):
        torch.load = torch.serialization.load = _wrap_load(torch.load)
    if not getattr(torch.storage._to, "_deferfuse", False):
        torch.storage._to = _refuse_storage_to(torch.storage._to)
    for cls in (torch.UntypedStorage, torch.TypedStorage):
        if hasattr(cls, "tpu"):         # generated by PyTorch for the renamed backend
            cls.tpu = _refuse_tpu
    torch.UntypedStorage.__new__ = _untyped_storage_new
