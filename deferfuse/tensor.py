"""The op path's tensor (``TpuTensor``): a wrapper subclass over a storage holding a JAX value.

NOTE [storage model]: a ``Storage`` holds the current value of one base tensor (a ``Value``: a
device array, or pending in defer mode). A tensor is a storage plus a chain of view ops read out
of it (empty for a base). Every view of a base shares its storage; a write through a view becomes
a functional update of the base (``runtime.viewchain.scatter_chain``) that replaces
``Storage.val``, so the base and every other view see it. Defer mode records these same updates
instead of running them, so both modes share one storage model.
"""
from __future__ import annotations

import weakref

import torch

from .scheduler.records import Value, sig_id


class Storage:
    # wr: a weak reference to itself, made once (the pending trace keeps one per storage it may
    # have to read back); ep: the trace epoch that last took it (see Trace.track); prev: id() of
    # the value it held before that trace first wrote it (see NOTE [alias order]).
    # stride: the strides of the tensor the storage was made for (None: contiguous), i.e. the
    # memory layout ``as_strided`` offsets refer to (NOTE [storage layout] in deferfuse/meta.py).
    __slots__ = ("val", "device", "dtype", "stride", "wr", "ep", "prev", "__weakref__")

    def __init__(self, val: Value, device: int, dtype: torch.dtype, stride=None):
        self.val = val
        self.device = device
        self.dtype = dtype
        self.stride = stride
        self.wr = weakref.ref(self)
        self.ep = 0
        self.prev = 0


_DEVICES: list = []   # torch.device("tpu", i), filled by deferfuse.device


class TpuTensor(torch.Tensor):
    """The op path's form of a tpu tensor: a wrapper subclass over a ``Storage`` (its value lives in
    JAX, NOTE [storage model]) with a view chain. No user holds one: a tpu tensor is the plain
    PrivateUse1 tensor of the C++ extension (NOTE [tensor representation] in plain.py), and the
    router gives the op path a ``TpuTensor`` over the same Storage and view (``as_tpu``) for the
    ops the C++ kernel does not record. The op path reading Storage records instead of these is
    the next step of docs/cxx-plan.md; until then this class is its argument type."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    _dyn = ()   # the view chain's dynamic offsets (NOTE [dynamic offsets] in runtime/viewchain.py)

    @staticmethod
    def __new__(cls, storage: Storage, chain: tuple, size, stride, offset: int, dtype):
        return make(storage, chain, size, stride, offset, dtype)

    def __init__(self, *a, **k):
        pass

    # __torch_dispatch__, __repr__ and tolist are set by the op path (deferfuse/route.py,
    # dispatch.py), __reduce_ex__ and untyped_storage by serialization.py: they run ops and read
    # values.
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("deferfuse's op path is not loaded: import deferfuse")

    def __format__(self, spec):
        if self.dim() == 0:
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    def numpy(self, *, force=False):
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() "
                        "to copy the tensor to host memory first.")

    def __array__(self, dtype=None):
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() "
                        "to copy the tensor to host memory first.")

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        if self.requires_grad:
            new.requires_grad_(True)
        if getattr(self, "_is_param", False):
            new._is_param = True
        memo[id(self)] = new
        return new

    @property
    def data(self):
        with torch.no_grad():
            return self.detach()

    @data.setter
    def data(self, new):
        if not isinstance(new, TpuTensor):
            raise RuntimeError(f"data set to a tensor on {new.device} that isn't on {self.device}; "
                               "move it with .to('tpu') first")
        torch._C.TensorBase.data.__set__(self, new)
        self._s = new._s
        self._chain = new._chain
        self._sig = new._sig
        self._dyn = new._dyn


    def data_ptr(self):
        # Unique per storage and view offset, for code that compares pointers (never dereference).
        return (id(self._s) << 4) + self.storage_offset() * self.element_size()


class PlainHooks:
    """What ``is_tpu``, ``storage_of`` and ``as_tpu`` ask of the plain PrivateUse1 tensor
    (deferfuse/plain.py fills it at install). One object, owned by this module because every layer above reads it."""
    __slots__ = ("is_plain", "wrapper", "storage")

    def __init__(self):
        self.is_plain = None    # tensor -> bool: a plain tpu tensor
        self.wrapper = None     # plain tensor -> the TpuTensor over its Storage and view
        self.storage = None     # plain tensor -> its Storage (made on first use)


PLAIN = PlainHooks()


def is_tpu(a) -> bool:
    """A tpu tensor: a plain PrivateUse1 tensor (NOTE [plain tensor] in _tpu_tensor.cpp), or the
    op path's ``TpuTensor`` of one. Code that would read
    anything else as a CPU tensor asks this, never ``type(a) is TpuTensor`` alone: a plain tensor
    read as a CPU tensor gives silent garbage (its data pointer is the engine's record)."""
    if isinstance(a, TpuTensor):
        return True
    f = PLAIN.is_plain
    return f is not None and isinstance(a, torch.Tensor) and f(a)


def storage_of(a) -> Storage:
    """The ``Storage`` of a tpu tensor, plain or the op path's ``TpuTensor``."""
    if isinstance(a, TpuTensor):
        return a._s
    return PLAIN.storage(a)


def as_tpu(a):
    """``a`` as a ``TpuTensor`` (the form the op path reads: ``_s``, ``_chain``): itself, or for a
    plain tpu tensor the ``TpuTensor`` over the same Storage and view (a write through it is seen
    by ``a``, as a write through one view is seen by the others); anything else as it is."""
    if type(a) is TpuTensor or PLAIN.is_plain is None or not isinstance(a, torch.Tensor) \
            or isinstance(a, TpuTensor) or not PLAIN.is_plain(a):
        return a
    return PLAIN.wrapper(a)


_wrap = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided


def make(storage: Storage, chain: tuple, size, stride, offset: int, dtype, sig=None):
    """A TpuTensor, without ``TpuTensor(...)``'s type call and ``__init__`` (this runs for every
    op's output). ``stride=None`` means contiguous; ``sig`` is ``_sig`` when the caller has it
    cached (see ``dispatch._Entry.fast``): an interned signature, see ``records.sig_id``."""
    # Positional arguments: (cls, size, strides, storage_offset, memory_format, dtype, layout,
    # device); PyTorch parses these faster than keywords.
    t = _wrap(TpuTensor, size, stride, offset or None, None, dtype, _STRIDED, _DEVICES[storage.device])
    t._s = storage
    t._chain = chain
    # Everything about this tensor that shapes compiled code, hashed with each op's key.
    t._sig = sig if sig is not None else sig_id(
        (storage.val.shape, storage.dtype, chain, tuple(size), tuple(t.stride()), dtype))
    return t


def new_tensor(val: Value, device: int, dtype, size, stride, chain=(), offset=0, storage=None,
               sig=None):
    st = storage if storage is not None else Storage(val, device, dtype, stride)
    t = make(st, chain, size, stride, offset, dtype, sig)
    if storage is None and val.node is not None:
        val.node.trace.track(st)
    return t
