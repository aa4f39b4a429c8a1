"""The vLLM ``Platform`` for the ``tpu`` device (see deferfuse/vllm/__init__.py).

vLLM asks its platform which device type, dispatch key, distributed backend, worker and attention
backend to use, and how much memory the device has. The answers: ``tpu`` tensors (dispatch key
PrivateUse1, where PyTorch registers out-of-tree devices), deferfuse's ``tpu`` process group, the
worker and model runner in deferfuse/vllm/worker.py, and the paged attention in
deferfuse/vllm/attention.py, written in plain torch ops that deferfuse lowers and fuses.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

WORKER = "deferfuse.vllm.worker.TpuWorker"
ATTENTION = "deferfuse.vllm.attention.TpuAttentionBackend"
BLOCK_SIZE = 16


class TpuPlatform(Platform):
    """vLLM on deferfuse's ``tpu`` device (XLA through JAX: a TPU, a GPU or XLA's CPU backend)."""

    _enum = PlatformEnum.OOT
    device_name: str = "tpu"
    device_type: str = "tpu"
    dispatch_key: str = "PrivateUse1"
    dist_backend: str = "tpu"
    # vLLM compiles a few small helpers with torch.compile(backend=simple_compile_backend)
    simple_compile_backend: str = "tpu"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"tpu: vLLM model dtype {dtype} is not supported; use float32, "
                             "bfloat16 or float16")

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.tpu.get_device_properties(device_id).name

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return torch.tpu.get_device_properties(device_id).total_memory

    @classmethod
    def mem_get_info(cls, device_id: int = 0) -> tuple[int, int]:
        """(free, total) bytes of ``tpu:device_id``, as ``torch.cuda.mem_get_info``."""
        return torch.tpu.mem_get_info(device_id)

    @classmethod
    def get_current_memory_usage(cls, device: torch.device | None = None) -> float:
        return float(torch.tpu.memory_allocated(device))

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.tpu.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.tpu.manual_seed_all(seed)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if getattr(attn_selector_config, "use_mla", False) or getattr(attn_selector_config, "use_sparse", False):
            raise NotImplementedError("deferfuse's vLLM plugin has no MLA or sparse attention yet")
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
        register_backend(AttentionBackendEnum.CUSTOM, ATTENTION)    # what get_name() names
        return ATTENTION

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase"

    @classmethod
    def supports_structured_output(cls) -> bool:
        return True

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        """The Triton kernels a plain (non speculative) decoding step launches, in torch ops."""
        from vllm.triton_utils.dispatcher import register_kernels

        from .attention import compute_slot_mapping
        register_kernels({"vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel":
                          compute_slot_mapping})

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = WORKER
        parallel_config.disable_custom_all_reduce = True

        cache_config = vllm_config.cache_config
        if cache_config.block_size is None:
            cache_config.block_size = BLOCK_SIZE

        # No CUDA graphs; vLLM's own torch.compile path (Inductor passes) is off: the model runs
        # in defer mode, each step recorded and run as fused, cached XLA programs.
        # compilation_config={"mode": 1, "backend": "tpu"} (STOCK_TORCH_COMPILE) compiles the model
        # with torch.compile(backend="tpu"), deferfuse's compiled mode
        compilation_config = vllm_config.compilation_config
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        stock = (compilation_config.mode == CompilationMode.STOCK_TORCH_COMPILE
                 and compilation_config.backend in ("tpu", "deferfuse"))
        if not stock:
            compilation_config.mode = CompilationMode.NONE
            if vllm_config.model_config is not None:
                vllm_config.model_config.enforce_eager = True

        # async scheduling copies each step's tokens on a second CUDA stream behind CUDA events;
        # the step's tolist() is the sync point here
        vllm_config.scheduler_config.async_scheduling = False

        # JAX is threaded: an engine process forked from a process that has used it may hang.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks_in_worker_env() -> None:
    """NOTE [vLLM workers join JAX's runtime]: with several workers (tensor parallelism) each is
    a spawned process that imports deferfuse early (the platform plugin lives in it), and
    deferfuse starts JAX's distributed runtime at import from ``RANK``/``WORLD_SIZE`` and a
    coordinator (docs/distributed.md). vLLM passes a worker its rank as an argument, not in the
    environment: each worker is started with them in its environment, and with one coordinator
    address (``DEFERFUSE_COORDINATOR``) chosen here. The workers are started by the process that
    runs the engine: by default a process of its own, spawned by the one that made the ``LLM``,
    and which neither imports the caller's modules nor sees its patches. vLLM runs its general
    plugins (the ``vllm.general_plugins`` entry point) in each of its processes, the engine's
    before it makes its executor: deferfuse's (``deferfuse.vllm.general``) makes the patch there.
    Made at the import of this module instead, it is a circular import of vLLM's config."""
    from vllm.v1.executor import multiproc_executor
    proc_cls = multiproc_executor.WorkerProc
    make = proc_cls.make_worker_process
    if getattr(make, "_deferfuse", False):
        return

    def make_worker_process(vllm_config, local_rank, rank, *args, **kwargs):
        world = vllm_config.parallel_config.world_size
        if world > 1 and "DEFERFUSE_COORDINATOR" not in os.environ:
            os.environ["DEFERFUSE_COORDINATOR"] = f"127.0.0.1:{_free_port()}"
        saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
        try:
            return make(vllm_config, local_rank, rank, *args, **kwargs)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    make_worker_process._deferfuse = True
    proc_cls.make_worker_process = staticmethod(make_worker_process)
