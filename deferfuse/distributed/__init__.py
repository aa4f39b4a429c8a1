"""torch.distributed on ``tpu`` tensors, carried by JAX's distributed runtime and XLA's collectives.

``import deferfuse`` registers the ``tpu`` backend: ``dist.init_process_group("tpu")`` (or with no
backend name when ``tpu`` is the accelerator) under ``torchrun``; DDP, DTensor, DeviceMesh, FSDP2
and ``torch.distributed.checkpoint`` then work on tpu tensors. See docs/distributed.md.
"""
from __future__ import annotations

from .coord import DistributedError

__all__ = ["DistributedError", "register"]

_registered = [False]


def register() -> None:
    """Start JAX's distributed runtime if this process is part of a job (before any JAX backend:
    NOTE [distributed start] in runtime/cluster.py) and register the ``tpu`` backend with
    torch.distributed (once)."""
    if _registered[0]:
        return
    _registered[0] = True
    import torch.distributed as dist
    from ..config import config
    from ..runtime.cluster import CLUSTER
    from . import functional, group
    CLUSTER.start(config.distributed, config.coordinator or None, timeout=config.dist_timeout)
    if dist.is_available():
        dist.Backend.register_backend("tpu", group.create, extended_api=True,
                                      devices=["tpu", "cpu"])
        functional.register()
