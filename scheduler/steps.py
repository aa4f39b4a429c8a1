"""Step detection: find the loop body in a trace that never syncs, from op-structure hashes only.

Deterministic: it looks at counts and hashes, never at time, so every rank of a job cuts alike.
"""
from __future__ import annotations

import numpy as np


def find_period(khashes: list[int], min_len: int = 8) -> int | None:
    """The smallest L >= min_len such that the last half of the trace, and the L ops before it,
    repeat with period L (so the loop body shows at least one full period before the last half)."""
    n = len(khashes)
    w = n // 2
    if w < 2 * min_len:
        return None
    a = np.asarray(khashes, dtype=np.int64)
    tail = a[n - w:]
    last = a[-1]
    # Candidate periods: distances to earlier occurrences of the last op's structure.
    cands = np.nonzero(a[n - 1 - w:n - 1] == last)[0]
    for j in sorted((n - 1) - (cands + n - 1 - w)):
        L = int(j)
        if L < min_len or L > w:
            continue
        if np.array_equal(tail[L:], tail[:-L]) and np.array_equal(a[n - w - L:n - L], tail):
            return L
    return None


def loop_phase(khashes: list[int], L: int) -> tuple[int, int]:
    """(where the repetitions begin, how many more ops until the next boundary of the loop's
    iterations) (NOTE [aligned cuts] in deferfuse/record.py): the repetitions with period ``L``
    begin where the trace stops differing from itself ``L`` ops later, and iterations start every
    ``L`` ops from there."""
    a = np.asarray(khashes, dtype=np.int64)
    n = len(a)
    miss = np.nonzero(a[:-L] != a[L:])[0]
    start = int(miss[-1]) + 1 if len(miss) else 0
    return start, (start - n) % L


def rolling(h: int, khash: int) -> int:
    return hash((h, khash))


def body_signature(khashes: list[int], L: int) -> tuple[int, int]:
    """(L, op-structure hash) of the last L ops, as the recorder computes it from an empty trace."""
    h = 0
    for k in khashes[-L:]:
        h = rolling(h, k)
    return (L, h)


LOOP_SPLIT_MIN_OPS = 256     # shorter traces run whole (one step of a model is never split)
CUT_MIN_OPS = 128            # early step detection cuts every k repetitions of a shorter body
LOOP_SPLIT_MIN_REPS = 3
LOOP_SPLIT_MIN_COVER = 0.5   # the repeated ops must be at least this share of the trace


def periodic_cuts(khashes: list[int], min_len: int = 8, max_candidates: int = 64) -> tuple | None:
    """NOTE [loop split]: a trace that holds many iterations of a loop (a training loop that logs
    every 100 steps: its one sync reads the loss after 100 steps) compiled as one program, and
    XLA's compile time grows with the program: 1,900 ops of a small MLP's steps took 98 s to
    compile on the development machine. Where at least ``LOOP_SPLIT_MIN_REPS`` repetitions of a
    body of ``min_len`` or more ops cover at least half of the trace, cut it into a prefix, one
    piece per repetition, and a suffix: the repetitions share one structure, so they compile once
    (the first may differ in which inputs it can donate) and run as cached regions.

    The period is found around the trace's middle op: each earlier occurrence of its structure is
    a candidate, and the one whose periodic run covers the most ops wins (ties: the shorter).
    Returns the end index of each piece, or None."""
    n = len(khashes)
    if n < LOOP_SPLIT_MIN_OPS:
        return None
    a = np.asarray(khashes, dtype=np.int64)
    p = n // 2
    occ = np.nonzero(a[:p] == a[p])[0]
    best = None
    for L in sorted(int(d) for d in p - occ)[:max_candidates]:
        if L < min_len:
            continue
        miss = np.nonzero(a[:-L] != a[L:])[0]       # a[i] != a[i + L]
        i0 = p - L
        k = np.searchsorted(miss, i0)
        if k < len(miss) and miss[k] == i0:
            continue
        s = int(miss[k - 1]) + 1 if k > 0 else 0    # the run of a[i] == a[i + L] holding i0
        e = int(miss[k]) if k < len(miss) else n - L
        reps = (e + L - s) // L
        cover = reps * L
        if reps >= LOOP_SPLIT_MIN_REPS and cover >= LOOP_SPLIT_MIN_COVER * n and \
                (best is None or cover > best[2]):
            best = (s, L, cover)
    if best is None:
        return None
    s, L, cover = best
    cuts = ([s] if s else []) + [s + L * k for k in range(1, cover // L + 1)]
    if cuts[-1] != n:
        cuts.append(n)
    return tuple(cuts)
