"""Compiled mode: ``torch.compile`` on ``tpu`` tensors, through the same lowering table.

``torch.compile(model, backend="tpu")`` (or ``"deferfuse"``; and plain ``torch.compile(model)``
when the model's tensors are on ``tpu``: NOTE [default backend]) captures graphs with Dynamo;
AOTAutograd splits them into forward and backward graphs of aten ops (PyTorch's decompositions for
the ops with no lowering of their own), over the plain ``tpu`` tensors as Dynamo fakeifies them
(NOTE [compiled plain tensors]). Each graph becomes one ``jax.jit`` program (runtime/graph.py). Inputs
a graph writes (an optimizer step's parameters and states: AOTAutograd keeps those ``copy_``\\s in
inference graphs) are donated where nothing else holds them, and take the new values. Random ops
draw from the device's generator, so ``torch.manual_seed`` decides them. Code Dynamo cannot
capture (a graph break) runs in the eager mode in force, defer by default: compiled graphs and
deferred regions mix in one step.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import operator
import sys

import jax
import numpy as np
import torch

from . import packed
from .config import config
from .dispatch import Entry, _contig, _nbytes
from .engine import engine
from .errors import LoweringError
from .opinfo import _DECOMP
from .runtime.lowering import LOWERINGS, take_flags
from .runtime import stats, transfer
from .runtime.bucket_fit import bucket_of
from .runtime.dtypes import x64
from .runtime.graph import ARRAY, FLOAT, INT, OBJ, SCALAR, SIZES, GraphPlan, fill
from .scheduler.policy import GRAPH_STEP_OPS, Sync
from .tensor import Storage

S = stats.S
_getitem = operator.getitem
_local = engine.local

# What becomes of each output of a graph: a device output of its op (DEV), an input's value
# returned as it is (PASS: AOTAutograd saves inputs for the backward pass), a value the host
# computes (HOST: a CPU tensor or a size from CPU inputs and shapes alone), a device value read
# back (READ: a CPU tensor or a number computed from device values: a sync), None, a constant.
DEV, PASS, HOST, READ, NONE, CONST = range(6)


def _kind(val) -> int:
    """What a graph input is at run time (runtime/graph.py)."""
    if isinstance(val, torch.Tensor):
        if (val.device.type != "tpu" and val.dim() == 0 and not val.dtype.is_complex
                and val.dtype not in (torch.bfloat16, torch.float16)):
            return SCALAR       # an optimizer's step count: a region scalar, not a transfer
        return ARRAY
    if isinstance(val, (float, torch.SymFloat)):
        return FLOAT
    if val is None or isinstance(val, (int, torch.SymInt, torch.SymBool)):
        return INT
    return OBJ      # a DeviceMesh passed through for the backward pass: no op reads it


def _on_device(val) -> bool:
    if isinstance(val, (tuple, list)):
        return any(_on_device(v) for v in val)
    return isinstance(val, torch.Tensor) and val.device.type == "tpu"


class _Host:
    """NOTE [host slice]: the part of a graph the host computes without waiting for the device:
    CPU tensors and sizes that depend only on CPU inputs and input shapes (an optimizer's step
    count ``step + 1``, written back into its CPU tensor; a size saved for the backward pass).
    Reading those back from the device program made every compiled optimizer step wait for it."""

    def __init__(self, gm, roots):
        self.memo: dict = {}
        # Only what the host can compute: a root it cannot (a value read back from the device)
        # must not pull the device's nodes into the host's order.
        need, stack = set(), [r for r in roots if self._ok(r)]
        while stack:
            n = stack.pop()
            if isinstance(n, torch.fx.Node) and n not in need:
                need.add(n)
                stack.extend(n.all_input_nodes)
        self.order = [n for n in gm.graph.nodes if n in need and n.op == "call_function"]
        # (node, source node, index) for an item of a node's list (the host's ``_foreach_add``
        # makes one per step count): no walk of its arguments; (node, None, spec) for a node
        # whose arguments are nodes, lists of nodes and constants (``_flat``); else (node, None,
        # None)
        self.steps = [(n, n.args[0], n.args[1]) if n.target is _getitem and not n.kwargs and
                      isinstance(n.args[0], torch.fx.Node) and type(n.args[1]) is int else
                      (n, None, _flat(n)) for n in self.order]

    def _ok(self, n) -> bool:
        if not isinstance(n, torch.fx.Node):
            return True
        r = self.memo.get(n)
        if r is None:
            self.memo[n] = False
            if n.op == "placeholder":
                r = True
            elif n.op != "call_function" or _on_device(n.meta.get("val")):
                r = False
            elif n.target in SIZES:
                r = all(self._ok(a) for a in n.all_input_nodes)
            else:
                r = all(self._ok(a) and not _on_device(a.meta.get("val"))
                        for a in n.all_input_nodes)
            self.memo[n] = r
        return r

    def run(self, phs, args) -> dict:
        env = dict(zip(phs, args))
        with torch.no_grad():
            for n, src, k in self.steps:
                if src is not None:
                    env[n] = env[src][k]
                    continue
                if k is not None:
                    env[n] = n.target(*[env[x] if w == 0 else [env[y] for y in x] if w == 1 else x
                                        for w, x in k])
                    continue
                a = fill(n.args, env)
                size = SIZES.get(n.target)
                env[n] = size(*a) if size is not None else n.target(*a, **fill(n.kwargs, env))
        return env


def _flat(n):
    """How ``_Host.run`` fills node ``n``'s arguments without ``fill``'s walk: (0, node), (1,
    nodes of a list) or (2, a constant) per argument, when it has no keyword arguments and no
    other container (the host's ``_foreach_add`` over an optimizer's step counts); else None."""
    if n.kwargs or n.target in SIZES:
        return None
    spec = []
    for a in n.args:
        if isinstance(a, torch.fx.Node):
            spec.append((0, a))
        elif isinstance(a, list) and a and all(isinstance(x, torch.fx.Node) for x in a):
            spec.append((1, tuple(a)))
        elif isinstance(a, (bool, int, float, str, type(None), torch.dtype, torch.device)):
            spec.append((2, a))
        else:
            return None
    return tuple(spec)


class CompiledGraph:
    """One graph (forward, backward or inference) as an op of the pending trace; AOTAutograd
    calls it with a list (a boxed call).

    NOTE [graphs are ops]: a call records the graph as one node of the thread's trace, as an eager
    op is recorded in defer mode, and returns tensors whose values are pending: the forward graph,
    the backward graph and a compiled optimizer step that run back to back become one region, one
    program (two when a ``.item()`` reads the loss: NOTE [needed first] in runtime/flush.py), with
    the eager ops around them (a graph break, the loss's gradient seed), and the parameters and
    optimizer states the step overwrites are donated by the region's memory plan. In strict and
    debug mode the trace is run at once. The node's key is the graph itself, its integer inputs
    (static) and its inputs' views; its CPU scalar inputs (an optimizer's step count) are region
    scalars, and what the host can compute alone it computes (NOTE [host slice])."""
    _boxed_call = True

    def __init__(self, gm, example_inputs, kind: str):
        self._boxed_call = True     # in the instance: Dynamo's wrapper copies only its __dict__
        self.kind = kind
        self.name = f"a compiled {kind} graph"      # (index-check and error messages name it)
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.plan = plan = GraphPlan(gm, [_kind(n.meta.get("val")) for n in phs])
        self.kinds = plan.kinds
        # NOTE [collectives in programs]: a graph with collectives runs over their group
        self.spmd = None
        if plan.groups:
            if not config.compiled_collectives:
                raise LoweringError("functional collectives",
                                    "off in compiled graphs (DEFERFUSE_COMPILED_COLLECTIVES=0)")
            from .distributed.graphs import SpmdGraph
            self.spmd = SpmdGraph(gm, plan.groups, plan.kinds)
        index = {n: i for i, n in enumerate(phs)}
        self.outs = []          # (what, node or input index or value, fake value) per output
        roots = []
        for o in plan.outputs:
            if o is None:
                self.outs.append((NONE, None, None))
                continue
            if not isinstance(o, torch.fx.Node):
                self.outs.append((CONST, o, None))
                continue
            val = o.meta.get("val")
            if _on_device(val):
                i = index.get(o)
                self.outs.append((PASS, i, val) if i is not None and plan.kinds[i] == ARRAY
                                 else (DEV, o, val))
            else:
                self.outs.append((HOST, o, val))
                roots.append(o)
        # Writes: into a tpu input (its new value), into a CPU input (from the host, or read).
        self.tpu_writes, self.cpu_writes = [], []
        for w, (i, src) in enumerate(plan.writes):
            if _on_device(phs[i].meta.get("val")):
                self.tpu_writes.append(w)
            else:
                self.cpu_writes.append(w)
                roots.append(src)
        host = _Host(gm, roots)
        for j, (what, o, val) in enumerate(self.outs):
            if what == HOST and not host._ok(o):
                self.outs[j] = (READ, o, val)
        self.host_writes = [w for w in self.cpu_writes if host._ok(plan.writes[w][1])]
        # the inputs the tpu writes go into, in write_acts' order (``_entry``: first, their
        # values a run of the device outputs)
        self.written = tuple(plan.writes[w][0] for w in self.tpu_writes)
        self.read_writes = [w for w in self.cpu_writes if w not in self.host_writes]
        # (an output that is a CPU input itself, as a packed sequence's lengths saved for the
        # backward pass, needs the inputs' values even when the host computes nothing)
        self.host = host if host.order or self.host_writes or any(
            o[0] == HOST for o in self.outs) else None
        self.phs = phs
        # NOTE [packed boundaries] (packed.py): inputs padded to a bucket, integers in no key.
        # An integer left out may be the only one that gave an input's dynamic size: the sizes
        # of the inputs with dynamic sizes key the entry themselves.
        self.bounds = plan.boundaries
        self.free_ints = plan.free_ints
        self.sized = frozenset(i for i, n in enumerate(phs) if plan.kinds[i] == ARRAY and any(
            isinstance(d, torch.SymInt) for d in getattr(n.meta.get("val"), "shape", ())))
        self.entries: dict = {}     # (ints, views, write aliases, sizes) -> Entry; see _entry
        self.evictions = 0
        self._shaping = False
        self.calls = 0
        S["compiled_graphs"] += 1

    def _described(self, args) -> str:
        """The inputs as this call's program sees them, for the ranks of a graph with collectives
        to compare (``SpmdGraph.agree``): each tensor's dtype and shape, with boundaries at the
        length ``__call__`` pads them to (ranks packing other numbers of sequences share a
        program: NOTE [packed boundaries]), and the integers that key the program."""
        parts = []
        pad = config.buckets
        for i, (a, kind) in enumerate(zip(args, self.kinds)):
            if isinstance(a, torch.Tensor):
                shape = list(a.shape)
                if pad and i in self.bounds and shape and shape[0] and (
                        "_s" not in a.__dict__ or (i in self.sized and not a.__dict__["_chain"])):
                    shape[0] = bucket_of(shape[0])
                parts.append(f"{str(a.dtype).replace('torch.', '')}{shape}")
            elif kind == INT and i not in self.free_ints:
                parts.append(repr(a))
        return " ".join(parts)

    def _traced(self):
        if not self._shaping:
            S["graph_compiles"] += 1    # traced into a region's program (or op by op)

    def __call__(self, *args):
        # Boxed (one list of arguments) or not (the backward graph, wrapped by Dynamo).
        if len(args) == 1 and type(args[0]) is list:
            args = args[0]
        if self.spmd is not None and not self.spmd.agree(self._described(args)):
            return _interpret(self.plan.gm, args)       # uneven shards (distributed/graphs.py)
        return self._run(args)

    def _run(self, args) -> list:
        """A call of inputs ``args`` as ``_read`` takes them (the ranks agreed first, where the
        graph has collectives)."""
        ts = _local.ts
        with engine.lock:
            return self._call(args, ts, *self._read(args, ts.device))

    def _read(self, args, device: int) -> tuple:
        """What a call reads of its inputs: (the program's input values, its scalars, the
        integers, views and dynamic inputs' sizes that key the entry, each tpu input's Storage by
        input index (None for the others), the tpu inputs themselves (a graph with collectives
        only), the device). ``args``: ``TpuTensor``s or records with their ``_s``, ``_chain``
        and ``_dyn`` (``PlainGraph._read_plain`` reads plain tensors straight)."""
        ins, scalars, ints, views, offsets = [], [], [], [], []
        tensors = [] if self.spmd is not None else None    # (for the group's steps)
        stores = [None] * len(args)
        dev = None
        bounds, sized, sizes, pad = self.bounds, self.sized, [], config.buckets
        for i, (a, kind) in enumerate(zip(args, self.kinds)):
            if kind == ARRAY:
                d = a.__dict__
                st = d.get("_s")
                if st is None:      # a CPU tensor
                    self._host_input(a, i, dev, ins, sizes)
                    continue
                if dev is None:
                    dev = st.device
                stores[i] = st
                v = st.val
                if i in sized:
                    if pad and i in bounds and not d["_chain"]:
                        v = packed.padded_value(v, dev) or v
                    sizes.append(v.shape)
                ins.append(v)
                if tensors is not None:
                    tensors.append(a)
                c = d["_chain"]
                if c:
                    views.append((i, c, v.shape, v.dtype))
                    dyn = getattr(a, "_dyn", ())
                    if dyn:     # NOTE [dynamic offsets]: a window's start is an input
                        offsets.extend(dyn)
            else:
                self._number_input(a, i, kind, scalars, ints)
        scalars.extend(offsets)     # after the graph's own scalars (GraphPlan.function)
        return ins, scalars, ints, views, sizes, stores, tensors, device if dev is None else dev

    def _number_input(self, a, i: int, kind, scalars: list, ints: list) -> None:
        """A number argument ``a`` (argument ``i``): a 0-d tensor's or a float's value is a runtime
        scalar, an integer part of the program's key."""
        if kind == SCALAR:
            scalars.append(a.item())
        elif kind == FLOAT:
            scalars.append(float(a))
        elif kind == INT:
            # (an integer no lowering reads, such as varlen's longest length: no key)
            ints.append(0 if i in self.free_ints else int(a))

    def _host_input(self, a, i: int, dev, ins: list, sizes: list) -> None:
        """A CPU tensor input ``a`` (argument ``i``): its value on the device, padded where it holds
        packed boundaries (NOTE [packed boundaries] in packed.py), appended to ``ins``."""
        v = transfer.host_value(a, dev or 0)
        if config.buckets and i in self.bounds:
            v = packed.padded_value(v, dev or 0) or v
        if i in self.sized:
            sizes.append(v.shape)
        ins.append(v)

    def _call(self, args, ts, ins, scalars, ints, views, sizes, stores, tensors, dev):
        """The rest of a call, under the engine's lock: the entry, the node recorded (or the
        group's call), the outputs made and the writes bound."""
        trace = ts.trace
        aliases = ()
        written = [stores[i] for i in self.written]
        if len(written) > 1 and len(set(written)) < len(written):
            # Two written inputs on one storage (a tensor and its view): the second write
            # goes into the base the first made.
            seen, al = {}, []
            for st in written:
                al.append(seen.get(id(st), -1))
                seen[id(st)] = len(al) - 1
            aliases = tuple(al)
        key = (tuple(ints), tuple(views), aliases, tuple(sizes))
        if self.plan.rng:
            # The graph's draws fold their node's index into this (seed, offset) key
            # (GraphPlan.run), so one step of the offset keeps calls apart.
            scalars.extend(engine.rng.draw(None, dev, 4))
        entry = self.entries.get(key)
        if entry is None:
            entry = self._entry(key, ins, scalars, dev)
        env = self.host.run(self.phs, args) if self.host is not None else None
        if self.spmd is None:
            outs = trace.record(entry, ins, scalars, dev)
        else:       # a sync point: the values are ready when the call returns
            # ins alone holds the inputs' values (NOTE [donation in graphs over a group])
            outs = self.spmd.call(self, entry, ins, scalars, dev, tensors)
        del ins, tensors
        self.calls += 1
        S["compiled_calls"] += 1
        out_acts, write_acts = entry.out
        res = []
        reads = []
        for act in out_acts:
            what = act[0]
            if what == DEV:
                res.append(output_inner(outs[act[1]], act[2], dev))
            elif what == PASS:
                i = act[1]
                res.append(output_inner(stores[i].val, args[i].dtype, dev))
            elif what == HOST:
                res.append(env[act[1]])
            elif what == READ:
                reads.append((len(res), _held(outs[act[1]], dev), act[2]))
                res.append(None)
            else:
                res.append(act[1])
        m = len(written)
        if m:
            x = write_acts[0][2]
            trace.write_all(written, outs[x:x + m])
        dsts, srcs = [], []
        for what, i, x in write_acts[m:] if m else write_acts:
            if what == HOST:
                dsts.append(args[i])
                srcs.append(env[x])
            else:
                reads.append((None, _held(outs[x], dev), args[i]))
        if dsts:
            # (an optimizer's step counts, one per parameter: one call for them all)
            if len(dsts) == 1:
                dsts[0].copy_(srcs[0])
            else:
                torch._foreach_copy_(dsts, srcs)
        del outs
        if ts.mode == "debug":
            engine.sync(Sync.COMPILED_GRAPH)
        elif ts.mode != "defer":
            engine.flush(trace, Sync.COMPILED_GRAPH, later=True)
        for j, st, val in reads:
            # A CPU tensor or a number computed on the device: a sync, as .item() is.
            arr = engine.ready(st.val, dev, Sync.COMPILED_GRAPH)
            if j is None:
                with torch.no_grad():
                    val.copy_(transfer.to_torch(arr, val.dtype).reshape(val.shape))
            elif isinstance(val, torch.Tensor):
                res[j] = transfer.to_torch(arr, val.dtype).reshape(val.shape)
            else:
                x = np.asarray(arr).item()
                res[j] = (bool(x) if isinstance(val, (bool, torch.SymBool)) else
                          float(x) if isinstance(val, (float, torch.SymFloat)) else int(x))
        return res

    def _shapes(self, fn, ins, scalars):
        """``fn``'s output shapes (``jax.eval_shape``), and {output index: value} of the outputs
        that are Python numbers while it is traced (sizes: static in the program)."""
        static = {}

        def shaping(arrays, scalars_):
            res = fn(arrays, scalars_, "shape")
            for k, r in enumerate(res):
                if isinstance(r, (bool, int, float)):
                    static[k] = r
            return res
        self._shaping = True
        try:
            with x64(True):
                shapes = jax.eval_shape(shaping, [jax.ShapeDtypeStruct(v.shape, v.dtype)
                                                  for v in ins], list(scalars))
        finally:
            self._shaping = False
            take_flags()        # the index checks eval_shape traced: not a region's
        return shapes, static

    def _entry(self, key, ins, scalars, dev) -> Entry:
        """The op entry of this graph for these integer inputs, views and write aliases: its
        function, its outputs' shapes (traced once with ``jax.eval_shape``) and its key."""
        ints, views, aliases, _ = key      # (the dynamic inputs' sizes: ``ins``' shapes)
        chains = {i: c for i, c, _, _ in views}
        plan = self.plan
        dev_outs, out_acts = [], []
        for j, (what, o, val) in enumerate(self.outs):
            if what == PASS and o in chains:
                what = DEV
            if what == DEV:
                out_acts.append((DEV, len(dev_outs), val.dtype))
                dev_outs.append(j)
            elif what == READ:
                out_acts.append((READ, len(dev_outs), val))
                dev_outs.append(j)
            elif what in (PASS, HOST):
                out_acts.append((what, o))
            else:
                out_acts.append((what, o))
        dev_writes, write_acts = [], []
        n = len(dev_outs)
        for k, w in enumerate(self.tpu_writes):
            dev_writes.append((w, aliases[k] if aliases else -1))
            write_acts.append((DEV, plan.writes[w][0], n + k))
        for w in self.read_writes:
            dev_writes.append((w, -1))
            write_acts.append((READ, plan.writes[w][0], n + len(dev_writes) - 1))
        for w in self.host_writes:
            write_acts.append((HOST, plan.writes[w][0], plan.writes[w][1]))
        fn = plan.function(ints, chains, tuple(dev_outs), tuple(dev_writes), self._traced)
        shapes, static = self._shapes(fn, ins, scalars)
        static = {k: v for k, v in static.items() if k < n}
        if static:
            # NOTE [static sizes]: a size of a device value (a KV cache's length, with dynamic
            # shapes) is static in the program: a constant of this entry, never read back.
            keep = [k for k in range(len(dev_outs)) if k not in static]
            at = {k: i for i, k in enumerate(keep)}
            out_acts = [(CONST, static[a[1]]) if a[0] == READ and a[1] in static else
                        (a[0], at[a[1]], a[2]) if a[0] in (DEV, READ) else a for a in out_acts]
            n_keep = len(keep)
            write_acts = [(w, i, x - n + n_keep) if w in (DEV, READ) else (w, i, x)
                          for w, i, x in write_acts]
            dev_outs = [dev_outs[k] for k in keep]
            fn = plan.function(ints, chains, tuple(dev_outs), tuple(dev_writes), self._traced)
            shapes, _ = self._shapes(fn, ins, scalars)
        e = Entry()
        e.fn = fn
        e.jit = e.msgs = e.fast = e.made = None
        e.out = (tuple(out_acts), tuple(write_acts))
        e.dev = dev
        e.name = self.name
        e.key = (self, key, (), (), dev)
        e.khash = hash((id(self), e.key[1], repr(e.key[1]), dev))
        e.ohash = hash((id(self), "graph"))     # NOTE [shapeless loop bodies] (record.py)
        e.dyn = ()              # (its views' offsets are among its scalars: GraphPlan.function)
        e.skey = None
        e.res_avals = tuple((tuple(s.shape), np.dtype(s.dtype), _nbytes(tuple(s.shape),
                                                                        np.dtype(s.dtype)))
                            for s in shapes)
        if len(self.entries) >= 256:
            self.evictions += len(self.entries)     # bounded: a graph with churning sizes
            self.entries.clear()
        self.entries[key] = e
        return e


def _held(v, device: int, dtype=None) -> Storage:
    """NOTE [read-back outputs]: a graph output the host reads back (a CPU tensor or a number
    computed from device values: READ) in a Storage of its own that the pending trace reads back,
    until it is read. A flush makes outputs only of the values live storages hold: a bare value
    was left out of the program (strict mode flushes before the read; defer mode's read of it
    alone ran without it), and the read gave zeros, so a compiled AdamW step that made a
    parameter's state beside another's left its new CPU step count at 0."""
    st = Storage(v, device, dtype)
    if v.node is not None:
        v.node.trace.track(st)
    return st


def output_inner(v, dtype, device: int = 0) -> Storage:
    """The value ``v`` (a graph's output, pending or ready) in a Storage of its own, kept among
    the storages the pending trace reads back (the backward pass may read it after a sync), as
    ``CompiledGraph.__call__`` hands a device output to ``PlainGraph``, which makes the caller's
    tensor over it (the value's shape, the Storage's dtype)."""
    return _held(v, device, dtype)


class _Order(tuple):
    """A dense layout whose strides depend on a dynamic size (a transposed output of a graph
    traced with dynamic shapes: strides ``(1, s0)``): its dimensions from the outermost to the
    innermost, the strides made from each call's own shape."""

    def strides(self, shape) -> tuple:
        stride, acc = [0] * len(shape), 1
        for d in reversed(self):
            stride[d] = acc
            acc *= max(shape[d], 1)
        return tuple(stride)


def _dense_stride(val):
    """``val``'s strides when they describe a dense layout of its elements (a permutation of
    contiguous strides: a transposed output), which a Storage's layout may be; an ``_Order``
    when they are symbolic; else None (contiguous)."""
    if not isinstance(val, torch.Tensor):
        return None
    size, stride = tuple(val.shape), tuple(val.stride())
    if not all(type(x) is int for x in size + stride):
        # Symbolic: the order of the strides' example values (hints), if every one has one.
        hints = [x if type(x) is int else getattr(x.node, "hint", None) for x in size + stride]
        if any(h is None for h in hints):
            return None
        n = len(size)
        fixed = _dense_stride(torch.empty_strided(hints[:n], hints[n:], device="meta"))
        if fixed is None:
            return None
        return _Order(sorted(range(n), key=lambda d: -fixed[d]))
    if stride == _contig(size):
        return None
    acc = 1
    for s, st in sorted(((s, st) for s, st in zip(size, stride) if s != 1),
                        key=lambda p: p[1]):
        if st != acc:
            return None
        acc *= s
    return stride


class PlainGraph(CompiledGraph):
    """NOTE [compiled plain tensors]: a compiled graph called with plain PrivateUse1 tpu tensors
    (NOTE [tensor representation] in plain.py). Dynamo fakeifies a plain tensor as the
    PrivateUse1 tensor it is, so AOTAutograd's graphs are plain graphs of aten ops, with no
    tensor subclass to trace through. A call reads each plain input as the
    ``TpuTensor`` over the same Storage and view (``tensor.as_tpu``: the form the graph's entry
    keys and binds), runs the graph as ``CompiledGraph`` does, and gives each output back as a
    plain base tensor over a Storage of its own holding the output's value, with the traced
    output's strides where they are a dense layout. A write into an input binds the new value to
    the Storage the plain tensor shares with its wrapper, so the caller's tensor (and its views)
    sees it."""

    def __init__(self, gm, example_inputs, kind: str):
        super().__init__(gm, example_inputs, kind)
        from . import plain
        self._ext = plain.PLAIN.ext
        self._wrapper = plain.PLAIN.wrapper
        self._is_plain = plain.PLAIN.is_plain
        self._plain = plain.PLAIN
        self._state = plain.PLAIN.ext.state
        # per output: its strides when they are a dense non-contiguous layout
        self._strides = [_dense_stride(val) if what in (DEV, PASS) else None
                         for what, _, val in self.outs]
        self._contig: dict = {}     # an output's shape -> its contiguous strides

    def __call__(self, *args):
        if len(args) == 1 and type(args[0]) is list:
            args = args[0]
        if self.spmd is not None:
            # (collectives take the inputs as tensors: TpuTensors. A plain tensor is on the tpu
            # device: ``is_plain`` checks it.) The ranks compare the inputs' description (dtypes
            # and shapes), never the tensors themselves: their values differ by rank.
            is_plain, T, wrapper = self._is_plain, torch.Tensor, self._wrapper
            wargs = [wrapper(a) if isinstance(a, T) and is_plain(a) else a for a in args]
            if not self.spmd.agree(self._described(wargs)):
                return _interpret(self.plan.gm, args)
            res = self._run(wargs)
        else:
            ts = _local.ts
            with engine.lock:
                res = self._call(args, ts, *self._read_plain(args, ts.device))
        make_base = self._ext.make_base
        strides, contig = self._strides, self._contig
        for j, o in enumerate(res):
            if o.__class__ is Storage:
                st = o
                shape = o.val.shape
                stride = strides[j]
                if stride is not None:
                    if stride.__class__ is _Order:      # (its strides from this shape)
                        stride = stride.strides(shape)
                    st.stride = stride
                else:
                    stride = contig.get(shape)
                    if stride is None:
                        if len(contig) >= 64:
                            contig.clear()      # bounded: a graph with churning sizes
                        stride = contig[shape] = _contig(tuple(shape))
                res[j] = make_base(shape, stride, o.dtype, st.device, st)
        return res

    def _read_plain(self, args, device: int) -> tuple:
        """``CompiledGraph._read`` for a graph without collectives, over the plain tensors
        themselves: each tpu input's Storage and view chain read from the tensor (``ext.state``)
        straight into the lists, no record made per input and no list of the tensors (198 tpu
        inputs a step on gpt_train's three graphs). A plain tensor's view steps are static
        (NOTE [plain router]): no dynamic offsets. What else is an ``ARRAY`` (a CPU tensor, a
        ``TpuTensor``) is read as ``_read`` reads it."""
        ins, scalars, ints, views, offsets = [], [], [], [], []
        stores = [None] * len(args)
        dev = None
        bounds, sized, sizes, pad = self.bounds, self.sized, [], config.buckets
        is_plain, state, pl = self._is_plain, self._state, self._plain
        for i, (a, kind) in enumerate(zip(args, self.kinds)):
            if kind == ARRAY:
                if is_plain(a):
                    st, raw, base = state(a)
                    if st is None:
                        st = pl.storage(a, st)
                    c = () if base else pl.chain(a, st, raw, base)
                else:
                    st = a.__dict__.get("_s")
                    if st is None:      # a CPU tensor
                        self._host_input(a, i, dev, ins, sizes)
                        continue
                    c = a._chain
                    if c:
                        dyn = getattr(a, "_dyn", ())
                        if dyn:     # NOTE [dynamic offsets]: a window's start is an input
                            offsets.extend(dyn)
                if dev is None:
                    dev = st.device
                stores[i] = st
                v = st.val
                if i in sized:
                    if pad and i in bounds and not c:
                        v = packed.padded_value(v, dev) or v
                    sizes.append(v.shape)
                ins.append(v)
                if c:
                    views.append((i, c, v.shape, v.dtype))
            else:
                self._number_input(a, i, kind, scalars, ints)
        if offsets:
            scalars.extend(offsets)     # after the graph's own scalars (GraphPlan.function)
        return ins, scalars, ints, views, sizes, stores, None, device if dev is None else dev


def graph_kinds(nodes) -> tuple:
    """The kinds ("forward", "backward") of the compiled graphs among a short pending trace's
    ``nodes`` (none asked of a longer one): what ``CutPolicy.cut_at_backward`` decides from.

    NOTE [no backward cut for graphs]: ``backward()`` dispatches the pending trace (NOTE
    [backward cut] in device.py) so the device computes the forward pass while the host records
    the backward pass op by op. When the pending trace is this step's compiled forward graph and a
    few eager ops (the loss), the backward pass is the graph's backward graph and a few ops:
    recording it costs next to nothing, and the cut only split a step that reads its loss into two
    programs (measured, quick sizes: compiled GPT training steps about 10% faster without it). A
    trace that still holds the last step's backward graph (a loop that reads its loss every few
    steps) is cut as in defer mode: one program per step, running while the host records the next
    step. The policy decides (scheduler/policy.py); this only looks."""
    if len(nodes) > GRAPH_STEP_OPS:
        return ()
    kinds = []
    for n in nodes:
        k = getattr(n.key, "key", None)
        if type(k) is tuple and k and isinstance(k[0], CompiledGraph):
            kinds.append(k[0].kind)
    return tuple(kinds)


class _Eager:
    """A graph with an op no lowering covers: run it op by op in the eager mode in force."""
    _boxed_call = True

    def __init__(self, gm, why):
        self._boxed_call = True
        self.gm = gm
        S["graphs_run_eagerly"] += 1
        S["graph_fallback_reasons"].append(why)

    def __call__(self, *args):
        if len(args) == 1 and type(args[0]) is list:
            args = args[0]
        return _interpret(self.gm, args)


def _interpret(gm, args) -> list:
    """Run the graph ``gm`` op by op in the eager mode in force on its (plain tensor) inputs."""
    outs = torch.fx.Interpreter(gm).run(*args)
    return list(outs) if isinstance(outs, (tuple, list)) else [outs]


def _rng_states_on_device(gm) -> None:
    """NOTE [rng state HOPs] (runtime/graph.py): the state that ``run_and_save_rng_state`` saves
    for a recomputed random op is, for PyTorch, a CPU generator's state (a device without
    graph-safe RNG), which would read it back to the host every step, at a size that can be
    symbolic. Ours is the draw's 16-byte key: the state node of a forward graph and the state
    input of a backward graph are made 16 bytes on ``tpu``, so the key stays on the device."""
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = getattr(n.target, "_name", None)
        if name == "run_and_save_rng_state":
            state = [u for u in n.users if u.target is _getitem and u.args[1] == 0]
        elif name == "run_with_rng_state" and isinstance(n.args[0], torch.fx.Node):
            state = [n.args[0]]
        else:
            continue
        for st in state:
            val = st.meta.get("val")
            if val is None or val.device.type == "tpu":
                continue
            dev = next((a.meta["val"].device for a in n.all_input_nodes
                        if _on_device(a.meta.get("val"))), torch.device("tpu", 0))
            with val.fake_mode:
                st.meta["val"] = torch.empty(16, dtype=torch.uint8, device=dev)


def _dense_hops(gm, example_inputs):
    """NOTE [flex attention in plain graphs]: with ``TpuTensor``s, AOTAutograd traces the flex
    attention HOPs through their ``TpuTensor`` kernels (PyTorch's dense implementation, NOTE in
    flex.py), so graphs hold its aten ops. A plain tpu tensor is no subclass: the HOPs stay whole
    in the graph (as for Inductor), with their score and mask functions as submodules, which no
    lowering covers. Such a graph is traced again with ``make_fx`` over its own fake inputs,
    each HOP node running that same dense implementation: a graph of aten ops. ``gm`` as it is
    when it holds no such HOP."""
    from . import flex
    dense = flex.dense_impls()
    if not any(n.op == "call_function" and n.target in dense for n in gm.graph.nodes):
        return gm
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    class Dense(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            impl = dense.get(target)
            if impl is not None:
                return impl(*args, **kwargs)
            return super().call_function(target, args, kwargs)

    def run(*args):
        return Dense(gm).run(*args)
    mode = detect_fake_mode(example_inputs)
    with mode if mode is not None else contextlib.nullcontext():
        return make_fx(run)(*example_inputs)


def _compiler(kind: str, cls=PlainGraph):
    def compile_graph(gm, example_inputs):
        gm = _dense_hops(gm, example_inputs)        # NOTE [flex attention in plain graphs]
        _rng_states_on_device(gm)
        try:
            return cls(gm, example_inputs, kind)
        except LoweringError as e:
            return _Eager(gm, str(e))
    return compile_graph


def _decompositions(library_ops: bool = True) -> dict:
    """PyTorch's decompositions for the ops with no lowering of their own (the lowered ones stay
    whole: one lowering each, as in eager mode); with ``library_ops``, the bodies of quantization
    libraries' ops too (NOTE [quantization ops in graphs])."""
    table = {op: fn for op, fn in _DECOMP.items() if op not in LOWERINGS}
    table.update(_custom_op_bodies(library_ops))
    return table


# PyTorch's own custom ops whose bodies are aten ops we lower (varlen_attn's forward and backward
# call aten._flash_attention_forward/_backward): traced through, not kept whole in the graph.
_TRACE_THROUGH = ("torch_attn::_varlen_attn", "torch_attn::_varlen_attn_backward")


# NOTE [quantization ops in graphs]: quantization libraries' ops (torchao's quantize_affine_float8
# and the like, PT2E's quantized_decomposed.quantize_per_token ...) are torch ops with a kernel for
# every backend (CompositeExplicitAutograd) written in aten ops. Eager tpu runs those kernels
# (NOTE [own kernels] in opinfo.py); in a compiled graph they are traced through the same way, so
# a graph that quantizes is one program instead of running eagerly ("no lowering"). A few bodies
# read a tensor's value (quantize_per_tensor.tensor calls ``scale.item()``) and cannot be traced:
# a graph whose trace fails with them traced through is traced again with them kept whole, and
# runs eagerly as before (``backend``).
_TRACE_THROUGH_NAMESPACES = ("quantized_decomposed", "torchao")


def _custom_op_bodies(library_ops: bool = True) -> dict:
    table = {}
    names = list(_TRACE_THROUGH)
    if library_ops:
        names += [n for n in torch._C._dispatch_get_all_op_names()
                  if n.split("::")[0] in _TRACE_THROUGH_NAMESPACES]
    for name in names:
        ns, op_name = name.split("::")
        op_name, _, overload = op_name.partition(".")
        packet = getattr(getattr(torch.ops, ns), op_name, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is None or op in LOWERINGS or op._schema.is_mutable:
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(
                op.name(), torch._C.DispatchKey.CompositeExplicitAutograd):
            table[op] = functools.partial(op._op_dk,
                                          torch._C.DispatchKey.CompositeExplicitAutograd)
    return table


def backend(gm, example_inputs, **kwargs):
    """The ``tpu`` Dynamo backend (also registered as ``deferfuse``)."""
    from torch._dynamo.backends.common import aot_autograd
    graph = PlainGraph      # NOTE [compiled plain tensors]
    S["dynamo_graphs"] += 1
    cid = torch._guards.CompileContext.current_compile_id()
    if cid is not None and getattr(cid, "frame_compile_id", 0):
        # The same frame compiled again: one of its guards failed (a new shape, dtype, Python
        # value); TORCH_LOGS=recompiles names the guard.
        S["graph_recompiles"].append(f"compile {cid} of a frame ({len(example_inputs)} inputs)")

    def aot(library_ops):
        return aot_autograd(fw_compiler=_compiler("forward", graph),
                            bw_compiler=_compiler("backward", graph),
                            inference_compiler=_compiler("inference", graph),
                            decompositions=_decompositions(library_ops),
                            keep_inference_input_mutations=True)(gm, example_inputs)
    try:
        compiled = aot(True)
    except Exception:
        if not _calls_library_ops(gm):
            raise
        compiled = aot(False)    # NOTE [quantization ops in graphs]
    return compiled


def _calls_library_ops(gm) -> bool:
    """Whether the Dynamo graph calls an op of a namespace in ``_TRACE_THROUGH_NAMESPACES``."""
    for n in gm.graph.nodes:
        t = n.target
        if isinstance(t, torch._ops.OpOverloadPacket):
            t = t._qualified_op_name
        elif isinstance(t, torch._ops.OpOverload):
            t = t.name()
        if n.op == "call_function" and isinstance(t, str) and \
                t.split("::")[0] in _TRACE_THROUGH_NAMESPACES:
            return True
    return False


def _on_tpu(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "tpu"


def _route_default_backend() -> None:
    """NOTE [default backend]: ``torch.compile(model)`` with no backend uses Inductor, which cannot
    compile for a Python device. When a graph's inputs are on ``tpu`` it goes to this backend;
    every other graph (CPU, CUDA) still goes to Inductor, untouched."""
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
    if wrapper is None or getattr(wrapper.__call__, "_deferfuse", False):
        return
    orig = wrapper.__call__
    orig_init = wrapper.__init__

    def __init__(self, *args, **kwargs):
        _skip_deferfuse()       # torch.compile(model) is being set up: before any tracing
        orig_init(self, *args, **kwargs)

    def __call__(self, model_, inputs_):
        if any(_on_tpu(x) for x in inputs_):
            return backend(model_, inputs_)
        return orig(self, model_, inputs_)
    __call__._deferfuse = True
    wrapper.__call__ = __call__
    wrapper.__init__ = __init__


def _skip_deferfuse() -> None:
    """NOTE [dynamo skips deferfuse]: Dynamo tries to compile every Python frame that runs while
    compiled code runs, eager ops of a graph break included: it went into our
    ``__torch_dispatch__``. deferfuse's folders join Dynamo's skip list when Dynamo first meets
    deferfuse (importing Dynamo at ``import deferfuse`` would cost seconds). JAX's folders
    too: a graph's program is traced and compiled at the sync that runs its region (NOTE [graphs
    are ops]), which may be a ``.item()`` in compiled code, and Dynamo compiled ``jnp.array``
    there (and broke it)."""
    global _skipping
    if _skipping:
        return
    _skipping = True
    from torch._dynamo import trace_rules
    for mod in ("deferfuse", "deferfuse.runtime", "deferfuse.scheduler", "deferfuse_autoload", "jax",
                "jaxlib"):
        trace_rules.add(mod)
    from . import flex
    flex.for_dynamo()
    _functionalized_ops()


def _functionalized_ops() -> None:
    """A mutating custom op in a graph (``varlen_attn_out``'s) comes as AOTAutograd's
    ``auto_functionalized`` operator, which no program lowers: the graph runs eagerly
    (runtime/graph.py), and that operator finds PyTorch's dense kernel (clone the written inputs,
    run the op on the clones) for tpu tensors, as flex attention's operators do (flex.py)."""
    from .tensor import TpuTensor
    hops = importlib.import_module("torch._higher_order_ops.auto_functionalize")
    # AOTAutograd's first call of a graph runs under a mode that checks custom ops' aliasing and
    # answers NotImplemented for tensor subclasses, which a HOP returns as its result instead of
    # asking the subclass: for tpu tensors that mode steps aside (the subclass's kernel runs).
    wrappers = importlib.import_module("torch._functorch._aot_autograd.runtime_wrappers")
    check = getattr(wrappers, "_AnalyzeCustomOpInputOutputMode", None)

    def aside(hop):
        def handler(mode, *args, **kwargs):
            flat = torch.utils._pytree.tree_leaves((args, kwargs))
            if any(isinstance(a, TpuTensor) for a in flat):
                return NotImplemented
            return mode.__torch_dispatch__(hop, [], args, kwargs)
        return handler
    for hop_name in ("auto_functionalized", "auto_functionalized_v2"):
        hop, impl = getattr(hops, hop_name, None), getattr(hops, hop_name + "_dense", None)
        if hop is None or impl is None or TpuTensor in hop.python_key_table:
            continue
        hop.py_impl(TpuTensor)(impl)
        if check is not None and check not in hop.python_key_table:
            hop.py_impl(check)(aside(hop))


_skipping = False


def __getattr__(name):
    # The entry points (pyproject.toml) name ``dynamo_backend``: Dynamo loads it when
    # torch.compile(backend="tpu") is called, before it traces anything.
    if name == "dynamo_backend":
        _skip_deferfuse()
        return backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """The backend names come from the ``torch_dynamo_backends`` entry points (pyproject.toml), read
    by Dynamo when a name is first asked for; registered here too if Dynamo is loaded already."""
    if "torch._dynamo" in sys.modules:
        from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend
        _skip_deferfuse()
        for name in ("tpu", "deferfuse"):
            if name not in _COMPILER_FNS:
                register_backend(name=name)(backend)
    _route_default_backend()
