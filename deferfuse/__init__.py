"""deferfuse: unmodified PyTorch on a ``tpu`` device backed by JAX/XLA.

``import deferfuse`` registers the device. Three modes share one lowering table and compile cache:
``defer`` (DeferAndFuse, the default), ``strict`` (op by op) and ``debug`` (op by op, synchronous).
"""
from __future__ import annotations

import contextlib

from . import device as _device
from . import state as _state
from .config import MODES, config, override
from .errors import LoweringError, RegionError
from .metrics import metrics, reset_metrics
from .runtime import platform as _platform

__all__ = ["mode", "current_mode", "sync", "metrics", "reset_metrics", "report", "platform",
           "dump_trace", "clear_caches", "config", "override", "LoweringError", "RegionError",
           "MODES"]
__version__ = "0.1.0"


def platform() -> str:
    """The JAX platform backing the tpu device: 'tpu', 'gpu' or 'cpu' (chosen once)."""
    return _platform.name()


def current_mode() -> str:
    return _state.MODE


@contextlib.contextmanager
def mode(name: str | None = None):
    """Run a block in ``name`` ('defer', 'strict' or 'debug'); nests.

    With no name: ``defer``, unless ``TORCHTPU_MODE`` said otherwise at import.
    """
    if name is None:
        name = _DEFAULT_MODE
    if name not in MODES:
        raise ValueError(f"unknown deferfuse mode {name!r}; expected one of {', '.join(MODES)}")
    prev = _state.MODE
    _state.set_mode(name)
    try:
        yield
    finally:
        if name == "defer":
            _state.sync("mode exit")
        _state.set_mode(prev)


def sync() -> None:
    """Run everything recorded so far (a sync point with reason 'sync')."""
    _state.sync("sync")


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
    from .dispatch import _CACHE, _ROUTE
    from .views import ALIASES, VIEWS
    from .runtime import flush, execute
    _state.sync("sync")
    _CACHE.clear()
    VIEWS.clear()
    ALIASES.clear()
    _ROUTE.clear()
    flush.clear()
    execute._view_jits.clear()


_DEFAULT_MODE = config.mode
_device.register()
if config.persistent_cache:
    from .runtime import diskcache as _diskcache
    _diskcache.enable(config.cache_dir)
