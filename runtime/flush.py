"""Run a consumed trace: verify its structure, cut it into the regions it runs as, find each region
in the compile cache (or compile it), execute, bind.

``Flush`` is what a trace hands over at a sync; ``Run`` is one region to run (the whole trace, or a
piece of it; both records are in runs.py); ``Runner`` owns the caches and runs them; a trace seen
before runs from its region hit (hits.py). A cache hit costs O(inputs + outputs) plus
one comparison of the structure (NOTE [verified hits]), never a compile.
"""
from __future__ import annotations

import sys

from . import execute, hits, inflight, replay, stats
from .memory import COUNTERS as memory_stats, LARGE
from .inflight import bind_all as _bind_all
from .checks import CheckList, dependents, ext_dependents
from .buckets import BucketHit, Buckets
from .diskcache import ProgramStore, region_key
from .errors import RegionError
from .hits import HitKey, key_of as _key_of, same_structure, wiring_of as _wiring_of
from .interrupts import Interrupts
from .jitmaps import MapGuard
from .regions import Region, explain_miss, raise_oom
from .runs import Ctx, Flush, Run, Settings
from ..scheduler import cut, memory, pieces, policy, steps
from ..scheduler.cache import Cache
from ..scheduler.records import Donated

S = stats.S
Policy = policy.CutPolicy
# The sets of shapes a churning structure remembers having compiled (NOTE [shape churn]).
_SHAPES_KEPT = 16
# Cuts nobody waits for (policy.is_async: the recorder's own cuts, scheduler/policy.py): the trace
# runs and recording goes on. Their index checks are read at the next real sync (NOTE [unchecked
# values] in checks.py).
is_async = policy.is_async


class _Struct:
    """What a trace structure taught: its ops and wiring (a hit compares them: NOTE [verified
    hits]), its loop-split cuts, its needed-first orders, and its piece plans."""
    __slots__ = ("entries", "wirings", "loop_cuts", "splits", "plans")

    def __init__(self, entries, wirings):
        self.entries, self.wirings = entries, wirings
        self.loop_cuts = 0          # 0: not worked out yet
        self.splits: dict = {}
        self.plans: dict = {}


def _structure(keys, wirings) -> tuple:
    """A region's structure across its sizes: each op key's first part and its wiring,
    the key of the shape-churn and bucket tables."""
    return tuple([(k[0], w) for k, w in zip(keys, wirings)])


class Runner:
    """Runs flushed traces, and owns every cache of that: verified trace structures, compiled
    regions, what churns, and the index checks not read yet."""

    def __init__(self, max_regions: int = 4096):
        self.structs = Cache("trace structures", 8192)
        self.hits = Cache("region hits", 4096)         # HitKey -> hits.Hit (NOTE [region hits])
        self.same_structure = same_structure    # the owner's C one, when it has it
        # (and its C ones of these: NOTE [run tables in C] in deferfuse/_fastpath.c)
        self.bind_values, self.drop_values = inflight.bind_values, inflight.drop_values
        self.hit_parts = hits.hit_parts
        # Past max_regions every region is dropped at once, with JAX's caches (evict): the
        # cache itself never rotates before that.
        self.regions = Cache("regions", 2 * max_regions + 2)
        self.max_regions = max_regions
        self.churn = Cache("region structures", 8192)   # ops+wiring -> [versions, keys, varied, shapes]
        self.once = Cache("regions run split once", 8192)
        self.ahead = Cache("bucket plans made ahead", 4096)    # NOTE [buckets ahead]
        self.checks = CheckList()
        self.programs = ProgramStore()      # NOTE [program store] (diskcache.py)
        self.buckets = Buckets()            # NOTE [buckets] (buckets.py)
        self.last = None        # [nodes, reason, src, pieces] of the latest trace (dump_trace)
        self.peak_seen = 0
        self.maps = MapGuard()              # NOTE [JIT mappings] (jitmaps.py)
        self.also_evict: tuple = ()         # the owner's caches of compiled programs (the engine's)
        self.interrupts = Interrupts()      # NOTE [interrupt safety] (interrupts.py)
        self.dispatcher = None      # the owner's execute.Dispatcher (NOTE [in flight])
        self.checks.settle = self.settle

    def caches(self) -> list:
        return [self.structs, self.hits, self.regions, self.churn, self.once, self.ahead,
                *self.buckets.caches()]

    def clear(self) -> None:
        for c in self.caches():
            c.clear()

    def evict(self) -> None:
        """Drop every compiled program: the regions, the owner's (``also_evict``: per-op programs,
        view reads) and JAX's in-process executables. Each holds memory mappings of XLA's CPU JIT,
        and a process that keeps thousands (generate() over many prompt lengths, a model zoo in one
        process) would otherwise run out of them and crash (NOTE [JIT mappings]). The on-disk
        caches make recompiling what comes back cheap."""
        import jax
        self.regions.evictions += len(self.regions)
        self.clear()
        for clear in self.also_evict:
            clear()
        jax.clear_caches()
        S["region_evictions"] += 1

    def relieve(self) -> None:
        """Drop every compiled program if the process nears its cap of memory mappings."""
        if self.maps.pressed():
            self.evict()

    # -----------------------------------------------------------------------------------------
    def start(self, fl: Flush, reason: str, src: str, cfg: Settings, max_regions: int) -> Ctx:
        if max_regions != self.max_regions:
            self.max_regions = max_regions
            self.regions.capacity = 2 * max_regions + 2
        return Ctx(fl, reason, src, cfg)

    def run(self, ctx: Ctx, later: bool) -> None:
        """Run a flushed trace. ``ctx`` records which positions ran (``done``) and the errors to
        raise (values that depend on them are failed already)."""
        fl, cfg = ctx.fl, ctx.cfg
        nodes, ext = fl.nodes, fl.ext
        # for dump_trace; the previous trace's nodes are freed with ctx, once the programs are
        # called (their frees are not on the way to the call)
        ctx.old, self.last = self.last, [nodes, ctx.reason, ctx.src, None]
        # Who else holds each input value (a storage: NOTE [donation safety]), and where each
        # output is made (NOTE [hit key parts] in hits.py)
        held, out_sig = self.hit_parts(ext, fl.ext_uses, fl.outs)
        hkey = None
        if cfg.debug < 2 and not cfg.cross_check:
            hkey = HitKey(fl.h, len(nodes), held, out_sig, fl.want, fl.whole, fl.device, cfg)
            hit = self.hits.get(hkey)
            if hit is None:
                S["region_hit_path"]["new key"] += 1
            elif hit is hits.SEEN:      # NOTE [piece hits]
                S["region_hit_path"]["seen once"] += 1
                hits.record(ctx)
            elif hit.__class__ is hits.Hit:
                if hits.run(self, ctx, hit, held, out_sig, later):
                    return
            else:
                if hits.run_pieces(self, ctx, hit, later):
                    return
                hits.record(ctx)
        else:
            S["region_hit_path"]["bypassed (debug 2+ or cross-check)"] += 1
        entries = list(map(_key_of, nodes))
        wirings = list(map(_wiring_of, nodes))
        skey = (fl.h, len(nodes))
        st = self.structs.get(skey)
        if st is None or not (st.entries == entries and st.wirings == wirings):
            st = _Struct(entries, wirings)
            self.structs[skey] = st
        whole = ctx.whole = Run(nodes, entries, wirings, range(len(nodes)), ext, held, fl.scalars,
                                fl.h, fl.outs, out_sig, later)
        if Policy.setup_split(len(nodes), bool(nodes) and cut.is_setup(entries[0].name),
                              cfg.setup_first):
            k = cut.setup_first(entries, wirings, out_sig)
            if k:       # NOTE [setup first] in scheduler/cut.py
                S["setup_splits"] += 1
                rest, st = self._setup_first(ctx, st, whole, k)
                want = fl.want
                if want is not None:
                    want = tuple(p - k for p in want) if min(want) >= k else None
                try:
                    self._trace(ctx, st, rest, want, fl.whole)
                finally:
                    rest.nodes.release()
                self._keep(ctx, hkey, entries, wirings)
                return
        self._trace(ctx, st, whole, fl.want, fl.whole)
        self._keep(ctx, hkey, entries, wirings)

    def _keep(self, ctx, hkey, entries, wirings) -> None:
        """Leave the hit of what the full path ran under ``hkey`` (NOTE [region hits], NOTE
        [piece hits] in hits.py)."""
        if hkey is None or ctx.errors:
            return
        if ctx.single is not None:
            reg, mplan = ctx.single
            self.hits[hkey] = hits.Hit(reg, entries, wirings, mplan, ctx.fl.scalars)
        elif ctx.rec is not None:
            hit = hits.pieces_of(ctx, entries, wirings, self.last[3])
            if hit is not None:
                self.hits[hkey] = hit
        elif hkey not in self.hits:
            self.hits[hkey] = hits.SEEN

    def bind(self, reg, ext, donate, donated_bytes: int, outs, res) -> None:
        """The step after ``reg``'s program returned ``res`` (on the full path, a region hit, or
        settled from the dispatch thread): count the run, fail the inputs it was given
        (``donate``: a flag per input, None when it was given none; NOTE [donation safety]), bind
        ``outs`` in its output order (NOTE [alias order]), note the peak."""
        reg.runs += 1
        S["donated_bytes"] += donated_bytes
        S["elided_bytes"] += reg.elided
        if donate is not None:
            # Donated buffers now belong to the outputs (no storage holds those values: NOTE
            # [donation safety]): stop counting them before the outputs are counted.
            memory_stats.add(*self.drop_values(ext, donate, Donated(reg.summary), LARGE))
        memory_stats.add(*self.bind_values(outs if reg.order is None else
                                           [outs[j] for j in reg.order], res, LARGE))
        if memory_stats.peak > self.peak_seen:
            self.peak_seen = memory_stats.peak
            S["peak_region"] = reg.summary

    def _trace(self, ctx, st, whole: Run, want, inside: bool) -> None:
        """Run ``whole`` (a trace, or what is left of one after its setup ops: NOTE [setup first])
        as the regions it is cut into; ``want``: the positions its sync reads; ``inside``: within
        an outer loop's body."""
        cfg = ctx.cfg
        entries, wirings = whole.entries, whole.wirings
        lf = 0 if whole.later else None     # pieces of a later run are later too
        # The splits to try, in order (the policy's: scheduler/policy.py); each is computed
        # from the structure and cached with it.
        for how in Policy.trace_splits(len(entries), inside, want is not None, cfg.loop_split,
                                       cfg.cross_check):
            if how is policy.Split.LOOP:
                cuts = st.loop_cuts
                if cuts == 0:
                    cuts = steps.periodic_cuts([e.ohash for e in entries])
                    # Repetitions whose sizes change (NOTE [shapeless loop bodies]): _pieces.
                    vary = (cuts is not None
                            and steps.periodic_cuts([e.khash for e in entries]) != cuts)
                    cuts = st.loop_cuts = None if cuts is None else (cuts, vary)
                if cuts is not None:        # see NOTE [loop split] in scheduler/steps.py
                    S["loop_splits"] += 1
                    self._pieces(ctx, st, whole, cuts[0], None, lf, cuts[1])
                    return
                continue
            split = st.splits.get(want, 0)
            if split == 0:
                split = st.splits[want] = cut.needed_first(wirings, want)
            if split is not None:
                # NOTE [needed first]: a sync that reads one value (``loss.item()`` after a
                # training step) needs only the ops that value depends on: the forward pass, not
                # the backward pass and the optimizer step recorded after it. Those run first, as
                # one region; the rest follows as a second region that the host does not wait for,
                # so it executes while Python records the next step. Values the second region
                # reads from the first leave the first as outputs. The split depends only on the
                # trace's structure, so it is cached with it. Index checks of the second region are
                # read at the next sync.
                order, n_first = split
                S["needed_first_splits"] += 1
                self._pieces(ctx, st, whole, (n_first, len(entries)), order, 1)
                return
        self._region(ctx, whole)

    def _setup_first(self, ctx, st, run: Run, k: int):
        """Run the first ``k`` ops of the trace ``run`` as a region of their own (NOTE [setup
        first] in scheduler/cut.py); return the rest as a ``Run`` that is the trace the recorder
        makes of those ops alone (the same structure hash, inputs in the same order, the same
        donation pattern), and its structure record."""
        nodes = run.nodes
        n = len(nodes)
        plan = st.plans.get(("setup", k))
        if plan is None:
            plan = st.plans[("setup", k)] = pieces.plan(nodes, range(n), (k, n))
        made = []
        for pc in plan:
            sub_ext, sub_held = [], []
            for w, later in zip(pc.src, pc.later):
                if w.__class__ is int:
                    sub_ext.append(run.ext[w])
                    sub_held.append(later or run.held[w])
                else:                   # a setup op's output (held if kept)
                    v = nodes[w[0]].outs[w[1]]
                    sub_ext.append(v)
                    sub_held.append(later or any(v is o for o in run.outs))
            lo = pc.pos[0]
            outs = [v for v in run.outs if lo <= v.node.pos < lo + len(pc.pos)]
            # What the rest reads leaves the setup region too (a carried state that no tensor
            # holds after the sync: NOTE [carried setup] in scheduler/cut.py), in trace order.
            for j, i in pc.needed:
                v = nodes[pc.pos[j]].outs[i]
                if not any(v is o for o in outs):
                    outs.append(v)
            outs.sort(key=lambda v: (v.node.pos, v.idx))
            sig = tuple((v.node.pos - lo, v.idx) for v in outs)
            sc = [x for p in pc.pos for x in nodes[p].scalars]
            made.append(Run(pieces.PieceNodes(nodes, pc), [run.entries[p] for p in pc.pos],
                            pc.wiring, [run.pos[p] for p in pc.pos], sub_ext, sub_held, sc, pc.h,
                            outs, sig, run.later))
        first, rest = made
        try:
            self._region(ctx, first)
        finally:
            first.nodes.release()
        skey = (rest.h, len(rest.entries))
        rst = self.structs.get(skey)
        if rst is None or not (rst.entries == rest.entries and rst.wirings == rest.wirings):
            rst = _Struct(rest.entries, rest.wirings)
            self.structs[skey] = rst
        return rest, rst

    def _pieces(self, ctx, st, run: Run, cuts, order, later_from, reps=False) -> None:
        """Run ``run`` (a whole trace) as pieces, one region each, one after another: its nodes in
        ``order`` (a topological order; trace order when None) cut at ``cuts``. Pieces from index
        ``later_from`` on are read at the next sync. The plan is cached with the structure.

        ``reps``: the pieces are repetitions of a loop body whose sizes change: each repetition
        leaves every value any of them leaves (the last one leaves what the loop's variables
        hold). A repetition then is the region the loop makes of it when it is cut at every
        repetition (as later, and in the next call: NOTE [aligned cuts] in deferfuse/record.py),
        and their programs (NOTE [buckets] in buckets.py) serve both."""
        nodes = run.nodes
        if nodes.__class__ is pieces.PieceNodes:
            iter(nodes)         # a piece split again: its nodes renumbered
        pk = (cuts, order)
        plan = st.plans.get(pk)
        if plan is None:
            plan = st.plans[pk] = pieces.plan(nodes, order or range(len(nodes)), cuts)
        if self.last is not None and self.last[0] is nodes:
            self.last[3] = [pc.pos for pc in plan]
        live = {}       # id(node) -> its outputs that tensors hold
        for v in run.outs:
            live.setdefault(id(v.node), []).append(v)
        live_ids = {id(v) for v in run.outs}
        ext, held = run.ext, run.held
        entries = run.entries
        union = None
        if reps:
            n_rep = max(len(pc.pos) for pc in plan)
            if Policy.plan_ahead(ctx.cfg.buckets, ctx.cfg.buckets_ahead, ctx.cfg.cross_check):
                self._plan_ahead(plan, entries, n_rep)
            union = set()
            for pc in plan:
                if len(pc.pos) == n_rep:
                    for j, p in enumerate(pc.pos):
                        for v in live.get(id(nodes[p]), ()):
                            union.add((j, v.idx))
        for k, pc in enumerate(plan):
            sub_ext, sub_held = [], []
            for w, later in zip(pc.src, pc.later):
                if w.__class__ is int:
                    sub_ext.append(ext[w])
                    sub_held.append(later or held[w])
                else:
                    v = nodes[w[0]].outs[w[1]]
                    sub_ext.append(v)
                    sub_held.append(later or id(v) in live_ids)
            sc, piece_outs, sig = [], [], []
            for j, p in enumerate(pc.pos):
                n = nodes[p]
                if n.scalars:
                    sc.extend(n.scalars)
                lv = live.get(id(n))
                if lv is not None:
                    piece_outs.extend(lv)
                    sig.extend([(j, v.idx) for v in lv])
            more = pc.needed
            if union and len(pc.pos) == n_rep:
                more = list(more) + sorted(union)
            if more:
                have = {id(v) for v in piece_outs}
                for j, i in more:
                    outs = nodes[pc.pos[j]].outs
                    if i >= len(outs):
                        # the union's (j, i) from a repetition; this piece is as long as one but
                        # holds other ops (the loop's setup or tail): nothing to leave there
                        continue
                    v = outs[i]
                    if id(v) not in have:
                        have.add(id(v))
                        piece_outs.append(v)
                        sig.append((j, i))
                if union and len(pc.pos) == n_rep:
                    order = sorted(range(len(sig)), key=sig.__getitem__)
                    piece_outs = [piece_outs[q] for q in order]
                    sig = [sig[q] for q in order]
            sub = pieces.PieceNodes(nodes, pc)
            try:
                self._region(ctx, Run(sub, [entries[p] for p in pc.pos], pc.wiring,
                                      [run.pos[p] for p in pc.pos],
                                      sub_ext, sub_held, sc, pc.h, piece_outs, tuple(sig),
                                      run.later or (later_from is not None and k >= later_from)))
            finally:
                sub.release()

    def _plan_ahead(self, plan, entries, n_rep: int) -> None:
        """NOTE [buckets ahead]: a loop whose sizes change, recorded before its body was known (a
        growing sequence's first trace holds several tokens), hands over its first repetitions at
        once. Its first two repetitions of one structure, both at hand, make the bucket plan
        before the first one runs (``Buckets.find`` from the two versions), so the first runs in
        the bucket's program too: the loop's first call no longer compiles an exact program for
        its first length (one of nanoGPT sampling's three programs, about a third of its first
        call), which only that length used. A plan refused (an op with no rule) changes nothing:
        the first repetition compiles exactly, as before."""
        two = [pc for pc in plan if len(pc.pos) == n_rep][:2]
        if len(two) < 2:
            return
        ents = [[entries[p] for p in pc.pos] for pc in two]
        structs = [_structure([e.key for e in es], pc.wiring) for es, pc in zip(ents, two)]
        struct = structs[0]
        if structs[1] != struct or struct in self.churn or struct in self.ahead:
            return
        self.buckets.note(struct, ents[0])
        if self.buckets.find(struct, ents[1], two[1].wiring, S) is not None:
            self.ahead[struct] = True

    def _region(self, ctx, run: Run) -> None:
        """Run one region: find it (or compile it), check its inputs, execute, bind."""
        cfg = ctx.cfg
        if self.dispatcher is not None and self.dispatcher.job is not None:
            self.settle()       # its outputs may be this region's inputs (NOTE [in flight])
        failed = [i for i, v in enumerate(run.ext) if v.array is None and v.err is not None]
        if failed:
            # An input failed (NOTE [value states]): what reads it fails too; the rest runs.
            self._around(ctx, run, {i: run.ext[i].err for i in failed}, None)
            return
        mplan = memory.plan([v.nbytes for v in run.ext], run.held, [v.nbytes for v in run.outs], 0,
                            None, cfg.planner and not cfg.cross_check)
        donate = mplan.donate
        key = (run.h, len(run.entries), len(run.ext), run.out_sig, donate, cfg.budget,
               ctx.fl.device)
        reg = self.regions.get(key)
        if reg is not None and reg.__class__ is not tuple and not reg.matches(run.entries,
                                                                               run.wirings):
            S["hash_collisions"] += 1
            reg = None
        if reg.__class__ is BucketHit:  # runs in a bucket (NOTE [buckets])
            if cfg.buckets:
                self._run_bucket(ctx, run, reg)
                return
            reg = None
        if reg.__class__ is tuple:      # split for the memory budget on an earlier run
            ctx.rec = None
            st = _Struct(run.entries, run.wirings)
            self._pieces(ctx, st, run, reg, None, 0 if run.later else None)
            return
        if reg is None:
            reg = self._compile(ctx, run, key, mplan)
            if reg is None:
                return
        else:
            S["cache_hits"] += 1
            if cfg.debug >= 2:
                print(f"[deferfuse] region hit: {reg.summary}", file=sys.stderr)
        if cfg.debug >= 3:
            for j, n in enumerate(run.nodes):
                print(f"    {j:5d} {n.name} {run.wirings[j]} at {n.src}", file=sys.stderr)
        # (bound here, after the lookup: a miss that runs in a bucket pads from its padded
        # inputs, never cut: NOTE [lazy cuts] in buckets.py)
        don, keep = execute.split_donated(run.ext, donate, self.buckets.padded)
        memory_stats.transient(reg.transient)
        if (cfg.dispatch and (run.later or is_async(ctx.reason)) and not cfg.cross_check
                and self.dispatcher is not None):
            self._dispatch(ctx, run, reg, mplan, don, keep)
            return
        outs = run.outs
        with self.interrupts:
            try:
                res, flags = execute.run_region(reg.compiled, don, keep, run.scalars,
                                                 ctx.fl.device)
            except Exception as e:
                raise_oom(e, reg, memory_stats)
                self._around(ctx, run, None, e)
                return
            self.bind(reg, run.ext, donate if don else None, mplan.donated_bytes, outs, res)
            ctx.done.update(run.pos)
            if ctx.rec is not None:
                ctx.rec.append((run, reg, mplan))
        if run is ctx.whole:
            ctx.single = (reg, mplan)   # NOTE [region hits]
        if flags or self.checks.pending:
            self.checks.add(flags, reg.msgs, run.nodes, run.wirings, outs, run.out_sig, run.ext,
                            run.later or is_async(ctx.reason))
        if cfg.cross_check:
            replay.cross_check(run, self.programs)

    def _dispatch(self, ctx, run: Run, reg, mplan, don, keep) -> None:
        """Call ``reg`` on the dispatch thread (NOTE [in flight] in execute.py); ``settle`` binds
        its outputs as ``_region`` binds a call made here."""
        ctx.rec = None      # not a hit (NOTE [piece hits])
        with self.interrupts:
            inflight.dispatch(self, ctx, run, reg, mplan, don, keep,
                              run.later or is_async(ctx.reason))

    def settle(self) -> None:
        """Bind the outputs of the region call in flight, once it returned (NOTE [in flight])."""
        d = self.dispatcher
        if d is None or d.job is None:
            return
        with self.interrupts:
            job = d.take()
            fin, job.finish = job.finish, None
            fin(job)

    def _compile(self, ctx, run: Run, key, mplan):
        """Compile ``run`` as a region (or split it, or run it op by op); None when it ran here."""
        cfg = ctx.cfg
        keys = [e.key for e in run.entries]
        # The structure: which ops, wired how; shapes, dtypes and static arguments left out.
        struct = _structure(keys, run.wirings)
        seen = self.churn.get(struct)
        n_compiled = seen[0] if seen else 0
        # The same ops at the same shapes compiled before under another key (another donation
        # pattern or set of outputs): not a new version of its shapes (NOTE [shape churn]).
        tkeys = tuple(keys)
        same = seen is not None and tkeys in seen[3]
        in_buckets = Policy.in_buckets(cfg.buckets, cfg.cross_check)
        if in_buckets:
            # (first seen here: a bucket an earlier process learned, NOTE [learned on disk])
            # (planned ahead from two repetitions at hand: NOTE [buckets ahead])
            found = (self.buckets.find(struct, run.entries, run.wirings, S)
                     if seen or struct in self.ahead else
                     self.buckets.recall(struct, run.entries, run.wirings, S))
            if found is not None:
                hit = self.regions[key] = BucketHit(found[0], found[1], run.entries, run.wirings)
                self._run_bucket(ctx, run, hit, explain_miss(self.regions.values(), keys))
                return None
        # NOTE [shape churn]: this structure keeps coming back with new shapes that do not fit
        # buckets (NOTE [buckets] in buckets.py). Past the limit it is split: runs of ops whose
        # keys never changed become regions of their own, compiled once; the ops whose shapes
        # change run apart (as regions until those too churn, then op by op). A version that comes
        # back (the same prompt length again) runs split the same way, so its pieces are found
        # compiled (what a loop taught converges in one call), except one that ran op by op: that
        # one recurs, and compiles whole on its second run. The policy decides
        # (CutPolicy.new_shapes in scheduler/policy.py); what it remembers is kept here.
        if seen and not same:
            # (a version at a new base of a family that runs in buckets: NOTE [new bases])
            base = in_buckets and self.buckets.relearns(struct, run.entries)
            sp, memo = Policy.new_shapes(n_compiled, cfg.shape_limit, self.once.get(key),
                                         seen[1], keys, seen[2], base)
            if memo is not None:
                self.once[key] = memo
            if sp.how is policy.Shapes.SPLIT:
                S["shape_splits"] += 1
                ctx.rec = None
                self._pieces(ctx, _Struct(run.entries, run.wirings), run, sp.cuts, None,
                             0 if run.later else None)
                return None
            if sp.how is policy.Shapes.OP_BY_OP:
                S["shape_fallbacks"] += 1
                self._around(ctx, run, None, None)
                return None
        if len(self.regions) >= self.max_regions or self.maps.pressed():
            self.evict()
        why = explain_miss(self.regions.values(), keys)
        plan, s0 = [], 0
        for e, w, n in zip(run.entries, run.wirings, run.nodes):
            k = len(n.scalars)
            plan.append((e.fn, w, s0, k))       # (lowering, wiring, first scalar, scalars)
            s0 += k
        order = _alias_order(run.outs, run.ext, mplan.donate, ctx.fl.partner)
        sig = run.out_sig if order is None else tuple([run.out_sig[j] for j in order])
        store = self.programs
        don, keep = execute.split_donated(run.ext, mplan.donate, self.buckets.padded)
        skey = region_key(run.entries, run.wirings, sig, mplan.donate, don, keep,
                          tuple(type(s) is float for s in run.scalars),
                          ctx.fl.device) if store.on else None
        try:
            compiled, lowered, dt, msgs, fresh = execute.compile_region(
                plan, sig, mplan.donate, don, keep, run.scalars, ctx.fl.device, store, skey)
        except Exception as e:   # a lowering failed while tracing: find the op
            self._around(ctx, run, None, e)
            return None
        reg = Region()
        reg.compiled, reg.entries, reg.wirings, reg.nops, reg.runs = (
            compiled, run.entries, list(run.wirings), len(run.entries), 0)
        reg.order = order
        reg.msgs = msgs
        reg.lowered = lowered
        reg.summary = (f"{reg.nops} ops ({run.nodes[0].name} .. {run.nodes[len(run.entries) - 1].name}), "
                       f"synced by {ctx.reason} at {ctx.src}")
        try:
            reg.temp_bytes = compiled.memory_analysis().temp_size_in_bytes
        except Exception:
            reg.temp_bytes = None
        out_bytes = sum(v.nbytes for v in run.outs)
        if cfg.budget:
            est = sum(v.nbytes for v in run.ext) + out_bytes + (reg.temp_bytes or 0)
            if Policy.over_budget(len(run.entries), est, cfg.budget):
                cuts = cut.budget_cut(run.wirings,
                                      [[0 if o is None else o.nbytes for o in n.outs]
                                       for n in run.nodes],
                                      [v.nbytes for v in run.ext], run.held, set(run.out_sig))
                if len(cuts) > 1:
                    ctx.rec = None
                    self.regions[key] = cuts
                    S["budget_splits"] += 1
                    if cfg.debug >= 2:
                        print(f"[deferfuse] region of {reg.nops} ops needs ~{est / 2**20:.1f} MB "
                              f"> budget {cfg.budget / 2**20:.1f} MB: split at {cuts[:-1]}",
                              file=sys.stderr)
                    self._pieces(ctx, _Struct(run.entries, run.wirings), run, cuts, None,
                                 0 if run.later else None)
                    return None
        node_bytes = sum(o.nbytes for n in run.nodes for o in n.outs if o is not None)
        reg.elided = max(node_bytes - out_bytes, 0)
        # What running it needs beyond what is allocated (outputs and donation are in the key).
        reg.transient = (reg.temp_bytes or 0) + out_bytes - mplan.donated_bytes
        if n_compiled and fresh:
            S["recompiles"] += 1
        if seen is None:
            self.churn[struct] = [1, keys, set(), {tkeys}]
        elif not same:
            seen[0] += 1
            if len(seen[3]) < _SHAPES_KEPT:
                seen[3].add(tkeys)
        if cfg.buckets:
            self.buckets.note(struct, run.entries)
        self.regions[key] = reg
        how = "compiled" if fresh else ("loaded from disk" if lowered is None else
                                        "compiled by XLA from its disk cache")
        S["miss_reasons"].append((reg.summary, why if fresh else f"{why}; {how}", dt))
        del S["miss_reasons"][:-64]
        if cfg.debug >= 2:
            print(f"[deferfuse] region MISS ({why}): {reg.summary}; {how} in {dt*1e3:.1f} ms",
                  file=sys.stderr)
        if cfg.debug >= 4:
            print(lowered.as_text() if lowered is not None else "(a program loaded from disk)",
                  file=sys.stderr)
        return reg

    def _run_bucket(self, ctx, run: Run, hit, why: str = "") -> None:
        """Run ``run`` in its bucket's program (NOTE [buckets] in buckets.py); ``why``: what
        differs from the closest compiled region (for the report, if a program is made)."""
        cfg = ctx.cfg
        try:
            prog = self.buckets.program(hit.plan, hit.plan.fit.bucket(hit.t), run, ctx.fl.device,
                                        self.programs, cfg.debug, S, why)
        except Exception as e:     # a case the rules did not foresee: run it exactly
            self.buckets.refuse(hit.plan, e, S)
            self.hits.clear()       # a piece hit may hold one of its programs (NOTE [piece hits])
            for k, v in self.regions.items():
                if v.__class__ is BucketHit and v.plan is hit.plan:
                    self.regions.pop(k)
            self._around(ctx, run, None, None)
            return
        outs = run.outs
        with self.interrupts:
            try:
                res, flags = self.buckets.execute(prog, hit, run.ext, run.scalars, outs,
                                                  ctx.fl.device, cfg.lazy_cuts)
            except Exception as e:
                self._around(ctx, run, None, e)
                return
            _bind_all(outs, res)
            ctx.done.update(run.pos)
            if ctx.rec is not None:
                ctx.rec.append((run, hit, prog))
        S["bucketed_runs"] += 1
        if cfg.debug >= 2:
            print(f"[deferfuse] region in bucket {prog.P} (at {hit.t}): {prog.summary}",
                  file=sys.stderr)
        if flags or self.checks.pending:
            self.checks.add(flags, prog.msgs, run.nodes, run.wirings, outs, run.out_sig, run.ext,
                            run.later or is_async(ctx.reason))

    def _around(self, ctx, run: Run, failed_ext, err) -> None:
        """Run ``run`` op by op around what cannot run: the ops reading a failed input
        (``failed_ext``: index -> its error), or the op whose lowering or execution failed (``err``;
        found by running op by op). Their outputs, and what depends on them, become failed; every
        other output is computed. With neither (shape churn), simply op by op."""
        ctx.rec = None      # not a hit (NOTE [piece hits])
        bad = set()
        first = None
        if failed_ext:
            bad = ext_dependents(run.wirings, failed_ext)
            first = next(iter(failed_ext.values()))
        rp, found = None, False
        while True:
            rp, bad_pos, e = replay.run_around(run, bad, rp, self.programs)
            if bad_pos is None:
                break
            found = True
            n = run.nodes[bad_pos]
            if isinstance(e, replay.FlagFailure):
                why = e.error       # an index check: its own type and message, as CPU's
            else:
                why = RegionError(
                    f"{n.name} failed inside a fused region, recorded at {n.src}: "
                    f"{type(e).__name__}: {e}\nRerun with TORCHTPU_MODE=debug (or "
                    "`with deferfuse.mode('debug'):`) to raise at the line that fails.")
                why.__cause__ = e
            if first is None:
                first = why
                ctx.errors.append(why)
            bad |= dependents(run.wirings, bad_pos)
        if err is not None and not found and not failed_ext:
            # Every op succeeds on its own: the values op by op are right; say so.
            import warnings
            warnings.warn(f"deferfuse: a fused region of {len(run.entries)} ops failed "
                          f"({type(err).__name__}: {err}), but every op succeeds on its own; it ran "
                          "op by op. Please report this.", RuntimeWarning, stacklevel=2)
        for v, (p, i) in zip(run.outs, run.out_sig):
            if p in bad:
                v.fail(first)
            else:
                r = rp.env.get((p, i))
                if r is not None:
                    v.bind(r)
        ctx.done.update(run.pos)


def _alias_order(outs, ext, donate, partner):
    """NOTE [alias order]: JAX gives each output, in output order, the first donated input buffer of
    the same shape and dtype still free. A training step's outputs come in the order their storages
    were first written: the gradients (backward), then the parameters and optimizer states (the
    optimizer step). So a parameter's donated buffer went to its gradient, and XLA copied the old
    parameter out first (the backward pass and the update still read it), then copied the gradient
    in: two copies of every parameter per step. Outputs that are a storage's new value, whose old
    value is a donated input, come first here, in the order of those inputs, so each takes its own
    storage's buffer and is written in place (the MLP step's optimizer region went from 12 copies
    to 2).
    Returns the output order (indices into ``outs``), or None to keep it."""
    if not partner or not any(donate):
        return None
    at = {id(v): i for i, (v, d) in enumerate(zip(ext, donate)) if d}
    first = []
    for j, v in enumerate(outs):
        i = at.get(partner.get(id(v)))
        if i is not None:
            first.append((i, j))
    if not first:
        return None
    first.sort()
    order = [j for _, j in first]
    taken = set(order)
    order += [j for j in range(len(outs)) if j not in taken]
    return None if order == list(range(len(outs))) else tuple(order)
