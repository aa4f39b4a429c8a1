"""Which JAX platform backs the tpu device: TPU if JAX has one, else GPU, else CPU; chosen once.

The first lookup starts JAX's distributed runtime when this process is part of a job (NOTE
[distributed start] in runtime/cluster.py); the devices are then this process's own
(``jax.local_devices``): in a job of several processes ``jax.devices()`` lists every process's.
"""
from __future__ import annotations

import jax

from .cluster import CLUSTER

_chosen = None


def choose() -> tuple[str, list]:
    global _chosen
    if _chosen is None:
        CLUSTER.start()
        for name in ("tpu", "gpu", "cpu"):
            try:
                devs = jax.local_devices(backend=name)
            except RuntimeError:
                continue
            if devs:
                _chosen = (name, devs)
                break
        else:  # pragma: no cover - JAX always has a CPU backend
            raise RuntimeError("JAX reports no devices at all; check the jax installation")
    return _chosen


def name() -> str:
    return choose()[0]


def jax_devices() -> list:
    return choose()[1]
