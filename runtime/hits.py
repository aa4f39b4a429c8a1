"""The region hit path (NOTE [region hits]): a sync whose trace was seen before goes straight to the
executables that ran it, with the key it is found by (``HitKey``), what it holds (``Hit``: one
region; ``Pieces``: several, or a bucket's program) and the sync it runs (``run``,
``run_pieces``). The cache of hits is the runner's (``Runner.hits``), dropped with its regions.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from operator import attrgetter

from . import execute, stats
from .buckets import BucketHit
from .inflight import bind_all
from .memory import COUNTERS as memory_stats
from .regions import raise_oom
from .runs import Run, Settings
from ..scheduler.pieces import Piece, PieceNodes
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
# hits are dropped with the regions (``evict``, ``clear``) and when a bucket plan is refused. A
# flush that ran as pieces or in a bucket: NOTE [piece hits].
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
    __slots__ = ("reg", "entries", "wirings", "donate", "donates", "donated_bytes", "pack")

    def __init__(self, reg, entries, wirings, mplan, scalars):
        self.reg, self.entries, self.wirings = reg, entries, wirings
        self.donate = mplan.donate
        self.donates = any(mplan.donate)
        self.donated_bytes = mplan.donated_bytes
        # Which scalar is a float is a function of the key (each op's entry has its scalars'
        # types: NOTE [packed scalars]), so a hit's scalars are all floats when these are.
        self.pack = (execute.pack_floats if scalars and all(type(s) is float for s in scalars)
                     else execute.pack_scalars)


def hit_parts(ext: list, ext_uses: list, outs: list) -> tuple:
    """NOTE [hit key parts]: (held, out_sig) of a flush: per external input, whether something
    holds it beyond the ext list and the trace's own node inputs reading it (``ext_uses``), that is
    a storage (NOTE [donation safety]); per output, (its node's position, its output index). The
    engine gives the runner _fastpath.c's, one pass over each list."""
    getrc = sys.getrefcount      # (its holders: the ext list, the node inputs, getrc's argument)
    held = tuple([getrc(ext[i]) - 2 - ext_uses[i] > 0 for i in range(len(ext))])
    return held, tuple([(v.node.pos, v.idx) for v in outs])


key_of = attrgetter("key")
wiring_of = attrgetter("wiring")


def same_structure(nodes: list, entries: list, wirings: list) -> bool:
    """Whether ``nodes``' op entries and wirings are ``entries`` and ``wirings`` (NOTE [verified
    hits]); the engine gives the runner the C one (deferfuse/_fastpath.c), which makes no lists."""
    return list(map(key_of, nodes)) == entries and list(map(wiring_of, nodes)) == wirings


def _usable(runner, fl, entries, wirings) -> bool:
    """A hit may run the flushed trace ``fl``: the same structure (NOTE [verified hits]) and no
    input that failed after it was recorded; else the miss's reason is counted."""
    if not runner.same_structure(fl.nodes, entries, wirings):
        S["region_hit_path"]["another structure"] += 1
        return False
    for v in fl.ext:
        if v.array is None and v.err is not None:
            S["region_hit_path"]["a failed input"] += 1
            return False
    return True


def run(runner, ctx, hit: Hit, held: tuple, out_sig: tuple, later: bool) -> bool:
    """Run ``runner``'s flushed trace as the region ``hit`` names (NOTE [region hits]); False,
    having done nothing, when the full path must run it."""
    fl = ctx.fl
    nodes, ext = fl.nodes, fl.ext
    entries, wirings = hit.entries, hit.wirings
    if not _usable(runner, fl, entries, wirings):
        return False
    S["region_hit_path"]["hits"] += 1
    reg = hit.reg
    S["cache_hits"] += 1
    don, keep = execute.split_donated(ext, hit.donate if hit.donates else None,
                                      runner.buckets.padded)
    memory_stats.transient(reg.transient)
    outs = fl.outs
    with runner.interrupts:
        try:
            res, flags = execute.run_region(reg.compiled, don, keep, fl.scalars, fl.device,
                                            False, hit.pack)
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


# NOTE [piece hits]: a sync that ran as more than one region (a needed-first split: the loss's
# forward pass first, the rest after; setup first; a loop split) or as a bucket's program (a
# region whose sizes keep changing: NOTE [buckets]) is a function of the same ``HitKey``: the
# splits, the piece plans, each piece's memory plan and region key, the bucket a length falls in
# and its program are all worked out from the trace's structure and cached with it. The second
# flush of such a key records what each region it ran was (``Step``: where the piece's inputs,
# scalars and outputs are in the trace, and the compiled ``Region`` with its donation or the
# ``BucketHit`` with its program) and leaves a ``Pieces`` hit; a flush with that key then compares
# the whole trace's structure, checks that no input failed, and runs the steps in order, each
# exactly as ``_region`` or ``_run_bucket`` would (the same counters, the split counters the full
# path bumps included). A key seen once leaves only a mark (``SEEN``), so a trace whose keys never
# come back pays nothing for the record. Not recorded (the full path runs every time): a flush in
# which anything ran op by op or failed, a region was handed to the dispatch thread, or a region
# was split for churn or the memory budget; a later run's split pieces (whose own later flags the
# record cannot tell). A call that raises in a step runs that step op by op and the remaining
# steps through ``_region``, as the full path would.
SEEN = True
COUNTED = ("setup_splits", "needed_first_splits", "loop_splits")


class Step:
    """One region of a ``Pieces`` hit (NOTE [piece hits]). ``pc``: its trace positions and wiring
    as a ``Piece`` (None: the whole trace); ``src``: per input, an external input's index or
    (pos, idx) of a node's output; ``outs``: per output, an index into the flush's outputs or
    (pos, idx); ``spos``: the positions whose scalars it reads; then its ``Run`` fields, and
    ``reg`` (with ``donate``, None when nothing is donated) or ``bucket`` and ``prog``."""
    __slots__ = ("pc", "pos", "src", "outs", "spos", "entries", "wirings", "held", "h",
                 "out_sig", "later", "reg", "donate", "donated_bytes", "bucket", "prog")


class Pieces:
    """A hit that runs as several regions or a bucket's program (NOTE [piece hits]): the trace's
    structure (compared on every hit), its steps, the split counters to bump, and the piece
    positions for dump_trace."""
    __slots__ = ("entries", "wirings", "steps", "counts", "last")

    def __init__(self, entries, wirings, steps, counts, last):
        self.entries, self.wirings, self.steps = entries, wirings, steps
        self.counts, self.last = counts, last


def record(ctx) -> None:
    """Start recording what ``ctx``'s flush runs (NOTE [piece hits])."""
    ctx.rec = []
    ctx.counts0 = tuple([S[k] for k in COUNTED])


def _places(values, first: dict, nodes: dict) -> list | None:
    """Each value's place: its index in ``first`` (the flush's inputs or outputs, by id), else its
    (trace position, output) in ``nodes``; None when one has neither."""
    places = []
    for v in values:
        w = first.get(id(v))
        if w is None:
            w = nodes.get(id(v))
            if w is None:
                return None
        places.append(w)
    return places


def pieces_of(ctx, entries, wirings, last) -> Pieces | None:
    """The ``Pieces`` hit of what ``ctx``'s flush ran (``ctx.rec``: (run, Region, memory plan)
    or (run, BucketHit, program) per region, in order), or None when it cannot be one."""
    fl, whole = ctx.fl, ctx.whole
    nodes = fl.nodes
    n = len(nodes)
    at_ext = {id(v): i for i, v in enumerate(fl.ext)}
    at_out = {id(v): j for j, v in enumerate(fl.outs)}
    at_node = {}
    for p, nd in enumerate(nodes):
        for i, o in enumerate(nd.outs or ()):
            if o is not None:
                at_node[id(o)] = (p, i)
    steps, covered = [], set()
    for run, a, b in ctx.rec:
        st = Step()
        if run is whole:
            st.pc = st.src = st.outs = st.spos = None
            st.pos = range(n)
            st.later = False
        else:
            if whole.later:
                return None
            # Its nodes as a piece of the trace itself (a piece of a piece, too: ``run.pos`` are
            # always trace positions), for index checks and a replay.
            st.pc = pc = Piece()
            pc.pos, pc.wiring = list(run.pos), run.wirings
            src, outs = _places(run.ext, at_ext, at_node), _places(run.outs, at_out, at_node)
            if src is None or outs is None:
                return None
            spos = [p for p in run.pos if nodes[p].scalars]
            sc = [x for p in spos for x in nodes[p].scalars]
            if len(sc) != len(run.scalars) or any(x is not y for x, y in zip(sc, run.scalars)):
                return None
            st.src, st.outs, st.spos, st.pos = tuple(src), tuple(outs), tuple(spos), list(run.pos)
            st.later = run.later
        if covered.intersection(st.pos):
            return None
        covered.update(st.pos)
        st.entries, st.wirings, st.held, st.h = run.entries, run.wirings, run.held, run.h
        st.out_sig = run.out_sig
        if a.__class__ is BucketHit:
            st.reg = st.donate = None
            st.donated_bytes = 0
            st.bucket, st.prog = a, b
        else:
            st.reg, st.bucket, st.prog = a, None, None
            st.donate = b.donate if any(b.donate) else None
            st.donated_bytes = b.donated_bytes
        steps.append(st)
    if len(covered) != n:
        return None
    counts = tuple([(k, S[k] - c0) for k, c0 in zip(COUNTED, ctx.counts0) if S[k] != c0])
    return Pieces(entries, wirings, steps, counts, last)


def run_pieces(runner, ctx, hit: Pieces, later: bool) -> bool:
    """Run ``runner``'s flushed trace as the steps ``hit`` holds (NOTE [piece hits]); False,
    having done nothing, when the full path must run it."""
    fl = ctx.fl
    nodes, ext = fl.nodes, fl.ext
    if not _usable(runner, fl, hit.entries, hit.wirings):
        return False
    S["region_hit_path"]["piece hits"] += 1
    all_outs, device, checks = fl.outs, fl.device, runner.checks
    broken = False      # a step's call raised: the rest runs as _pieces runs it
    for st in hit.steps:
        pc = st.pc
        if pc is None:
            sub_ext, outs, sc = ext, all_outs, fl.scalars
        else:
            sub_ext = [ext[w] if w.__class__ is int else nodes[w[0]].outs[w[1]] for w in st.src]
            outs = [all_outs[j] if j.__class__ is int else nodes[j[0]].outs[j[1]]
                    for j in st.outs]
            sc = [x for p in st.spos for x in nodes[p].scalars]
        step_later = later or st.later
        if broken:
            sub = nodes if pc is None else PieceNodes(nodes, pc)
            try:
                runner._region(ctx, Run(sub, st.entries, st.wirings, st.pos, sub_ext, st.held, sc,
                                        st.h, outs, st.out_sig, step_later))
            finally:
                if pc is not None:
                    sub.release()
            continue
        reg = st.reg
        with runner.interrupts:
            try:
                if reg is not None:
                    S["cache_hits"] += 1
                    donate = st.donate
                    don, keep = execute.split_donated(sub_ext, donate, runner.buckets.padded)
                    memory_stats.transient(reg.transient)
                    res, flags = execute.run_region(reg.compiled, don, keep, sc, device)
                else:
                    res, flags = runner.buckets.execute(st.prog, st.bucket, sub_ext, sc, outs,
                                                        device, ctx.cfg.lazy_cuts)
            except Exception as e:
                if reg is not None:
                    raise_oom(e, reg, memory_stats)
                broken = True
                sub = nodes if pc is None else PieceNodes(nodes, pc)
                try:
                    runner._around(ctx, Run(sub, st.entries, st.wirings, st.pos, sub_ext, st.held,
                                            sc, st.h, outs, st.out_sig, step_later), None, e)
                finally:
                    if pc is not None:
                        sub.release()
                continue
            if reg is not None:
                runner.bind(reg, sub_ext, donate, st.donated_bytes, outs, res)
                msgs = reg.msgs
            else:
                bind_all(outs, res)
                msgs = st.prog.msgs
            if pc is None:
                ctx.done = st.pos
            else:
                ctx.done.update(st.pos)
        if reg is None:
            S["bucketed_runs"] += 1
        if flags or checks.pending:
            checks.add(flags, msgs, nodes if pc is None else PieceNodes(nodes, pc), st.wirings,
                       outs, st.out_sig, sub_ext, step_later)
    for k, c in hit.counts:
        S[k] += c
    if runner.last is not None:
        runner.last[3] = hit.last
    return True
