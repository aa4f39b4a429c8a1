"""Host <-> device copies, and the one place torch tensors become JAX arrays and back."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..scheduler.records import Value
from .dtypes import numpy_to_torch, to_np_dtype, torch_to_numpy, x64

_devices = None


def devices():
    global _devices
    if _devices is None:
        from . import platform
        _devices = platform.jax_devices()
    return _devices


def host_value(cpu: torch.Tensor, device: int) -> Value:
    """Copy a CPU tensor to JAX device ``device`` as a bound Value."""
    # A copy: on the CPU platform device_put may alias numpy memory, and the CPU tensor may be
    # written in place later (z.to("tpu"); z.add_(1) must not change the tpu tensor).
    a = np.array(torch_to_numpy(cpu), copy=True)
    with x64(True):
        arr = jax.device_put(a, devices()[device])
    return Value(tuple(a.shape), a.dtype, a.nbytes, array=arr)


def empty_value(shape, dtype: torch.dtype) -> Value:
    """An uninitialized Value (no array, no producer): materialized as zeros if ever read."""
    d = to_np_dtype(dtype)
    n = d.itemsize
    for s in shape:
        n *= s
    return Value(tuple(shape), d, n)


def materialize_empty(v: Value, device: int) -> None:
    with x64(True):
        v.bind(jax.device_put(jnp.zeros(v.shape, v.dtype), devices()[device]))


def to_torch(arr, dtype: torch.dtype) -> torch.Tensor:
    with x64(True):
        a = np.asarray(jax.device_get(arr))
    return numpy_to_torch(a, dtype)
