"""The collectives of the ``tpu`` process group: all-reduce, broadcast, reduce, the all-gathers,
gather, the reduce-scatters, scatter, all-to-all and barrier. ``Collectives`` is the part of
``ProcessGroupTPU`` (group.py) that checks each call's tensors and builds the JAX part it runs
(``runtime/collectives.py``), as ``PointToPoint`` (p2p.py) is the part that sends and receives.

Apart from group.py because each method is one collective's arguments and arrays: group.py holds
the group itself (its gloo group, devices and timeout), the steps every collective shares
(``_collective``: the sync, the ranks' agreement, the wait, the stats) and the backend's
constructor. CPU tensors still go to the group's gloo group, method by method.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work

from ..runtime import collectives as xc
from ..runtime.dtypes import to_np_dtype
from ..tensor import as_tpu
from .arrays import describe, read_array, write_array

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


class Collectives:
    """The collectives of ``ProcessGroupTPU``: the group's ``_split``, ``_collective``, ``_gloo``,
    ``rank()`` and ``size()`` are what these methods use."""

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


def _max_opts():
    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp.MAX
    return o
