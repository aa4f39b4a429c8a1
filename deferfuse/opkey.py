"""An op call's structural key (``op_key``): its arguments made a hashable template (tpu tensors
and runtime Python numbers become numbered inputs, everything else a constant: NOTE [typed
constants] in runtime/node.py), with its tpu tensor inputs, its scalar inputs and its device, and
the device errors PyTorch raises while reading them.

Apart from dispatch.py because it is the first step of every op and reads only the arguments:
dispatch.py looks the key up in the op cache and records, runs or first builds the op's entry.
Everything here shapes the key, so it shapes which compiled program a call finds (``_FRONT`` in
runtime/diskcache.py reads this file).
"""
from __future__ import annotations

import functools
import operator

import torch

from .device_info import check
from .engine import engine
from .runtime import transfer
from .runtime.node import SS, TS, const
from .scheduler.records import Value
from .tensor import TpuTensor, new_tensor

_SIG = operator.attrgetter("_sig")
_DEV = operator.attrgetter("_s.device")
_TPU_ONLY = {TpuTensor}
_INTS = {int, type(None)}     # list items _encode keeps as they are (sizes, dims: static)
_SPECIAL_SCALARS = {0, 1, -1, 2, 0.5, 0.0, 1.0, -1.0, 2.0}
_local = engine.local          # .ts: the calling thread's ThreadState (NOTE [threads])


class CpuTensorArg(RuntimeError):
    """PyTorch's device error for a CPU tensor of more than one element among a tpu op's
    arguments. The router catches it: the indexing ops take CPU index tensors, as on CUDA
    (route._cpu_indices); any other op raises it as the plain RuntimeError PyTorch raises."""


def _device_error(a, b, cls=RuntimeError):
    return cls("Expected all tensors to be on the same device, but found at least two "
                        f"devices, {a} and {b}! Move the {b} tensor with .to('{a}') first.")


def _const_value(cpu: torch.Tensor, device: int) -> Value:
    return transfer.host_value(cpu, device)


class ForeignSubclass(Exception):
    """An argument is another tensor subclass wrapping a tpu tensor (DTensor's
    AsyncCollectiveTensor): __torch_dispatch__ returns NotImplemented so that its own runs first."""


class OtherDevice(Exception):
    """An op on tensors of ``tpu:here`` asked for its result on device ``there`` (``new_ones``,
    ``zeros_like`` with a ``device=``): the router runs it there (route._on_other_device)."""

    def __init__(self, here: int, there: torch.device):
        super().__init__(here, there)
        self.here, self.there = here, there


_NO_DISPATCH = torch._C._disabled_torch_dispatch_impl


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
        return const(a)
    if ta is bool or ta is complex:
        return const(a)
    if ta is list or ta is tuple:
        if a and type(a[0]) is TpuTensor and set(map(type, a)) == _TPU_ONLY:
            # A tensor list on one device (foreach ops: a whole optimizer group): one pass.
            d = a[0]._s.device
            if (device[0] is None or device[0] == d) and len(set(map(_DEV, a))) == 1:
                device[0] = d
                n = len(tensors)
                tensors.extend(a)
                return _ts_range(n, len(a))
        elif (static or not info_scalar) and set(map(type, a)) <= _INTS:
            return tuple(a)     # sizes, strides, dims: what the loop below would give, in one call
        return tuple([_encode(x, info_scalar, tensors, scalars, static, device) for x in a])
    if isinstance(a, torch.Tensor):
        if isinstance(a, TpuTensor):
            tensors.append(a)
            return (TS, len(tensors) - 1)
        if a.dim() == 0 and a.device.type == "cpu":
            # PyTorch lets 0-dim CPU tensors mix with any device: move the value over.
            d = device[0] if device[0] is not None else _local.ts.device
            t = new_tensor(_const_value(a, d), d, a.dtype, (), ())
            tensors.append(t)
            return (TS, len(tensors) - 1)
        if getattr(type(a), "__torch_dispatch__", _NO_DISPATCH) is not _NO_DISPATCH:
            raise ForeignSubclass       # its own __torch_dispatch__ unwraps it: let it run
        raise _device_error(f"tpu:{device[0] if device[0] is not None else _local.ts.device}",
                            str(a.device), CpuTensorArg if a.device.type == "cpu" else RuntimeError)
    if ta is torch.device:
        if a.type != "tpu":
            raise OtherDevice(device[0], a)     # on tpu tensors (or it would not be here)
        d = _local.ts.device if a.index is None else check(a.index)
        if device[0] is None:
            device[0] = d
        elif device[0] != d:
            raise OtherDevice(device[0], torch.device("tpu", d))
        return ("\0dev",)
    return a


@functools.lru_cache(maxsize=4096)
def _ts_range(start: int, n: int) -> tuple:
    """The template of a tensor list that is tensor inputs start .. start+n-1 (cached)."""
    return tuple([(TS, i) for i in range(start, start + n)])


def op_key(info, args, kwargs):
    """The structural key of one op call: (OpInfo, argument template, keyword template, input
    signatures, device), with its tpu tensor inputs, its Python scalar inputs and its device. Two
    calls share a key only if one compiled program computes both (NOTE [typed constants])."""
    tensors: list = []
    scalars: list = []
    device = [None]
    static = info.low.static
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
                targs.append(const(a))      # NOTE [typed constants] (runtime/node.py)
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
    dev = device[0] if device[0] is not None else _local.ts.device
    return (info, targs, tkw, tuple(map(_SIG, tensors)), dev), tensors, scalars, dev
