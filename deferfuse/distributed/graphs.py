"""Compiled graphs that hold functional collectives, run as one program over the group's processes.

NOTE [collectives in programs] (runtime/collectives.py): Dynamo and AOTAutograd put tensor
parallelism's and DTensor's collectives (``_c10d_functional.all_reduce`` and ``wait_tensor``, ...)
into the graphs they hand to the ``tpu`` backend. Such a graph is lowered whole, its collectives
included, and runs as one ``jit(shard_map(...))`` over the devices of the collectives' group, one
device per process, as deferfuse's eager collectives do: every rank calls the graph at the same
point of its program (the graph is a collective), so each call takes the group's collective steps
(``ProcessGroupTPU._collective``): a sync point in defer mode, and the wait that names a rank that
failed. Before each call the ranks compare the graph's collectives and its inputs as its program
sees them (``agree``; with ``DEFERFUSE_DIST_CHECK``): shapes, with packed sequence boundaries at
their padded length (ranks packing other numbers of sequences share a program: NOTE [packed
boundaries] in packed.py), and the integers that key the program. One program needs the same
block shapes on every rank, so where they
differ (DTensor's uneven shards: the same model, a row more on one rank) that call runs op by op
on every rank, its collectives deferfuse's eager ones, which check their own agreement. A graph
that uses two groups (a 2-D mesh's tensor- and data-parallel dimensions in one graph) or an uneven
all-to-all always runs op by op.

NOTE [donation in graphs over a group]: a graph that writes into an input (vLLM's attention
writes each layer's KV cache) returns that input's new value; unless the program is given the old
buffer, XLA copies the whole input into a new one first (the KV caches, every step). So, as a
region's memory plan does (NOTE [donation safety] in scheduler/memory.py), each call donates the
old buffer of every input the graph overwrites on the device, when nothing but the written
storage holds that value (its reference count, counted after the pending trace ran) and the graph
does not also return it; the donated values are marked so (``Donated``). The donation pattern is
part of the program's key. ``DEFERFUSE_NO_MEMORY_PLANNER=1`` (or the cross-check) turns it off.
"""
from __future__ import annotations

import sys
import time
import zlib

import jax
import numpy as np
import torch
from jax.sharding import PartitionSpec as P

from ..scheduler.policy import Sync
from ..compiled import DEV, PASS
from ..config import config
from ..dispatch import user_frame
from ..engine import engine
from ..errors import LoweringError
from ..runtime import collectives as xc
from ..runtime import execute, stats
from ..runtime.cluster import CLUSTER
from ..runtime.dtypes import x64
from ..runtime.lowering import flag_message, take_flags
from ..runtime.graph import ARRAY
from ..scheduler.records import Donated, Value
from .coord import COORD
from .functional import _group

S = stats.S


class SpmdGraph:
    """How a compiled graph with collectives runs (see the module's doc): ``call`` replaces the
    recording of its node. The programs are kept on the graph's entries (one per input
    structure, bounded with them), one per group mesh."""

    def __init__(self, gm, groups, kinds):
        # the position in a call's input list of each tensor argument (``CompiledGraph``'s ins)
        self.at = {}
        for i, k in enumerate(kinds):
            if k == ARRAY:
                self.at[i] = len(self.at)
        pgs = {name: _group(name) for name in sorted(groups)}
        ranks = {tuple(pg._ranks) for pg in pgs.values()}
        if len(ranks) > 1:
            raise LoweringError("functional collectives of several process groups "
                                f"({', '.join(sorted(groups))})",
                                "one compiled graph runs over one group's processes")
        self.pg = next(iter(pgs.values()))
        self.n = n = self.pg.size()
        for node in gm.graph.nodes:
            name = getattr(node.target, "_opname", None)
            if node.op != "call_function" or \
                    getattr(node.target, "namespace", None) != "_c10d_functional":
                continue
            size = (node.args[2] if name.startswith("reduce_scatter") else
                    node.args[1] if name.startswith("all_gather") else n)
            splits = node.args[1] if name == "all_to_all_single" else ()
            if size != n or (splits and len(splits) != n):
                raise LoweringError(str(node.target), f"a group size of {size} (splits "
                                    f"{list(splits)}) for a group of {n} processes")
        # What the ranks compare before each call (NOTE [collective check] in coord.py), with
        # the inputs' shapes: the graph's collectives in order, their arguments and shapes. Not
        # the graph's code: a rank's constants differ (vLLM's vocabulary shard starts at its
        # rank's offset, a constant of that rank's graph), its collectives may not.
        sig = []
        for node in gm.graph.nodes:
            if getattr(node.target, "namespace", None) == "_c10d_functional":
                sig.append(f"{node.target._opname}{_shapes(node.args)}->"
                           f"{_shapes(node.meta.get('val'))}")
        self.desc = f"{zlib.crc32(';'.join(sig).encode()):08x}"
        S["graphs_with_collectives"] += 1

    def agree(self, inputs: str) -> bool:
        """Whether every rank calls a graph with these collectives on inputs as ``inputs``
        describes them here (``CompiledGraph._described``: the shapes and dtypes its program
        sees, boundaries padded; always, without the check or in a group of one); every rank
        gets the same answer."""
        pg = self.pg
        if len(pg._ranks) == 1 or COORD.client is None or not config.dist_check:
            return True
        desc = f"graph {self.desc} {inputs}"
        seq, pg._seq = pg._seq, pg._seq + 1
        t0 = time.perf_counter()
        got = COORD.gather(pg._gname, seq, CLUSTER.rank, pg._ranks, desc, user_frame(),
                           f"compiled_graph (collective #{seq} of group {pg._gname})",
                           pg._timeout)
        S["collective_check_seconds"] += time.perf_counter() - t0
        if all(d == desc for d, _ in got.values()):
            return True
        S["graph_calls_op_by_op"] += 1
        return False

    def call(self, graph, entry, ins, scalars, dev, tensors) -> list:
        """Run ``entry`` (the graph's op entry) on the input Values ``ins`` and ``scalars`` over
        the group, every rank at once; its outputs as ready Values. The caller holds each input
        Value only in ``ins`` (NOTE [donation in graphs over a group])."""
        got = []
        out_acts, write_acts = entry.out
        # inputs the graph overwrites on the device and does not return as they are
        written = [self.at[i] for what, i, _ in write_acts if what == DEV]
        if written and config.memory_planner and not config.cross_check:
            passed = {self.at[a[1]] for a in out_acts if a[0] == PASS}
            written = [k for k in written if k not in passed]
        else:
            written = []
        donate = []

        def run(devices):
            arrays = [engine.ready(v, dev, Sync.COLLECTIVE) for v in ins]
            # After the pending trace ran (above), an overwritten input's value is held by the
            # list ``ins``, its storage and getrefcount's argument: a fourth holder keeps it.
            donate[:] = [k in written and arrays[k].ndim > 0 and sys.getrefcount(ins[k]) <= 3
                         for k in range(len(ins))]
            res = self._program(entry, arrays, scalars, devices, tuple(donate))(arrays, scalars)
            got.extend(res)
            return res
        try:
            self.pg._collective("compiled_graph", graph.kind, tensors, run, check=False)
        finally:
            if any(donate):
                # (a call that raised may have taken them or not: its arrays say)
                gone = Donated(graph.name)
                for v, d in zip(ins, donate):
                    if d and v.array is not None and v.array.is_deleted():
                        S["donated_bytes"] += v.nbytes
                        v.fail(gone)
        return [Value(tuple(a.shape), a.dtype, a.nbytes, array=a) for a in got]

    def _program(self, entry, arrays, scalars, devices, donate):
        progs = entry.jit
        if progs is None:
            progs = entry.jit = {}
        run = progs.get((devices, donate))
        if run is None:
            run = progs[(devices, donate)] = _Program(entry, arrays, scalars, devices, self.n,
                                                      donate)
        return run


def _shapes(x) -> str:
    """``x`` (a node's arguments or fake value) in words: tensors as dtype and shape."""
    if isinstance(x, (tuple, list)):
        return "(" + ",".join(_shapes(y) for y in x) + ")"
    if hasattr(x, "meta"):          # an FX node: its fake value
        x = x.meta.get("val")
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).replace('torch.', '')}{list(x.shape)}"
    return repr(x)


class _Program:
    """One graph entry's program over one group mesh: local arrays and scalars in, local arrays
    out. Every value crosses ``shard_map`` as this process's block along dim 0 (0-d values as
    shape (1,)); the scalars as two packed arrays (NOTE [packed scalars] in runtime/execute.py),
    each with one padding element so that neither is empty. ``donate[k]``: input k's buffer is
    given to the program (NOTE [donation in graphs over a group]); the donated inputs come as the
    program's first argument, the others as its second."""

    def __init__(self, entry, arrays, scalars, devices, n, donate):
        self.devices = devices
        self.donate = donate
        self.me = next(i for i, d in enumerate(devices) if d.process_index == jax.process_index())
        mesh, self.sharding = xc.mesh_of(devices)
        shapes = [tuple(a.shape) for a in arrays]
        self.out_shapes = [s for s, _, _ in entry.res_avals]
        is_float = tuple(type(s) is float for s in scalars)
        fn = entry.fn
        self.msgs = msgs = []

        def body(don, keep, packed):
            don, keep = iter(don), iter(keep)
            blocks = [next(don) if d else next(keep) for d in donate]
            ins = [b.reshape(s) for b, s in zip(blocks, shapes)]
            fl, it = packed
            sc = execute._unpack_scalars((fl[:-1], it[:-1]), is_float) if is_float else []
            take_flags()
            res = list(fn(ins, sc, n))
            flags = take_flags()
            msgs[:] = [(exc, m) for _, exc, m in flags]
            res += [f for f, _, _ in flags]
            return [r.reshape(1) if r.ndim == 0 else r for r in res]
        t0 = time.perf_counter()
        with execute.compiling():
            jitted = jax.jit(xc.shard_map(body, mesh=mesh, in_specs=P(xc.AXIS),
                                          out_specs=P(xc.AXIS)),
                             donate_argnums=(0,) if any(donate) else ())
            self.compiled = jitted.lower(*self._globals(arrays, scalars)).compile()
        S["compiles"] += 1
        S["compile_seconds"] += time.perf_counter() - t0

    def _global(self, a):
        a = a.reshape(1) if a.ndim == 0 else a
        shape = (len(self.devices) * a.shape[0],) + tuple(a.shape[1:])
        return jax.make_array_from_single_device_arrays(shape, self.sharding, [a])

    def _globals(self, arrays, scalars):
        dev = self.devices[self.me]
        fl = np.array([s for s in scalars if type(s) is float] + [0.0], np.float64)
        it = np.array([s for s in scalars if type(s) is not float] + [0], np.int64)
        blocks = [self._global(a) for a in arrays]
        return ([b for b, d in zip(blocks, self.donate) if d],
                [b for b, d in zip(blocks, self.donate) if not d],
                (self._global(jax.device_put(fl, dev)), self._global(jax.device_put(it, dev))))

    def __call__(self, arrays, scalars) -> list:
        t0 = time.perf_counter()
        with x64(True):
            outs = [o.addressable_data(0) for o in self.compiled(*self._globals(arrays, scalars))]
        S["execute_seconds"] += time.perf_counter() - t0
        k = len(self.out_shapes)
        res = [o.reshape(s) if o.ndim != len(s) else o for o, s in zip(outs[:k], self.out_shapes)]
        for f, (exc, m) in zip(outs[k:], self.msgs):
            # An index check of the graph (NOTE [unchecked values]): read at once, as in strict
            # mode (the call waits for its outputs anyway).
            if int(np.asarray(f).reshape(-1)[0]):
                raise exc(flag_message(m, np.asarray(f).reshape(-1)[0]))
        return res
