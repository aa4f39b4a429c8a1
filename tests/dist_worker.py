"""One process of a multi-process test: tests/test_distributed.py starts 2 or 4 of these with the
variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), one CPU JAX device
each. ``python tests/dist_worker.py SCENARIO MODE [ARG]`` runs one scenario in deferfuse mode MODE,
asserts, prints ``RESULT {json}`` and exits 0.

Every numeric result is compared with CPU PyTorch: the collectives with the same collectives on CPU
tensors through gloo, training with single-process CPU training of the same global batch.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import deferfuse
from deferfuse.tensor import is_tpu
from util import bench_module

M = bench_module("models")

VOCAB, T, STEPS = 64, 16, 20


# --------------------------------------------------------------------------- the small GPT
def GPT(d=32, layers=2, heads=4):
    """bench/models.py's GPT at this file's vocabulary and length."""
    return M.GPT(VOCAB, d, layers, heads, T)


def loss_of(model, x, y):
    return F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))


def batches(global_batch: int, steps: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (global_batch, T), generator=g),
             torch.randint(0, VOCAB, (global_batch, T), generator=g)) for _ in range(steps)]


def sgd(params, **kw):
    # SGD with momentum: Adam's normalised update turns summation-order noise in near-zero
    # gradients into visible parameter differences, even between two CPU runs.
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, **kw)


def train(model, opt, data, rows=slice(None), read=lambda loss: loss.item(), device=None):
    """One optimizer step of ``model`` per batch of ``data`` (the ``rows`` of each batch, moved to
    ``device`` unless it is None); returns each step's loss as ``read`` gives it."""
    losses = []
    for x, y in data:
        x, y = x[rows], y[rows]
        if device is not None:
            x, y = x.to(device), y.to(device)
        loss = loss_of(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(read(loss))
    return losses


def cpu_reference(data):
    """Single-process CPU training on the global batches: (losses, final state dict)."""
    torch.manual_seed(0)
    model = GPT()
    opt = sgd(model.parameters())
    losses = train(model, opt, data)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def compare_training(losses, state, data, loss_tol=1e-5, param_tol=2e-5) -> dict:
    """Losses and final parameters against CPU training of the same global batches."""
    want_losses, want_state = cpu_reference(data)
    loss_err = max(abs(a - b) for a, b in zip(losses, want_losses))
    param_err = max((state[k].float() - want_state[k]).abs().max().item() for k in want_state)
    assert set(state) == set(want_state), (sorted(state), sorted(want_state))
    for k in want_state:
        assert state[k].dtype == want_state[k].dtype and state[k].shape == want_state[k].shape, k
    assert loss_err <= loss_tol, f"losses differ from CPU training by {loss_err}"
    assert param_err <= param_tol, f"parameters differ from CPU training by {param_err}"
    return {"loss_err": loss_err, "param_err": param_err, "first": losses[0], "last": losses[-1]}


def mean_loss(loss):
    """The global batch's mean loss, from each rank's mean over its equal share."""
    l = loss.detach().clone()
    dist.all_reduce(l, op=dist.ReduceOp.AVG)
    return l.item()


def full_state(model):
    from torch.distributed.tensor import DTensor
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- scenarios
def same(got, want, what):
    """``got`` (tpu, or a list of them) equals ``want`` (CPU, from gloo): dtype, shape, values."""
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{what}[{i}]")
        return
    assert got.device.type == "tpu", f"{what}: on {got.device}"
    g = got.cpu()
    assert g.dtype == want.dtype and g.shape == want.shape, f"{what}: {g.dtype}{list(g.shape)} vs {want.dtype}{list(want.shape)}"
    assert torch.equal(g, want), f"{what}:\n{g}\n!=\n{want}"


def scenario_collectives(mode, arg):
    r, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    checked = 0
    ops = ["SUM", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR"]
    for dt in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32,
               torch.uint8, torch.bool):
        for op in ops:
            if op.startswith("B") and dt.is_floating_point:
                continue
            base = (torch.arange(6) * (r + 2) % 5 - (1 if dt != torch.bool and dt != torch.uint8 else 0)).to(dt)
            a, c = base.to("tpu"), base.clone()
            dist.all_reduce(a, op=getattr(dist.ReduceOp, op))
            dist.all_reduce(c, op=getattr(dist.ReduceOp, op), group=gloo)
            same(a, c, f"all_reduce {dt} {op}")
            checked += 1
    # AVG and PREMUL_SUM (gloo has neither): the mean, and the sum of scaled values, of every rank's
    x = torch.arange(6, dtype=torch.float32) * (r + 1)
    everyone = [torch.empty(6) for _ in range(n)]
    dist.all_gather(everyone, x, group=gloo)
    a = x.to("tpu")
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    torch.testing.assert_close(a.cpu(), torch.stack(everyone).sum(0) / n)
    a = x.to("tpu")
    dist.all_reduce(a, op=dist.ReduceOp.PREMUL_SUM(0.25) if callable(dist.ReduceOp.PREMUL_SUM)
                    else dist._make_nccl_premul_sum(0.25))
    torch.testing.assert_close(a.cpu(), sum(e * 0.25 for e in everyone))
    # A float reduction through a bitwise op raises, as on gloo
    try:
        dist.all_reduce(torch.ones(2, device="tpu"), op=dist.ReduceOp.BAND)
        raise AssertionError("BAND of floats did not raise")
    except RuntimeError as e:
        assert "BAND" in str(e), e

    def both(fn, make):
        t, c = make("tpu"), make("cpu")
        ft = fn(t, None)
        fc = fn(c, gloo)
        return ft, fc

    x = torch.arange(4.) + 10 * r
    # all_gather_into_tensor: concatenated and stacked outputs (gloo: concatenated only)
    c = torch.empty(4 * n)
    dist.all_gather_into_tensor(c, x, group=gloo)
    for shape in ((4 * n,), (n, 4)):
        a = torch.empty(shape, device="tpu")
        dist.all_gather_into_tensor(a, x.to("tpu"))
        same(a, c.reshape(shape), f"all_gather_into_tensor {shape}")
    outs, couts = [torch.empty(4, device="tpu") for _ in range(n)], [torch.empty(4) for _ in range(n)]
    dist.all_gather(outs, x.to("tpu"))
    dist.all_gather(couts, x, group=gloo)
    same(outs, couts, "all_gather")
    xs = torch.arange(4. * n) * (r + 1)
    for op in ("SUM", "MAX"):
        a, c = torch.empty(4, device="tpu"), torch.empty(4)
        dist.reduce_scatter_tensor(a, xs.to("tpu"), op=getattr(dist.ReduceOp, op))
        dist.reduce_scatter_tensor(c, xs, op=getattr(dist.ReduceOp, op), group=gloo)
        same(a, c, f"reduce_scatter_tensor {op}")
    ins = [torch.full((3,), float(r * 10 + i)) for i in range(n)]
    a, c = torch.empty(3, device="tpu"), torch.empty(3)
    dist.reduce_scatter(a, [t.to("tpu") for t in ins])
    dist.reduce_scatter(c, ins, group=gloo)
    same(a, c, "reduce_scatter")
    # broadcast is bit for bit, -0.0 and NaN included
    b = torch.tensor([-0.0, float("nan"), 1.5, r + 0.25])
    a, c = b.to("tpu"), b.clone()
    dist.broadcast(a, n - 1)
    dist.broadcast(c, n - 1, group=gloo)
    assert torch.equal(a.cpu().view(torch.int32), c.view(torch.int32)), "broadcast bits"
    for dt in (torch.int64, torch.bool, torch.bfloat16):
        b = (torch.arange(5) + r).to(dt)
        a, c = b.to("tpu"), b.clone()
        dist.broadcast(a, 1)
        dist.broadcast(c, 1, group=gloo)
        same(a, c, f"broadcast {dt}")
    # reduce (only dst's result is defined: gloo leaves partial sums elsewhere), scatter, gather
    a, c = x.to("tpu"), x.clone()
    dist.reduce(a, 0)
    dist.reduce(c, 0, group=gloo)
    same(a, c if r == 0 else x, "reduce")
    sl = [torch.full((2, 2), float(i + 1)) for i in range(n)] if r == 0 else None
    a, c = torch.empty(2, 2, device="tpu"), torch.empty(2, 2)
    dist.scatter(a, [t.to("tpu") for t in sl] if sl else None, src=0)
    dist.scatter(c, sl, src=0, group=gloo)
    same(a, c, "scatter")
    gl = [torch.empty(4, device="tpu") for _ in range(n)] if r == n - 1 else None
    gc = [torch.empty(4) for _ in range(n)] if r == n - 1 else None
    dist.gather(x.to("tpu"), gl, dst=n - 1)
    dist.gather(x, gc, dst=n - 1, group=gloo)
    if gl:
        same(gl, gc, "gather")
    # all_to_all_single: even and uneven splits; all_to_all of lists
    e = torch.arange(2. * n) + 100 * r
    a, c = torch.empty(2 * n, device="tpu"), torch.empty(2 * n)
    dist.all_to_all_single(a, e.to("tpu"))
    dist.all_to_all_single(c, e, group=gloo)
    same(a, c, "all_to_all_single")
    ins_sz = [(r + j) % 3 + 1 for j in range(n)]           # rank r sends ins_sz[j] rows to j
    outs_sz = [(j + r) % 3 + 1 for j in range(n)]          # and receives rank j's ins_sz[r]
    u = torch.arange(sum(ins_sz) * 2, dtype=torch.float32).reshape(-1, 2) + 1000 * r
    a, c = torch.empty(sum(outs_sz), 2, device="tpu"), torch.empty(sum(outs_sz), 2)
    dist.all_to_all_single(a, u.to("tpu"), outs_sz, ins_sz)
    dist.all_to_all_single(c, u, outs_sz, ins_sz, group=gloo)
    same(a, c, "all_to_all_single uneven")
    # all_to_all of lists of different sizes (gloo takes equal sizes only: its
    # all_to_all_single with splits is the reference)
    li = [torch.full((j + 1,), float(r * 10 + j)) for j in range(n)]
    lt = [torch.empty(r + 1, device="tpu") for _ in range(n)]
    dist.all_to_all(lt, [t.to("tpu") for t in li])
    flat = torch.empty((r + 1) * n)
    dist.all_to_all_single(flat, torch.cat(li), [r + 1] * n, [j + 1 for j in range(n)], group=gloo)
    same(lt, list(flat.split(r + 1)), "all_to_all")
    # point to point (sync and async), in a ring
    t = torch.full((3,), float(r), device="tpu")
    tc = torch.full((3,), float(r))
    if r % 2 == 0:
        dist.send(t + 5, (r + 1) % n)
        dist.recv(t, (r - 1) % n)
        dist.send(tc + 5, (r + 1) % n, group=gloo)
        dist.recv(tc, (r - 1) % n, group=gloo)
    else:
        dist.recv(t, (r - 1) % n)
        dist.send(t + 5, (r + 1) % n)
        dist.recv(tc, (r - 1) % n, group=gloo)
        dist.send(tc + 5, (r + 1) % n, group=gloo)
    same(t, tc, "send/recv")
    # async handles
    a = x.to("tpu")
    w = dist.all_reduce(a, async_op=True)
    assert w.wait() and w.is_completed()
    fut = dist.all_reduce(a, async_op=True).get_future()
    c = x.clone()
    dist.all_reduce(c, group=gloo)
    dist.all_reduce(c, group=gloo)
    same(fut.wait()[0], c, "async all_reduce")
    # CPU tensors given to the tpu group go to its gloo group
    c1, c2 = x.clone(), x.clone()
    dist.all_reduce(c1)
    dist.all_reduce(c2, group=gloo)
    assert torch.equal(c1, c2) and c1.device.type == "cpu", "cpu tensor on the tpu group"
    # object collectives
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "s": "x" * r})
    assert objs == [{"rank": i, "s": "x" * i} for i in range(n)], objs
    lst = [f"from {r}", r] if r == 1 else [None, None]
    dist.broadcast_object_list(lst, 1)
    assert lst == ["from 1", 1], lst
    # a sub-group of the first two ranks
    sub = dist.new_group([0, 1])
    sub_gloo = dist.new_group([0, 1], backend="gloo")
    if r < 2:
        a, c = x.to("tpu"), x.clone()
        dist.all_reduce(a, group=sub)
        dist.all_reduce(c, group=sub_gloo)
        same(a, c, "sub-group all_reduce")
    # functional collectives
    import torch.distributed._functional_collectives as fc
    w = dist.group.WORLD
    same(fc.wait_tensor(fc.all_reduce(x.to("tpu"), "sum", w)), _gloo_sum(x, gloo), "fc.all_reduce")
    g = fc.all_gather_tensor(x.to("tpu"), 0, w)
    c = torch.empty(4 * n)
    dist.all_gather_into_tensor(c, x, group=gloo)
    same(fc.wait_tensor(g), c, "fc.all_gather_tensor")
    rs = fc.reduce_scatter_tensor(xs.to("tpu"), "sum", 0, w)
    c = torch.empty(4)
    dist.reduce_scatter_tensor(c, xs, group=gloo)
    same(fc.wait_tensor(rs), c, "fc.reduce_scatter_tensor")
    dist.barrier()
    m = deferfuse.metrics()
    return {"checked": checked, "collectives": sum(m["collectives"].values())}


def _gloo_sum(x, gloo):
    c = x.clone()
    dist.all_reduce(c, group=gloo)
    return c


def scenario_ddp(mode, arg):
    from torch.nn.parallel import DistributedDataParallel as DDP
    r, n = dist.get_rank(), dist.get_world_size()
    data = batches(4 * n)
    torch.manual_seed(0)
    model = DDP(GPT().to("tpu"), gradient_as_bucket_view=(arg == "bucket_view"),
                static_graph=(arg == "static_graph"),
                find_unused_parameters=(arg == "find_unused"))
    opt = sgd(model.parameters())
    losses = train(model, opt, data, slice(r * 4, (r + 1) * 4), mean_loss, "tpu")
    out = compare_training(losses, full_state(model.module), data)
    out["syncs"] = deferfuse.metrics()["syncs"]
    return out


def scenario_fsdp(mode, arg):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    r, n = dist.get_rank(), dist.get_world_size()
    data = batches(4 * n)
    torch.manual_seed(0)
    model = GPT().to("tpu")
    kw = {}
    if arg == "mp":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    opt = sgd(model.parameters())
    losses = train(model, opt, data, slice(r * 4, (r + 1) * 4), mean_loss, "tpu")
    local = next(iter(model.parameters())).to_local()
    # a tpu tensor of either representation (tensor.is_tpu), not a CPU or meta local shard
    assert is_tpu(local) and local.shape[0] < VOCAB, "not sharded on tpu"
    # bf16 compute against fp32 CPU training: bf16's rounding, not exactness
    tol = dict(loss_tol=5e-3, param_tol=2e-3) if arg == "mp" else {}
    return compare_training(losses, full_state(model), data, **tol)


def scenario_tp(mode, arg):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    r, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("tpu", (n,))
    full = torch.arange(4. * n * 6).reshape(4 * n, 6)
    d = distribute_tensor(full.to("tpu"), mesh, [Shard(0)])
    assert torch.equal(d.to_local().cpu(), full[r * 4:(r + 1) * 4])
    assert torch.equal(d.redistribute(mesh, [Replicate()]).to_local().cpu(), full)
    if 6 % n == 0:
        s1 = d.redistribute(mesh, [Shard(1)])
        k = 6 // n
        assert torch.equal(s1.to_local().cpu(), full[:, r * k:(r + 1) * k])
    assert torch.allclose(((d * 2).sum()).full_tensor().cpu(), (full * 2).sum())
    w = distribute_tensor(torch.linspace(-1, 1, 30).reshape(6, 5).to("tpu"), mesh, [Replicate()])
    torch.testing.assert_close((d @ w).full_tensor().cpu(), full @ torch.linspace(-1, 1, 30).reshape(6, 5))
    # tensor-parallel MLPs in a GPT: every rank sees the whole batch
    data = batches(4)
    torch.manual_seed(0)
    model = GPT().to("tpu")
    for b in model.blocks:
        parallelize_module(b.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    # foreach=False: the replicated parameters are plain tensors, the MLP's DTensors
    opt = sgd(model.parameters(), foreach=False)
    losses = train(model, opt, data, device="tpu")
    return compare_training(losses, full_state(model), data)


def scenario_tp_compiled(mode, arg):
    """Compiled graphs holding functional collectives (NOTE [collectives in programs]): each runs
    as one program over the group, never op by op. A manual ``funcol`` function (every collective
    kind, against gloo on CPU), one called with other shapes on each rank (run op by op on every
    rank), then a tensor-parallel MLP (ColwiseParallel/RowwiseParallel)
    behind a replicated layer, compiled with backend="tpu", trained 3 steps: outputs, losses and
    gradients against the unsharded model on CPU, and steps 2 and 3 compile nothing; then a graph
    that writes into a cache input, its buffer donated, against gloo."""
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    r, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    w = dist.group.WORLD

    def collectives(x, y):
        a = fc.wait_tensor(fc.all_reduce(x * 2, "sum", w))
        m = fc.wait_tensor(fc.all_reduce(x, "max", w))
        g = fc.wait_tensor(fc.all_gather_tensor(y, 0, w))
        s = fc.wait_tensor(fc.reduce_scatter_tensor(y.repeat(n, 1), "sum", 0, w))
        t = fc.wait_tensor(fc.all_to_all_single(y.repeat(n, 1), None, None, w))
        b = fc.wait_tensor(fc.broadcast(y + 1, 1 % n, w))
        return a + 1, m, g.sum(1), s, t, b
    x = torch.arange(6.).reshape(2, 3) * (r + 1) - 2
    y = torch.arange(4.).reshape(1, 4) + 10 * r
    got = torch.compile(collectives, backend="tpu")(x.to("tpu"), y.to("tpu"))
    a, m = _gloo_sum(x * 2, gloo) + 1, x.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=gloo)
    g = torch.empty(n, 4)
    dist.all_gather_into_tensor(g, y, group=gloo)
    s = torch.empty(1, 4)
    dist.reduce_scatter_tensor(s, y.repeat(n, 1), group=gloo)
    t = torch.empty(n, 4)
    dist.all_to_all_single(t, y.repeat(n, 1), group=gloo)
    b = y + 1
    dist.broadcast(b, 1 % n, group=gloo)
    same(list(got), [a, m, g.sum(1), s, t, b], "compiled functional collectives")
    m0 = deferfuse.metrics()
    assert m0["graphs_run_eagerly"] == 0, m0["graph_fallback_reasons"]
    assert m0["graphs_with_collectives"] == 1, m0["graphs_with_collectives"]
    # Uneven shards: the same graph with more rows on one rank runs op by op on every rank
    def uneven(x):
        return fc.wait_tensor(fc.all_reduce(x.sum(0), "sum", w)) * 2
    xu = torch.arange(4.).repeat(2 + r, 1) * (r + 1)
    same(torch.compile(uneven, backend="tpu")(xu.to("tpu")), _gloo_sum(xu.sum(0), gloo) * 2,
         "a compiled graph on uneven shards")
    assert deferfuse.metrics()["graph_calls_op_by_op"] == 1

    mesh = init_device_mesh("tpu", (n,))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 16), nn.GELU(),
                                                       nn.Linear(16, 8)))
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 16), nn.GELU(),
                                                         nn.Linear(16, 8)))
    model.load_state_dict(ref.state_dict())
    model = model.to("tpu")
    parallelize_module(model[1], mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    cmodel = torch.compile(model, backend="tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    out_err = grad_err = loss_err = 0.0
    compiles = []
    for step in range(3):
        xb = torch.randn(4, 8, generator=g)
        out = cmodel(xb.to("tpu"))
        loss = (out * out).mean()
        opt.zero_grad()
        loss.backward()
        grads = {k: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).cpu()
                 for k, p in model.named_parameters()}
        opt.step()
        want = ref(xb)
        ref_loss = (want * want).mean()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        out_err = max(out_err, (out.cpu() - want).abs().max().item())
        loss_err = max(loss_err, abs(loss.item() - ref_loss.item()))
        for k, p in ref.named_parameters():
            assert grads[k].shape == p.grad.shape and grads[k].dtype == p.grad.dtype, k
            grad_err = max(grad_err, (grads[k] - p.grad).abs().max().item())
        compiles.append(deferfuse.metrics()["graph_compiles"])
    assert out_err <= 1e-5 and loss_err <= 1e-5 and grad_err <= 1e-5, (out_err, loss_err, grad_err)
    m = deferfuse.metrics()
    assert m["graphs_run_eagerly"] == 0, m["graph_fallback_reasons"]
    # the functions above, the forward graph and the backward graph (the replicated layer's input
    # gradient is an all-reduce) hold collectives
    assert m["graphs_with_collectives"] == 4, m["graphs_with_collectives"]
    assert compiles[0] == compiles[-1], compiles       # steps 2 and 3 compile nothing

    # A graph that writes into its input (a KV cache, as vLLM's attention) is given that input's
    # buffer (NOTE [donation in graphs over a group]): the cache against gloo's, three calls.
    def kv(cache, idx, x):
        cache.index_copy_(0, idx, x)
        return fc.wait_tensor(fc.all_reduce(cache.sum(0), "sum", w))
    ckv = torch.compile(kv, backend="tpu")
    ref_cache = torch.arange(32.).reshape(8, 4) * (r + 1)
    cache = ref_cache.to("tpu")
    donated = deferfuse.metrics()["donated_bytes"]
    for step in range(3):
        idx, xb = torch.tensor([step, 5]), torch.randn(2, 4, generator=g) + r
        got = ckv(cache, idx.to("tpu"), xb.to("tpu"))
        ref_cache.index_copy_(0, idx, xb)
        same([got, cache], [_gloo_sum(ref_cache.sum(0), gloo), ref_cache],
             "a graph writing a cache")
    kv_donated = deferfuse.metrics()["donated_bytes"] - donated
    assert kv_donated >= 3 * ref_cache.numel() * 4, kv_donated
    return {"out_err": out_err, "loss_err": loss_err, "grad_err": grad_err,
            "graph_compiles": compiles[-1], "compiled_calls": m["compiled_calls"],
            "collectives": dict(m["collectives"]), "kv_donated": kv_donated,
            "report": deferfuse.report()}


def _varlen_ref(q, k, v, lens):
    """Causal attention over each packed document on its own, SDPA on CPU."""
    parts, s = [], 0
    for n in lens:
        qq, kk, vv = (x[s:s + n].transpose(0, 1) for x in (q, k, v))
        parts.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(0, 1))
        s += n
    return torch.cat(parts)


def scenario_packed_graph(mode, arg):
    """NOTE [packed boundaries] in a compiled graph over a group (NOTE [collectives in
    programs]): varlen attention whose output is all-reduced, called on ranks that pack
    other numbers of documents (23 tokens on each). The first call packs as many on each rank
    (Dynamo's static graph); from the second on (its dynamic graph) every rank's boundaries are
    padded to one bucket, so the ranks agree on the inputs and each call runs as one program over
    the group, never op by op. Values against CPU's SDPA per document, summed by gloo."""
    import torch.distributed._functional_collectives as fc
    from torch.nn.attention.varlen import varlen_attn
    r = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    w = dist.group.WORLD

    def f(q, k, v, cu, longest):
        out = varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0))
        return fc.wait_tensor(fc.all_reduce(out, "sum", w))
    cf = torch.compile(f, backend="tpu", fullgraph=True)
    # per call, each rank's documents: the same count on the first call, then other counts
    docs = [([5, 18], [10, 13]), ([5, 11, 7], [4, 4, 4, 11]), ([23], [2, 3, 4, 5, 9]),
            ([6, 6, 6, 5], [12, 11])]
    g = torch.Generator().manual_seed(r)
    for lens in (d[r] for d in docs):
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        q, k, v = (torch.randn(23, 2, 8, generator=g) for _ in range(3))
        got = cf(q.to("tpu"), k.to("tpu"), v.to("tpu"), cu.to("tpu"), max(lens))
        want = _gloo_sum(_varlen_ref(q, k, v, lens), gloo)
        assert got.device.type == "tpu" and got.dtype == want.dtype, (got.device, got.dtype)
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"varlen attention over {lens}, all-reduced: {m}")
    m = deferfuse.metrics()
    assert m["graphs_run_eagerly"] == 0, m["graph_fallback_reasons"]
    return {"op_by_op": m["graph_calls_op_by_op"], "padded": m["packed_padded"],
            "graphs": m["dynamo_graphs"], "calls": m["compiled_calls"]}


def scenario_dcp(mode, arg):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    r, n = dist.get_rank(), dist.get_world_size()

    def make(seed):
        torch.manual_seed(seed)
        m = GPT().to("tpu")
        for b in m.blocks:
            fully_shard(b)
        fully_shard(m)
        return m
    data = batches(4 * n, 6)
    model = make(0)
    opt = sgd(model.parameters())

    def step(model, opt, x, y):
        loss = loss_of(model, x[r * 4:(r + 1) * 4].to("tpu"), y[r * 4:(r + 1) * 4].to("tpu"))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return mean_loss(loss)
    for x, y in data[:3]:
        step(model, opt, x, y)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=arg)
    files = sorted(os.listdir(arg))
    # a fresh sharded model and optimizer, loaded from the checkpoint, trains on exactly as the
    # original does
    model2 = make(123)
    opt2 = sgd(model2.parameters())
    for x, y in data[:1]:
        step(model2, opt2, x, y)       # optimizer state exists, and differs
    sd = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    dcp.load(sd, checkpoint_id=arg)
    model2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])
    a, b = full_state(model), full_state(model2)
    assert all(torch.equal(a[k], b[k]) for k in a), "loaded parameters differ"
    for x, y in data[3:]:
        assert step(model, opt, x, y) == step(model2, opt2, x, y)
    a, b = full_state(model), full_state(model2)
    assert all(torch.equal(a[k], b[k]) for k in a), "training after loading differs"
    return {"files": files}


def scenario_noname(mode, arg):
    """``init_process_group()`` without a backend when the accelerator is tpu (``arg``
    "device_id": bound to the process's tpu device, as scripts written for NCCL do); a sub-group
    that leaves a rank out."""
    from deferfuse.distributed.group import ProcessGroupTPU
    r, n = dist.get_rank(), dist.get_world_size()
    assert isinstance(dist.group.WORLD, ProcessGroupTPU), dist.group.WORLD
    t = torch.full((3,), float(r + 1), device="tpu")
    dist.all_reduce(t)
    assert torch.equal(t.cpu(), torch.full((3,), float(n * (n + 1) // 2)))
    sub = dist.new_group(list(range(1, n)))
    if r > 0:
        dist.all_reduce(t, group=sub)
        assert torch.equal(t.cpu(), torch.full((3,), float((n - 1) * n * (n + 1) // 2)))
    dist.barrier()      # rank 0 holds torch's store: it stays until the sub-group is made
    return {"backend": dist.get_backend_config()}


def scenario_mesh2d(mode, arg):
    """A 2 x 2 DeviceMesh: collectives along each dimension (its sub-groups) and a DTensor
    sharded on one dimension, replicated on the other."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    r = dist.get_rank()
    mesh = init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        a, c = torch.full((3,), float(r), device="tpu"), torch.full((3,), float(r))
        dist.all_reduce(a, group=mesh.get_group(dim))
        dist.all_reduce(c, group=cmesh.get_group(dim))
        same(a, c, f"all_reduce over {dim}")
    full = torch.arange(24.).reshape(4, 6)
    d = distribute_tensor(full.to("tpu"), mesh, [Replicate(), Shard(0)])
    c = distribute_tensor(full, cmesh, [Replicate(), Shard(0)])
    same(d.to_local(), c.to_local(), "2-D DTensor shard")
    same(d.redistribute(mesh, [Shard(1), Replicate()]).to_local(),
         c.redistribute(cmesh, [Shard(1), Replicate()]).to_local(), "2-D redistribute")
    return {}


def scenario_fault(mode, arg):
    """Rank 1 fails at step 3 of an all-reduce loop (``arg``: raise, kill, hang, mismatch, exit,
    die_inside); the others must fail with a DistributedError naming it."""
    r, n = dist.get_rank(), dist.get_world_size()
    marker = os.environ.get("DIST_TEST_MARKER")
    t = torch.ones(4, device="tpu")
    for step in range(6):
        if r == 1 and step == 3:
            if arg == "raise":
                raise ValueError("rank 1 broke on purpose")
            if arg == "kill":
                open(marker, "w").close()      # the test kills this process
                time.sleep(600)
            if arg == "hang":
                time.sleep(600)
            if arg == "mismatch":
                t = torch.ones(8, device="tpu")
            if arg == "exit":
                sys.exit(0)
            if arg == "die_inside":
                # die inside the collective, after agreeing on it: the others' XLA collective
                # loses its peer mid-flight
                from deferfuse.runtime import collectives
                collectives.all_reduce = lambda *a, **k: os.kill(os.getpid(), 9)
        dist.all_reduce(t)
        t = t / n
    return {}


def scenario_p2p(mode, arg):
    """Sends and receives posted in any order (NOTE [p2p matching]): every rank isend first then
    irecv, and a batch_isend_irecv ring of two messages (float32 and int64), each against the same
    on CPU tensors through gloo and the values the sender built; then two ranks that both block in
    send first get a DistributedError instead of a hang."""
    from deferfuse.distributed import DistributedError
    r, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    nxt, prv = (r + 1) % n, (r - 1) % n

    def made_by(k):      # what rank k sends: values and a shape of its own
        return (torch.arange(3. * (k + 2)).reshape(k + 2, 3) + 100 * k,
                torch.arange(k + 4, dtype=torch.int64) * (k + 1))
    # every rank posts its send first, then its recv (symmetric on 2 ranks)
    for group, dev in ((None, "tpu"), (gloo, "cpu")):
        x, _ = made_by(r)
        got = torch.empty(prv + 2, 3, device=dev)
        s = dist.isend(x.to(dev), nxt, group=group)
        q = dist.irecv(got, prv, group=group)
        s.wait()
        q.wait()
        if dev == "tpu":
            sym = got
    same(sym, got, "isend first")
    same(sym, made_by(prv)[0], "isend first (sender's values)")
    # a batch_isend_irecv ring (pipeline parallelism's pattern), two messages each way
    outs = {}
    for group, dev in ((None, "tpu"), (gloo, "cpu")):
        a, b = made_by(r)
        ga = torch.empty(prv + 2, 3, device=dev)
        gb = torch.empty(prv + 4, dtype=torch.int64, device=dev)
        ops = [dist.P2POp(dist.isend, a.to(dev), nxt, group=group),
               dist.P2POp(dist.irecv, ga, prv, group=group),
               dist.P2POp(dist.isend, b.to(dev), nxt, group=group),
               dist.P2POp(dist.irecv, gb, prv, group=group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        outs[dev] = [ga, gb]
    same(outs["tpu"], outs["cpu"], "batch_isend_irecv ring")
    same(outs["tpu"], list(made_by(prv)), "batch_isend_irecv ring (sender's values)")
    # a send whose recv differs in shape: every rank of the pair says so
    dist.barrier()
    error = ""
    if n == 2:
        try:
            dist.send(torch.ones(2, device="tpu"), nxt)      # both ranks send first, blocking
        except DistributedError as e:
            error = str(e)
        assert "neither can post more" in error and "send float32[2] to" in error, error
    return {"error": error}


def scenario_rng(mode, arg):
    """Parameters initialised through DTensor's random ops (its OffsetBasedRNGTracker moves the
    tpu generator's offset per shard) equal the same draws on one device with the same seed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    import torch.distributed.tensor as dtensor
    n = dist.get_world_size()
    mesh = init_device_mesh("tpu", (n,))
    shape = (8, 6)

    def draws(distributed):
        """uniform_ (sharded, replicated), normal_, trunc_normal_ and randn, from seed 1234: as
        DTensors on the mesh, or as plain tensors of this device."""
        torch.manual_seed(1234)

        def empty(placements):
            t = torch.empty(shape, device="tpu")
            return distribute_tensor(t, mesh, placements) if distributed else t
        out = [empty([Shard(0)]).uniform_(-1, 1), empty([Replicate()]).uniform_(-1, 1),
               torch.nn.init.normal_(empty([Shard(0)]), std=0.02),
               torch.nn.init.trunc_normal_(empty([Shard(0)]), std=0.02)]
        out.append(dtensor.randn(shape, device_mesh=mesh, placements=[Shard(0)]) if distributed
                   else torch.randn(shape, device="tpu"))
        # An explicit tpu generator (NOTE [generators in DTensor] in deferfuse/generator.py)
        g = torch.Generator("tpu").manual_seed(99)
        out.append(empty([Shard(0)]).normal_(generator=g))
        out.append(torch.nn.init.uniform_(empty([Shard(0)]), generator=g))
        return out

    got = draws(True)
    got = [g.full_tensor().cpu() for g in got]
    want = [w.cpu() for w in draws(False)]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (i, g.dtype, g.shape)
        assert torch.equal(g, w), f"draw {i}: DTensor on {n} ranks differs from one device"
    # The tracker leaves the generator where every rank agrees: the next plain draws are equal.
    nxt = torch.rand(8, device="tpu")
    gathered = [torch.empty(8, device="tpu") for _ in range(n)]
    dist.all_gather(gathered, nxt)
    assert all(torch.equal(x.cpu(), nxt.cpu()) for x in gathered)
    return {"sums": [float(g.double().sum()) for g in got],
            "state": torch.tpu.get_rng_state().tolist()}


SCENARIOS = {k[len("scenario_"):]: v for k, v in globals().items() if k.startswith("scenario_")}


def main():
    scenario, mode = sys.argv[1], sys.argv[2]
    arg = sys.argv[3] if len(sys.argv) > 3 else None
    if scenario == "noname":
        dist.init_process_group(device_id=torch.device("tpu", 0) if arg == "device_id" else None)
    else:
        dist.init_process_group("tpu")
    t0 = time.time()
    with deferfuse.mode(mode):
        out = SCENARIOS[scenario](mode, arg)
    out["seconds"] = round(time.time() - t0, 2)
    out["rank"] = dist.get_rank()
    print("RESULT " + json.dumps(out, default=str), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
