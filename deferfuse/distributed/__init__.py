"""torch.distributed on ``tpu`` tensors, carried by JAX's distributed runtime and XLA's collectives.

The ``tpu`` backend (alias ``tpu_dist``) is registered at ``import torch`` by the autoload entry
point, whose constructor loads deferfuse, and again by ``import deferfuse`` with the constructor
itself: ``dist.init_process_group("tpu")`` (or with no backend name when ``tpu`` is the
accelerator) under ``torchrun``; DDP, DTensor, DeviceMesh, FSDP2
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
    import deferfuse_autoload
    from ..config import config
    from ..runtime.cluster import CLUSTER
    from . import functional, group
    # A process group being made loaded deferfuse: its rank and size (deferfuse_autoload).
    rank, world, store_coordinator = deferfuse_autoload.LOADER.job or (None, None, None)
    CLUSTER.start(config.distributed, config.coordinator or None, timeout=config.dist_timeout,
                  rank=rank, world=world, store_coordinator=store_coordinator)
    deferfuse_autoload.register_backends(group.create)
    import torch.distributed as dist
    if dist.is_available():
        functional.register()
