"""deferfuse: unmodified PyTorch on a ``tpu`` device backed by JAX/XLA.

``import deferfuse`` registers the device. Three modes share one lowering table and compile cache:
``defer`` (DeferAndFuse, the default), ``strict`` (op by op) and ``debug`` (op by op, synchronous).
"""
from __future__ import annotations

import contextlib

from . import device as _device
from .config import MODES, config, override
from .engine import engine as _engine
from .engine import user_error as _user_error
from .errors import LoweringError, RegionError
from .jax_op import jax_op
from .scheduler.policy import Sync as _Sync
from .metrics import metrics, reset_metrics
from .runtime import platform as _platform

__all__ = ["mode", "current_mode", "sync", "metrics", "reset_metrics", "report", "platform",
           "dump_trace", "clear_caches", "config", "override", "LoweringError", "RegionError",
           "MODES", "jax_op"]
__version__ = "0.1.0"


def platform() -> str:
    """The JAX platform backing the tpu device: 'tpu', 'gpu' or 'cpu' (chosen once)."""
    return _platform.name()


def current_mode() -> str:
    """The calling thread's mode (each thread has its own, as PyTorch's mode stack)."""
    return _engine.mode


@contextlib.contextmanager
def mode(name: str | None = None):
    """Run a block in ``name`` ('defer', 'strict' or 'debug') on the calling thread; nests.

    With no name: ``defer``, unless ``TORCHTPU_MODE`` said otherwise at import. Other threads keep
    their own mode (a new thread starts in the default).
    """
    if name is None:
        name = _engine.default_mode
    if name not in MODES:
        raise ValueError(f"unknown deferfuse mode {name!r}; expected one of {', '.join(MODES)}")
    prev = _engine.mode
    _engine.set_mode(name)
    try:
        yield
    finally:
        if name == "defer":
            _engine.sync(_Sync.MODE_EXIT)
        _engine.set_mode(prev)


def sync() -> None:
    """Run everything the calling thread recorded so far (a sync point with reason 'sync')."""
    try:
        _engine.sync(_Sync.SYNC)
    except Exception as e:
        raise _user_error(e)    # NOTE [user frames] (engine.py)


def report(file=None) -> str:
    """Print (and return) a human-readable summary of what ran, compiled and synced, and why."""
    from .reporting import render
    text = render()
    if file is not False:
        print(text, file=file)
    return text


def dump_trace(path: str) -> str:
    """Write the last trace with its regions and cuts as a Graphviz DOT file (and a PNG if Graphviz
    is installed); returns the path written."""
    from .reporting import dump_trace as _dump
    return _dump(path)


def clear_caches() -> None:
    """Drop every in-process compile cache (per-op programs, regions, meta inference)."""
    _engine.sync(_Sync.SYNC)
    _engine.clear_caches()


def _tune_gc(threshold: int) -> None:
    """NOTE [gc threshold]: every recorded op makes a few small objects (its node, output value,
    storage and tensor) that live until the next sync. Python's cyclic collector runs a young
    collection every 700 net new container objects, so a training step's trace is walked several
    times and promoted to older generations. The promotions trigger full collections, which walk
    every object in the process: about 400,000 once torch and jax are imported, 160-190 ms each
    here. With a threshold above one step's live objects, a steady loop frees them by reference
    counting before any collection starts. Measured in one process, alternating thresholds:
    collection time per step went from 0.3 ms to 0 in gpt_train and from 0.6 to 0 in
    hf_llama_train; the 200-op overhead loop's mean step fell 18% (its full collections).

    Cyclic garbage (a reference cycle can hold a device buffer) is still collected by the next
    sync after Python's own threshold would have collected it: after each sync, once the trace is
    released, a young collection runs if more than 700 objects were added (Engine.sync; every 15-25
    steps in gpt_train and convnet_train, 17-20 µs per step on average). Strict and debug modes
    record nothing and keep Python's threshold (Engine.set_mode switches it). A threshold the
    program set itself is left alone."""
    import gc
    t = gc.get_threshold()
    if threshold > 0 and t[0] == 700:
        _engine.young_gc, _engine.raised_gc = 700, threshold
        if _engine.mode == "defer":
            gc.set_threshold(threshold, *t[1:])


_tune_gc(config.gc_threshold)
_device.register()
if config.persistent_cache:
    import os as _os
    import torch as _torch
    from .config import codegen_key as _codegen_key
    from .runtime import diskcache as _diskcache
    _diskcache.enable(config.cache_dir)
    _engine.runner.programs.enable(_os.path.join(config.cache_dir, "programs"),
                                   (_torch.__version__, _codegen_key()))
    if config.learned_buckets:
        _engine.runner.buckets.learned.enable(config.cache_dir, _engine.runner.programs.env)
    if config.learned_entries:
        _engine.entry_store.enable(config.cache_dir, _engine.runner.programs.env)
    from .meta import memo as _meta_memo
    _meta_memo.enable(config.cache_dir)
