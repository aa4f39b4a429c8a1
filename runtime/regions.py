"""Compiled regions: the record of one compiled program, and what a compile-cache miss says.

A region is found by a key built from rolling hashes (so a hit costs no walk over the trace), and
a hit is accepted only once the region's own structure, its op entries and their wiring, equals
the run's (NOTE [verified hits]).
"""
from __future__ import annotations

from ..scheduler.records import sig_id


class Region:
    """One compiled program and what it needs to run (``entries``, ``wirings``: the structure it
    was compiled for; ``order``: NOTE [alias order] in flush.py)."""
    __slots__ = ("compiled", "entries", "wirings", "nops", "summary", "runs", "temp_bytes",
                 "lowered", "elided", "msgs", "transient", "order")

    def matches(self, entries: list, wirings) -> bool:
        """NOTE [verified hits]: a key is a bucket; this decides. Op entries are unique per op key
        (a cache entry stands for one op structure), so they compare by identity first."""
        return self.entries == entries and self.wirings == wirings


def _describe_sig(i):
    return sig_id.of.get(i)


def diff(a, b) -> str:
    """What differs between two op keys, in words."""
    fa, ta, kwa, sa, da = a
    fb, tb, kwb, sb, db = b
    if fa is not fb:
        return f"op {fb.name} where the cached region had {fa.name}"
    fb = fb.name
    if da != db:
        return f"{fb}: runs on tpu:{db}, cached tpu:{da}"
    # a tensor's signature: (base shape, base dtype, view chain, shape, strides, dtype)
    for i, (x, y) in enumerate(zip(sa, sb)):
        x, y = _describe_sig(x), _describe_sig(y)
        if x is None or y is None:
            continue
        if x[3] != y[3]:
            return f"{fb}: input {i} has shape {list(y[3])}, cached {list(x[3])}"
        if x[5] != y[5]:
            return f"{fb}: input {i} has dtype {y[5]}, cached {x[5]}"
        if x[0] != y[0]:
            return f"{fb}: input {i} is a view of a tensor of shape {list(y[0])}, cached {list(x[0])}"
        if x[2] != y[2] or x[4] != y[4]:
            return f"{fb}: input {i} is a different view"
    if ta != tb or kwa != kwb:
        # Python scalars that are inputs appear as (slot, index, type): only a type change shows.
        return (f"{fb}: arguments {tb} {dict(kwb)}, cached {ta} {dict(kwa)} (a baked-in value, a "
                "static argument or a Python scalar's type changed)")
    return f"{fb}: the wiring between ops differs"


def explain_miss(regions, keys: list) -> str:
    """Why a region compiled: compared with the closest cached region of the same length."""
    best, best_same = None, -1
    for r in regions:
        if r.__class__ is not Region or len(r.entries) != len(keys):
            continue
        # Same ops in the same places first, then identical op keys.
        same = sum(2 * (x.key[0] is y[0]) + (x.key == y) for x, y in zip(r.entries, keys))
        if same > best_same:
            best, best_same = r, same
    if best is None:
        return "new region structure (no cached region has this many ops)"
    first = None    # the first op key that differs, when every op is the same
    for k, (x, y) in enumerate(zip(best.entries, keys)):
        x = x.key
        if x[0] is not y[0]:
            # Other ops, not other shapes: name the first op that differs, never a shape
            # difference between two unrelated regions that happen to start alike.
            return (f"new region structure (no cached region runs these ops; the closest one of "
                    f"this length has {x[0].name} where this has {y[0].name}, op {k})")
        if first is None and x != y:
            first = (x, y)
    return diff(*first) if first else "same ops, different outputs or wiring"


def raise_oom(e, reg, memory):
    text = str(e)
    if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text:
        import torch
        memory.ooms += 1
        raise torch.OutOfMemoryError(
            f"tpu out of memory running a fused region ({reg.summary}). Live device buffers "
            f"{memory.allocated / 2**20:.1f} MB, peak {memory.peak / 2**20:.1f} MB, this region's XLA "
            f"temporaries {(reg.temp_bytes or 0) / 2**20:.1f} MB. Set DEFERFUSE_MEMORY_BUDGET to "
            f"split regions, or reduce the batch size. XLA said: {text.splitlines()[0]}") from e
