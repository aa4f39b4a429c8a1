"""Ops the generic path cannot express: transfers, sync points, allocation, aliasing; and
``SPECIAL``, the table of every op's handler that is not the generic path (other modules add
theirs with ``register``: composed.py's ops run as other ops then written back or read,
datadep.py's, the functional collectives)."""
from __future__ import annotations

import math
import sys

import torch
from torch._prims_common import suggest_memory_format

from .device_info import check
from .dispatch import Fallback, _contig, _run, copy_into, read, read_host, to_cpu
from .engine import engine
from .opinfo import op_info, op_info_with
from .runtime import transfer
from .runtime.platform import name as platform_name
from .scheduler.policy import Sync
from .scheduler.records import Value
from .tensor import TpuTensor, new_tensor

aten = torch.ops.aten


def _dense(t) -> bool:
    """Non-overlapping and dense: some permutation of the dims is contiguous."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return False
        expect *= sz
    return True


def _dev_index(device) -> int:
    """The index of a tpu device argument: ``tpu`` alone is the thread's current device; an index
    past the devices there are raises (device_info.check)."""
    if device is None:
        return engine.state.device
    device = torch.device(device)
    return engine.state.device if device.index is None else check(device.index)


def _layout(size, memory_format=None):
    """(``size`` as ints, the strides of a new tensor of that size in ``memory_format``); CPU's
    error for a negative size."""
    size = tuple(int(s) for s in size)
    if any(s < 0 for s in size):
        raise RuntimeError(f"Trying to create tensor with negative dimension {min(size)}: {list(size)}")
    if memory_format is not None and memory_format not in (torch.contiguous_format, torch.preserve_format):
        return size, torch.empty(size, device="meta", memory_format=memory_format).stride()
    return size, _contig(size)


def _empty(size, dtype, device: int, stride=None, memory_format=None):
    dtype = dtype or torch.get_default_dtype()
    size, layout = _layout(size, memory_format)
    stride = layout if stride is None else stride
    v = transfer.empty_value(size, dtype)
    return new_tensor(v, device, dtype, size, tuple(stride))


def empty_memory_format(size, *, dtype=None, layout=None, device=None, pin_memory=None,
                        memory_format=None):
    return _empty(size, dtype, _dev_index(device), memory_format=memory_format)


def empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _empty(size, dtype, _dev_index(device), stride=tuple(stride))


def _h_empty(func, args, kwargs):
    return empty_memory_format(*args, **kwargs)


def _h_empty_strided(func, args, kwargs):
    return empty_strided(*args, **kwargs)


def _h_empty_like(func, args, kwargs):
    self = args[0]
    m = func(torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device="meta"),
             *args[1:], **{k: (torch.device("meta") if k == "device" else v) for k, v in kwargs.items()})
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type != "tpu":
        return torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=dev)
    return _empty(m.shape, m.dtype, self._s.device if dev is None else _dev_index(dev), stride=m.stride())


def _h_new_empty(func, args, kwargs):
    self = args[0]
    dev = kwargs.get("device")
    size = args[1]
    stride = args[2] if func is aten.new_empty_strided.default else None
    if dev is not None and torch.device(dev).type != "tpu":
        if stride is None:
            return torch.empty(size, dtype=kwargs.get("dtype") or self.dtype, device=dev)
        return torch.empty_strided(size, stride, dtype=kwargs.get("dtype") or self.dtype, device=dev)
    return _empty(size, kwargs.get("dtype") or self.dtype,
                  self._s.device if dev is None else _dev_index(dev), stride=stride)


def _h_copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if type(dst) is not TpuTensor:
        # tpu -> cpu (or other) copy: read the value to the host, then copy there.
        with torch._C._DisableTorchDispatch():
            dst.copy_(to_cpu(src, Sync.CPU))
        return dst
    if type(src) is TpuTensor and src._s.device != dst._s.device:
        # copy_ from another tpu device, as CUDA's copy_ between devices: the value moves over
        # first (``x.to("tpu:0")`` on a plain tensor is empty on tpu:0 and this copy_)
        src = _h_to_copy(aten._to_copy.default, (src,), {"device": dst.device})
    return copy_into(dst, src)


def _h_copy_from(func, args, kwargs):
    src, dst = args[0], args[1]
    return _h_copy(aten.copy_.default, (dst, src), {})


def _h_to_copy(func, args, kwargs):
    self = args[0]
    dev = kwargs.get("device")
    dtype = kwargs.get("dtype") or self.dtype
    if dev is not None and torch.device(dev).type == "meta":
        return torch.empty_strided(self.shape, self.stride(), dtype=dtype, device="meta")
    if dev is not None and torch.device(dev).type != "tpu":
        out = to_cpu(self, Sync.CPU)
        out = out.to(dtype=dtype)
        if kwargs.get("pin_memory"):
            out = out.pin_memory()
        mf = kwargs.get("memory_format")
        if mf is not None and mf != torch.preserve_format:
            out = out.contiguous(memory_format=mf)
        elif out.stride() != self.stride() and _dense(self):
            out = torch.empty_strided(self.shape, self.stride(), dtype=dtype).copy_(out)
        return out
    if dev is not None and _dev_index(dev) != self._s.device:
        # Another tpu device: the value moves device to device (a sync point in defer mode).
        arr = transfer.to_device(read(self, Sync.CPU), _dev_index(dev))
        t = new_tensor(Value(tuple(arr.shape), arr.dtype, arr.nbytes, array=arr), _dev_index(dev),
                       self.dtype, tuple(self.shape),
                       tuple(self.stride()) if _dense(self) else _contig(self.shape))
        if dtype != self.dtype or kwargs.get("memory_format") not in (None, torch.preserve_format):
            kw = {k: v for k, v in kwargs.items() if k in ("dtype", "memory_format")}
            return _run(func, op_info(func), (t,), dict(kw, dtype=dtype))
        return t
    kw = {k: v for k, v in kwargs.items() if k in ("dtype", "memory_format")}
    kw["dtype"] = dtype
    return _run(func, op_info(func), (self,), kw)


def _h_item(func, args, kwargs):
    t = args[0]
    arr = read_host(t, Sync.ITEM)
    x = transfer.to_number(arr, t.dtype)
    return transfer.to_torch(arr, t.dtype).item() if x is None else x


def rebind(self, new) -> None:
    """Make the tensor object ``self`` the tensor ``new`` (its sizes, strides, storage and view
    chain), as ``self.data = new`` does: what ``resize_`` leaves."""
    torch._C.TensorBase.data.__set__(self, new)
    self._s, self._chain, self._sig, self._dyn = new._s, new._chain, new._sig, new._dyn


def resize(self, size, memory_format=None):
    """NOTE [resize]: ``t.resize_(size)`` as on CPU. A tpu storage holds one value, its base
    tensor (NOTE [storage model] in tensor.py), of ``capacity`` elements. A size that fits in it
    from the tensor's offset makes the tensor a contiguous ``as_strided`` view of the same storage,
    so every other view of it sees the same elements, as on CPU. A size that does not fit grows the
    storage: a new base holding the old elements (the rest zero, where CPU leaves them
    uninitialised), which only this tensor may hold: when another tensor shares the storage, it
    would keep the old one, so that raises instead. ``out=`` tensors of the wrong shape are resized
    through this too (``dispatch.ResizeOuts``)."""
    if any(int(s) < 0 for s in size):     # CPU's words for resize_ (not empty's)
        raise RuntimeError("numel: integer multiplication overflow")
    size, stride = _layout(size, memory_format)
    if memory_format == torch.preserve_format:
        raise RuntimeError("Unsupported memory format. Preserve")
    if tuple(self.shape) == size and (memory_format is None or tuple(self.stride()) == stride):
        return self
    st = self._s
    if st.val.nbytes == 0 and any(st.val.shape):
        raise RuntimeError("resize_ of a tensor whose storage was freed with "
                           "untyped_storage().resize_(0) (NOTE [storage resize])")
    capacity = math.prod(st.val.shape)
    offset = self.storage_offset()
    need = offset + (1 + sum((n - 1) * d for n, d in zip(size, stride)) if all(size) else 0)
    with torch.no_grad():
        if need <= capacity:
            new = aten.as_strided.default(self, size, stride, offset)
        else:
            # getrefcount: its argument, ``st`` and this tensor's ``_s``: nobody else holds it.
            if sys.getrefcount(st) > 3:
                raise RuntimeError(
                    f"cannot resize a tpu tensor to {list(size)}: that needs {need} elements and its "
                    f"storage holds {capacity}, and other tensors (views) share that storage; CPU "
                    "would grow the storage under all of them. Allocate a new tensor "
                    "(torch.empty(size, device='tpu')) instead")
            flat = aten.as_strided.default(self, (capacity,), (1,), 0)
            grown = aten.cat.default([flat, aten.zeros.default(
                (need - capacity,), dtype=self.dtype, device=self.device)])
            new = aten.as_strided.default(grown, size, stride, offset)
    rebind(self, new)
    return self


def _h_resize(func, args, kwargs):
    rest = dict(zip(("memory_format",), args[2:]), **kwargs)
    return resize(args[0], args[1], rest.get("memory_format"))


def _h_resize_as(func, args, kwargs):
    self, like = args[0], args[1]
    mf = dict(zip(("memory_format",), args[2:]), **kwargs).get("memory_format")
    if mf == torch.preserve_format:     # CPU: the template's suggested memory format
        mf = suggest_memory_format(like)
    return resize(self, like.shape, mf)


def _h_set(func, args, kwargs):
    self = args[0]
    if len(args) > 1 and type(args[1]) is TpuTensor:
        src = args[1]
        if tuple(src.shape) == tuple(self.shape) and src.stride() == self.stride() \
                and src.storage_offset() == self.storage_offset():
            self._s, self._chain, self._sig, self._dyn = src._s, src._chain, src._sig, src._dyn
        else:
            rebind(self, src)       # its sizes, strides and offset too
        return self
    raise Fallback("set_ with a new shape")


def _h_noop_self(func, args, kwargs):
    return args[0]


def _h_is_pinned(func, args, kwargs):
    return False


_HALF = (torch.bfloat16, torch.float16)


def _h_layer_norm_backward(func, args, kwargs):
    """A half-precision layer norm's weight and bias gradients follow CPU's per-thread sums,
    which depend on the thread count: read here, when the op is recorded, and passed to the
    lowering as a static argument of the op's key (NOTE [half layer norm parameter gradients]
    in runtime/lowering/norms.py). Other dtypes and platforms record the op as it is."""
    x = args[1]
    mask = args[7] if len(args) > 7 else kwargs.get("output_mask")
    if x.dtype in _HALF and mask is not None and (mask[1] or mask[2]) and platform_name() == "cpu":
        info = op_info_with(func, cpu_threads=torch.get_num_threads())
    else:
        info = op_info(func)
    return _run(func, info, args, kwargs)


_NO_PYTHON = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | \
    torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot)


def _h_inplace_view(func, args, kwargs):
    """squeeze_, unsqueeze_, transpose_, t_, as_strided_ ...: the tensor itself becomes the view.
    Its view chain comes from the functional view op; its sizes and strides are set below Python
    dispatch (the TensorImpl of a wrapper subclass holds them, no data)."""
    self = args[0]
    v = _INPLACE_VIEWS[func](*args, **kwargs)
    with torch._C._ExcludeDispatchKeyGuard(_NO_PYTHON):
        aten.as_strided_.default(self, v.shape, v.stride(), v.storage_offset())
    self._chain, self._sig, self._dyn = v._chain, v._sig, v._dyn
    return self


def _h_foreach_inplace(func, args, kwargs):
    """An in-place foreach op (``torch._foreach_add_(xs, ys)``, ``_foreach_copy_`` ...). One op
    writes every tensor of its first list from the values they held before it; tensors that are
    views of one storage (the slices of one flat buffer: FSDP2 copies parameters into one) would
    each write that storage from its old value, and the last write would undo the others. Those
    run one element at a time, in order (a copy into consecutive slices as one copy). So do calls
    whose other arguments read a tensor the op writes at another place in its list
    (``_foreach_add_(xs, xs[::-1])``): PyTorch's CPU kernel writes element by element, so a later
    element reads what an earlier one wrote."""
    dsts = args[0]
    seen = {}
    for i, d in enumerate(dsts):
        if type(d) is TpuTensor:
            if id(d._s) in seen:
                break
            seen[id(d._s)] = i
    else:
        # one written tensor is one op whatever it reads (CPU's ``t.mul_(t)``): run one element
        # at a time, ``_foreach_mul_([t], t)`` called itself again, for ever
        if len(dsts) == 1 or not _reads_written(args, kwargs, seen):
            return _run(func, op_info(func), args, kwargs)
    if func is aten._foreach_copy_.default:
        srcs = args[1]
        span = _consecutive(dsts)
        if span is not None and len({s.dtype for s in srcs}) == 1 and all(
                type(s) is TpuTensor for s in srcs):
            copy_into(span, aten.cat.default([s.reshape(-1) for s in srcs]))
            return None
    n = len(dsts)
    for k in range(n):
        func(*[a[k:k + 1] if isinstance(a, (list, tuple)) and len(a) == n else a for a in args],
             **kwargs)
    return None


def _reads_written(args, kwargs, written: dict) -> bool:
    """Whether a foreach op's inputs other than its first list read a storage it writes
    (``written``: id of storage -> the index writing it) at another index of their list, or as a
    single tensor (deferfuse/_fastpath.c's ``foreach_fast`` decides the same)."""
    for a in (*args[1:], *kwargs.values()):
        if type(a) is TpuTensor:
            if id(a._s) in written:
                return True
        elif isinstance(a, (list, tuple)):
            for j, t in enumerate(a):
                if type(t) is TpuTensor and written.get(id(t._s), j) != j:
                    return True
    return False


def _consecutive(dsts):
    """The 1-D view covering ``dsts`` when they are contiguous 1-D views of one storage that
    follow each other, else None."""
    d0 = dsts[0]
    if type(d0) is not TpuTensor:
        return None
    at = d0.storage_offset()
    for d in dsts:
        if (type(d) is not TpuTensor or d._s is not d0._s or d.dim() != 1 or d.dtype != d0.dtype
                or (d.numel() > 1 and d.stride(0) != 1) or d.storage_offset() != at):
            return None
        at += d.numel()
    return aten.as_strided.default(d0, (at - d0.storage_offset(),), (1,), d0.storage_offset())


_INPLACE_VIEWS = {}
for _p in ("squeeze_", "unsqueeze_", "transpose_", "t_", "swapdims_", "swapaxes_", "as_strided_"):
    _pk = getattr(aten, _p, None)
    for _ov in (_pk.overloads() if _pk is not None else ()):
        # transpose_.default is transpose.int
        _fn = getattr(getattr(aten, _p[:-1]), _ov, None) or getattr(getattr(aten, _p[:-1]), "int", None)
        if _fn is not None:
            _INPLACE_VIEWS[getattr(_pk, _ov)] = _fn

SPECIAL = {
    **{f: _h_inplace_view for f in _INPLACE_VIEWS},
    aten.empty.memory_format: _h_empty,
    aten.empty_strided.default: _h_empty_strided,
    aten.empty_like.default: _h_empty_like,
    aten.new_empty.default: _h_new_empty,
    aten.new_empty_strided.default: _h_new_empty,
    aten.copy_.default: _h_copy,
    aten._copy_from.default: _h_copy_from,
    aten._to_copy.default: _h_to_copy,
    aten._local_scalar_dense.default: _h_item,
    aten.resize_.default: _h_resize,
    aten.resize_as_.default: _h_resize_as,
    aten.set_.source_Tensor: _h_set,
    aten.is_pinned.default: _h_is_pinned,
    aten.native_layer_norm_backward.default: _h_layer_norm_backward,
}
for _full in torch._C._dispatch_get_all_op_names():
    # every in-place foreach op: _foreach_add_, _foreach_copy_, _foreach_mul_ ... (not _foreach_add)
    _p, _, _ov = _full.partition("::")[2].partition(".")
    if _full.startswith("aten::_foreach_") and _p.endswith("_"):
        _o = getattr(getattr(aten, _p, None), _ov or "default", None)
        if _o is not None and any(a.alias_info is not None and a.alias_info.is_write
                                  for a in _o._schema.arguments[:1]):
            SPECIAL[_o] = _h_foreach_inplace
for _name in ("record_stream.default",):
    _p, _, _ov = _name.partition(".")
    _o = getattr(getattr(aten, _p, None), _ov, None)
    if _o is not None:
        SPECIAL[_o] = _h_noop_self


def register(handlers: dict) -> None:
    """Add handlers ``{OpOverload: handler(func, args, kwargs)}`` from another module (the
    distributed package's functional collectives): such an op then never takes the generic path."""
    for f, h in handlers.items():
        if f in SPECIAL and SPECIAL[f] is not h:
            raise AssertionError(f"a second special handler for {f}")
        SPECIAL[f] = h
        engine.routes.pop(id(f), None)
