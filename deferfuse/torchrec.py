"""TorchRec's sharded embeddings on ``tpu``: a plan whose shards sit on ``tpu``, and FBGEMM's
table-batched embedding (TBE) lookup with its fused optimizer update, computed on the device.

    import deferfuse.torchrec
    plan = deferfuse.torchrec.plan(ebc, [EmbeddingBagCollectionSharder()], world_size, constraints)
    model = DistributedModelParallel(ebc, device=torch.device("tpu"), plan=plan)

TorchRec's planner accepts only ``cpu``, ``cuda`` and ``mtia`` as its ``Topology``'s compute device
(a fixed list, no registry): ``plan`` runs the planner for ``cpu`` and moves every shard's
placement to ``tpu:<local rank>``. Sharded on any device but CUDA, TorchRec builds FBGEMM's TBE
module with its weights in "host" memory, here ``tpu`` tensors; FBGEMM's autograd kernel of the
lookup then refuses them ("must be a CPU or MTIA tensor"). Importing this module registers, for
``tpu`` only (the ``AutogradPrivateUse1`` key), a lookup written in torch ops: sum and mean pooling,
per-sample weights, tables of mixed widths, and in backward the fused update of the weights in
place, as FBGEMM's CPU kernels do, for SGD and exact row-wise Adagrad (no gradient for the
per-sample weights themselves). Other fused optimizers (they reach FBGEMM's own check), weights
placed on the device (CUDA's layout), variable batch sizes per feature (VBE) and sequence
(unpooled) TBE are not covered: those raise ``NotImplementedError``.

Importing it imports ``torchrec`` and ``fbgemm_gpu`` (the ``torchrec`` extra).
"""
from __future__ import annotations

import fbgemm_gpu  # noqa: F401  (defines torch.ops.fbgemm)
import torch
from torch.distributed.remote_device import _remote_device
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

_SUM, _MEAN = 0, 1          # FBGEMM's PoolingMode
_FP32 = 0                   # FBGEMM's SparseType.FP32.as_int()


def plan(module, sharders, world_size: int, constraints=None, local_world_size=None, pg=None):
    """A TorchRec ``ShardingPlan`` for ``module`` over ``world_size`` ranks with its shards on
    ``tpu``: the planner's plan for ``cpu``, each placement moved to rank r's device, ``tpu:<r %
    local>`` where each process sees all the host's devices, ``tpu:0`` where each sees one.
    ``pg`` (a process group) makes the planner agree across ranks, as TorchRec's
    ``collective_plan``."""
    local = local_world_size or world_size
    per_process = torch.tpu.device_count() >= local
    topology = Topology(world_size=world_size, local_world_size=local, compute_device="cpu")
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    if pg is not None:
        p = planner.collective_plan(module, sharders, pg)
    else:
        p = planner.plan(module, sharders)
    for module_plan in p.plan.values():
        for sharding in module_plan.values():
            if sharding.sharding_spec is None:
                continue
            for shard in sharding.sharding_spec.shards:
                r = shard.placement.rank()
                shard.placement = _remote_device(f"rank:{r}/tpu:{r % local if per_process else 0}")
    return p


# --------------------------------------------------------------------------------------------
# The TBE lookup

def _rows(weights_offsets, D_offsets, indices, offsets, max_D: int):
    """Each index's flat weight addresses [N, max_D], which of them are real (d < D of its
    feature), and its bag. Features index tables through ``weights_offsets`` (one entry per
    feature; features sharing a table share an offset)."""
    N = indices.numel()
    pos = torch.arange(N, device=indices.device, dtype=offsets.dtype)
    bag = torch.searchsorted(offsets, pos, right=True) - 1
    T = D_offsets.numel() - 1
    B = (offsets.numel() - 1) // T
    t = torch.div(bag, B, rounding_mode="floor")
    D = (D_offsets[1:] - D_offsets[:-1]).long()
    Dt = D.index_select(0, t)
    d = torch.arange(max_D, device=indices.device)
    valid = (d[None, :] < Dt[:, None]) & (indices[:, None] >= 0)    # -1: a pruned row, skipped
    base = weights_offsets.long().index_select(0, t) + indices.long() * Dt
    addr = base[:, None] + d[None, :]
    return torch.where(valid, addr, 0), valid, bag, B


def _scale(offsets, bag, pooling_mode: int, indice_weights):
    """Each index's factor in its bag's pooled sum: its per-sample weight, over the bag's length
    for mean pooling; None for a plain sum."""
    s = None
    if indice_weights is not None:
        s = indice_weights.float()
    if pooling_mode == _MEAN:
        L = (offsets[1:] - offsets[:-1]).index_select(0, bag).clamp(min=1).float()
        s = 1.0 / L if s is None else s / L
    return s


def _out_columns(D_offsets, B: int, max_D: int, total_D: int):
    """For the [B, total_D] output: each (b, column)'s row in the pooled [T * B * max_D] buffer."""
    c = torch.arange(total_D, device=D_offsets.device, dtype=D_offsets.dtype)
    t = torch.searchsorted(D_offsets, c, right=True) - 1
    d = c - D_offsets.index_select(0, t)
    b = torch.arange(B, device=D_offsets.device)
    return ((t.long()[None, :] * B + b[:, None]) * max_D + d.long()[None, :])


def _sgd(host_weights, addr, g, lr, state):
    """Fused SGD, in place: w -= lr * grad (a row used twice gets both updates, as FBGEMM's CPU
    kernel)."""
    host_weights.index_add_(0, addr.reshape(-1), (g * -lr).reshape(-1).to(host_weights.dtype))


def _rowwise_adagrad(host_weights, addr, g, lr, state):
    """FBGEMM's exact row-wise Adagrad, in place: per row used, with its gradient summed over
    its uses, ``m += mean(g * g)`` and ``w -= lr / (sqrt(m) + eps) * g``. Computed densely over
    the whole table (a row not used has a zero gradient, so it keeps its weights and state
    exactly): no size depends on the data, at a cost proportional to the table."""
    momentum, mom_offsets, weights_offsets, D_offsets, eps = state
    n = host_weights.numel()
    grad = torch.zeros(n, dtype=torch.float32, device=g.device)
    grad = grad.index_add(0, addr.reshape(-1), g.reshape(-1))
    # Each element's feature (features sharing a table share its offset, width and state).
    off, order = torch.sort(weights_offsets.long())
    D = (D_offsets[1:] - D_offsets[:-1]).long().index_select(0, order)
    mo = mom_offsets.long().index_select(0, order)
    e = torch.arange(n, device=g.device)
    f = (torch.searchsorted(off, e, right=True) - 1).clamp(min=0)
    De = D.index_select(0, f)
    row = torch.div(e - off.index_select(0, f), De, rounding_mode="floor")
    m_idx = (mo.index_select(0, f) + row).clamp(0, momentum.numel() - 1)
    momentum.index_add_(0, m_idx, (grad * grad / De).to(momentum.dtype))
    mult = lr / (momentum.index_select(0, m_idx).float().sqrt() + eps)
    host_weights.sub_((mult * grad).to(host_weights.dtype))


class _Lookup(torch.autograd.Function):
    """The pooled lookup; backward applies the fused optimizer ``update`` to the weights."""
    @staticmethod
    def forward(ctx, placeholder, host_weights, weights_offsets, D_offsets, total_D, max_D, indices,
                offsets, pooling_mode, indice_weights, update, lr, state):
        addr, valid, bag, B = _rows(weights_offsets, D_offsets, indices, offsets, max_D)
        T = D_offsets.numel() - 1
        vals = host_weights.index_select(0, addr.reshape(-1)).view(addr.shape).float()
        vals = torch.where(valid, vals, 0.0)
        scale = _scale(offsets, bag, pooling_mode, indice_weights)
        if scale is not None:
            vals = vals * scale[:, None]
        pooled = torch.zeros(T * B, max_D, device=vals.device).index_add(0, bag, vals)
        cols = _out_columns(D_offsets, B, max_D, total_D)
        ctx.save_for_backward(host_weights, addr, valid, bag, scale, cols)
        ctx.update, ctx.lr, ctx.state = update, lr, state
        ctx.max_D, ctx.n_pooled = max_D, T * B * max_D
        return pooled.reshape(-1).index_select(0, cols.reshape(-1)).view(B, total_D)

    @staticmethod
    def backward(ctx, grad):
        host_weights, addr, valid, bag, scale, cols = ctx.saved_tensors
        # Each pooled slot's gradient (scattered from the output's columns), then each index's.
        g = torch.zeros(ctx.n_pooled, device=grad.device, dtype=torch.float32)
        g = g.index_copy(0, cols.reshape(-1), grad.reshape(-1).float())
        g = g.view(-1, ctx.max_D).index_select(0, bag)
        if scale is not None:
            g = g * scale[:, None]
        g = torch.where(valid, g, 0.0)
        ctx.update(host_weights, addr, g, ctx.lr, ctx.state)
        return (None,) * 13


def _checked(weights, aux_tensor, pooling_mode, output_dtype, learning_rate_tensor):
    """(host weights, weights offsets, learning rate) of a lookup this module computes."""
    if len(weights) != 3:
        raise NotImplementedError("TBE on tpu: only host-placed weights (TorchRec's placement "
                                  "off CUDA) are supported")
    if aux_tensor and aux_tensor[0] is not None:
        raise NotImplementedError("TBE on tpu: variable batch sizes per feature (VBE) are not "
                                  "supported")
    if pooling_mode not in (_SUM, _MEAN) or output_dtype != _FP32:
        raise NotImplementedError(f"TBE on tpu: pooling mode {pooling_mode}, output dtype "
                                  f"{output_dtype}: only sum or mean pooling to float32")
    host_weights, _placements, weights_offsets = weights
    # The rate as FBGEMM keeps it: a CPU tensor is read (a Python number becomes a program input,
    # so a schedule never recompiles); one on the device stays there (no sync).
    lr = learning_rate_tensor
    if lr.device.type == "cpu":
        lr = float(lr)
    return host_weights, weights_offsets, lr


def _lookup_sgd(placeholder_autograd_tensor, weights, D_offsets, total_D, max_D, hash_size_cumsum,
                total_hash_size_bits, indices, offsets, pooling_mode, indice_weights,
                feature_requires_grad, output_dtype, aux_tensor, aux_int, aux_float, aux_bool,
                learning_rate_tensor, max_B=-1, max_B_feature_rank=-1, vbe_output_size=-1,
                vbe_output=None):
    host_weights, weights_offsets, lr = _checked(weights, aux_tensor, pooling_mode, output_dtype,
                                                 learning_rate_tensor)
    return _Lookup.apply(placeholder_autograd_tensor, host_weights, weights_offsets, D_offsets,
                         int(total_D), int(max_D), indices, offsets, int(pooling_mode),
                         indice_weights, _sgd, lr, None)


def _lookup_rowwise_adagrad(placeholder_autograd_tensor, weights, D_offsets, total_D, max_D,
                            hash_size_cumsum, total_hash_size_bits, indices, offsets, pooling_mode,
                            indice_weights, feature_requires_grad, output_dtype, aux_tensor,
                            aux_int, aux_float, aux_bool, momentum1, learning_rate_tensor,
                            optim_int, optim_float, max_B=-1, max_B_feature_rank=-1,
                            vbe_output_size=-1, vbe_output=None):
    host_weights, weights_offsets, lr = _checked(weights, aux_tensor, pooling_mode, output_dtype,
                                                 learning_rate_tensor)
    eps, weight_decay, max_norm = optim_float
    # aux_bool[4]: gradient clipping; aux_bool[3]: global weight decay
    if weight_decay != 0 or max_norm != 0 or aux_bool[4] or aux_bool[3]:
        raise NotImplementedError("TBE on tpu: row-wise Adagrad with weight decay, max_norm or "
                                  "gradient clipping is not supported")
    momentum, _placements, mom_offsets = momentum1
    state = (momentum, mom_offsets, weights_offsets, D_offsets, float(eps))
    return _Lookup.apply(placeholder_autograd_tensor, host_weights, weights_offsets, D_offsets,
                         int(total_D), int(max_D), indices, offsets, int(pooling_mode),
                         indice_weights, _rowwise_adagrad, lr, state)


_LIB = torch.library.Library("fbgemm", "IMPL")  # noqa: TOR901 (kernels for tpu tensors only)
_LIB.impl("split_embedding_codegen_lookup_sgd_function_pt2", _lookup_sgd, "AutogradPrivateUse1")
_LIB.impl("split_embedding_codegen_lookup_rowwise_adagrad_function_pt2", _lookup_rowwise_adagrad,
          "AutogradPrivateUse1")
