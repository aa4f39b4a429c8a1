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


def rolling(h: int, khash: int) -> int:
    return hash((h, khash))


def body_signature(khashes: list[int], L: int) -> tuple[int, int]:
    """(L, op-structure hash) of the last L ops, as the recorder computes it from an empty trace."""
    h = 0
    for k in khashes[-L:]:
        h = rolling(h, k)
    return (L, h)
