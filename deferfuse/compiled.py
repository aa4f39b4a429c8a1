"""Compiled mode: ``torch.compile`` on ``tpu`` tensors, through the same lowering table.

``torch.compile(model, backend="tpu")`` (or ``"deferfuse"``; and plain ``torch.compile(model)``
when the model's tensors are on ``tpu``: NOTE [default backend]) captures graphs with Dynamo;
AOTAutograd splits them into forward and backward graphs of aten ops (PyTorch's decompositions for
the ops with no lowering of their own), over the inner tensors of ``tpu`` tensors (NOTE [inner
tensor] in traceable.py). Each graph becomes one ``jax.jit`` program (runtime/graph.py). Inputs
a graph writes (an optimizer step's parameters and states: AOTAutograd keeps those ``copy_``\\s in
inference graphs) are donated where nothing else holds them, and take the new values. Random ops
draw from the device's generator, so ``torch.manual_seed`` decides them. Code Dynamo cannot
capture (a graph break) runs in the eager mode in force, defer by default: compiled graphs and
deferred regions mix in one step.
"""
from __future__ import annotations

import sys
import time

import torch

from .config import config
from .dispatch import _contig, copy_into, read
from .engine import engine
from .errors import LoweringError
from .opinfo import _DECOMP
from .runtime.lowering import LOWERINGS
from .runtime import execute, stats, transfer
from .runtime.dtypes import x64
from .runtime.graph import GraphPlan, jitted
from .scheduler.records import Donated, Value
from .tensor import TpuTensor, make
from .traceable import _unflatten, inner_for

S = stats.S


def _value(a):
    """(Value or None, device array) of an input of a compiled graph: its inner tensor's value (a
    graph's output), or the current value of the storage and view it stands for; a CPU tensor
    (an optimizer's step count) is copied over."""
    if a.device.type != "tpu":
        return None, transfer.host_value(a, 0).array
    v = a.__dict__.get("_v")
    if v is None:
        v = a._s.val
    arr = engine.ready(v, a._s.device if "_s" in a.__dict__ else 0, "compiled graph", check=False)
    chain = a.__dict__.get("_chain")
    if chain:
        return v, execute.read_view(arr, chain, a.__dict__.get("_dyn", ()))
    return v, arr


class CompiledGraph:
    """One graph (forward, backward or inference) and its jitted programs, per donation pattern;
    AOTAutograd calls it with a list (a boxed call)."""
    _boxed_call = True

    def __init__(self, gm, example_inputs, kind: str):
        self._boxed_call = True     # in the instance: Dynamo's wrapper copies only its __dict__
        self.kind = kind
        self.name = f"a compiled {kind} graph"      # (index-check messages name it)
        self.src = "torch.compile"
        self.plan = GraphPlan(gm)
        self.jits: dict = {}
        self.written = {i for i, _ in self.plan.writes}
        self.calls = 0
        S["compiled_graphs"] += 1

    def __call__(self, *args):
        # Boxed (one list of arguments) or not (the backward graph, wrapped by Dynamo).
        if len(args) == 1 and type(args[0]) is list:
            args = args[0]
        plan = self.plan
        with engine.lock:
            if engine.state.trace.nodes:
                engine.sync("compiled graph")    # its inputs may be pending: dispatch them
            tensors, ints, vals, arrays = [], [], [], []
            for a, is_t in zip(args, plan.is_tensor):
                if is_t:
                    v, arr = _value(a)
                    tensors.append(a)
                    vals.append(v)
                    arrays.append(arr)
                else:
                    ints.append(int(a))
            donate = []
            getrc = sys.getrefcount
            for i in range(len(vals)):
                # A written input, not a view, whose value nothing but its storage holds (and
                # ``vals``, and getrefcount's argument) gives its buffer to the program.
                donate.append(i in self.written and not tensors[i].__dict__.get("_chain")
                              and vals[i] is not None and getrc(vals[i]) <= 3
                              and config.memory_planner)
            donate = tuple(donate)
            entry = self.jits.get(donate)
            if entry is None:
                entry = self.jits[donate] = jitted(plan, donate, execute.sharding(0))
            fn, msgs = entry
            key = engine.rng.storage(0) if plan.rng else None
            don = [a for a, d in zip(arrays, donate) if d]
            keep = [a for a, d in zip(arrays, donate) if not d]
            t0 = time.perf_counter()
            with x64(True), execute.no_interrupt():
                n0 = fn._cache_size() if hasattr(fn, "_cache_size") else 0
                outs, written, new_key, flags = fn(don, keep, tuple(ints),
                                                   None if key is None else engine.ready(key.val))
                if hasattr(fn, "_cache_size") and fn._cache_size() > n0:
                    S["compiles"] += 1
                    S["graph_compiles"] += 1
                    S["compile_seconds"] += time.perf_counter() - t0
                if any(donate):
                    gone = Donated(f"a compiled {self.kind} graph")
                    for v, d in zip(vals, donate):
                        if d:
                            S["donated_bytes"] += v.nbytes
                            v.fail(gone)
                for (i, _), arr in zip(plan.writes, written):
                    self._write(tensors[i], arr)
                if key is not None:
                    key.val = Value(key.val.shape, key.val.dtype, key.val.nbytes, array=new_key)
            self.calls += 1
            S["compiled_calls"] += 1
            res, made = [], []
            for o, node in zip(outs, plan.outputs):
                val = node.meta.get("val") if hasattr(node, "meta") else None
                if isinstance(val, torch.Tensor) and val.device.type == "tpu":
                    inner = _inner_of_value(o, val.dtype)
                    made.append(inner._v)
                    res.append(inner)
                elif isinstance(val, torch.Tensor):
                    res.append(transfer.to_torch(o, val.dtype).reshape(val.shape))
                elif isinstance(val, (int, torch.SymInt)) and not isinstance(val, bool):
                    res.append(int(o))      # a size (dynamic shapes): a Python int again
                else:
                    res.append(o)
            # Index checks (an embedding's, a loss's targets) are read later, as a region's are:
            # the graph's outputs are unchecked until then (NOTE [unchecked values]); all of them
            # depend on every check, as one op's outputs do.
            engine.runner.checks.add(flags, [(0, e, m) for e, m in msgs], (self,), [()], made,
                                     [(0, i) for i in range(len(made))],
                                     [v for v in vals if v is not None], False)
            return res

    @staticmethod
    def _write(inner, arr):
        """The input ``inner`` takes the value ``arr`` the graph computed for it."""
        if inner.device.type != "tpu":
            with torch.no_grad():
                inner.copy_(transfer.to_torch(arr, inner.dtype).reshape(inner.shape))
            return
        new = Value(tuple(arr.shape), arr.dtype, arr.nbytes, array=arr)
        if "_v" in inner.__dict__:
            inner._v = new
        elif not inner._chain:
            inner._s.val = new
        else:       # a view: written into its base
            size, stride, offset = inner._view
            st = inner._s
            copy_into(_with_dyn(make(st, inner._chain, size, stride, offset, inner.dtype), inner),
                      _unflatten({"_inner": inner_for(new, inner.dtype)}, None, size,
                                 _contig(size)))


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
        outer = [_outer_of(a) if isinstance(a, torch.Tensor) else a for a in args]
        outs = torch.fx.Interpreter(self.gm).run(*outer)
        outs = outs if isinstance(outs, (tuple, list)) else [outs]
        return [_inner_of_value(read(o), o.dtype) if isinstance(o, TpuTensor) else o for o in outs]


def _outer_of(a):
    """A tpu tensor for the inner tensor ``a`` (a graph run eagerly)."""
    if "_v" in a.__dict__:
        return _unflatten({"_inner": a}, None, a.shape, _contig(a.shape))
    size, stride, offset = a._view
    return _with_dyn(make(a._s, a._chain, size, stride, offset, a.dtype), a)


def _with_dyn(t, inner):
    """``t`` at the dynamic offsets of the view ``inner`` stands for (NOTE [dynamic offsets])."""
    dyn = inner.__dict__.get("_dyn")
    if dyn:
        t._dyn = dyn
    return t


def _inner_of_value(arr, dtype):
    return inner_for(Value(tuple(arr.shape), arr.dtype, arr.nbytes, array=arr), dtype)


def _compiler(kind: str):
    def compile_graph(gm, example_inputs):
        try:
            return CompiledGraph(gm, example_inputs, kind)
        except LoweringError as e:
            return _Eager(gm, str(e))
    return compile_graph


def _decompositions() -> dict:
    """PyTorch's decompositions for the ops with no lowering of their own (the lowered ones stay
    whole: one lowering each, as in eager mode)."""
    return {op: fn for op, fn in _DECOMP.items() if op not in LOWERINGS}


def backend(gm, example_inputs, **kwargs):
    """The ``tpu`` Dynamo backend (also registered as ``deferfuse``)."""
    from torch._dynamo.backends.common import aot_autograd
    S["dynamo_graphs"] += 1
    cid = torch._guards.CompileContext.current_compile_id()
    if cid is not None and getattr(cid, "frame_compile_id", 0):
        # The same frame compiled again: one of its guards failed (a new shape, dtype, Python
        # value); TORCH_LOGS=recompiles names the guard.
        S["graph_recompiles"].append(f"compile {cid} of a frame ({len(example_inputs)} inputs)")
    return aot_autograd(fw_compiler=_compiler("forward"), bw_compiler=_compiler("backward"),
                        inference_compiler=_compiler("inference"),
                        decompositions=_decompositions(),
                        keep_inference_input_mutations=True)(gm, example_inputs)


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
    deferfuse (importing Dynamo at ``import deferfuse`` would cost seconds)."""
    global _skipping
    if _skipping:
        return
    _skipping = True
    from torch._dynamo import trace_rules
    for mod in ("deferfuse", "deferfuse.runtime", "deferfuse.scheduler", "deferfuse_autoload"):
        trace_rules.add(mod)


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
