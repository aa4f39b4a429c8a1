"""An FX graph of aten ops (a compiled-mode graph from Dynamo and AOTAutograd) as one pure JAX
function, lowered node by node through the one lowering table.

The function is an op of a region (NOTE [graphs are ops] in deferfuse/compiled.py): it takes the
arrays of the graph's device inputs (the base of a view input: its view is read inside) and the
RNG key when the graph draws random numbers, and the region's scalars for its CPU scalar inputs
(an optimizer's step count) and float inputs; its integer inputs (sizes, with dynamic shapes) are
static. It returns the graph's device outputs, the new values of the inputs the graph writes
(``copy_`` into an input: AOTAutograd keeps those in the graph; a view input's new value is its
base's), and the new key. Output dtypes are the graph's own (its nodes' fake values), as a
region's are PyTorch's.
"""
from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from . import collectives as xc
from . import prng
from .dtypes import cast, to_np_dtype, torch_to_numpy
from .errors import LoweringError
from .lowering import LOWERINGS
from .viewchain import apply_chain, n_dynamic, scatter_chain

_COPY = None     # aten.copy_.default, resolved once torch is imported (it always is here)

# What a placeholder is at run time: a device array, a CPU scalar tensor (a region scalar made an
# array of its dtype), a float (a region scalar), an int (static: one program per value), an
# opaque object no op reads (a DeviceMesh AOTAutograd passes through for the backward pass).
ARRAY, SCALAR, FLOAT, INT, OBJ = range(5)


def _val_avals(val, sizes=None):
    """((shape, numpy dtype) or None per output) of a node's fake value(s); ``sizes``: the
    values of the graph's size symbols in this program (NOTE [symbolic shapes])."""
    import torch
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return tuple((_shape(v.shape, sizes), to_np_dtype(v.dtype)) if isinstance(v, torch.Tensor)
                 else None for v in vals)


# NOTE [symbolic shapes]: with dynamic shapes a node's fake value has sizes that are expressions
# of the graph's size symbols (``16*s1``), and a factory's lowering reads its output shape from
# it (``arange(n * 16)``, ``zeros(n, 3)``). Sizes are static in each program: the symbols take
# the values of this program's integer inputs and input shapes (``GraphPlan.sources``), and
# each expression is evaluated with them (a data-dependent size, whose symbol no input gives,
# stays symbolic: as before, only a lowering that reads it fails).
def _shape(shape, sizes) -> tuple:
    if sizes is None or all(type(d) is int for d in shape):
        return tuple(shape)
    return tuple(_size(d, sizes) for d in shape)


def _size(d, sizes) -> int:
    if type(d) is int:
        return d
    expr = d.node.expr
    if expr.is_Integer:
        return int(expr)
    try:
        return int(expr.xreplace(sizes))
    except TypeError:       # a symbol with no value here (a data-dependent size): left as it is
        return d


class GraphPlan:
    """What running one graph needs, worked out once: its inputs' kinds, the inputs it writes (and
    from which node), whether it draws random numbers, and its outputs."""

    def __init__(self, gm, kinds: list):
        import torch
        global _COPY
        _COPY = torch.ops.aten.copy_.default
        self.gm = gm
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.kinds = kinds
        self.scalar_avals = {}      # placeholder index -> (shape, numpy dtype) of a SCALAR input
        for i, (n, k) in enumerate(zip(self.placeholders, kinds)):
            if k == SCALAR:
                v = n.meta["val"]
                self.scalar_avals[i] = (tuple(v.shape), to_np_dtype(v.dtype))
        self.writes = []        # (input index, node whose value it takes)
        self.write_nodes = []   # the copy_ node of each write (``run`` puts the new value there)
        index = {n: i for i, n in enumerate(self.placeholders)}
        self.rng = False
        # NOTE [collectives in programs] (collectives.py): the group names the graph's functional
        # collectives use; the front runs such a graph over the group's processes
        self.groups = set()
        missing = []
        for n in gm.graph.nodes:
            if n.op == "get_attr":
                c = getattr(gm, n.target, None)
                if isinstance(c, torch.Tensor) and _is_fake(c) and c.numel():
                    missing.append(f"a constant tensor {n.target} known only by its shape")
                continue
            if n.op != "call_function":
                continue
            if n.target is _COPY and n.args[0] in index:
                self.writes.append((index[n.args[0]], n.args[1]))
                self.write_nodes.append(n)
                continue
            target = n.target
            if getattr(target, "namespace", None) == "_c10d_functional":
                why = _collective_ok(n)
                if why:
                    missing.append(why)
                elif target._opname != "wait_tensor":
                    self.groups.add(n.args[-1])
                continue
            hop = _RNG_HOPS.get(getattr(target, "_name", None))
            if hop is not None and isinstance(target, torch._ops.HigherOrderOperator):
                target = n.args[hop]            # NOTE [rng state HOPs]: the random op inside
                if hop == 0:
                    self.rng = True
            elif getattr(target, "_name", None) in _MUTATING_HOPS:
                # A mutating custom op (``varlen_attn_out``'s) that AOTAutograd functionalized:
                # lowered nowhere, so the graph runs eagerly, where the op itself runs.
                missing.append(f"{target._name}({n.args[0]})")
                continue
            elif (target in (operator.getitem,) or target in _SIZES or target in _EMPTIES
                    or not isinstance(target, torch._ops.OpOverload)):
                continue
            low = LOWERINGS.get(target)
            if low is None:
                missing.append(str(n.target))
            elif low.rng:
                self.rng = True
        if missing:
            raise LoweringError(", ".join(sorted(set(missing))), "no lowering in a compiled graph")
        out = next(n for n in gm.graph.nodes if n.op == "output")
        self.outputs = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
        # NOTE [symbolic shapes]: (placeholder index, dimension or None for an integer input,
        # size symbol) for each place a symbol's value can be read from at run time
        self.sources = []
        seen = set()
        for i, n in enumerate(self.placeholders):
            v = n.meta.get("val")
            dims = ([(None, v)] if isinstance(v, torch.SymInt) else
                    list(enumerate(v.shape)) if isinstance(v, torch.Tensor) else [])
            for d, size in dims:
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol \
                        and size.node.expr not in seen:
                    seen.add(size.node.expr)
                    self.sources.append((i, d, size.node.expr))

        self.boundaries, self.free_ints = _packed(gm, self.placeholders, kinds)

    def function(self, ints: tuple, chains: dict, dev_outs: tuple, dev_writes: tuple,
                 traced=None):
        """The op function ``fn(arrays, scalars, spmd=None) -> [outputs, written values]``.

        ``arrays``: one per ARRAY input in order (``chains[i]``: input i's view of it);
        ``scalars``: one per SCALAR or FLOAT input in order, the views' dynamic offsets, then
        the generator's (seed, offset) when the graph draws; ``ints``: the INT inputs.
        ``dev_outs``: the indices of the outputs returned; ``dev_writes``: per write returned,
        (index into ``self.writes``, the earlier write of the same storage or -1): its value is
        that storage's new base. ``traced()`` is called each time the function is traced.
        ``spmd``: for a graph with collectives (``groups``), the group's size when traced under its
        mesh axis (NOTE [collectives in programs]), or ``"shape"``: each collective a stand-in of
        its shape and dtype, for ``jax.eval_shape``."""
        plan = self
        n_scalars = sum(1 for k in plan.kinds if k == SCALAR or k == FLOAT)

        def fn(arrays, scalars, spmd=None):
            if traced is not None:
                traced()
            env, bases, dyns = {}, {}, {}
            ai = si = ii = 0
            di = n_scalars      # the views' dynamic offsets follow the graph's scalars
            for k, (n, kind) in enumerate(zip(plan.placeholders, plan.kinds)):
                if kind == ARRAY:
                    a = arrays[ai]
                    ai += 1
                    c = chains.get(k)
                    if c:
                        bases[k] = a
                        nd = n_dynamic(c)
                        dyns[k] = tuple(scalars[di:di + nd])
                        di += nd
                        a = apply_chain(a, c, dyns[k])
                    env[n] = a
                elif kind == SCALAR:
                    shape, dt = plan.scalar_avals[k]
                    env[n] = jnp.reshape(jnp.asarray(scalars[si]).astype(dt), shape)
                    si += 1
                elif kind == FLOAT:
                    env[n] = scalars[si]
                    si += 1
                elif kind == OBJ:
                    env[n] = None
                else:
                    env[n] = ints[ii]
                    ii += 1
            sizes = None
            if plan.sources:
                import sympy
                sizes = {sym: sympy.Integer(env[plan.placeholders[i]] if d is None else
                                            env[plan.placeholders[i]].shape[d])
                         for i, d, sym in plan.sources}
            plan.run(env, prng.key(scalars[-2], scalars[-1]) if plan.rng else None, sizes, spmd)
            res = [_fill(plan.outputs[j], env) for j in dev_outs]
            newbase = []
            for w, prev in dev_writes:
                i = plan.writes[w][0]
                val = env[plan.write_nodes[w]]      # (``run``: cast and broadcast to the input)
                c = chains.get(i)
                if prev >= 0:
                    val = scatter_chain(newbase[prev], c or (), val, dyns.get(i, ()))
                elif c:
                    val = scatter_chain(bases[i], c, val, dyns[i])
                newbase.append(val)
            res.extend(newbase)
            return res
        return fn

    def run(self, env: dict, key, sizes=None, spmd=None) -> None:
        """Lower every node into ``env`` (placeholders filled); random node j draws with
        ``key`` folded with j (NOTE [rng offsets] in prng.py); ``sizes``: the size symbols'
        values (NOTE [symbolic shapes]); ``spmd``: as ``function``'s."""
        if self.groups and spmd is None:
            raise RuntimeError("internal error: a graph with collectives traced outside its "
                               "group's mesh (NOTE [collectives in programs])")
        for j, n in enumerate(self.gm.graph.nodes):
            if n.op == "get_attr":      # a constant the graph holds (a tensor made in the code)
                env[n] = _constant(getattr(self.gm, n.target))
                continue
            if n.op != "call_function":
                continue
            if n.target is _COPY and n.args[0] in env and n.args[0].op == "placeholder":
                # A write into an input (``writes``); the node itself is the input's new value
                # (a graph may return it: an in-place function returning its argument).
                ph = n.args[0].meta["val"]
                env[n] = jnp.broadcast_to(_fill(n.args[1], env), _shape(ph.shape, sizes)).astype(
                    to_np_dtype(ph.dtype))
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
                shape, dt = _val_avals(n.meta["val"], sizes)[0]
                env[n] = jnp.zeros(shape, dt)
                continue
            hop = _RNG_HOPS.get(getattr(n.target, "_name", None))
            if hop is not None:
                env[n] = _rng_hop(n, hop, args, kwargs, key, j, sizes)
                continue
            if not hasattr(n.target, "_schema"):       # a Python function on sizes
                env[n] = n.target(*args, **kwargs)
                continue
            if getattr(n.target, "namespace", None) == "_c10d_functional":
                if spmd == "shape":
                    res = [jnp.zeros(*a) for a in _val_avals(n.meta.get("val"), sizes)]
                    env[n] = res if isinstance(n.meta.get("val"), (tuple, list)) else res[0]
                else:
                    env[n] = xc.in_program(n.target._opname, args, spmd)
                continue
            low = LOWERINGS[n.target]
            avals = _val_avals(n.meta.get("val"), sizes)
            if low.rng:
                kwargs["key"] = jax.random.fold_in(key, j)
            if low.meta:
                kwargs["_avals"] = avals
            res = low.fn(*args, **kwargs)
            if isinstance(res, (tuple, list)):
                res = tuple(r if r is None or a is None or r.dtype == a[1] else cast(r, a[1])
                            for r, a in zip(res, avals))
            elif res is not None and avals[0] is not None and (
                    not hasattr(res, "dtype") or res.dtype != avals[0][1]):
                # (a Python number: ``_to_copy`` of a literal, as vmapped flex attention traces)
                res = cast(jnp.asarray(res), avals[0][1])
            env[n] = res


# NOTE [packed boundaries] (deferfuse/packed.py): a packed batch's sequence boundaries
# (``cum_seq_q``/``cum_seq_k`` of the flash attention ops: varlen attention) are one longer than
# its number of sequences, which changes from batch to batch, and its longest sequence
# (``max_q``/``max_k``) changes too: with dynamic shapes, a graph input and an integer input that
# made a program each. The boundaries can be padded with copies of their last entry (empty
# sequences: the lowering gives every token the same sequence, and so the same result), and no
# lowering reads the longest length. ``_packed`` finds, once per graph: the inputs that are such
# boundaries and nothing else (read only by those arguments, or returned as they are, and their
# length in no other value's shape), which the caller may pad to a bucket; and the integer inputs
# no lowering reads (only those arguments, returned as they are, or unused, and in no value's
# shape), which need not key a program.
_FLASH_OPS = frozenset(("_flash_attention_forward", "_flash_attention_backward"))


def _packed(gm, placeholders, kinds) -> tuple:
    """(indices of the boundary inputs that may be padded, indices of the integer inputs no
    lowering reads): NOTE [packed boundaries]."""
    import torch
    index = {n: i for i, n in enumerate(placeholders)}
    uses: dict = {}         # placeholder index -> set of argument names ('' for any other use)
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        names = None
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
                and n.target.namespace == "aten" and n.target._opname in _FLASH_OPS:
            names = [a.name for a in n.target._schema.arguments]
        pairs = list(zip(names or [""] * len(n.args), n.args)) + [
            (k if names else "", v) for k, v in n.kwargs.items()]
        for name, a in pairs:
            for x in (a if isinstance(a, (tuple, list)) else (a,)):
                i = index.get(x) if isinstance(x, torch.fx.Node) else None
                if i is not None:
                    uses.setdefault(i, set()).add(name)
    cands, free = {}, {}
    for i, n in enumerate(placeholders):
        v = n.meta.get("val")
        u = uses.get(i, set())
        if kinds[i] == ARRAY and isinstance(v, torch.Tensor) and v.dim() == 1 \
                and not v.dtype.is_floating_point and v.dtype != torch.bool \
                and isinstance(v.shape[0], torch.SymInt) and v.shape[0].node.expr.is_Symbol \
                and u and u <= {"cum_seq_q", "cum_seq_k"}:
            cands[i] = v.shape[0].node.expr.free_symbols
        elif kinds[i] == INT and isinstance(v, torch.SymInt) and u <= {"max_q", "max_k"}:
            free[i] = v.node.expr.free_symbols
    if not cands and not free:
        return frozenset(), frozenset()
    # The size symbols any other value's shape (or a read integer) is made of.
    other = set()
    for n in gm.graph.nodes:
        if n.op == "output" or (n.op == "placeholder" and (index[n] in cands or index[n] in free)):
            continue
        vals = n.meta.get("val")
        for v in (vals if isinstance(vals, (tuple, list)) else (vals,)):
            if isinstance(v, torch.Tensor):
                for d in tuple(v.shape) + tuple(v.stride()):
                    if isinstance(d, torch.SymInt):
                        other |= d.node.expr.free_symbols
            elif isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                other |= v.node.expr.free_symbols
    return (frozenset(i for i, syms in cands.items() if not syms & other),
            frozenset(i for i, syms in free.items() if not syms & other))


# NOTE [rng state HOPs]: AOTAutograd's partitioner, when the backward pass recomputes a random op
# (activation checkpointing in a compiled graph), rewrites it in the forward graph as
# ``run_and_save_rng_state(op, *args)`` -> (state, out) and in the backward graph as
# ``run_with_rng_state(state, op, *args)`` -> out, which must draw the same numbers. PyTorch's
# kernels for them save and restore a device generator's state; inside one program the state is
# the draw's key: the forward node draws with its key (the graph's key folded with its index, as
# any random node) and returns that key's 16 bytes at the front of a state tensor of the shape
# and dtype PyTorch gave it (a CPU generator's state); the backward node draws with the key it
# reads there. The value of the argument: 0, the forward HOP, whose op is its first argument; 1,
# the backward HOP, whose op follows the state.
_RNG_HOPS = {"run_and_save_rng_state": 0, "run_with_rng_state": 1}
_MUTATING_HOPS = frozenset(("auto_functionalized", "auto_functionalized_v2"))


def _rng_hop(n, hop: int, args, kwargs, key, j: int, sizes=None):
    import torch
    op, rest = args[hop], args[hop + 1:]
    low = LOWERINGS[op]
    out_node = n if hop == 1 else next((u for u in n.users if u.args[1] == 1), None)
    avals = _val_avals(out_node.meta.get("val"), sizes) if out_node is not None else (None,)
    if hop == 0:
        k = jax.random.fold_in(key, j)
    else:
        state = args[0]
        data = lax.bitcast_convert_type(state.reshape(-1)[:16].reshape(4, 4), np.uint32)
        k = jax.random.wrap_key_data(data, impl=prng.IMPL)
    kw = dict(kwargs)
    kw["key"] = k
    if low.meta:
        kw["_avals"] = avals
    res = low.fn(*rest, **kw)
    if isinstance(res, (tuple, list)):
        avals = tuple(avals) + (None,) * (len(res) - len(avals))
        res = tuple(r if r is None or a is None or r.dtype == a[1] else cast(r, a[1])
                    for r, a in zip(res, avals))
    elif avals[0] is not None and res.dtype != avals[0][1]:
        res = cast(res, avals[0][1])
    if hop == 1:
        return res
    st_node = next((u for u in n.users if u.args[1] == 0), None)
    st_val = st_node.meta["val"] if st_node is not None else torch.empty(16, dtype=torch.uint8)
    shape, dt = _shape(st_val.shape, sizes), to_np_dtype(st_val.dtype)
    raw = lax.bitcast_convert_type(jax.random.key_data(k), np.uint8).reshape(-1)
    flat = jnp.zeros(int(np.prod(shape)) * np.dtype(dt).itemsize, np.uint8).at[:16].set(raw)
    return (lax.bitcast_convert_type(flat.reshape(-1, np.dtype(dt).itemsize), dt).reshape(shape)
            if np.dtype(dt).itemsize > 1 else flat.astype(dt).reshape(shape)), res


def _collective_ok(n) -> str:
    """Why the functional collective node ``n`` cannot be lowered into the graph's program, or
    '' (NOTE [collectives in programs])."""
    name = n.target._opname
    if name not in xc.IN_PROGRAM:
        return str(n.target)
    if name == "all_to_all_single":
        out, inp = n.args[1], n.args[2]
        if (out or inp) and not (list(out) == list(inp) and len(set(out)) == 1
                                 and all(type(s) is int for s in out)):
            return f"{n.target} with uneven splits"
    return ""


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


def _constant(t):
    """A graph's constant tensor as an array of the program (read once per trace)."""
    import torch
    if not isinstance(t, torch.Tensor):
        return t
    if t.numel() == 0 or _is_fake(t):      # (a fake one is empty: GraphPlan checks)
        return jnp.zeros(tuple(t.shape), to_np_dtype(t.dtype))
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return jnp.asarray(torch_to_numpy(t))       # NOTE [no numpy view] (dtypes.py)


def _sizes() -> dict:
    import torch
    aten = torch.ops.aten
    return {aten.sym_size.int: lambda x, d: x.shape[d],
            aten.sym_stride.int: lambda x, d: int(np.prod(x.shape[d + 1:])),
            aten.sym_numel.default: lambda x: int(np.prod(x.shape)),
            aten.sym_storage_offset.default: lambda x: 0}


SIZES = _SIZES = _sizes()


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


def fill(x, env):
    """``x`` (a node's argument) with the nodes in ``env`` replaced by their values."""
    return _fill(x, env)
