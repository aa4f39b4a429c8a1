"""Running a region op by op (each op its own cached jit): for shape churn, to run around an op that
failed, and for the cross-check switch."""
from __future__ import annotations

import numpy as np

from . import execute
from .errors import RegionError
from .lowering import flag_message


class FlagFailure(Exception):
    """An op's index check failed while running op by op (``error``: the error to raise)."""

    def __init__(self, error):
        super().__init__(str(error))
        self.error = error


class Replay:
    """Op-by-op results: ``env[(position, output)]`` and the positions that ran."""
    __slots__ = ("env", "ran")

    def __init__(self):
        self.env: dict = {}
        self.ran: set = set()


def run_around(run, skip: set, rp: Replay | None = None, store=None):
    """Run the ops of ``run`` not in ``skip`` (positions, grown by the ops that read a skipped
    op) and not run yet, in order. Returns (the ``Replay``, the position of the first op that
    raised or None, its exception)."""
    rp = Replay() if rp is None else rp
    env = rp.env
    for j, (entry, wiring) in enumerate(zip(run.entries, run.wirings)):
        if j in rp.ran:
            continue
        if j in skip or any(w.__class__ is tuple and w[0] in skip for w in wiring):
            skip.add(j)
            continue
        n = run.nodes[j]
        try:
            arrays = [None if w is None else
                      (run.ext[w].exact() if w.__class__ is int else env[w]) for w in wiring]
            with execute.x64(True):
                res, flags = execute.call_op(entry, arrays, list(n.scalars), store)
                for fl, (exc, msg) in zip(flags, entry.msgs):
                    fl = np.asarray(fl)
                    if bool(fl):
                        raise FlagFailure(exc(f"{flag_message(msg, fl)} ({n.name} recorded at "
                                              f"{n.src})"))
        except Exception as e:
            return rp, j, e
        rp.ran.add(j)
        for i, o in enumerate(res):
            env[(j, i)] = o
    return rp, None, None


def cross_check(run, store=None) -> None:
    """Run ``run`` again op by op and compare every output it bound with the fused result."""
    rp, bad, e = run_around(run, set(), None, store)
    env = rp.env
    if bad is not None:
        n = run.nodes[bad]
        raise RegionError(f"cross-check: {n.name} recorded at {n.src} fails op by op: "
                          f"{type(e).__name__}: {e}") from e
    for v, (p, i) in zip(run.outs, run.out_sig):
        if v.array is None:
            continue
        a, b = np.asarray(v.exact()), np.asarray(env[(p, i)])
        if a.dtype.kind in "fc":
            ok = np.allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-4, atol=1e-5,
                             equal_nan=True)
        else:
            ok = np.array_equal(a, b)
        if not ok:
            n = run.nodes[p]
            raise RegionError(f"cross-check: {n.name} recorded at {n.src} gives different results "
                              f"fused and op by op (max abs diff "
                              f"{np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))):.3g})")
