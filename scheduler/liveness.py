"""Liveness over a trace and budget-aware cuts: pure Python over (wiring, bytes) records.

The trace is a DAG: nodes are ops in recording order, edges carry values. A value is
live from the op that produces it to its last reader, or to the end when a live tensor holds it.
``simulate`` walks the ops in order and reports live bytes after each; the runtime cuts a region
over its memory budget where the fewest bytes are live (scheduler/cut.py). Runs on a compile-cache
miss only; decisions depend on sizes and order, never on time.
"""
from __future__ import annotations


def simulate(wiring, out_bytes, ext_bytes, ext_held, live_outs) -> list[int]:
    """Live bytes right after each op runs (recording order).

    ``out_bytes[pos]``: bytes of op pos's outputs; ``ext_held[i]``: external input i stays alive
    throughout (a live tensor holds it); ``live_outs``: set of (pos, idx) that leave the region.
    """
    n = len(wiring)
    # recording order is a topological order: every op reads outputs of earlier ops only
    assert all(w[0] < q for q, ws in enumerate(wiring) for w in ws if isinstance(w, tuple))
    dies: list[list[int]] = [[] for _ in range(n)]        # bytes freed after op q
    last, ext_last = {}, [-1] * len(ext_bytes)
    for q, ws in enumerate(wiring):
        for w in ws:
            if isinstance(w, tuple):
                last[w] = q
            elif w is not None:
                ext_last[w] = q
    for q, sizes in enumerate(out_bytes):
        for i, b in enumerate(sizes):
            if (q, i) not in live_outs:
                dies[max(last.get((q, i), q), q)].append(b)
    for i, lu in enumerate(ext_last):
        if not ext_held[i] and lu >= 0:
            dies[lu].append(ext_bytes[i])
    live = sum(ext_bytes)
    out = []
    for q in range(n):
        live += sum(out_bytes[q])
        out.append(live)
        live -= sum(dies[q])
    return out

