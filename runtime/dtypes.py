"""torch <-> numpy/JAX dtypes and host transfers.

JAX keeps 64-bit types off by default; deferfuse turns them on only around its own tracing and
execution (``x64``), so int64 stays int64 and float64 works, and a user's own JAX code keeps its
configuration.
"""
from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import torch

x64 = jax.enable_x64  # use as ``with x64(True):``

TORCH_TO_NP = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.int64: np.dtype(np.int64),
    torch.int32: np.dtype(np.int32),
    torch.int16: np.dtype(np.int16),
    torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}
for _name, _np in (("uint16", np.uint16), ("uint32", np.uint32), ("uint64", np.uint64),
                   ("float8_e4m3fn", ml_dtypes.float8_e4m3fn), ("float8_e5m2", ml_dtypes.float8_e5m2)):
    if hasattr(torch, _name):
        TORCH_TO_NP[getattr(torch, _name)] = np.dtype(_np)
NP_TO_TORCH = {v: k for k, v in TORCH_TO_NP.items()}


def to_np_dtype(dtype: torch.dtype) -> np.dtype:
    try:
        return TORCH_TO_NP[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported on the tpu device; supported: "
                        f"{', '.join(str(d) for d in TORCH_TO_NP)}") from None


class _HostBytes:
    """Raw host bytes as numpy's array interface describes them (read once, by ``np.array``)."""
    __slots__ = ("__array_interface__",)

    def __init__(self, ptr: int, n: int):
        self.__array_interface__ = {"data": (ptr, True), "shape": (n,), "typestr": "|u1",
                                    "version": 3}


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy array owning a copy of the CPU tensor ``t`` (bfloat16, float8 and the unsigned
    types too).

    NOTE [no numpy view]: never ``Tensor.numpy()`` on the caller's tensor: PyTorch marks a storage
    numpy has viewed non-resizable for good, so ``x.to("tpu")`` would make a later
    ``torch.cat(..., out=x)`` or ``x.resize_()`` on CPU fail ("Trying to resize storage that is not
    resizable"). The bytes are copied through numpy's array interface instead."""
    if t.device.type != "cpu":
        # its data pointer is no host memory (a plain tpu tensor's names an engine storage)
        raise RuntimeError(f"internal error: a tensor on {t.device} reached a host transfer")
    t = t.detach()
    dt = to_np_dtype(t.dtype)
    if t.is_conj() or t.is_neg() or not t.is_contiguous():
        t = t.resolve_conj().resolve_neg().contiguous()
    shape = tuple(t.shape)
    n = t.numel() * t.element_size()
    if n == 0:
        return np.empty(shape, dt)
    return np.array(_HostBytes(t.data_ptr(), n), copy=True).view(dt).reshape(shape)


def numpy_to_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor owning a copy of ``a`` with torch dtype ``dtype``."""
    a = np.ascontiguousarray(a)
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    if str(dtype).startswith("torch.float8"):
        return torch.from_numpy(a.view(np.int8).copy()).view(dtype)
    if a.dtype.kind == "u" and a.dtype.itemsize > 1:
        bits = {2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
        return torch.from_numpy(a.view(bits).copy()).view(dtype)
    return torch.from_numpy(a.copy())
