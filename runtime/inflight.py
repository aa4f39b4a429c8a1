"""A region called on the dispatch thread: its outputs in flight, then bound on the host
(NOTE [in flight] in execute.py). ``dispatch`` hands the call over; the ``Finish`` it leaves with
the job binds the results when the runner settles the job, exactly as ``Runner._region`` binds a
call made on the host: donated inputs, outputs in alias order, index checks, an error replayed
op by op."""
from __future__ import annotations

import dataclasses

from ..scheduler.records import counted
from . import execute, stats
from .memory import COUNTERS as memory_stats, LARGE
from .regions import raise_oom

S = stats.S


def dispatch(runner, ctx, run, reg, mplan, don, keep, later: bool) -> None:
    """Call ``reg`` (found or compiled for ``run``) on ``runner``'s dispatch thread; ``later``:
    its index checks are read at the next sync. The caller holds the interrupts."""
    # What finishing needs after this flush released its nodes: the nodes themselves (names,
    # source lines, scalars: checks and a replay) and the inputs (a replay, donation).
    nodes = run.nodes
    run = dataclasses.replace(run, nodes=[nodes[j] for j in range(len(run.entries))])
    fin = Finish(runner, dataclasses.replace(ctx, done=set(), errors=[]), run, reg, mplan)
    job = execute.dispatch(runner.dispatcher, reg.compiled, don, keep, run.scalars,
                           ctx.fl.device, fin)
    for v in run.outs:
        v.node = job
    ctx.done.update(run.pos)
    if reg.msgs or runner.checks.pending:
        # Its flags come back with the call: filled in when settled (CheckList.check settles).
        fin.rec = runner.checks.add([None] * len(reg.msgs), reg.msgs, run.nodes, run.wirings,
                                    run.outs, run.out_sig, run.ext, later, job)


class Finish:
    """What binds a dispatched region's results on the host."""
    __slots__ = ("runner", "ctx", "run", "reg", "mplan", "rec")

    def __init__(self, runner, ctx, run, reg, mplan):
        self.runner, self.ctx, self.run, self.reg, self.mplan = runner, ctx, run, reg, mplan
        self.rec = None     # its index checks' record, its flags filled in here

    def __call__(self, job) -> None:
        runner, run, reg, rec = self.runner, self.run, self.reg, self.rec
        outs = run.outs
        try:
            if job.exc is not None:
                self._failed(job.exc)
                return
            res, flags = job.res
            donate = self.mplan.donate
            runner.bind(reg, run.ext, donate if any(donate) else None, self.mplan.donated_bytes,
                        outs, res)
            if rec is not None:
                rec.flags[:] = flags
        finally:
            if rec is not None:
                rec.job = None
            for v in outs:
                if v.node is job:   # neither bound nor failed: never read as zeros
                    v.fail(RuntimeError(f"deferfuse internal error: a result of {reg.summary} "
                                        "was not bound"))
            self.run = self.rec = None

    def _failed(self, e) -> None:
        """The call raised: an out-of-memory error fails every output; any other error is found
        op by op, as ``Runner._region`` does; the errors are raised at the next sync."""
        runner, run, ctx = self.runner, self.run, self.ctx
        if self.rec is not None:
            self.rec.flags[:] = [False] * len(self.rec.flags)
        try:
            raise_oom(e, self.reg, memory_stats)
        except Exception as oom:
            for v in run.outs:
                v.fail(oom)
            runner.checks.errors.append(oom)
            return
        runner._around(ctx, run, None, e)
        runner.checks.errors.extend(ctx.errors)


def bind_all(values, arrays) -> None:
    """Value.bind for each value, with one count of the buffers for all."""
    memory_stats.add(*bind_values(values, arrays, LARGE))


def bind_values(values, arrays, large: int) -> tuple:
    """Each value bound to its array, counted by no one: (bytes, buffers, bytes and buffers over
    ``large``) for one ``Counters.add``. _fastpath.c's does the same (NOTE [run tables in C])."""
    n = k = big = nbig = 0
    for v, r in zip(values, arrays):
        v.array = r
        v.node = None
        b = counted(v, r)      # (NOTE [lazy cuts])
        n += b
        k += 1
        if b > large:
            big += b
            nbig += 1
    return n, k, big, nbig


def drop_values(values, flags, err, large: int) -> tuple:
    """``Value.fail(err)`` for each value flagged in ``flags`` that has an array (a donated input:
    NOTE [donation safety]); what is left to un-count with ``Counters.add`` (nothing here: ``fail``
    counts; _fastpath.c's drops and leaves the count: NOTE [run tables in C])."""
    for v, d in zip(values, flags):
        if d and v.array is not None:
            v.fail(err)
    return 0, 0, 0, 0
