"""The persistent on-disk compile cache: JAX's own, pointed at deferfuse's cache folder.

JAX keeps this setting process-wide, so turning it on also caches a user's own JAX compiles in that
folder; if the user already set ``jax_compilation_cache_dir``, deferfuse uses theirs and changes
nothing. ``DEFERFUSE_PERSISTENT_CACHE=0`` leaves JAX's configuration alone.
"""
from __future__ import annotations

import os

import jax

from . import stats


def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        stats.S["disk_cache_hits"] += 1


def enable(cache_dir: str) -> str | None:
    """Turn the persistent cache on (once); returns the folder in use, or None if unavailable."""
    current = jax.config.jax_compilation_cache_dir
    if not current:
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError:
            return None
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        # Cache every program: deferfuse's regions are often small and quick to compile, but a
        # second run of a script should still compile nothing.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        current = cache_dir
    jax.monitoring.register_event_listener(_on_event)
    return current
