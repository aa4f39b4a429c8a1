"""The region hit path (NOTE [region hits]): a sync whose trace was seen before goes straight to the
executable that ran it, with the key it is found by (``HitKey``), what it holds (``Hit``) and the
sync it runs (``run``). The cache of hits is the runner's (``Runner.hits``), dropped with its
regions.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

from . import execute, stats
from .memory import COUNTERS as memory_stats
from .regions import raise_oom
from .runs import Run, Settings
from ..scheduler.policy import is_async

S = stats.S


# NOTE [region hits]: a sync whose trace was seen before (a training step's forward pass, its
# backward pass, a chain of small ops) most often runs as one compiled region, and every decision
# on the way there (the structure record, setup first, the loop and needed-first splits, the
# memory plan, the region key and its lookup) is a function of the trace's structure, the
# outputs' signature, which inputs something outside the trace holds (the donation pattern), the
# value the sync reads, whether it is within an outer loop's body, its device and the settings.
# ``HitKey`` is those; the first flush that ran its whole trace as one compiled ``Region`` leaves
# a ``Hit`` (the region, its structure, what it donates) under it, and a flush with the same key
# goes straight to the executable: it compares the structure (NOTE [verified hits]: the hash is a
# bucket, the comparison decides), checks that no input failed, then calls, donates and binds
# exactly as ``_region`` does, with the same counters. Anything else (a new key, another
# structure under it, a failed input, debug level 2 and up, cross-checks) takes the full path. The
# hits are dropped with the regions (``evict``, ``clear``).
@dataclass(frozen=True, slots=True)
class HitKey:
    """What a whole-trace region run is a function of (NOTE [region hits])."""
    h: int                      # the trace's structure hash (Trace.h)
    n: int                      # its ops
    held: tuple                 # per external input: something outside the trace holds it
    out_sig: tuple              # (node, output) of each value that leaves it
    want: tuple | None          # the positions its sync reads (NOTE [needed first])
    whole: bool                 # within an outer loop's body
    device: int
    cfg: Settings


class Hit:
    """What a region hit needs (NOTE [region hits]): the region, the structure it runs (compared
    on every hit) and its memory plan."""
    __slots__ = ("reg", "entries", "wirings", "donate", "donates", "donated_bytes")

    def __init__(self, reg, entries, wirings, mplan):
        self.reg, self.entries, self.wirings = reg, entries, wirings
        self.donate = mplan.donate
        self.donates = any(mplan.donate)
        self.donated_bytes = mplan.donated_bytes


key_of = attrgetter("key")
wiring_of = attrgetter("wiring")


def same_structure(nodes: list, entries: list, wirings: list) -> bool:
    """Whether ``nodes``' op entries and wirings are ``entries`` and ``wirings`` (NOTE [verified
    hits]); the engine gives the runner the C one (deferfuse/_fastpath.c), which makes no lists."""
    return list(map(key_of, nodes)) == entries and list(map(wiring_of, nodes)) == wirings


def run(runner, ctx, hit: Hit, held: tuple, out_sig: tuple, later: bool) -> bool:
    """Run ``runner``'s flushed trace as the region ``hit`` names (NOTE [region hits]); False, having
    done nothing, when the full path must run it."""
    fl = ctx.fl
    nodes, ext = fl.nodes, fl.ext
    entries, wirings = hit.entries, hit.wirings
    if not runner.same_structure(nodes, entries, wirings):    # NOTE [verified hits]
        S["region_hit_path"]["another structure"] += 1
        return False
    for v in ext:
        if v.array is None and v.err is not None:
            S["region_hit_path"]["a failed input"] += 1
            return False
    S["region_hit_path"]["hits"] += 1
    reg = hit.reg
    S["cache_hits"] += 1
    if hit.donates:
        donate = hit.donate
        don = [v.array for v, d in zip(ext, donate) if d]
        keep = [v.array for v, d in zip(ext, donate) if not d]
    else:
        don, keep = [], [v.array for v in ext]
    memory_stats.transient(reg.transient)
    outs = fl.outs
    with runner.interrupts:
        try:
            res, flags = execute.run_region(reg.compiled, don, keep, fl.scalars, fl.device)
        except Exception as e:
            raise_oom(e, reg, memory_stats)
            runner._around(ctx, Run(nodes, entries, wirings, range(len(nodes)), ext, held,
                                    fl.scalars, fl.h, outs, out_sig, later), None, e)
            return True
        runner.bind(reg, ext, hit.donate if hit.donates else None, hit.donated_bytes, outs, res)
        ctx.done = range(len(nodes))     # every position: one region ran them all
    if flags or runner.checks.pending:
        runner.checks.add(flags, reg.msgs, nodes, wirings, outs, out_sig, ext,
                          later or is_async(ctx.reason))
    return True
