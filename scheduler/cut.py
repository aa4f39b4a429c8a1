"""Where to cut a region into pieces that run one after another: pure Python over trace records.

Two reasons to cut, both decided on a compile-cache miss only:

- memory budget: cut where the fewest bytes are live (``budget_cut``, from ``liveness.simulate``);
- shape churn: a structure that keeps coming back with new shapes is cut between the ops whose keys
  changed and those that never did (``churn_cuts``), so the unchanging runs compile once.

A cut list is the end index of each piece, the last one being the trace length.
"""
from __future__ import annotations

from . import liveness


def budget_cut(wiring: list, out_bytes: list, ext_bytes: list, held: list, live_outs: set) -> tuple:
    """Split at the op after which the fewest bytes are live, within the middle half (each half is
    checked again when it compiles)."""
    live = liveness.simulate(wiring, out_bytes, ext_bytes, held, live_outs)
    n = len(wiring)
    lo, hi = max(1, n // 4), max(2, (3 * n) // 4)
    cut = min(range(lo, min(hi, n)), key=lambda q: (live[q - 1], q)) if n > 1 else n
    return (cut, n) if 0 < cut < n else (n,)


def churn_cuts(first: list, keys: list, vary: set) -> tuple | None:
    """Cuts between runs of ops whose keys changed since ``first`` (accumulated into ``vary``) and
    runs that never did; None when every op changed (nothing stable to keep fused) or none did."""
    vary.update(i for i, (a, b) in enumerate(zip(first, keys)) if a != b)
    n = len(keys)
    cuts = [i for i in range(1, n) if (i in vary) != (i - 1 in vary)]
    if len(vary) >= n or not cuts:
        return None
    return tuple(cuts) + (n,)
