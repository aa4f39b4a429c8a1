"""What code reads about a ``tpu`` device through ``torch.tpu`` (as through ``torch.cuda``): a device
index checked against the devices there are, the device's properties, its memory counters and its
free memory. Installed on ``torch.tpu`` and ``torch.accelerator`` by deferfuse/device.py.
"""
from __future__ import annotations

import collections
import os
import re

import torch

from .engine import engine
from .runtime import platform
from .runtime.memory import COUNTERS, POOLS
from .tensor import _DEVICES

_Error = getattr(torch, "AcceleratorError", RuntimeError)   # CUDA's (a RuntimeError)


def check(idx: int) -> int:
    """``idx`` if ``tpu:idx`` exists; else CUDA's kind of error for an invalid device ordinal (a
    ``torch.AcceleratorError``, which is a ``RuntimeError``) naming the device and the devices
    there are. Every path that takes a device index checks it here, before anything is recorded."""
    n = len(_DEVICES)
    if 0 <= idx < n:
        return idx
    where = f"tpu:0 .. tpu:{n - 1}" if n > 1 else "tpu:0"
    from .runtime.cluster import CLUSTER
    if CLUSTER.size > 1:
        raise _Error(f"tpu error: invalid device ordinal: tpu:{idx} does not exist: this process has "
                     f"{n} tpu device(s), {where}; in a job of several processes each has its own "
                     "devices (use torch.device('tpu'), not tpu:LOCAL_RANK; docs/distributed.md)")
    raise _Error(f"tpu error: invalid device ordinal: tpu:{idx} does not exist: this machine has {n} "
                 f"tpu device(s), {where}")


def index(device=None, optional: bool = True) -> int:
    """The checked index of ``device`` (an int, a string, a ``torch.device``; ``None`` or ``tpu``
    alone: the calling thread's current device), as ``torch.cuda``'s calls take one."""
    if device is None:
        return engine.state.device
    if isinstance(device, int) and not isinstance(device, bool):
        return check(device)
    d = torch.device(device)
    if d.type != "tpu":
        raise ValueError(f"Expected a tpu device, but got: {d}")
    return engine.state.device if d.index is None else check(d.index)


# --------------------------------------------------------------------------------------------
# properties

class TpuDeviceProperties:
    """``torch.tpu.get_device_properties(i)``: what ``torch.cuda.get_device_properties`` gives,
    from the JAX device that backs ``tpu:i``.

    - ``name``: JAX's device kind (``TPU v5 lite``, the GPU's name, ``cpu``).
    - ``total_memory``: bytes: XLA's limit for the device where the platform reports one (TPU,
      GPU), else the host's physical memory (XLA's CPU backend).
    - ``multi_processor_count``: the units that run a program in parallel: TensorCores on a TPU
      chip, SMs on a GPU, the host's usable cores on CPU.
    - ``major``, ``minor``: the GPU's CUDA compute capability; on a TPU its generation (``TPU v4``:
      4, 0); 0, 0 on CPU, so code that gates CUDA kernels on a capability does not take them.
    - ``platform``: the JAX platform (``tpu``, ``gpu``, ``cpu``); ``index``: ``i``."""

    __slots__ = ("name", "total_memory", "multi_processor_count", "major", "minor", "platform",
                 "index", "is_integrated", "is_multi_gpu_board")

    def __init__(self, idx: int):
        d = platform.jax_devices()[idx]
        kind = str(getattr(d, "device_kind", "") or d.platform)
        self.name = kind
        self.index = idx
        self.platform = d.platform
        self.total_memory = _limit(d)[1]
        self.multi_processor_count = _cores(d)
        self.major, self.minor = _capability(d, kind)
        self.is_integrated = d.platform == "cpu"     # the host's memory, as an integrated GPU's
        self.is_multi_gpu_board = False

    def __repr__(self):
        return (f"_TpuDeviceProperties(name='{self.name}', platform='{self.platform}', "
                f"major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // 2**20}MB, "
                f"multi_processor_count={self.multi_processor_count})")


def _cores(d) -> int:
    for attr in ("core_count", "num_cores"):      # GPU: SMs; TPU: TensorCores per chip
        n = getattr(d, attr, None)
        if isinstance(n, int) and n > 0:
            return n
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _capability(d, kind: str) -> tuple:
    cc = getattr(d, "compute_capability", None)
    if cc:
        major, _, minor = str(cc).partition(".")
        return int(major), int(minor or 0)
    m = re.search(r"v(\d+)", kind) if d.platform == "tpu" else None
    return (int(m.group(1)), 0) if m else (0, 0)


def _limit(d) -> tuple:
    """(bytes in use, bytes in all) of JAX device ``d``: XLA's allocator's where the platform
    reports them (TPU, GPU), else the host's (available, physical) memory."""
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return stats.get("bytes_in_use", 0), stats["bytes_limit"]
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    return total - os.sysconf("SC_AVPHYS_PAGES") * page, total


def get_device_properties(device=None) -> TpuDeviceProperties:
    return TpuDeviceProperties(index(device))


def get_device_name(device=None) -> str:
    return get_device_properties(device).name


def get_device_capability(device=None) -> tuple:
    p = get_device_properties(device)
    return p.major, p.minor


def accelerator_capability(device=None) -> dict:
    """``torch.accelerator.get_device_capability``: the dtypes tensors can have on the device."""
    from .runtime.dtypes import TORCH_TO_NP
    index(device)
    return {"supported_dtypes": set(TORCH_TO_NP)}


# --------------------------------------------------------------------------------------------
# memory

def mem_get_info(device=None) -> tuple:
    """(free bytes, total bytes) of the device, as ``torch.cuda.mem_get_info``: XLA's own limit
    and use where the platform reports them (TPU, GPU), else the host's memory (JAX's CPU)."""
    used, total = _limit(platform.jax_devices()[index(device)])
    return total - used, total


def memory_stats_as_nested_dict(device=None) -> dict:
    """CUDA's caching allocator's statistics, from the runtime's counters (NOTE [memory counters]
    in runtime/memory.py). deferfuse keeps no cache of freed blocks and splits none: every live
    buffer is active, reserved and its own segment, so ``active``, ``reserved`` and ``requested``
    bytes are the allocated bytes, ``segment`` and ``active`` the allocations, and the inactive
    splits, retries and oversize counts are 0."""
    index(device)
    nbytes, count = COUNTERS.series()

    def stat(series):
        return {p: dict(zip(("current", "peak", "allocated", "freed"), s))
                for p, s in zip(POOLS, series)}
    zeros = [[0, 0, 0, 0]] * len(POOLS)
    return {
        "allocation": stat(count), "segment": stat(count), "active": stat(count),
        "inactive_split": stat(zeros),
        "allocated_bytes": stat(nbytes), "reserved_bytes": stat(nbytes),
        "active_bytes": stat(nbytes), "inactive_split_bytes": stat(zeros),
        "requested_bytes": stat(nbytes),
        "num_alloc_retries": 0, "num_ooms": COUNTERS.ooms, "num_sync_all_streams": 0,
        "num_device_alloc": count[0][2], "num_device_free": count[0][3],
        "max_split_size": -1,
        "oversize_allocations": stat(zeros)["all"], "oversize_segments": stat(zeros)["all"],
    }


def memory_stats(device=None) -> collections.OrderedDict:
    """``torch.cuda.memory_stats``: the nested statistics flattened to ``a.b.c`` keys, sorted."""
    out = []

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out.append((prefix, obj))
    walk("", memory_stats_as_nested_dict(device))
    out.sort()
    return collections.OrderedDict(out)


def memory_allocated(device=None) -> int:
    index(device)
    return COUNTERS.allocated


def max_memory_allocated(device=None) -> int:
    index(device)
    return COUNTERS.peak


def reset_peak_memory_stats(device=None) -> None:
    index(device)
    COUNTERS.reset_peak()


def reset_accumulated_memory_stats(device=None) -> None:
    index(device)
    COUNTERS.reset_accumulated()
