"""An FX graph of aten ops (a compiled-mode graph from Dynamo and AOTAutograd) as one pure JAX
function, lowered node by node through the one lowering table.

The function takes the graph's tensor inputs as arrays (split into donated and kept, as a region's),
its integer inputs as static values, and the RNG key when the graph draws random numbers; it
returns the graph's outputs, the new values of the inputs the graph writes (``copy_`` into an
input: AOTAutograd's inference graphs keep those in the graph), the new key and the index-check
flags. Output dtypes are the graph's own (its nodes' fake values), as a region's are PyTorch's.
"""
from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from .dtypes import to_np_dtype
from .errors import LoweringError
from .lowering import LOWERINGS, take_flags

_COPY = None     # aten.copy_.default, resolved once torch is imported (it always is here)


def _val_avals(val):
    """((shape, numpy dtype) or None per output) of a node's fake value(s)."""
    import torch
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return tuple((tuple(v.shape), to_np_dtype(v.dtype)) if isinstance(v, torch.Tensor) else None
                 for v in vals)


class GraphPlan:
    """What running one graph needs, worked out once: its inputs (tensor or int), the tensor
    inputs it writes (and from which node), whether it draws random numbers, and its lowered
    function."""

    def __init__(self, gm):
        import torch
        global _COPY
        _COPY = torch.ops.aten.copy_.default
        self.gm = gm
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.is_tensor = [isinstance(n.meta.get("val"), torch.Tensor) for n in self.placeholders]
        self.writes = []        # (input index, node whose value it takes)
        index = {n: i for i, n in enumerate(self.placeholders)}
        self.rng = False
        missing = []
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            if n.target is _COPY and n.args[0] in index:
                self.writes.append((index[n.args[0]], n.args[1]))
                continue
            if (n.target in (operator.getitem,) or n.target in _SIZES or n.target in _EMPTIES
                    or not isinstance(n.target, torch._ops.OpOverload)):
                continue
            low = LOWERINGS.get(n.target)
            if low is None:
                missing.append(str(n.target))
            elif low.rng:
                self.rng = True
        if missing:
            raise LoweringError(", ".join(sorted(set(missing))), "no lowering in a compiled graph")
        out = next(n for n in gm.graph.nodes if n.op == "output")
        self.outputs = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]

    def function(self, donate: tuple):
        """The pure function (donated arrays, kept arrays, static ints, key) -> (outputs,
        written values, key, flags); ``donate[i]`` for each tensor input."""
        plan = self
        order, nd, nk = [], 0, 0
        for d in donate:
            order.append((0, nd) if d else (1, nk))
            nd, nk = nd + d, nk + (not d)

        def fn(don, keep, ints, key):
            take_flags()
            env = {}
            ti = ii = 0
            for n, is_t in zip(plan.placeholders, plan.is_tensor):
                if is_t:
                    src, i = order[ti]
                    env[n] = (don if src == 0 else keep)[i]
                    ti += 1
                else:
                    env[n] = ints[ii]
                    ii += 1
            for n in plan.gm.graph.nodes:
                if n.op != "call_function" or (n.target is _COPY and n.args[0] in env
                                               and n.args[0].op == "placeholder"):
                    continue
                args = _fill(n.args, env)
                kwargs = _fill(n.kwargs, env)
                if n.target is operator.getitem:
                    env[n] = args[0][args[1]]
                    continue
                size = _SIZES.get(n.target)
                if size is not None:            # a dynamic dimension: static in each program
                    env[n] = size(*args)
                    continue
                if n.target in _EMPTIES:        # uninitialised memory: zeros, as eager mode reads it
                    shape, dt = _val_avals(n.meta["val"])[0]
                    env[n] = jnp.zeros(shape, dt)
                    continue
                if not hasattr(n.target, "_schema"):       # a Python function on sizes
                    env[n] = n.target(*args, **kwargs)
                    continue
                low = LOWERINGS[n.target]
                avals = _val_avals(n.meta.get("val"))
                if low.rng:
                    key, sub = jax.random.split(key)
                    kwargs["key"] = sub
                if low.meta:
                    kwargs["_avals"] = avals
                res = low.fn(*args, **kwargs)
                if isinstance(res, (tuple, list)):
                    res = tuple(r if r is None or a is None or r.dtype == a[1] else r.astype(a[1])
                                for r, a in zip(res, avals))
                elif res is not None and avals[0] is not None and res.dtype != avals[0][1]:
                    res = res.astype(avals[0][1])
                env[n] = res
            outs = [_fill(o, env) for o in plan.outputs]
            written = []
            for i, src in plan.writes:
                ph = plan.placeholders[i].meta["val"]
                written.append(jnp.broadcast_to(_fill(src, env), tuple(ph.shape)).astype(
                    to_np_dtype(ph.dtype)))
            flags = take_flags()
            msgs[:] = [(e, m) for _, e, m in flags]
            return outs, written, key, [f for f, _, _ in flags]
        msgs: list = []     # (exception type, message) per flag, filled when it traces
        return fn, msgs


def _sizes() -> dict:
    import torch
    aten = torch.ops.aten
    return {aten.sym_size.int: lambda x, d: x.shape[d],
            aten.sym_stride.int: lambda x, d: int(np.prod(x.shape[d + 1:])),
            aten.sym_numel.default: lambda x: int(np.prod(x.shape)),
            aten.sym_storage_offset.default: lambda x: 0}


_SIZES = _sizes()


def _empties() -> set:
    import torch
    aten = torch.ops.aten
    names = ("empty.memory_format", "empty_strided.default", "empty_permuted.default",
             "new_empty.default", "new_empty_strided.default", "empty_like.default")
    out = set()
    for name in names:
        packet, _, ov = name.partition(".")
        o = getattr(getattr(aten, packet, None), ov, None)
        if o is not None:
            out.add(o)
    return out


_EMPTIES = _empties()


def _fill(x, env):
    if isinstance(x, (tuple, list)):
        return type(x)(_fill(y, env) for y in x)
    if isinstance(x, dict):
        return {k: _fill(v, env) for k, v in x.items()}
    if hasattr(x, "op") and x in env:
        return env[x]
    return x


def jitted(plan: GraphPlan, donate: tuple, device_sharding):
    """The graph's function, jitted for placement on one device (JAX compiles it per input shapes
    and integer inputs, which are static): (jitted function, flag messages)."""
    fn, msgs = plan.function(donate)
    return jax.jit(fn, donate_argnums=(0,) if any(donate) else (), static_argnums=(2,),
                   out_shardings=device_sharding), msgs
