"""One rank of TorchTitan's llama3 debug model trained data-parallel on ``tpu`` (tests/test_titan.py
starts 2 of these under ``torch.distributed.run``).

``python tests/titan_worker.py SHARD REPLICATE ATTN BACKEND OUT`` trains 10 steps on the global batch of
tests/test_titan.py (``batches()``: 2 rows, one per rank) the way TorchTitan's trainer does, from
its own parts: its ``init_distributed`` (the ``tpu`` process group), ``ParallelDims`` and
``set_determinism`` (DTensor's RNG seeded from ``--debug.seed``), the model from its
``llama3_debugmodel`` config (ATTN: ``flex`` or ``varlen`` attention) built on meta and given to its ``parallelize_llama`` (selective
activation checkpointing, ``torch.compile`` with BACKEND unless it is ``none``, FSDP2 over ``dp_shard`` x
``dp_replicate``), ``to_empty("tpu")`` and ``init_weights`` through DTensor's random ops, its
chunked cross-entropy over the global token count, its ``clip_grad_norm_``, AdamW container and
schedule. Two settings differ from the debug config: ``spmd_backend`` is ``partial_dtensor`` (the
default, ``spmd_types``, stops inside TorchTitan 0.3.0 against torch 2.13's FSDP2, on any device),
and parameters stay float32 under FSDP (``mixed_precision_param``), so that the run compares with a
float32 CPU run. Rank 0 saves the initial full weights to OUT (the CPU reference starts from them)
and every rank prints ``RESULT {json}`` with the global losses.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def plain(key: str) -> str:
    """A parameter's name without the wrappers' parts (activation checkpointing, compile)."""
    return ".".join(p for p in key.split(".")
                    if p not in ("_checkpoint_wrapped_module", "_orig_mod"))


def build(cfg):
    """TorchTitan's trainer's set-up from its own parts, on ``tpu``, for the config ``cfg``: the
    local device, ``init_distributed`` (the ``tpu`` process group), ``ParallelDims``,
    ``set_determinism``, the model built on meta and given to the model's ``parallelize_fn``,
    ``to_empty("tpu")`` and ``init_weights`` (DTensor's random ops, its RNG tracker), the loss
    (the lm head fused into it), the optimizer container and the schedule. Returns (device, dims,
    model, loss_fn, opt, sched). bench/titan_varlen.py builds its runs with it too."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.tools import utils

    device = utils.get_local_device()               # as TorchTitan's trainer: tpu:0 here
    torch.tpu.set_device(device)
    world = dist_utils.init_distributed(cfg.comm)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)
    dist_utils.set_determinism(dims, device, cfg.debug, distinct_seed_mesh_dims=["pp"])
    spec = cfg.model_spec
    spec.model.update_from_config(config=cfg)
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=dims, training=cfg.training,
                                parallelism=cfg.parallelism, compile_config=cfg.compile,
                                ac_config=cfg.activation_checkpoint, dump_folder="/tmp")
    model.to_empty(device="tpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = cfg.loss.build(compile_config=cfg.compile)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    opt = cfg.optimizer.build(model_parts=[model])
    sched = cfg.lr_scheduler.build(optimizers=opt, training_steps=cfg.training.steps)
    return device, dims, model, loss_fn, opt, sched


def main(shard: int, replicate: int, attn: str, backend: str, out: str) -> None:
    import deferfuse
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from test_titan import STEPS, batches

    cfg = llama3_debugmodel()
    cfg.model_spec = model_registry("debugmodel", attn_backend=attn)
    cfg.parallelism.spmd_backend = "partial_dtensor"
    cfg.parallelism.data_parallel_shard_degree = shard
    cfg.parallelism.data_parallel_replicate_degree = replicate
    cfg.training.mixed_precision_param = "float32"
    cfg.training.steps = STEPS
    cfg.training.local_batch_size = 2 // (shard * replicate)
    cfg.debug.seed = 42
    if backend != "none":
        cfg.compile.enable = True
        cfg.compile.backend = backend
    device, dims, model, loss_fn, opt, sched = build(cfg)
    assert dist.get_backend() == "tpu", dist.get_backend()
    init = {plain(k): (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in model.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save(init, out)
    # The global batch split over the data-parallel ranks (one process: all of it).
    batch_mesh = dims.get_optional_mesh("batch")
    loss_mesh = dims.get_optional_mesh("loss")
    n = 1 if batch_mesh is None else batch_mesh.size()
    row = 0 if batch_mesh is None else batch_mesh.get_local_rank()
    losses = []
    for tokens, labels, positions in batches():
        rows = slice(row * len(tokens) // n, (row + 1) * len(tokens) // n)
        tokens, labels, positions = (t[rows].to(device) for t in (tokens, labels, positions))
        opt.zero_grad()
        global_tokens = dist_utils.dist_sum_tensor(
            torch.tensor(labels.numel(), device=device), batch_mesh)
        pred = model(tokens, positions=positions,
                     attention_masks=model.get_attention_masks(positions=positions))
        loss, _ = loss_fn(pred, labels, global_tokens, positions=positions)
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), cfg.training.max_norm, foreach=True,
                                   pp_mesh=None, ep_enabled=False)
        opt.step()
        sched.step()
        losses.append(dist_utils.dist_sum(loss.detach(), loss_mesh))
    assert all(p.device.type == "tpu" for p in model.parameters())
    m = deferfuse.metrics()
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "losses": losses, "init_keys": len(init),
                                  "graphs": m["dynamo_graphs"], "compiled_blocks": sum(
                                      getattr(b, "_compiled_call_impl", None) is not None
                                      for b in model.layers.values()),
                                  "fallbacks": m["cpu_fallbacks"]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
