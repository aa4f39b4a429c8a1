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


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host copy of a CPU tensor as numpy (bfloat16 and float8 through a bit view)."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.dtype in (torch.bfloat16,) or str(t.dtype).startswith("torch.float8"):
        bits = t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int8).numpy()
        return bits.view(TORCH_TO_NP[t.dtype])
    if t.dtype in (getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None)):
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        return t.contiguous().view(bits).numpy().view(TORCH_TO_NP[t.dtype])
    return t.numpy()


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
