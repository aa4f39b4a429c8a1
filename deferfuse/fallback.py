"""The CPU fallback: an op with no lowering to JAX (or whose output shape depends on the data) runs
on CPU copies of its ``tpu`` arguments; what it writes and returns is copied back.
"""
from __future__ import annotations

import warnings

import torch

from .config import config
from .dispatch import copy_into, from_cpu, to_cpu
from .engine import engine
from .errors import LoweringError
from .metrics import count_fallback
from .scheduler.policy import Sync
from .tensor import TpuTensor

_warned: set = set()     # ops warned about once (a set of op names: bounded by the op set)


def fallback(func, info, args, kwargs, why):
    """Run ``func`` on CPU copies of its tpu arguments and copy back what it wrote and returned
    (an op with no lowering, or whose output shape depends on the data); counted and warned
    once per op. A sync point in defer mode."""
    if not config.cpu_fallback:
        raise LoweringError(func, why)
    reason = Sync.DATA_DEPENDENT if why == Sync.DATA_DEPENDENT else Sync.UNLOWERED
    if engine.state.trace.nodes:
        engine.sync(reason, op=info.name)
    count_fallback(info.name)
    if why != "data-dependent shape" and info.name not in _warned:
        _warned.add(info.name)
        what = "no lowering to JAX" if why == "no lowering" else why
        warnings.warn(f"deferfuse: {info.name} has {what}; it runs on CPU (copy in, run, copy "
                      "out). Counted in deferfuse.metrics()['cpu_fallbacks'].", stacklevel=3)
    dev = [0]
    cpu_of = {}

    mutated = {id(args[i]) for i in info.mut_pos if i < len(args)} | \
        {id(kwargs[n]) for n in info.mut_kw if n in kwargs}

    def to_host(a):
        if type(a) is TpuTensor:
            dev[0] = a._s.device
            c = to_cpu(a, reason)
            if id(a) in mutated:
                c = c.clone()    # a resizable CPU buffer for out= ops
            cpu_of[id(c)] = a
            return c
        if isinstance(a, (list, tuple)):
            return type(a)(to_host(x) for x in a)
        if isinstance(a, torch.device) and a.type == "tpu":
            return torch.device("cpu")
        return a
    cargs = [to_host(a) for a in args]
    ckw = {k: to_host(v) for k, v in kwargs.items()}
    res = func(*cargs, **ckw)
    # Write back what the op mutated.
    flat_mut = [cargs[i] for i in info.mut_pos if i < len(cargs)] + [ckw[n] for n in info.mut_kw if n in ckw]
    for c in flat_mut:
        for ci in (c if isinstance(c, (list, tuple)) else [c]):
            t = cpu_of.get(id(ci))
            if t is not None:
                copy_into(t, ci)

    def back(r):
        if isinstance(r, torch.Tensor):
            t = cpu_of.get(id(r))
            if t is not None:
                return t
            if r.layout != torch.strided:
                raise NotImplementedError(
                    f"{info.name} gives a {r.layout} tensor; tpu tensors are dense (strided) "
                    "only. Keep sparse and other layouts on CPU, and move dense tensors to tpu")
            return from_cpu(r, dev[0])
        if isinstance(r, (list, tuple)):
            return type(r)(back(x) for x in r)
        return r
    return back(res)
