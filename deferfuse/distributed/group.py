"""The ``tpu`` process group: torch.distributed's collectives on tpu tensors, run as XLA collectives
(runtime/collectives.py) across the processes of the job; CPU tensors go to a gloo group it owns,
as NCCL groups leave CPU tensors to gloo.

Every collective on tpu tensors follows the same steps (``_collective``): in defer mode it is a sync
point (the pending trace is dispatched, reason ``collective``, cut at the same op on every rank);
the ranks agree on it (NOTE [collective check] in coord.py); the inputs' JAX arrays go to one XLA
program over the group's devices; its results become the values of the output tensors; and, unless
``DEFERFUSE_DIST_WAIT=async``, the caller waits for them, so a rank that fails meanwhile is named
in a ``DistributedError`` here rather than in an XLA error at some later read.

NOTE [p2p matching]: a ``send`` and its ``recv`` run as one XLA program between the two processes,
so both must call it at once, in the same order as every other program they share. gloo and NCCL
let ranks post sends and receives in any order (both ranks ``isend`` first, then ``irecv``; a
``batch_isend_irecv`` ring), so a send or recv on tpu tensors is only posted (a send keeps its
value: JAX arrays never change) and runs when this rank waits on one of its requests
(``dist.send``/``recv`` wait at once). Waiting takes rounds: for each pair of ranks this rank has
posted to, in increasing order of the pair (so no two ranks wait on each other in a cycle), both
ranks publish what they posted to the other in the coordination service; each direction's sends
and receives are matched in posting order (shapes and dtypes must agree) and the matched messages
run, lower rank's first. Rounds repeat until the awaited request has run. Two ranks that each wait
on a request the other cannot match (both blocking ``send`` first) raise a ``DistributedError``
instead of hanging, as does a request no round completes within the timeout.
"""
from __future__ import annotations

import json
import functools
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroup, ProcessGroupGloo, Work

from ..scheduler.policy import Sync
from ..engine import engine
from ..config import config
from ..dispatch import _contig, copy_into, new_tensor, read, user_frame
from ..runtime import collectives as xc
from ..runtime import stats
from ..runtime.cluster import CLUSTER
from ..runtime.dtypes import to_np_dtype
from ..scheduler.records import Value
from ..tensor import TpuTensor, as_tpu
from .coord import COORD

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


class _P2P:
    """A posted send or recv on a tpu tensor, waiting for its peer (NOTE [p2p matching])."""
    __slots__ = ("kind", "peer", "tensor", "array", "desc", "line", "done")

    def __init__(self, kind, peer, tensor, array, line):
        self.kind, self.peer, self.tensor, self.array, self.line = kind, peer, tensor, array, line
        self.desc = _desc(tensor)
        self.done = False


class _P2PWork(Work):
    """The request of a posted send or recv: waiting on it runs the rounds that complete it."""

    def __init__(self, group, ops, source=-1):
        super().__init__()
        self._group, self._ops, self._source = group, ops, source

    def wait(self, timeout=None):
        for op in self._ops:
            self._group._p2p_complete(op)
        return True

    def is_completed(self):
        # Completing takes the peer's part: a poll waits for it (a loop polling a request that
        # never ran would spin forever).
        return self.wait()

    def is_success(self):
        return True

    def result(self):
        return [op.tensor for op in self._ops]

    def source_rank(self):
        return self._source

    def get_future(self):
        self.wait()
        f = torch.futures.Future()
        f.set_result(self.result())
        return f


def _arr(t):
    """The concrete JAX array of a tpu tensor (its view applied)."""
    return read(t)


def _write(t, arr) -> None:
    """Make ``arr`` (a JAX array of ``t``'s shape and dtype) the value of ``t``."""
    st = t._s
    if not t._chain and tuple(t.shape) == tuple(st.val.shape) and st.dtype == t.dtype:
        st.val = Value(tuple(arr.shape), arr.dtype, arr.nbytes, array=arr)
        return
    copy_into(t, _wrap(arr, t._s.device, t.dtype))


def _wrap(arr, device: int, dtype) -> TpuTensor:
    shape = tuple(arr.shape)
    return new_tensor(Value(shape, arr.dtype, arr.nbytes, array=arr), device, dtype, shape,
                      _contig(shape))


def _desc(t) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


class ProcessGroupTPU(ProcessGroup):
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
            desc = (f"{kind}({detail}) " + (shapes or " ".join(_desc(t) for t in tensors))
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
            outs = [xc.all_reduce(_arr(t), devices, op, factor) for t in tensors]
            for t, a in zip(tensors, outs):
                _write(t, a)
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
            outs = [xc.broadcast(_arr(t), devices, src) for t in tensors]
            for t, a in zip(tensors, outs):
                _write(t, a)
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
            outs = [xc.all_reduce(_arr(t), devices, op, factor) for t in tensors]
            if self.rank() == dst:
                for t, a in zip(tensors, outs):
                    _write(t, a)
            return outs
        self._collective("reduce", f"{op},dst={dst}", tensors, run)
        return _Work(tensors)

    # --- all-gather ----------------------------------------------------------------------------
    def _gather_into(self, output, input, kind="all_gather_into_tensor"):
        n = self.size()
        if output.numel() != n * input.numel() or output.dtype != input.dtype:
            raise ValueError(f"all_gather_into_tensor: the output ({_desc(output)}) must hold "
                             f"{n} inputs ({_desc(input)}) of the same dtype")

        def run(devices):
            a = _arr(input)
            g = xc.all_gather(a.reshape(-1) if a.ndim != 1 else a, devices)
            g = g.reshape(tuple(output.shape))
            _write(output, g)
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
                g = xc.all_gather(_arr(t), devices)
                res.append(g)
                for i, o in enumerate(outs):
                    if tuple(o.shape) != tuple(t.shape):
                        raise ValueError(f"all_gather: output {i} is {_desc(o)}, the input is "
                                         f"{_desc(t)}")
                    _write(o, g[i])
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
                g = xc.all_gather(_arr(t), devices)
                res.append(g)
                if self.rank() == dst:
                    for i, o in enumerate(output_lists[k]):
                        _write(o, g[i])
            return res
        self._collective("gather", f"dst={dst}", list(inputs), run)
        return _Work(output_lists)

    # --- reduce-scatter, scatter, all-to-all ---------------------------------------------------
    def _scatter_from(self, output, input, op, factor, kind="reduce_scatter_tensor"):
        n = self.size()
        if input.numel() != n * output.numel() or output.dtype != input.dtype:
            raise ValueError(f"reduce_scatter_tensor: the input ({_desc(input)}) must hold "
                             f"{n} outputs ({_desc(output)}) of the same dtype")
        xc.check_op(op, to_np_dtype(output.dtype))

        def run(devices):
            r = xc.reduce_scatter(_arr(input).reshape(-1), devices, op, factor)
            r = r.reshape(tuple(output.shape))
            _write(output, r)
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
                                 f"({_desc(o)})")
            for t in ins:
                xc.check_op(op, to_np_dtype(t.dtype))

        def run(devices):
            import jax.numpy as jnp
            res = []
            for o, ins in zip(outputs, input_lists):
                flat_in = jnp.concatenate([_arr(i).reshape(-1) for i in ins])
                r = xc.reduce_scatter(flat_in, devices, op, factor).reshape(tuple(o.shape))
                _write(o, r)
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
                    x = jnp.concatenate([_arr(i).reshape(-1) for i in input_lists[k]])
                else:
                    x = jnp.zeros((n * o.numel(),), to_np_dtype(o.dtype), device=devices[self.rank()])
                r = xc.scatter(x, devices, src).reshape(tuple(o.shape))
                _write(o, r)
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
                raise ValueError(f"all_to_all_single: {_desc(input)} does not split evenly into "
                                 f"{n} ranks' blocks, or the output {_desc(output)} differs")

            def run(devices):
                a = _arr(input)
                r = xc.all_to_all(a, devices).reshape(tuple(output.shape))
                _write(output, r)
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
            a = _arr(input).reshape(input.shape[0], row)
            blocks, at = [], 0
            for s in in_splits:
                b = a[at:at + s]
                blocks.append(jnp.pad(b, ((0, m - s), (0, 0))))
                at += s
            r = xc.all_to_all(jnp.concatenate(blocks), devices)
            r = jnp.concatenate([r[j * m:j * m + s] for j, s in enumerate(out_splits)])
            r = r.reshape(tuple(output.shape))
            _write(output, r)
            return [r]
        # What reaches XLA is the padded exchange: the same on every rank.
        self._collective("all_to_all_single", "uneven", [input], run,
                         shapes=f"{_desc(input).split('[')[0]}[{n * m}, {row}]")

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

    # --- point to point (NOTE [p2p matching]), barrier ---------------------------------------
    def _post(self, kind: str, tensors, peer: int):
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(f"{kind}: invalid peer rank {peer} for a group of {self.size()} "
                             f"processes (this process is rank {self.rank()})")
        if engine.state.trace.nodes:
            engine.sync(Sync.COLLECTIVE, op=kind)
        line = user_frame()
        ops = [_P2P(kind, self._ranks[peer], t, _arr(t) if kind == "send" else None, line)
               for t in tensors]
        self._p2p_pending.extend(ops)
        return ops

    def _p2p_complete(self, op) -> None:
        """Run rounds until ``op`` has run (NOTE [p2p matching])."""
        last_progress = time.monotonic()
        while not op.done:
            if not self._p2p_pending:
                raise RuntimeError("internal error: a p2p request is neither done nor posted")
            me = CLUSTER.rank
            progress = False
            for peer in sorted({o.peer for o in self._p2p_pending}):
                progress |= self._p2p_round(me, peer, op)
            now = time.monotonic()
            if progress:
                last_progress = now
            elif now - last_progress > self._timeout:
                raise COORD.fail(
                    f"{op.kind} of {op.desc} {'to' if op.kind == 'send' else 'from'} rank "
                    f"{op.peer} (at {op.line}) did not complete within {self._timeout:.0f} s "
                    "(the timeout): its peer never posted the matching request")

    def _p2p_round(self, me: int, peer: int, waited) -> bool:
        """One round with ``peer`` (a global rank): exchange what each posted to the other, run
        the matched messages; returns whether any ran."""
        lo, hi = min(me, peer), max(me, peer)
        mine = [o for o in self._p2p_pending if o.peer == peer]
        sends = [o for o in mine if o.kind == "send"]
        recvs = [o for o in mine if o.kind == "recv"]
        waiting = waited in mine
        scope = f"{self._gname}/p2p/{lo}-{hi}"
        seq = self._p2p_seq.get(scope, 0)
        self._p2p_seq[scope] = seq + 1
        what = f"send/recv (round #{seq} between ranks {lo} and {hi} of group {self._gname})"
        desc = json.dumps({"s": [o.desc for o in sends], "r": [o.desc for o in recvs],
                           "w": f"{waited.kind} {waited.desc}" if waiting else "",
                           "at": [o.line for o in mine]})
        if COORD.client is None:
            raise RuntimeError("send/recv on tpu tensors needs JAX's distributed runtime (a "
                               "group of several processes)")
        t1 = time.perf_counter()
        got = COORD.gather(scope, seq, me, [lo, hi], desc, waited.line if waiting else "", what,
                           self._timeout)
        S["collective_check_seconds"] += time.perf_counter() - t1
        theirs = json.loads(got[peer][0])
        out = list(zip(sends, theirs["r"]))      # me -> peer, matched in posting order
        into = list(zip(recvs, theirs["s"]))     # peer -> me
        bad = [(o, d) for o, d in out + into if o.desc != d]
        if bad or (not out and not into and waiting and theirs["w"]):
            def posted(r, info):
                ops = [f"send {d} to {hi if r == lo else lo}" for d in info["s"]] + \
                      [f"recv {d} from {hi if r == lo else lo}" for d in info["r"]]
                w = f", waiting on its {info['w']}" if info["w"] else ""
                return (f"  rank {r}: posted {', '.join(ops) or 'nothing'}{w} (at "
                        f"{', '.join(dict.fromkeys(info['at']))})")
            both = "\n".join(posted(r, json.loads(got[r][0])) for r in (lo, hi))
            why = ("a send and its recv differ in shape or dtype" if bad else
                   "each waits on a request the other has not matched, and neither can post more")
            raise COORD.fail(f"ranks disagree on {what}: {why}; a send's recv must be posted "
                             f"with the same shape and dtype, in the same order:\n{both}")
        if not out and not into:
            return False
        lo_first = (out + into) if me == lo else (into + out)
        for o, _ in lo_first:
            self._p2p_run(o, me, lo, hi, what)
        done = {id(o) for o, _ in lo_first}
        self._p2p_pending = [o for o in self._p2p_pending if id(o) not in done]
        return True

    def _p2p_run(self, o, me, lo, hi, what) -> None:
        """One message of a round: a permute between ``lo`` and ``hi`` (global ranks)."""
        src_is_lo = (o.kind == "send") == (me == lo)
        pair = ((0, 1),) if src_is_lo else ((1, 0),)

        def run(devices):
            if o.kind == "send":
                x = o.array
            else:
                import jax.numpy as jnp
                x = jnp.zeros(tuple(o.tensor.shape), to_np_dtype(o.tensor.dtype),
                              device=devices[0 if me == lo else 1])
            a = xc.permute(x, devices, pair)
            if o.kind == "recv":
                _write(o.tensor, a)
            return [a]
        t0 = time.perf_counter()
        self._execute("send/recv", [o.tensor], run, self._devices(o.tensor._s.device, (lo, hi)),
                      [o.peer], what)
        o.done, o.array = True, None
        S["collective_seconds"] += time.perf_counter() - t0

    def send(self, tensors, dstRank, tag=0):
        if self._split(tensors) == "cpu":
            return self._gloo.send(tensors, dstRank, tag)
        return _P2PWork(self, self._post("send", tensors, dstRank))

    def recv(self, tensors, srcRank, tag=0):
        if self._split(tensors) == "cpu":
            return self._gloo.recv(tensors, srcRank, tag)
        return _P2PWork(self, self._post("recv", tensors, srcRank), source=srcRank)

    def recv_anysource(self, tensors, tag=0):
        if self._split(tensors) == "cpu":
            return self._gloo.recv_anysource(tensors, tag)
        raise RuntimeError("recv without a source rank is not supported for tpu tensors (each "
                           "send and its recv run as one XLA program between two processes): "
                           "give src=")

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
        m = ProcessGroupTPU.__dict__[name]
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
