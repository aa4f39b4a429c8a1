"""vLLM's worker and model runner for the ``tpu`` device.

``TpuWorker`` is vLLM's GPU ``Worker`` with the device set up as ``tpu:N`` and the KV cache sized
from the device's free memory (or ``kv_cache_memory_bytes``). ``TpuModelRunner`` is vLLM's
``GPUModelRunner`` with, as the in-tree XPU runner does, ``torch.cuda``'s streams and events
swapped for ``torch.tpu``'s while it is built (NOTE [one stream] in deferfuse/streams.py), the KV
cache allocated as one plain tensor a layer (vLLM's default carves every layer out of one int8 buffer
through ``as_strided`` and dtype views), and sampled tokens read with one ``tolist()``, the step's
sync point.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc

import torch
import torch._dynamo.config as dynamo_config
import torch.fx.experimental._config as fx_config
from vllm.config import CompilationMode
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model
from vllm.platforms import current_platform
from vllm.utils.mem_utils import format_gib
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import bind_kv_cache, map_kv_caches_to_kernel_blocks
from vllm.v1.worker.worker_base import CompilationTimes

import deferfuse  # noqa: F401  (registers the tpu device)
from deferfuse.engine import engine
from deferfuse.scheduler.policy import Cut

from . import buckets

logger = init_logger(__name__)


@contextlib.contextmanager
def _tpu_streams():
    """``torch.cuda.Stream``/``Event``/``stream``/``current_stream`` as ``torch.tpu``'s, for the
    block that builds the runner (the GPU runner makes its copy streams and events there)."""
    names = ("Stream", "Event", "stream", "current_stream", "default_stream", "set_stream")
    saved = {n: getattr(torch.cuda, n) for n in names}
    tpu = torch.tpu

    def event(*args, blocking=None, **kwargs):
        return tpu.Event(*args, **kwargs)

    try:
        torch.cuda.Stream = tpu.Stream
        torch.cuda.Event = event
        torch.cuda.stream = tpu.stream
        torch.cuda.current_stream = tpu.current_stream
        torch.cuda.default_stream = tpu.default_stream
        torch.cuda.set_stream = tpu.set_stream
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.cuda, n, f)


def _exact_versions():
    """Compiled mode's steps around the model's graph (NOTE [vLLM buckets]): each exact size a
    region of input preparation or sampling meets is compiled whole the first time, as a program
    of its own, however many sizes the region has had. deferfuse's default (past
    ``shape_recompile_limit`` versions, a new one runs split or op by op, and compiles whole
    when it comes back) made the same requests compile again in their second and third runs;
    here the sizes are bounded by the step's token budget and request count."""
    return deferfuse.override(shape_recompile_limit=1 << 16)


def _no_grad_instead_of_inference_mode(cls, base) -> None:
    """Give ``cls`` each method of ``base`` decorated ``@torch.inference_mode()``, run under
    ``torch.no_grad()`` instead: a view of a tpu tensor taken inside inference mode raises
    "Cannot set version_counter for inference tensor" (the view is a new wrapper tensor made in
    inference mode, and PyTorch then shares the base's version counter with it)."""
    for name, fn in vars(base).items():
        inner = getattr(fn, "__wrapped__", None)
        cells = getattr(fn, "__closure__", None) or ()
        if inner is not None and name not in vars(cls) and any(
                isinstance(getattr(c.cell_contents, "__self__", None), torch.inference_mode) for c in cells):
            setattr(cls, name, torch.no_grad()(inner))


class TpuModelRunner(GPUModelRunner):
    """vLLM's GPU model runner on ``tpu`` tensors (see the module's docstring)."""

    def __init__(self, vllm_config, device: torch.device):
        with _tpu_streams():
            super().__init__(vllm_config, device)
        self.use_cuda_graph = False
        self.token_buckets = buckets.for_config(vllm_config)   # NOTE [vLLM buckets]

    def _determine_batch_execution_and_padding(self, num_tokens: int, *args, **kwargs):
        """vLLM's choice of a step's padded size (a CUDA graph's, on GPUs): in compiled mode, the
        step's tokens padded up to a token bucket (NOTE [vLLM buckets])."""
        mode, desc, *rest = super()._determine_batch_execution_and_padding(
            num_tokens, *args, **kwargs)
        if self.token_buckets is not None:
            padded = buckets.up(desc.num_tokens, self.token_buckets)
            if padded != desc.num_tokens and padded <= self.max_num_tokens:
                desc = dataclasses.replace(desc, num_tokens=padded)
        return (mode, desc, *rest)

    def _model_forward(self, *args, **kwargs):
        if self.token_buckets is None:
            return super()._model_forward(*args, **kwargs)
        # NOTE [vLLM buckets]. Dynamo traces here (once): without duck sizing, two sizes that
        # happen to be equal at the first trace stay two sizes; floats (norms' epsilons, the
        # attention's scale) are constants, not symbols, which Dynamo would make and then
        # specialize, restarting its whole trace. The model's graph runs as a region of its
        # own, fenced off from the step's input preparation and sampling, whose sizes are the
        # step's exact ones (in its region, each of those sizes was a program holding the model).
        self._fence()
        with fx_config.patch(use_duck_shape=False), dynamo_config.patch(specialize_float=True):
            out = super()._model_forward(*args, **kwargs)
        self._fence()
        return out

    def _fence(self) -> None:
        with _exact_versions():
            engine.sync(Cut.FENCE)

    def load_model(self, load_dummy_weights: bool = False) -> None:
        logger.info("Loading model %s onto %s", self.model_config.model, self.device)
        self.model = get_model(vllm_config=self.vllm_config)
        if self.lora_config:
            self.model = self.load_lora_model(self.model, self.vllm_config, self.device)
        cc = self.vllm_config.compilation_config
        if cc.mode == CompilationMode.STOCK_TORCH_COMPILE:
            # deferfuse's compiled mode: each Dynamo graph one jax.jit program (docs/compiled.md).
            # vLLM's parameter subclasses (ModelWeightParameter ...) only carry weight loaders:
            # plain Parameters from here on, which is what compiled graphs take
            for mod in self.model.modules():
                for name, p in list(mod._parameters.items()):
                    if p is not None and type(p) is not torch.nn.Parameter:
                        mod._parameters[name] = torch.nn.Parameter(p.data, requires_grad=False)
            # every size dynamic from the first trace (NOTE [vLLM buckets])
            self.model.compile(fullgraph=True, dynamic=True,
                               backend=cc.init_backend(self.vllm_config))

    def get_model(self) -> torch.nn.Module:
        return self.model

    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes,
                                    kv_cache_allocation_context=None) -> dict[str, torch.Tensor]:
        kv_caches: dict[str, torch.Tensor] = {}
        specs = {}
        for group in kv_cache_config.kv_cache_groups:
            for name in group.layer_names:
                spec = group.kv_cache_spec
                specs[name] = getattr(spec, "kv_cache_specs", {}).get(name, spec)
        for tensor in kv_cache_config.kv_cache_tensors:
            num_blocks = kv_cache_config.num_blocks_of(tensor)
            for name in tensor.layers:
                spec = specs[name]
                if not hasattr(spec, "head_size"):
                    raise NotImplementedError(f"tpu: KV cache spec {type(spec).__name__} is not supported")
                kv_caches[name] = torch.zeros(
                    (num_blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size),
                    dtype=spec.dtype, device=self.device)
        if self.token_buckets is not None:
            # their sizes never change: constants of the compiled graph, not symbols
            # (fewer symbols, a faster trace: NOTE [vLLM buckets])
            for kv in kv_caches.values():
                torch._dynamo.mark_static(kv)
        for layer_name, target in self.shared_kv_cache_layers.items():
            kv_caches[layer_name] = kv_caches[target]
        attn_groups = [g for groups in self.attn_groups for g in groups]
        bind_kv_cache(kv_caches, self.compilation_config.static_forward_context, self.kv_caches, 1,
                      kv_cache_groups=kv_cache_config.kv_cache_groups,
                      layer_kv_caches=map_kv_caches_to_kernel_blocks(kv_caches, attn_groups))
        return kv_caches

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        seen = set()
        for kv in self.kv_caches:
            if isinstance(kv, torch.Tensor) and id(kv) not in seen:
                seen.add(id(kv))
                kv.index_fill_(0, ids, 0)

    def _sync_device(self) -> None:
        torch.tpu.synchronize()

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        if self.token_buckets is None:
            return sampled_token_ids.tolist()
        with _exact_versions():
            return sampled_token_ids.tolist()


class TpuWorker(Worker):
    """vLLM's GPU worker on ``tpu:local_rank`` (see the module's docstring)."""

    def init_device(self):
        # The process group first: with several ranks it starts JAX's distributed runtime,
        # which must come before the first device lookup (docs/distributed.md).
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        init_worker_distributed_environment(self.vllm_config, self.rank, self.distributed_init_method,
                                            self.local_rank, current_platform.dist_backend)
        self.device = torch.device("tpu", self.local_rank % torch.tpu.device_count())
        torch.tpu.set_device(self.device)
        set_random_seed(self.model_config.seed)
        gc.collect()
        self.model_runner = TpuModelRunner(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str):
        return contextlib.nullcontext()     # no sleep-mode allocator: XLA owns device memory

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache: ``kv_cache_memory_bytes`` when given, else the fraction
        ``gpu_memory_utilization`` of the device's memory less what is in use now (the weights)."""
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            return int(explicit)
        free, total = torch.tpu.mem_get_info(self.device)
        used = total - free
        budget = int(total * self.cache_config.gpu_memory_utilization) - used
        if budget <= 0:
            raise ValueError(f"tpu: no memory left for the KV cache: {format_gib(used)} GiB of "
                             f"{format_gib(total)} GiB in use, gpu_memory_utilization="
                             f"{self.cache_config.gpu_memory_utilization}; raise it or set "
                             "kv_cache_memory_bytes")
        logger.info("tpu: %s GiB for the KV cache", format_gib(budget))
        return budget

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # What loading the model, the KV cache and the runner's buffers recorded runs now, in
        # programs of its own: left pending, it joined the first step's program, and the first
        # step of the next batch, alone, was a program to compile again.
        torch.tpu.synchronize(self.device)
        set_random_seed(self.model_config.seed)
        return CompilationTimes(language_model=self.compilation_config.compilation_time,
                                encoder=self.compilation_config.encoder_compilation_time)

    def deferfuse_metrics(self) -> dict:
        """This worker's ``deferfuse.metrics()`` (what a tensor-parallel worker process compiled
        and ran): ``llm.collective_rpc("deferfuse_metrics")`` asks every worker."""
        m = deferfuse.metrics()
        return {k: ({str(a): b for a, b in v.items()} if isinstance(v, dict) else
                    [str(x) for x in v] if isinstance(v, list) else v)
                for k, v in m.items() if k not in ("sync_sites", "miss_reasons", "peak_region")}

    def sleep(self, level: int = 1) -> None:
        logger.warning("tpu: sleep mode is not supported; ignored")

    def wake_up(self, tags=None) -> None:
        logger.warning("tpu: sleep mode is not supported; ignored")


_no_grad_instead_of_inference_mode(TpuModelRunner, GPUModelRunner)
_no_grad_instead_of_inference_mode(TpuWorker, Worker)
