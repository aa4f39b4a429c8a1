"""``deferfuse.metrics()`` and ``reset_metrics()``: counters of what ran, compiled and synced."""
from __future__ import annotations

import copy

from .engine import engine
from .runtime import stats
from .runtime.memory import COUNTERS as memory


def metrics() -> dict:
    """A snapshot of every counter (see README, 'Seeing what happened')."""
    with engine.lock:
        m = copy.deepcopy(stats.S)
    m["caches"] = engine.cache_stats()
    # Recorded ops are counted when their trace runs (not per op, which costs on the hot path).
    m["ops_recorded"] += _pending()
    m["syncs"] = dict(m["syncs"])
    m["sync_sites"] = {f"{r} at {s}": n for (r, s), n in m["sync_sites"].items()}
    m["cpu_fallbacks"] = dict(m["cpu_fallbacks"])
    m["bucket_refusals"] = dict(m["bucket_refusals"])
    m["collectives"] = dict(m["collectives"])
    m["memory_allocated"] = memory.allocated
    m["max_memory_allocated"] = memory.peak
    m["c_record"] = _c_record_stats()
    return m


def _c_record_stats() -> dict:
    """Op calls the C record path took (``hits``) and handed to the Python path (``misses``)."""
    try:
        from . import _fastpath
    except ImportError:         # not built: every call takes the Python path (route.py warns)
        return {"hits": 0, "misses": 0}
    return _fastpath.stats()


def reset_metrics() -> None:
    """Zero every counter (compile caches are kept; clear them with ``deferfuse.clear_caches()``)."""
    stats.reset()
    memory.reset_peak()
    try:
        from . import _fastpath
        _fastpath.reset_stats()
    except ImportError:
        pass
    for trace in list(engine.traces):
        trace.counted = len(trace.nodes)


def _pending() -> int:
    return sum(len(t.nodes) - t.counted for t in list(engine.traces))


def count_fallback(name: str) -> None:
    stats.S["cpu_fallbacks"][name] += 1

