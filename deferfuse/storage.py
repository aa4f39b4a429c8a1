"""``tensor.untyped_storage()`` of a tpu tensor: its storage, with the identity, size, ``resize_()``
and ``data_ptr()`` that code grouping tensors by storage (safetensors' and Hugging Face's checks
for tied weights) and code managing memory by hand (FSDP2 frees the unsharded parameters after the
forward pass with ``resize_(0)`` and allocates them again before the next all-gather) use. It is
not a ``torch.UntypedStorage`` and holds no host memory: anything that would read or copy it
raises, saying what to do instead.

NOTE [storage resize]: a tpu storage holds one value, the whole base tensor (NOTE [storage model]
in tensor.py). ``resize_(0)`` drops that value, so its device buffer is freed: the storage then
holds a value of the same shape with no buffer and ``nbytes`` 0 (its size); reading it raises
(CPU would read freed memory). ``resize_(n)`` back to the base's full size makes it an
uninitialised value again (read before written: zeros, as any ``torch.empty``). Other sizes would
change what the base tensor is, and raise.
"""
from __future__ import annotations

import torch

from .runtime import transfer
from .scheduler.records import Value


class TpuUntypedStorage:
    """The storage of a tpu tensor (see NOTE [storage resize]); not host-addressable."""

    __slots__ = ("_st",)

    def __init__(self, st):
        self._st = st

    @property
    def device(self) -> torch.device:
        return torch.device("tpu", self._st.device)

    def size(self) -> int:
        return self._st.val.nbytes

    nbytes = size

    def __len__(self) -> int:
        return self.size()

    def _full(self) -> int:
        v = self._st.val
        n = v.dtype.itemsize
        for s in v.shape:
            n *= s
        return n

    def resize_(self, nbytes: int):
        st = self._st
        v = st.val
        full = self._full()
        if nbytes == 0:
            if v.nbytes:
                st.val = Value(v.shape, v.dtype, 0)
        elif nbytes == full:
            if v.nbytes == 0:
                st.val = transfer.empty_value(v.shape, st.dtype)
        else:
            raise RuntimeError(f"a tpu storage holds one whole tensor of {full} bytes: it can be "
                               f"resized to 0 (freed) or back to {full} bytes, not {nbytes}")
        return self

    def data_ptr(self) -> int:
        # An identity for code that compares storages (never dereferenced); 0 when freed, as a
        # storage of size 0 has.
        return (id(self._st) << 4) if self._st.val.nbytes else 0

    def __eq__(self, other):
        return isinstance(other, TpuUntypedStorage) and other._st is self._st

    def __hash__(self):
        return id(self._st)

    def __repr__(self):
        return f"TpuUntypedStorage(nbytes={self.size()}, device={self.device})"

    def element_size(self) -> int:
        return 1

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        raise RuntimeError(f"untyped_storage().{name}: {STORAGE_HELP}")


STORAGE_HELP = ("tpu tensors have no PyTorch storage, so a storage cannot live on the tpu device; "
                "make the tensor on CPU and move it with .to('tpu'), or load checkpoints with "
                "torch.load(f, map_location='tpu') or map_location='cpu'")


def untyped_storage(t):
    """``TpuTensor.untyped_storage()``."""
    return TpuUntypedStorage(t._s)
