"""Host <-> device copies, and the one place torch tensors become JAX arrays and back."""
from __future__ import annotations

import math

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
    # A copy (torch_to_numpy always copies): on the CPU platform device_put may alias numpy
    # memory, and the CPU tensor may be written in place later (z.to("tpu"); z.add_(1) must not
    # change the tpu tensor).
    a = torch_to_numpy(cpu)
    return Value(tuple(a.shape), a.dtype, a.nbytes, array=put(a, device))


_put = [None]       # the direct transfer (see put), False where this JAX lacks it
_shardings: dict = {}


def put(a: np.ndarray, device: int):
    """``jax.device_put(a, devices()[device])``. A training loop moves every batch to the device,
    and device_put's Python costs ~30 µs a call; JAX's own C++ transfer under it
    (``batched_device_put``) costs ~3. It is JAX-internal, so it is checked against device_put
    once, and any failure falls back to device_put for good."""
    return put_on(a, devices()[device])


def put_on(a: np.ndarray, d):
    """``put`` onto the JAX device ``d`` (a ``jax.Device``)."""
    f = _put[0]
    if f is None:
        f = _put[0] = _direct_put()
    if f:
        try:
            return f(a, d)
        except Exception:
            _put[0] = False
    with x64(True):
        return jax.device_put(a, d)


def _direct_put():
    try:
        from jax._src.core import ShapedArray
        from jax._src.lib import xla_client as xc
        from jax._src.sharding_impls import SingleDeviceSharding
        bdp = xc.batched_device_put

        def f(a, d):
            s = _shardings.get(d)       # one per device
            if s is None:
                s = _shardings[d] = SingleDeviceSharding(d)
            with x64(True):     # else ShapedArray makes an int64 array's type int32
                return bdp(ShapedArray(a.shape, a.dtype), s, [a], [d], True, True)

        probe = np.arange(6, dtype=np.int64).reshape(2, 3)
        d0 = devices()[0]
        with x64(True):
            want = jax.device_put(probe, d0)
        got = f(probe, d0)
        if (got.shape != want.shape or got.dtype != want.dtype or got.devices() != want.devices()
                or not got.committed or not np.array_equal(np.asarray(got), probe)):
            return False
        return f
    except Exception:
        return False


def to_device(arr, device: int):
    """``arr`` (a JAX array on another device) copied to device ``device``."""
    with x64(True):
        return jax.device_put(arr, devices()[device])


def empty_value(shape, dtype: torch.dtype) -> Value:
    """An uninitialized Value (no array, no producer): materialized as zeros if ever read."""
    d = to_np_dtype(dtype)
    n = d.itemsize
    for s in shape:
        n *= s
    return Value(tuple(shape), d, n)


def materialize_empty(v: Value, device: int) -> None:
    """Bind the empty value ``v`` (NOTE [value states]) to zeros: uninitialised memory read. A
    value with elements but no bytes is a storage freed by ``resize_(0)`` (NOTE [storage resize]
    in deferfuse/storage.py): reading it raises (CPU reads freed memory) instead of giving zeros."""
    if v.nbytes == 0 and v.dtype.itemsize and math.prod(v.shape):
        raise RuntimeError(f"a tpu tensor of shape {list(v.shape)} was read after its storage was "
                           "freed (untyped_storage().resize_(0)); resize the storage back to its "
                           "full size before reading it")
    with x64(True):
        v.bind(jax.device_put(jnp.zeros(v.shape, v.dtype), devices()[device]))


# The dtypes whose numpy scalar's ``item()`` is the Python number torch's ``item()`` gives (bool,
# int, float of the same value, complex); bfloat16, float8 and the wide unsigned types are not.
_NUMBER_DTYPES = frozenset((torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
                            torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64,
                            torch.complex128))


def to_number(arr, dtype: torch.dtype):
    """The Python number of the one-element array ``arr`` of torch dtype ``dtype``, as
    ``Tensor.item()`` gives it, without making a CPU tensor (a read-back of a stopping criterion
    or a loss); None for a dtype numpy does not give as torch does."""
    if dtype not in _NUMBER_DTYPES:
        return None
    a = np.asarray(arr)
    if a.size != 1 or a.dtype != to_np_dtype(dtype):
        return None
    return a.reshape(-1)[0].item()


def to_torch(arr, dtype: torch.dtype) -> torch.Tensor:
    # np.asarray waits for the array and copies it to the host once (jax.device_get does the
    # same through a pytree map, ~8 µs more a read); numpy_to_torch copies it again, so the CPU
    # tensor never shares JAX's host copy.
    return numpy_to_torch(np.asarray(arr), dtype)
