"""Functional collectives (``torch.ops._c10d_functional.*``) on tpu tensors.

DTensor, DeviceMesh's helpers, tensor parallelism and ``torch.distributed._functional_collectives``
call these ops; with a tpu tensor they reach ``__torch_dispatch__``, where the handlers below run
them through the ``tpu`` process group named by their ``group_name``. A result's value is a JAX
array (computed, or being computed on the device), so ``wait_tensor`` has nothing left to do.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group

from ..scheduler.policy import Sync
from ..engine import engine
from ..dispatch import read
from ..specials import register as register_specials
from .arrays import wrap_array
from .group import ProcessGroupTPU

_f = torch.ops._c10d_functional


def _group(name) -> ProcessGroupTPU:
    pg = _resolve_process_group(name)
    if not isinstance(pg, ProcessGroupTPU):
        raise RuntimeError(f"a functional collective on tpu tensors needs a tpu process group; "
                           f"group {name!r} is {type(pg).__name__} ({pg.name()}); create it with "
                           "dist.init_process_group('tpu') or a DeviceMesh of device type 'tpu'")
    return pg


def _fresh(x):
    """A new tensor holding ``x``'s current value (no copy: JAX arrays never change)."""
    if engine.state.trace.nodes:
        engine.sync(Sync.COLLECTIVE, op="functional collective")
    return wrap_array(read(x), x._s.device, x.dtype)


def _empty(shape, like):
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _opts(cls, **kw):
    o = cls()
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def _op(name: str):
    return getattr(dist.ReduceOp, name.upper())


def _all_reduce(func, args, kwargs):
    x, op, name = args
    y = _fresh(x)
    _group(name).allreduce([y], _opts(dist.AllreduceOptions, reduceOp=_op(op)))
    return y


def _all_reduce_(func, args, kwargs):
    x, op, name = args
    _group(name).allreduce([x], _opts(dist.AllreduceOptions, reduceOp=_op(op)))
    return x


def _all_reduce_coalesced(func, args, kwargs):
    xs, op, name = args
    ys = [_fresh(x) for x in xs]
    _group(name).allreduce(ys, _opts(dist.AllreduceOptions, reduceOp=_op(op)))
    return ys


def _all_reduce_coalesced_(func, args, kwargs):
    xs, op, name = args
    _group(name).allreduce(list(xs), _opts(dist.AllreduceOptions, reduceOp=_op(op)))
    return xs


def _gathered_shape(x, n):
    return (n * x.shape[0],) + tuple(x.shape[1:]) if x.dim() else (n,)


def _all_gather(func, args, kwargs):
    x, n, name = args[:3]
    pg = _group(name)
    out = kwargs.get("out")
    if out is None:
        out = _empty(_gathered_shape(x, n), x)
    pg._gather_into(out, x)
    return out


def _all_gather_coalesced(func, args, kwargs):
    xs, n, name = args
    pg = _group(name)
    outs = []
    for x in xs:
        out = _empty(_gathered_shape(x, n), x)
        pg._gather_into(out, x)
        outs.append(out)
    return outs


def _reduce_scatter(func, args, kwargs):
    x, op, n, name = args[:4]
    pg = _group(name)
    out = kwargs.get("out")
    if out is None:
        if x.shape[0] % n:
            raise ValueError(f"reduce_scatter_tensor: dim 0 of the input ({x.shape[0]}) must be "
                             f"divisible by the group size {n}")
        out = _empty((x.shape[0] // n,) + tuple(x.shape[1:]), x)
    o, factor = _reduce_name(op)
    pg._scatter_from(out, x, o, factor)
    return out


def _reduce_scatter_coalesced(func, args, kwargs):
    xs, op, n, name = args
    return [_reduce_scatter(func, (x, op, n, name), {}) for x in xs]


def _reduce_name(op: str):
    from .collective_ops import reduce_op
    return reduce_op(_op(op))


def _all_to_all(func, args, kwargs):
    x, out_splits, in_splits, name = args
    pg = _group(name)
    if out_splits:
        out = _empty((sum(out_splits),) + tuple(x.shape[1:]), x)
    else:
        out = _empty(tuple(x.shape), x)
    pg.alltoall_base(out, x, list(out_splits), list(in_splits))
    return out


def _broadcast(func, args, kwargs):
    x, src, name = args
    y = _fresh(x)
    pg = _group(name)
    pg.broadcast([y], _opts(dist.BroadcastOptions, rootRank=src))
    return y


def _broadcast_(func, args, kwargs):
    x, src, name = args
    _group(name).broadcast([x], _opts(dist.BroadcastOptions, rootRank=src))
    return x


def _wait_tensor(func, args, kwargs):
    return args[0]


def _isend(func, args, kwargs):
    # A result here is a value (wait_tensor has nothing left to do): the request completes now.
    x, dst, tag, name = args
    _group(name).send([x], dst, tag).wait()
    return x


def _irecv(func, args, kwargs):
    x, src, tag, name = args
    _group(name).recv([x], src, tag).wait()
    return x


def _batch_p2p(func, args, kwargs):
    # Every request is posted before any is waited on (NOTE [p2p matching] in p2p.py).
    ops, peers, tags, tensors, name = args
    pg = _group(name)
    works = [(pg.send if o == "isend" else pg.recv)([x], p, t)
             for o, p, t, x in zip(ops, peers, tags, tensors)]
    for w in works:
        w.wait()
    return list(tensors)


def register() -> None:
    """Handle the functional collectives on tpu tensors (deferfuse/specials.py's table)."""
    table = {
        "all_reduce": _all_reduce, "all_reduce_": _all_reduce_,
        "all_reduce_coalesced": _all_reduce_coalesced,
        "all_reduce_coalesced_": _all_reduce_coalesced_,
        "all_gather_into_tensor": _all_gather, "all_gather_into_tensor_out": _all_gather,
        "all_gather_into_tensor_coalesced": _all_gather_coalesced,
        "reduce_scatter_tensor": _reduce_scatter, "reduce_scatter_tensor_out": _reduce_scatter,
        "reduce_scatter_tensor_coalesced": _reduce_scatter_coalesced,
        "all_to_all_single": _all_to_all, "broadcast": _broadcast, "broadcast_": _broadcast_,
        "wait_tensor": _wait_tensor, "isend": _isend, "irecv": _irecv,
        "batch_p2p_ops": _batch_p2p,
    }
    handlers = {}
    for name, h in table.items():
        packet = getattr(_f, name, None)     # looked up defensively: versions differ
        o = getattr(packet, "default", None) if packet is not None else None
        if o is not None:
            handlers[o] = h
    register_specials(handlers)
