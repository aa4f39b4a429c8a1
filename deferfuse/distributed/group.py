"""The ``tpu`` process group: torch.distributed's collectives on tpu tensors, run as XLA collectives
(runtime/collectives.py) across the processes of the job; CPU tensors go to a gloo group it owns,
as NCCL groups leave CPU tensors to gloo.

Every collective on tpu tensors follows the same steps (``_collective``): in defer mode it is a sync
point (the pending trace is dispatched, reason ``collective``, cut at the same op on every rank);
the ranks agree on it (NOTE [collective check] in coord.py); the inputs' JAX arrays go to one XLA
program over the group's devices; its results become the values of the output tensors; and, unless
``DEFERFUSE_DIST_WAIT=async``, the caller waits for them, so a rank that fails meanwhile is named
in a ``DistributedError`` here rather than in an XLA error at some later read. ``send`` and
``recv`` are ``PointToPoint``'s (p2p.py: NOTE [p2p matching]).
"""
from __future__ import annotations

import functools
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroup, ProcessGroupGloo, Work

from ..scheduler.policy import Sync
from ..engine import engine
from ..config import config
from ..dispatch import user_frame
from ..runtime import collectives as xc
from ..runtime import stats
from ..runtime.cluster import CLUSTER
from ..runtime.dtypes import to_np_dtype
from ..tensor import TpuTensor, as_tpu
from .arrays import describe, read_array, write_array
from .coord import COORD
from .p2p import PointToPoint

S = stats.S
_DEFAULT_TIMEOUT = timedelta(minutes=30)    # torch's default_pg_timeout: not a choice the user made

_OPS = {"SUM": "sum", "AVG": "avg", "PRODUCT": "product", "MIN": "min", "MAX": "max",
        "BAND": "band", "BOR": "bor", "BXOR": "bxor", "PREMUL_SUM": "premul_sum"}


def reduce_op(op) -> tuple:
    """(name, factor) of a ``ReduceOp`` (a ``RedOpType``, or a string of functional collectives)."""
    if isinstance(op, str):
        return op.lower(), None
    kind = getattr(op, "op", op)
    name = _OPS[kind.name]
    factor = None
    if name == "premul_sum":
        factor = op.factor
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        factor = float(factor)
    return name, factor


class _Work(Work):
    """A finished collective: its results are JAX values that later ops wait for on the device."""

    def __init__(self, result=(), source=-1):
        super().__init__()
        self._result = list(result)
        self._source = source

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def result(self):
        return self._result

    def source_rank(self):
        return self._source

    def get_future(self):
        f = torch.futures.Future()
        f.set_result(self._result)
        return f


class ProcessGroupTPU(PointToPoint, ProcessGroup):
    """A process group of ``tpu`` tensors on JAX's distributed runtime (see the module's doc)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, name: str,
                 global_ranks: list):
        super().__init__(rank, size)
        self._ranks = list(global_ranks) or list(range(size))
        self._gname = str(name)
        self._seq = 0
        self._p2p_seq: dict = {}
        self._p2p_pending: list = []    # posted sends and recvs, in posting order
        self._devs: dict = {}
        self._timeout = (config.dist_timeout if timeout == _DEFAULT_TIMEOUT
                         else timeout.total_seconds())
        self._gloo = ProcessGroupGloo(PrefixStore("gloo/", store), rank, size,
                                      timedelta(seconds=self._timeout))
        # Registered for both devices: the group's name lives on its backends (functional
        # collectives, DeviceMesh), and init_process_group(device_id=tpu) asks the tpu one. The
        # collectives themselves are this class's methods: gloo only ever sees CPU tensors.
        for device in ("cpu", "tpu"):
            self._register_backend(torch.device(device), ProcessGroup.BackendType.GLOO,
                                   self._gloo)

    def getBackendName(self):
        return "tpu"

    def __repr__(self):
        return f"ProcessGroupTPU(rank={self.rank()}, size={self.size()}, ranks={self._ranks})"

    # --- the common path -----------------------------------------------------------------------
    def _devices(self, index: int, ranks=None) -> tuple:
        key = (index, ranks)
        d = self._devs.get(key)
        if d is None:
            d = self._devs[key] = xc.devices_of(ranks or self._ranks, index)
        return d

    def _split(self, tensors):
        """'tpu' if every tensor is a tpu tensor, 'cpu' if none is; else raise as PyTorch does for
        tensors on two devices."""
        tpu = [type(t) is TpuTensor for t in tensors]
        if all(tpu):
            return "tpu"
        if not any(tpu):
            return "cpu"
        other = next(t for t, k in zip(tensors, tpu) if not k)
        raise RuntimeError("Expected all tensors of a collective on one device, found tpu and "
                           f"{other.device}; move the {other.device} tensors with .to('tpu')")

    def _collective(self, kind: str, detail: str, tensors, run, scope=None, peers=None,
                    shapes=None, check=True):
        """Steps shared by every collective on tpu tensors (see the module's doc). ``run(devices)``
        does the JAX part, writes the outputs and returns the arrays it made. ``check=False``:
        the caller had the ranks agree already (a compiled graph: ``SpmdGraph.agree``)."""
        t0 = time.perf_counter()
        dev = tensors[0]._s.device if tensors else 0
        if any(t._s.device != dev for t in tensors):
            raise RuntimeError(f"a collective takes tensors on one tpu device, got tpu:{dev} and "
                               f"tpu:{next(t._s.device for t in tensors if t._s.device != dev)}")
        trace = ""
        trace_now = engine.state.trace
        if trace_now.nodes:
            # Shown when ranks disagree: whether the ops each recorded before it differ too.
            trace = (f" (after a recorded trace of {len(trace_now.nodes)} ops, structure "
                     f"{trace_now.h & 0xffffffff:08x})")
            engine.sync(Sync.COLLECTIVE, op=kind)
        ranks = peers or self._ranks
        me = CLUSTER.rank
        if scope is None:
            seq, self._seq = self._seq, self._seq + 1
            scope = self._gname
        else:
            seq = self._p2p_seq.get(scope, 0)
            self._p2p_seq[scope] = seq + 1
        what = f"{kind} (collective #{seq} of group {self._gname})"
        if check and len(ranks) > 1 and COORD.client is not None and (
                config.dist_check or kind == "barrier"):
            desc = (f"{kind}({detail}) " + (shapes or " ".join(describe(t) for t in tensors))
                    + f" tpu:{dev}")
            t1 = time.perf_counter()
            COORD.exchange(scope, seq, me, ranks, desc, user_frame() + trace, what,
                           self._timeout)
            S["collective_check_seconds"] += time.perf_counter() - t1
        others = [r for r in ranks if r != me]
        self._execute(kind, tensors, run, self._devices(dev, None if peers is None
                                                        else tuple(peers)), others, what)
        S["collective_seconds"] += time.perf_counter() - t0

    def _execute(self, kind, tensors, run, devices, others, what) -> None:
        """Run ``run(devices)`` (the JAX part of a collective) and, unless
        ``DEFERFUSE_DIST_WAIT=async``, wait for its arrays, naming a failed peer."""
        try:
            with xc.x64(True):
                arrays = run(devices)
        except Exception as e:
            if xc.failed_in_xla(e):     # CPU runs small programs at once: failures show here
                raise COORD.explain(e, others, what) from e
            raise
        S["collectives"][kind] += 1
        S["collective_bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        if arrays and config.dist_wait == "block":
            t1 = time.perf_counter()
            COORD.wait(lambda: xc.ready(arrays), others, what, self._timeout)
            try:
                xc.block(arrays)
            except Exception as e:
                raise COORD.explain(e, others, what) from e
            S["collective_wait_seconds"] += time.perf_counter() - t1

    # --- all-reduce, broadcast, reduce ---------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if self._split(tensors) == "cpu":
            return self._gloo.allreduce(tensors, opts)
        op, factor = reduce_op(opts.reduceOp)
        for t in tensors:
            xc.check_op(op, to_np_dtype(t.dtype))

        def run(devices):
            outs = [xc.all_reduce(read_array(t), devices, op, factor) for t in tensors]
            for t, a in zip(tensors, outs):
                write_array(t, a)
            return outs
        self._collective("all_reduce", op, tensors, run)
        return _Work(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        if self._split(tensors) == "cpu":
            return self._gloo.allreduce_coalesced(tensors, opts)
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        if self._split(tensors) == "cpu":
            return self._gloo.broadcast(tensors, opts)
        src = opts.rootRank

        def run(devices):
            outs = [xc.broadcast(read_array(t), devices, src) for t in tensors]
            for t, a in zip(tensors, outs):
                write_array(t, a)
            return outs
        self._collective("broadcast", f"src={src}", tensors, run)
        return _Work(tensors)

    def reduce(self, tensors, opts=None):
        if self._split(tensors) == "cpu":
            return self._gloo.reduce(tensors, opts)
        op, factor = reduce_op(opts.reduceOp)
        dst = opts.rootRank
        for t in tensors:
            xc.check_op(op, to_np_dtype(t.dtype))

        def run(devices):
            outs = [xc.all_reduce(read_array(t), devices, op, factor) for t in tensors]
            if self.rank() == dst:
                for t, a in zip(tensors, outs):
                    write_array(t, a)
            return outs
        self._collective("reduce", f"{op},dst={dst}", tensors, run)
        return _Work(tensors)

    # --- all-gather ----------------------------------------------------------------------------
    def _gather_into(self, output, input, kind="all_gather_into_tensor"):
        n = self.size()
        if output.numel() != n * input.numel() or output.dtype != input.dtype:
            raise ValueError(f"all_gather_into_tensor: the output ({describe(output)}) must hold "
                             f"{n} inputs ({describe(input)}) of the same dtype")

        def run(devices):
            a = read_array(input)
            g = xc.all_gather(a.reshape(-1) if a.ndim != 1 else a, devices)
            g = g.reshape(tuple(output.shape))
            write_array(output, g)
            return [g]
        self._collective(kind, "", [input], run)

    def all_gather_single(self, output, input, opts=None):
        if self._split([output, input]) == "cpu":
            return self._gloo._allgather_base(output, input, opts)
        self._gather_into(output, input)
        return _Work([output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        if self._split(list(outputs) + list(inputs)) == "cpu":
            for o, i in zip(outputs, inputs):
                self._gloo._allgather_base(o, i, opts).wait()
            return _Work(outputs)
        for o, i in zip(outputs, inputs):
            self._gather_into(o, i)
        return _Work(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_lists, inputs, opts=None):
        flat = [t for ts in output_lists for t in ts] + list(inputs)
        if self._split(flat) == "cpu":
            return self._gloo.allgather(output_lists, inputs, opts)
        n = self.size()
        for outs, t in zip(output_lists, inputs):
            if len(outs) != n:
                raise ValueError(f"all_gather needs a list of {n} output tensors, got {len(outs)}")

        def run(devices):
            res = []
            for outs, t in zip(output_lists, inputs):
                g = xc.all_gather(read_array(t), devices)
                res.append(g)
                for i, o in enumerate(outs):
                    if tuple(o.shape) != tuple(t.shape):
                        raise ValueError(f"all_gather: output {i} is {describe(o)}, the input is "
                                         f"{describe(t)}")
                    write_array(o, g[i])
            return res
        self._collective("all_gather", "", list(inputs), run)
        return _Work(output_lists)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def gather(self, output_lists, inputs, opts=None):
        flat = [t for ts in output_lists for t in ts] + list(inputs)
        if self._split(flat) == "cpu":
            return self._gloo.gather(output_lists, inputs, opts)
        dst = opts.rootRank

        def run(devices):
            res = []
            for k, t in enumerate(inputs):
                g = xc.all_gather(read_array(t), devices)
                res.append(g)
                if self.rank() == dst:
                    for i, o in enumerate(output_lists[k]):
                        write_array(o, g[i])
            return res
        self._collective("gather", f"dst={dst}", list(inputs), run)
        return _Work(output_lists)

    # --- reduce-scatter, scatter, all-to-all ---------------------------------------------------
    def _scatter_from(self, output, input, op, factor, kind="reduce_scatter_tensor"):
        n = self.size()
        if input.numel() != n * output.numel() or output.dtype != input.dtype:
            raise ValueError(f"reduce_scatter_tensor: the input ({describe(input)}) must hold "
                             f"{n} outputs ({describe(output)}) of the same dtype")
        xc.check_op(op, to_np_dtype(output.dtype))

        def run(devices):
            r = xc.reduce_scatter(read_array(input).reshape(-1), devices, op, factor)
            r = r.reshape(tuple(output.shape))
            write_array(output, r)
            return [r]
        self._collective(kind, op, [input], run)

    def reduce_scatter_single(self, output, input, opts=None):
        if self._split([output, input]) == "cpu":
            return self._gloo._reduce_scatter_base(output, input, opts)
        op, factor = reduce_op(opts.reduceOp)
        self._scatter_from(output, input, op, factor)
        return _Work([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        if self._split(list(outputs) + list(inputs)) == "cpu":
            for o, i in zip(outputs, inputs):
                self._gloo._reduce_scatter_base(o, i, opts).wait()
            return _Work(outputs)
        op, factor = reduce_op(opts.reduceOp)
        for o, i in zip(outputs, inputs):
            self._scatter_from(o, i, op, factor)
        return _Work(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        flat = list(outputs) + [t for ts in input_lists for t in ts]
        if self._split(flat) == "cpu":
            return self._gloo.reduce_scatter(outputs, input_lists, opts)
        op, factor = reduce_op(opts.reduceOp)
        for o, ins in zip(outputs, input_lists):
            if any(tuple(i.shape) != tuple(o.shape) for i in ins):
                raise ValueError("reduce_scatter: every input must have the output's shape "
                                 f"({describe(o)})")
            for t in ins:
                xc.check_op(op, to_np_dtype(t.dtype))

        def run(devices):
            import jax.numpy as jnp
            res = []
            for o, ins in zip(outputs, input_lists):
                flat_in = jnp.concatenate([read_array(i).reshape(-1) for i in ins])
                r = xc.reduce_scatter(flat_in, devices, op, factor).reshape(tuple(o.shape))
                write_array(o, r)
                res.append(r)
            return res
        self._collective("reduce_scatter", op, list(outputs), run)
        return _Work(outputs)

    def scatter(self, outputs, input_lists, opts=None):
        flat = list(outputs) + [t for ts in input_lists for t in ts]
        if self._split(flat) == "cpu":
            return self._gloo.scatter(outputs, input_lists, opts)
        src = opts.rootRank
        n = self.size()

        def run(devices):
            import jax.numpy as jnp
            res = []
            for k, o in enumerate(outputs):
                if self.rank() == src:
                    x = jnp.concatenate([read_array(i).reshape(-1) for i in input_lists[k]])
                else:
                    x = jnp.zeros((n * o.numel(),), to_np_dtype(o.dtype), device=devices[self.rank()])
                r = xc.scatter(x, devices, src).reshape(tuple(o.shape))
                write_array(o, r)
                res.append(r)
            return res
        self._collective("scatter", f"src={src}", list(outputs), run)
        return _Work(outputs)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if self._split([output, input]) == "cpu":
            return self._gloo.alltoall_base(output, input, output_split_sizes,
                                            input_split_sizes, opts)
        n = self.size()
        if not output_split_sizes and not input_split_sizes:
            if input.numel() % n or output.numel() != input.numel():
                raise ValueError(f"all_to_all_single: {describe(input)} does not split evenly into "
                                 f"{n} ranks' blocks, or the output {describe(output)} differs")

            def run(devices):
                a = read_array(input)
                r = xc.all_to_all(a, devices).reshape(tuple(output.shape))
                write_array(output, r)
                return [r]
            self._collective("all_to_all_single", "", [input], run)
            return _Work([output])
        self._uneven_all_to_all(output, input, list(output_split_sizes),
                                list(input_split_sizes))
        return _Work([output])

    def _uneven_all_to_all(self, output, input, out_splits, in_splits):
        """All-to-all with uneven splits along dim 0: every block padded to the largest one of any
        rank (agreed with a small all-reduce), exchanged evenly, then cut back."""
        import jax.numpy as jnp
        n = self.size()
        row = 1
        for s in input.shape[1:]:
            row *= s
        in_splits = in_splits or [input.shape[0] // n] * n
        out_splits = out_splits or [output.shape[0] // n] * n
        m = torch.tensor([max(in_splits + out_splits + [0])], dtype=torch.int64, device=input.device)
        self.allreduce([m], _max_opts())
        m = int(m.item())

        def run(devices):
            a = read_array(input).reshape(input.shape[0], row)
            blocks, at = [], 0
            for s in in_splits:
                b = a[at:at + s]
                blocks.append(jnp.pad(b, ((0, m - s), (0, 0))))
                at += s
            r = xc.all_to_all(jnp.concatenate(blocks), devices)
            r = jnp.concatenate([r[j * m:j * m + s] for j, s in enumerate(out_splits)])
            r = r.reshape(tuple(output.shape))
            write_array(output, r)
            return [r]
        # What reaches XLA is the padded exchange: the same on every rank.
        self._collective("all_to_all_single", "uneven", [input], run,
                         shapes=f"{describe(input).split('[')[0]}[{n * m}, {row}]")

    def alltoall(self, outputs, inputs, opts=None):
        if self._split(list(outputs) + list(inputs)) == "cpu":
            return self._gloo.alltoall(outputs, inputs, opts)
        # (as_tpu: cat and empty make plain tensors, which _write and _arr do not read)
        flat_in = as_tpu(torch.cat([t.reshape(-1) for t in inputs]))
        flat_out = as_tpu(torch.empty(sum(t.numel() for t in outputs), dtype=outputs[0].dtype,
                                      device=outputs[0].device))
        self._uneven_all_to_all(flat_out, flat_in, [t.numel() for t in outputs],
                                [t.numel() for t in inputs])
        at = 0
        for t in outputs:
            t.copy_(flat_out[at:at + t.numel()].view(t.shape))
            at += t.numel()
        return _Work(outputs)

    # --- barrier --------------------------------------------------------------------------------
    def barrier(self, opts=None):
        self._collective("barrier", "", [], lambda devices: [])
        return _Work()


def _tpu_tree(a):
    """Tensor arguments as ``TpuTensor``s (``tensor.as_tpu``: a plain tpu tensor's is over the
    same Storage, so what a collective writes into it is the plain tensor's value), in lists too."""
    if type(a) is list:
        return [_tpu_tree(x) for x in a]
    return as_tpu(a)


def _taking_plain(method):
    """NOTE [mixed arguments] in plain.py, for the collectives: they read ``_s`` and ``_chain``,
    so plain tpu tensors come in as the ``TpuTensor``s over their storages."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        return method(self, *[_tpu_tree(a) for a in args], **kwargs)
    return run


def plain_collectives() -> None:
    """Wrap every collective of ``ProcessGroupTPU`` with ``_taking_plain`` (plain.install)."""
    for name in ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "all_gather_single",
                 "all_gather_single_coalesced", "allgather", "allgather_coalesced", "gather",
                 "reduce_scatter_single", "reduce_scatter_single_coalesced", "reduce_scatter",
                 "scatter", "alltoall_base", "alltoall", "send", "recv", "recv_anysource"):
        m = getattr(ProcessGroupTPU, name)     # send/recv: PointToPoint's
        if not hasattr(m, "__wrapped__"):
            setattr(ProcessGroupTPU, name, _taking_plain(m))


def _max_opts():
    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp.MAX
    return o


def create(opts, backend_options=None):
    """The ``tpu`` backend's constructor (``dist.Backend.register_backend(..., extended_api=True)``)."""
    size = opts.group_size
    if size > 1 and CLUSTER.client is None:
        why = CLUSTER.error or (
            "deferfuse starts it at import from torchrun's RANK/WORLD_SIZE/MASTER_ADDR/"
            "MASTER_PORT, and they were not set then")
        raise RuntimeError(
            f"the tpu process group of {size} processes needs JAX's distributed runtime: {why}. "
            "Launch with torchrun (or set those variables before importing deferfuse); see "
            "docs/distributed.md")
    if not opts.global_ranks_in_group and size > 1 and opts.group_rank != CLUSTER.rank:
        raise RuntimeError(f"torch rank {opts.group_rank} runs in JAX process {CLUSTER.rank}: "
                           "JAX's distributed runtime was started with other process ids than "
                           "torch's ranks")
    COORD.start(config.dist_timeout)
    return ProcessGroupTPU(opts.store, opts.group_rank, size, opts.timeout, opts.group_id,
                           list(opts.global_ranks_in_group))
