"""Index checks a program computed next to its results, read by the host later.

NOTE [unchecked values]: XLA never faults on a bad index; a lowering computes a flag next to its
result (NOTE [index checks] in lowering/__init__.py) and the host reads the flags later, as CUDA
reports device asserts. Until then the values that program computed are unchecked: ``Value.chk``
is the ``Checks`` record of the program run that computed them. A program that reads unchecked
values is unchecked too (its record names those values and their records: ``ups``), whether or
not it has checks of its own, so nothing waits for the device to dispatch it.

A record is read when a value it stands for is read by the host, and at every sync (those a sync
did not wait for, at the next one). Reading one reads its ``ups`` first. If a check failed, the
outputs of that run that depend on the failing op become failed (NOTE [value states]): reading
one raises the error, naming the op and the line that recorded it; outputs of later runs that
read a failed value fail with the same error. Every other value is correct. The error itself is
raised at the sync that found it (or at the next one).

A later run names what it read by its record and output position, never by the value: by the time
a check is read, the values a later run read are often dead (a training step's backward pass and
optimizer step read the forward pass's activations, which autograd drops, and the gradients, which
``zero_grad`` drops), and a failure looked up on them was lost: the step's outputs were computed
from the out-of-range lookup's NaN fill, and every later loss and parameter came back NaN. A read
record keeps the positions that failed (``failed``, ``err``) and forgets its ``ups``.
"""
from __future__ import annotations

import weakref
from operator import attrgetter

import numpy as np

from . import stats
from .lowering import flag_message


_chk_of = attrgetter("chk")


def dependents(wirings, start: int) -> set:
    """Positions of the ops that read, directly or not, an output of op ``start`` (and itself)."""
    bad = {start}
    for q in range(start + 1, len(wirings)):
        for w in wirings[q]:
            if w.__class__ is tuple and w[0] in bad:
                bad.add(q)
                break
    return bad


def ext_dependents(wirings, failed_ext) -> set:
    """Positions of the ops that read, directly or not, one of the external inputs ``failed_ext``."""
    bad = set()
    for q, ws in enumerate(wirings):
        for w in ws:
            if w.__class__ is int:
                if w in failed_ext:
                    bad.add(q)
                    break
            elif w.__class__ is tuple and w[0] in bad:
                bad.add(q)
                break
    return bad


def unchecked_inputs(ext) -> list | None:
    """(i, its record, its position there) of each input ``ext[i]`` whose index checks are not
    read yet (NOTE [unchecked values]), or None when there is none. _fastpath.c's does the same."""
    ups = None
    for i, c in enumerate(map(_chk_of, ext)):
        if c is not None and not c.done:
            if ups is None:
                ups = []
            ups.append((i, c, c.at[id(ext[i])]))
    return ups


def check_tables(outs, rec) -> tuple:
    """A ``Checks`` record's tables of ``outs``: (a weak ref of each, id -> its position); each
    output's ``chk`` becomes ``rec``. _fastpath.c's does the same."""
    tables = list(map(weakref.ref, outs)), dict(zip(map(id, outs), range(len(outs))))
    for v in outs:
        v.chk = rec
    return tables


class Checks:
    """One program run whose values are unchecked: its own flags (maybe none), the unchecked
    values it read (``ups``: (external input index, their record, their position in its
    ``outs``)), and what is needed to fail the right outputs."""
    __slots__ = ("flags", "msgs", "names", "srcs", "wirings", "outs", "at", "out_sig", "ups",
                 "done", "later", "failed", "err", "job")

    def __init__(self, flags, msgs, nodes, wirings, out_sig, ups, later):
        self.flags = flags
        self.msgs = msgs            # (node position, exception type, message) per flag
        self.names = [nodes[p].name for p, _, _ in msgs] if flags else ()
        self.srcs = [nodes[p].src for p, _, _ in msgs] if flags else ()
        self.wirings = wirings
        self.outs = self.at = None  # weak refs of its outputs; id(output) -> position (tables)
        self.out_sig = out_sig
        self.ups = ups
        self.done = False
        self.later = later          # read at the next sync, not the one that ran it
        self.failed = None          # once read: the positions in ``outs`` that failed
        self.err = None             # and their error
        self.job = None             # its program's call in flight (NOTE [in flight] in execute.py)


class CheckList:
    """The unchecked program runs, and the errors found and not raised yet."""

    def __init__(self):
        self.pending: list = []
        self.errors: list = []
        self.settle = None      # the runner's: binds the job in flight (NOTE [in flight])
        # The owner's C ones when it has them (NOTE [run tables in C] in deferfuse/_fastpath.c)
        self.unchecked_inputs = unchecked_inputs
        self.check_tables = check_tables

    def add(self, flags, msgs, nodes, wirings, outs, out_sig, ext, later, job=None):
        """Record a program run that returned ``flags`` or read unchecked values of ``ext``;
        its outputs become unchecked. ``job``: the run's call is in flight, and ``flags`` are
        filled in when it is settled. Returns the record, or None."""
        ups = self.unchecked_inputs(ext) if self.pending else None
        if not flags and ups is None:
            return None
        rec = Checks(flags, msgs, nodes, wirings, out_sig, ups, later)
        rec.job = job
        rec.outs, rec.at = self.check_tables(outs, rec)
        self.pending.append(rec)
        return rec

    def check(self, rec: Checks) -> None:
        """Read ``rec`` (its ``ups`` first; its own flags wait for its program): fail the values
        that depend on a failed check, and keep a new error for the sync."""
        if rec.done:
            return
        if rec.job is not None:
            self.settle()       # its flags come back with its call (NOTE [in flight])
        rec.done = True
        try:
            self.pending.remove(rec)
        except ValueError:
            pass
        first = None
        bad = None
        if rec.ups:
            failed = {}
            for i, c, k in rec.ups:
                self.check(c)
                if c.failed is not None and k in c.failed:
                    failed[i] = c.err
            if failed:
                bad = ext_dependents(rec.wirings, failed)
                first = next(iter(failed.values()))
        if rec.flags:
            values = [np.asarray(fl) for fl in rec.flags]
            fired = [k for k, fl in enumerate(values) if bool(fl)]
            if fired:
                stats.S["failed_checks"] += 1
                own = None
                bad = bad or set()
                for k in fired:
                    pos, exc, msg = rec.msgs[k]
                    if own is None:
                        own = exc(f"{flag_message(msg, values[k])} ({rec.names[k]} recorded at "
                                  f"{rec.srcs[k]})")
                    bad |= dependents(rec.wirings, pos)
                self.errors.append(own)
                first = first or own
        rec.ups = None      # read: forget the runs it read (a chain as long as the training run)
        if bad:
            rec.failed = {k for k, (p, _) in enumerate(rec.out_sig) if p in bad}
            rec.err = first
            for k in rec.failed:
                v = rec.outs[k]()
                if v is not None:
                    v.fail(first)

    def check_all(self, later: bool) -> None:
        """Read every unchecked run (those the last sync did not wait for too, with ``later``;
        without it, they are read at the next sync)."""
        for rec in list(self.pending):
            if later or not rec.later:
                self.check(rec)
            else:
                rec.later = False

    def take_error(self):
        """The first error found and not yet raised (and forget it), or None."""
        return self.errors.pop(0) if self.errors else None

    def forget(self, err) -> None:
        """``err`` is being raised by a read of a failed value: not again by a sync."""
        self.errors = [e for e in self.errors if e is not err]
