"""A tpu tensor's JAX array for the collectives: read it (its view applied), make an array the
value of a tensor, wrap an array as a new tensor, and describe a tensor in an error message."""
from __future__ import annotations

from ..dispatch import _contig, copy_into, read
from ..scheduler.records import Value
from ..tensor import TpuTensor, new_tensor


def read_array(t):
    """The concrete JAX array of a tpu tensor (its view applied)."""
    return read(t)


def write_array(t, arr) -> None:
    """Make ``arr`` (a JAX array of ``t``'s shape and dtype) the value of ``t``."""
    st = t._s
    if not t._chain and tuple(t.shape) == tuple(st.val.shape) and st.dtype == t.dtype:
        st.val = Value(tuple(arr.shape), arr.dtype, arr.nbytes, array=arr)
        return
    copy_into(t, wrap_array(arr, t._s.device, t.dtype))


def wrap_array(arr, device: int, dtype) -> TpuTensor:
    """A new tpu tensor (contiguous, on ``device``, of ``dtype``) whose value is ``arr``."""
    shape = tuple(arr.shape)
    return new_tensor(Value(shape, arr.dtype, arr.nbytes, array=arr), device, dtype, shape,
                      _contig(shape))


def describe(t) -> str:
    """``float32[2, 3]``: a tensor's dtype and shape, as the collectives' errors name it."""
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
