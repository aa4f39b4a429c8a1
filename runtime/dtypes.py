"""torch <-> numpy/JAX dtypes and host transfers.

JAX keeps 64-bit types off by default; deferfuse turns them on only around its own tracing and
execution (``x64``), so int64 stays int64 and float64 works, and a user's own JAX code keeps its
configuration.
"""
from __future__ import annotations

import platform

import jax
import jax.numpy as jnp
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


# NOTE [float to int casts]: XLA's convert saturates a float out of the integer type's range (and
# makes NaN 0); PyTorch's CPU kernels do the C cast, which on x86 is the cvtt instruction: a value
# out of the range of the 32- or 64-bit integer it converts to (NaN and infinities included)
# becomes that integer's minimum, and a narrower type keeps the low bits. Measured on CPU for
# float64, float32, bfloat16 and float16 sources, contiguous, strided and long (vectorized)
# tensors alike: int8 and int16 go through int32, uint8 through int64, int32 and int64 directly
# (so 400.0 -> uint8 is 144, -1.0 -> 255, 1e10 -> int32 is -2**31, nan -> int64 is -2**63).
# Elsewhere (an ARM CPU saturates, as XLA does) the cast is XLA's.
_CVTT = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_CVTT_VIA = {np.dtype(np.int8): np.int32, np.dtype(np.int16): np.int32,
             np.dtype(np.int32): np.int32, np.dtype(np.uint8): np.int64,
             np.dtype(np.int64): np.int64}


def cast(x, dt):
    """``x`` as dtype ``dt`` the way PyTorch's CPU ``.to(dt)`` makes it (NOTE [float to int
    casts])."""
    x = jnp.asarray(x)
    dt = np.dtype(dt)
    via = _CVTT_VIA.get(dt)
    if via is None or not _CVTT or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dt:
        return x.astype(dt)
    w = x if x.dtype.itemsize >= 4 else x.astype(np.float32)
    t = jnp.trunc(w)
    bound = 2.0 ** (np.iinfo(via).bits - 1)
    ok = (t >= -bound) & (t < bound)            # False for NaN
    i = jnp.where(ok, jnp.where(ok, t, 0).astype(via), np.iinfo(via).min)
    return i.astype(dt)                          # an int -> int convert keeps the low bits
