"""Which JAX platform backs the tpu device: TPU if JAX has one, else GPU, else CPU; chosen once."""
from __future__ import annotations

import jax

_chosen = None


def choose() -> tuple[str, list]:
    global _chosen
    if _chosen is None:
        for name in ("tpu", "gpu", "cpu"):
            try:
                devs = jax.devices(name)
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
