"""Buckets: one program for every length of a region whose sizes keep changing.

NOTE [buckets]: a loop that grows a sequence (generate() appending a token with ``torch.cat``, a KV
cache growing by one position per step) records the same region again and again with one size
changed, and each version was a compile (a 1,800-op region compiled again per length, or the
changing ops run one by one). Here such a region runs as a program compiled for a *bucket* of
lengths: every size that depends on the length is padded to what it is where the first of them
reaches the next power of two, the inputs are padded with zeros (on the host: a new length costs no
compile), the program runs, and each output is cut back to its exact size. The exact length is a
program input, so masks and offsets inside use it.

Finding the length. Two versions of a structure (same ops and wiring) that differ in sizes are
compared int by int: every int in the ops' structure (the sizes of their inputs, views and outputs,
and static arguments that are sizes; nothing else may change) must be constant or ``a * s + b``,
with integers ``a`` (all of one sign) and ``b``, one length ``s`` for the whole region (0 at the
first version). Every later version is checked before it runs; one that does not fit compiles
exactly (counted in ``metrics()['bucket_misfits']``). The second version already runs padded: it
fits by construction, and the padding rules make any version that fits exact.

Padding is exact where it is used: data that the padding adds is never read into a valid position.
How each op runs padded, and which ops refuse, is ``plan_node``'s (bucket_node.py); the ints of a
structure and their fit are in bucket_fit.py, an op's padded function in bucket_fn.py, a region's
plan and program in bucket_region.py; this file keeps what bucketing learned (``Buckets``).
Where a region is refused, its shapes go on compiling as before (shape churn: runtime/flush.py).
Programs are kept per (structure, bucket); a bucket's program is stored on disk like any other
(NOTE [program store] in diskcache.py).
"""
from __future__ import annotations

import jax

from .bucket_fit import MIN_BUCKET, Fit, Refused, at, bucket_of, fit, flatten  # noqa: F401
from .bucket_region import (_at, BucketPlan, BucketProgram, cut, describe_plan,  # noqa: F401
                            pad, plan_region, region_function, repad)
from ..scheduler.records import Padded
from .stats import S
from .learned import LearnedStore


# NOTE [lazy cuts]: cutting a bucket run's output to its exact shape right after the run made the
# host wait for the program there (on a CPU device the cut is a host copy of the finished array),
# before it could go on recording the next token. So the output is bound lazily cut: its Value's
# ``array`` is a ``Padded`` (the bucket-shaped array, counted at its padded size: one array, no
# second copy), a state of NOTE [value states]. A later bucket run that takes it pads straight
# from the padded array (one host copy of its exact part into zeros: the program never reads the
# padding, whose contents are whatever the program left there, so it is never passed on as it
# is); every other reader takes data through ``Value.exact``, which cuts it once: ``Engine.ready``
# (``.cpu()``, ``.item()``, printing, checkpoints, compiled mode's and collectives' inputs,
# packed boundaries), a region's input binding (``execute.split_donated``: the full path, a region
# hit, a piece hit; donation donates the cut array), strict mode's ops (``run_op``), a bucket
# program's compile and its inputs that are not padded. ``Padded`` is no array, so a reader that
# skips the cut fails (no program or numpy takes it) instead of reading padding. The cut at a
# read goes through the host on a CPU device (the reader waits for the array anyway): no program
# per exact shape. ``DEFERFUSE_LAZY_CUTS=0`` cuts right after the run, as before.

# NOTE [new bases]: plans per region family (each a base the family was met at) and versions kept
# to fit a new base against; past them a family's new sizes compile as shape churn.
MAX_PLANS = 8
MAX_VERSIONS = 8


class Refusal:
    """A fit whose plan was refused (``why``): versions it takes compile exactly."""
    __slots__ = ("fit", "why")

    def __init__(self, fit, why):
        self.fit, self.why = fit, why


def _closest(vs, ints, mask):
    """The kept version with the fewest ints unlike ``ints`` (and the same may-change mask;
    never ``ints`` itself), or None."""
    best, nb = None, None
    for v in vs:
        if v[3] != mask or v[0] == ints:
            continue
        d = sum(x != y for x, y in zip(v[0], ints))
        if nb is None or d < nb:
            best, nb = v, d
    return best


class BucketHit:
    """A region key that runs in a bucket: the plan, its length ``t``, and the structure it was
    found for (a hit compares it: NOTE [verified hits] in regions.py)."""
    __slots__ = ("plan", "t", "entries", "wirings")

    def __init__(self, plan, t, entries, wirings):
        self.plan, self.t, self.entries, self.wirings = plan, t, entries, list(wirings)

    def matches(self, entries, wirings) -> bool:
        return self.entries == entries and self.wirings == wirings


class Buckets:
    """What bucketing learned (NOTE [buckets]): versions of each region structure, the plans made
    from them (or why not), and their compiled programs."""

    def __init__(self):
        from ..scheduler.cache import Cache
        self.versions = Cache("bucket versions", 4096)   # structure -> [(ints, entries, lens)]
        self.plans = Cache("bucket plans", 4096)         # family -> [BucketPlan or Refusal]
        self.ints = Cache("bucket ints", 1 << 15)        # id(entry) -> (entry, ints)
        self.moves = Cache("bucket pad and cut programs", 4096)   # off CPU: NOTE on pad()
        self.bases = Cache("bucket bases learned", 4096)  # family -> relearns (NOTE [new bases])
        self.learned = LearnedStore()   # NOTE [learned on disk] (learned.py)
        # Whether a lazily cut value was ever made here (NOTE [lazy cuts]): until then a region's
        # input binding looks at no input for one. Set, never reset: safe from any thread.
        self.padded = False

    def caches(self) -> list:
        return [self.versions, self.plans, self.ints, self.moves, self.bases]

    def _ints(self, entries):
        """(ints, may-change mask, skeletons, ints per entry) of a version, or Nones."""
        out, mask, skels, lens = [], [], [], []
        cache = self.ints
        for e in entries:
            c = cache.get(id(e))
            if c is None or c[0] is not e:
                try:
                    c = cache[id(e)] = (e,) + flatten(e)
                except Refused:
                    return None, None, None, None
            out.extend(c[1])
            mask.extend(c[2])
            skels.append(c[3])
            lens.append(len(c[1]))
        return out, mask, skels, lens

    def note(self, struct, entries) -> None:
        """An exact version of ``struct`` compiled: keep the first ``MAX_VERSIONS`` that differ
        (what a new base is fitted against: NOTE [new bases]).

        NOTE [bucket families]: versions and plans are kept per structure *and skeleton* (what is
        left of the ops' keys without their ints: views, dtypes, static arguments). Two sites of
        one structure that differ in more than sizes (HF's ``generate()`` grows the attention
        mask with ``cat([mask, new_ones(B, 1)])`` and the tokens with ``cat([ids,
        next[:, None]])``: one op, the same wiring, one input a view) are two families; under one
        key the first took the place and the second never had a bucket, so it ran op by op in a
        loop's first call and compiled per length in its second."""
        ints, mask, skels, lens = self._ints(entries)
        if ints is None:
            return
        self._keep((struct, tuple(skels)), ints, entries, lens, mask, skels)

    def _keep(self, fam, ints, entries, lens, mask, skels) -> None:
        vs = self.versions.get(fam)
        if vs is None:
            self.versions[fam] = [(ints, list(entries), lens, mask, skels)]
        elif len(vs) < MAX_VERSIONS and all(v[0] != ints for v in vs):
            vs.append((ints, list(entries), lens, mask, skels))

    def find(self, struct, entries, wirings, stats):
        """(plan, length) to run this version of ``struct`` in a bucket, or None.

        NOTE [new bases]: a family keeps up to ``MAX_PLANS`` plans, each with its own fit. A
        version that none takes (the same model met with a batch of another size, a longer
        prompt, a model rebuilt at another width) is fitted against the closest version kept
        (the fewest ints differ): where one length separates them, that is a new plan, and the
        new base runs in buckets from its second version on (its first may make a plan with a
        version of another base, a line through both that nothing else follows: it is kept, so
        the second is fitted against it). Where the family's latest plan is confirmed, the new
        base's first version is first tried on that plan's line moved to it (NOTE [a new base
        grows alike]): one program, not two. A first version that fits no kept version compiles
        exactly (``relearns``) instead of being split as shape churn, and is kept. Before, a
        family had one plan, made from its first two versions, and a new base never fitted it:
        every size of it compiled (a sampling loop at batch 2 after batch 1: 8 programs, its
        regions split as shape churn; bench/results/vary-new-bases.md)."""
        ints, mask, skels, lens = self._ints(entries)
        if ints is None:
            return None
        fam = (struct, tuple(skels))
        plans = self.plans.get(fam)
        if plans is not None:
            found = _taken(plans, ints)
            if found is not _NONE:
                return found
            if len(plans) >= MAX_PLANS:
                stats["bucket_misfits"] += 1
                return None
            found = self._wider(plans, ints, entries, wirings, lens)
            if found is not None:
                return found
            found = self._grows_alike(fam, plans, ints, mask, skels, entries, wirings, lens)
            if found is not None:
                return found
        vs = self.versions.get(fam)
        v = _closest(vs, ints, mask) if vs else None
        if v is None:
            return None
        # Two versions give the forms (each is exact on them; a later version that does not
        # follow them compiles exactly: bucket_misfits).
        f = fit([v[0], ints], mask)
        if f is None:
            if plans:
                stats["bucket_misfits"] += 1
            return None
        f.skels = skels
        try:
            plan = plan_region(f, v[1], wirings, v[2], self.learned)
        except Refused as e:
            plan = Refusal(f, str(e))
            stats["bucket_refusals"][plan.why] += 1
        except Exception as e:      # a view or rule this code did not foresee: no buckets
            plan = Refusal(f, f"{type(e).__name__}: {e}")
            stats["bucket_refusals"][plan.why] += 1
        if plans is None:
            plans = self.plans[fam] = []
        plans.append(plan)
        if plan.__class__ is Refusal:
            return None
        plan.seen.update((f.value(v[0]), f.value(ints)))
        # (kept to fit against: a base's first version may have made a plan with a version of
        # another base, a line through both that no third version follows)
        self._keep(fam, ints, entries, lens, mask, skels)
        if len(plans) == 1 and self.learned.on:
            key = _family_key(fam)
            if key is not None:
                self.learned.put("fits", key, (tuple(v[0]), tuple(ints)))
        return plan, f.value(ints)

    def _grows_alike(self, fam, plans, ints, mask, skels, entries, wirings, lens):
        """NOTE [a new base grows alike]: a version that no plan takes, at a new base of a family
        whose latest plan is confirmed (it took two lengths), runs in a plan along the same line
        through this version: (plan, 0), or None.

        A sampling loop learnt at batch 1 and run at batch 2 from a longer prompt made its first
        new plan through a version of each base (a line along the batch, which the loop's next
        version, one token longer, does not follow) and a second from the new base's first two
        versions: 2 programs where the second alone was needed. A new base mostly moves as the
        old one did (a sequence grows by one token; a batch sweep at another length changes the
        batch again): each int moves by the same step as in the latest plan, from this version.
        Where it does not (a size that is the batch times the length), the next version misses
        and the family goes on as before: a line through the two closest versions (one program
        more, as before). A plan made so and not confirmed is never followed again: the next new
        base takes the line through the closest versions (a batch sweep after a growing loop)."""
        last = next((p for p in reversed(plans) if p.__class__ is not Refusal), None)
        if last is None or len(last.seen) < 2:
            return None
        f = Fit()
        free = last.fit.free
        f.forms = [(a, x) if k not in free else (0, max(b, bucket_of(x)))
                   for k, ((a, b), x) in enumerate(zip(last.fit.forms, ints))]
        f.n, f.pos0, f.skels, f.free = len(f.forms), last.fit.pos0, skels, free
        if f.n != len(ints) or any(a and not m for (a, _), m in zip(f.forms, mask)):
            return None
        try:
            plan = plan_region(f, entries, wirings, lens, self.learned)
        except Exception:       # (refused: the line through the closest versions is tried)
            return None
        plans.append(plan)
        plan.seen.add(0)
        self._keep(fam, ints, entries, lens, mask, skels)
        return plan, 0

    def _wider(self, plans, ints, entries, wirings, lens):
        """NOTE [window bases]: a version on a plan's line whose window bases are longer than
        the plan's buckets for them runs in a copy of the plan with those buckets grown to
        theirs: (plan, length), or None."""
        for p in plans:
            if p.__class__ is Refusal:
                continue
            need = p.fit.over(ints)
            if need is None:
                continue
            f = Fit()
            f.forms = [(0, max(b, need[k])) if k in need else (a, b)
                       for k, (a, b) in enumerate(p.fit.forms)]
            f.n, f.pos0, f.skels, f.free = p.fit.n, p.fit.pos0, p.fit.skels, p.fit.free
            try:
                plan = plan_region(f, entries, wirings, lens, self.learned)
            except Exception:       # (refused: the version goes on as one no plan takes)
                return None
            plan.seen.update(p.seen)
            plans.append(plan)
            return plan, f.value(ints)
        return None

    def relearns(self, struct, entries) -> bool:
        """Whether this version of ``struct``, which no plan took, is a new base to learn from
        (NOTE [new bases]): its family has a plan that runs, no plan's fit (run or refused)
        takes it, and fewer than ``MAX_PLANS`` plans were made and bases met. Counted: each call
        that says yes is one of them."""
        ints, mask, skels, lens = self._ints(entries)
        if ints is None:
            return False
        fam = (struct, tuple(skels))
        plans = self.plans.get(fam)
        if not plans or not any(p.__class__ is not Refusal for p in plans):
            return False
        if any(p.fit.value(ints) is not None for p in plans):
            return False
        n = self.bases.get(fam, 0)
        if n >= MAX_PLANS or len(plans) >= MAX_PLANS:
            return False
        self.bases[fam] = n + 1
        return True

    def recall(self, struct, entries, wirings, stats):
        """(plan, length) to run the first version of ``struct`` seen in this process in a bucket
        that an earlier process learned (NOTE [learned on disk] in learned.py), or None."""
        if not self.learned.has_fits():
            return None
        ints, mask, skels, lens = self._ints(entries)
        if ints is None:
            return None
        fam = (struct, tuple(skels))
        plans = self.plans.get(fam)
        if plans is not None:
            found = _taken(plans, ints)
            return None if found is _NONE else found
        key = _family_key(fam)
        vs = self.learned.fit_versions(key) if key is not None else None
        if vs is None:
            return None
        # Made again from the two versions, and it must take this one: else it is stale.
        f = fit([list(vs[0]), list(vs[1]), ints], mask) if vs[0] != vs[1] else None
        if f is None:
            self.learned.drop_fit(key)
            return None
        f.skels = skels
        # The version a fit was learned from first ran exactly in that process. Where its
        # bucket is not the second version's (a ragged last batch: 64 rows, then 23, buckets
        # 64 and 32), no bucket program of it was made: its exact program is the one on disk.
        s = f.value(ints)
        if s == f.value(list(vs[0])) and f.bucket(s) != f.bucket(f.value(list(vs[1]))):
            return None
        try:
            plan = plan_region(f, entries, wirings, lens, self.learned)
        except Exception:           # (refused: what made it no longer holds)
            self.learned.drop_fit(key)
            return None
        plan.seen.update((f.value(list(vs[0])), f.value(list(vs[1]))))
        self.plans[fam] = [plan]
        return _at(plan, ints, stats)

    def program(self, plan, P, run, device, store, debug, stats, why=""):
        """The compiled program of ``plan`` at bucket ``P`` (compiled, or loaded from disk)."""
        is_float = tuple(type(s) is float for s in run.scalars)
        pk = (P, run.out_sig, is_float)
        prog = plan.programs.get(pk)
        if prog is not None:
            return prog
        # NOTE [fewer outputs]: a loop's last iteration is read at a sync after the loop, when the
        # loop's own variables are gone: it leaves fewer values than the iterations cut at the
        # loop's boundary (nanoGPT's sampling: the tokens, not the logits, top-k and next token),
        # and compiled a program of its own (18-25% of the first call's compile time). A program
        # of this bucket that leaves every value it needs serves it; the others are dropped.
        outs = set(run.out_sig)
        for (P2, sig2, f2), p2 in plan.programs.items():
            if P2 == P and f2 == is_float and p2.pick is None and outs <= set(sig2):
                prog = BucketProgram()
                prog.compiled, prog.msgs, prog.P, prog.runs = p2.compiled, p2.msgs, P, 0
                prog.summary, prog.pick = p2.summary, tuple(sig2.index(s) for s in run.out_sig)
                plan.programs[pk] = prog
                return prog
        import time
        from .diskcache import fresh_compiles
        from .execute import compiling, pack_scalars, sharding
        t0 = time.perf_counter()
        key = describe_plan(plan, P, run.wirings, run.out_sig, is_float, device,
                            [v.dtype for v in run.ext]) \
            if store is not None and store.on else None
        got = store.load(key, device) if key is not None else None
        prog = BucketProgram()
        prog.P, prog.runs, prog.pick = P, 0, None
        if got is not None:
            prog.compiled, prog.msgs = got[0], got[1]["msgs"]
            how = "loaded from disk"
        else:
            fn = region_function(plan, P, run.wirings, [len(n.scalars) for n in run.nodes],
                                 run.out_sig, is_float)
            keep = [jax.ShapeDtypeStruct(at(plan.ext_forms[i], P), v.dtype,
                                         sharding=sharding(device)) if i in plan.ext_forms
                    else v.exact() for i, v in enumerate(run.ext)]
            scalars = pack_scalars(list(run.scalars) + [P])
            hits = stats["jax_disk_hits"]
            with compiling(), (fresh_compiles() if key is not None else _NULL):
                prog.compiled = jax.jit(fn, out_shardings=sharding(device)).lower(
                    [], keep, scalars).compile()
            prog.msgs = list(fn.msgs)
            if stats["jax_disk_hits"] == hits:
                dt = time.perf_counter() - t0
                stats["compiles"] += 1
                stats["region_compiles"] += 1
                stats["compile_seconds"] += dt
                if key is not None:
                    store.save(key, prog.compiled, {"msgs": prog.msgs})
            how = "compiled"
        dt = time.perf_counter() - t0
        stats["bucket_programs"] += 1
        prog.summary = (f"{len(plan.nodes)} ops ({run.nodes[0].name} .. "
                        f"{run.nodes[len(plan.nodes) - 1].name}) padded to the bucket of length "
                        f"{at(plan.fit.forms[plan.fit.pos0], P)}")
        stats["miss_reasons"].append((prog.summary, (f"{why}; " if why else "") + "a new bucket "
                                      f"of a region whose sizes keep changing; {how}", dt))
        del stats["miss_reasons"][:-64]
        if debug >= 2:
            import sys
            print(f"[deferfuse] region BUCKET {how} in {dt * 1e3:.1f} ms: {prog.summary}"
                  + (f" (outputs {run.out_sig})" if debug >= 3 else ""), file=sys.stderr)
        plan.programs[pk] = prog
        return prog

    def execute(self, prog, hit, ext, scalars, outs, device, lazy: bool = False):
        """Run a bucket program for a region's inputs ``ext``, its scalars and the values ``outs``
        it leaves (length ``hit.t``): pad, run, cut; (results, flags). ``lazy``: an output whose
        exact shape is not its bucket's is left padded (a ``Padded``: NOTE [lazy cuts])."""
        from .execute import run_region
        plan, P = hit.plan, prog.P
        forms = plan.ext_forms
        keep = []
        for i, v in enumerate(ext):
            a = v.array
            if i in forms:
                shape = at(forms[i], P)
                if a.__class__ is Padded and tuple(v.shape) != tuple(shape):
                    S["lazy_cuts_padded"] += 1
                    a = repad(a.array, v.shape, shape, self.moves)
                else:
                    a = pad(v.exact() if a.__class__ is Padded else a, shape, self.moves)
            elif a.__class__ is Padded:
                a = v.exact()
            keep.append(a)
        res, flags = run_region(prog.compiled, [], keep, list(scalars) + [hit.t], device)
        prog.runs += 1
        if prog.pick is not None:
            res = [res[j] for j in prog.pick]
        if not lazy:
            return [cut(r, v.shape, self.moves) for r, v in zip(res, outs)], flags
        out = []
        for r, v in zip(res, outs):
            if tuple(r.shape) != tuple(v.shape):
                S["lazy_cuts"] += 1
                self.padded = True
                r = Padded(r, r.nbytes, self.cut_read)
            out.append(r)
        return out, flags

    def cut_read(self, array, shape):
        """NOTE [lazy cuts]: a lazily cut value read by anything but a bucket run, cut to its
        exact ``shape`` (through the host on a CPU device, where the reader waits for the array
        anyway: no program per exact shape)."""
        S["lazy_cuts_read"] += 1
        return cut(array, shape, self.moves)

    def refuse(self, plan, err, stats) -> None:
        """A plan whose program could not be made: never used again (its structure compiles
        exactly, as one with no plan)."""
        why = f"{type(err).__name__} making a bucket program: {str(err)[:200]}"
        stats["bucket_refusals"][why] += 1
        for key, v in self.plans.items():
            if type(v) is list and plan in v:
                i = v.index(plan)
                if key[0] == "op":
                    v.remove(plan)
                    self.versions.pop(key, None)    # (its versions made the failing plan)
                    continue
                v[i] = Refusal(plan.fit, why)
                fk = _family_key(key) if i == 0 and self.learned.on else None
                if fk is not None:
                    self.learned.drop_fit(fk)

    # ------------------------------------------------------------------- one op (strict mode)
    def note_op(self, entry) -> None:
        """An op's own program compiled for these sizes (strict and debug mode): a version of its
        structure without sizes (``ohash``: NOTE [shapeless loop bodies]). Many ops share one
        (every linear layer), so a few versions are kept, and a new one is fitted to the closest."""
        if getattr(entry, "ohash", None) is None or entry.out[1] or entry.out[2]:
            return
        ints, mask, skels, lens = self._ints([entry])
        if ints is None:
            return
        fam = ("op", entry.ohash)
        vs = self.versions.get(fam)
        if vs is None:
            vs = self.versions[fam] = []
        if len(vs) < 8 and all(v[0] != ints for v in vs):
            vs.append((ints, [entry], lens, mask, skels))

    def _op_find(self, entry, wiring, stats):
        fam = ("op", entry.ohash)
        ints, mask, skels, lens = self._ints([entry])
        if ints is None:
            return None
        plans = self.plans.get(fam)
        if plans is None:
            plans = self.plans[fam] = []
        for plan in plans:
            if plan.fit.skels == skels:
                t = plan.fit.value(ints)
                if t is not None:
                    return plan, t
        vs = [v for v in self.versions.get(fam, ()) if v[4] == skels and v[3] == mask]
        if not vs or len(plans) >= 8:
            return None
        # the closest version: the fewest sizes differ (another layer differs in its weights too)
        v = min(vs, key=lambda v: sum(x != y for x, y in zip(v[0], ints)))
        f = fit([v[0], ints], mask)
        if f is None:
            return None
        f.skels = skels
        try:
            plan = plan_region(f, v[1], [wiring], v[2])
        except Refused as e:
            stats["bucket_refusals"][str(e)] += 1
            return None
        except Exception as e:
            stats["bucket_refusals"][f"{type(e).__name__}: {e}"] += 1
            return None
        plans.append(plan)
        t = f.value(ints)
        return None if t is None else (plan, t)

    def op_program(self, entry, ins, scalars, store, debug, stats):
        """NOTE [buckets] for one op (strict and debug mode run each op as its own program): a
        callable ``(arrays, scalars) -> (outputs, flags)`` running ``entry`` padded in a bucket,
        when an earlier version of the same op with other sizes fits; else None."""
        if getattr(entry, "ohash", None) is None or entry.out[1] or entry.out[2]:
            return None
        wiring = tuple(None if v is None else i for i, v in enumerate(ins))
        found = self._op_find(entry, wiring, stats)
        if found is None:
            return None
        plan, t = found
        run = _OpRun(entry, ins, scalars, wiring)
        try:
            prog = self.program(plan, plan.fit.bucket(t), run, entry.dev, store, debug, stats,
                                f"{entry.name} with new sizes")
        except Exception as e:     # a case the rules did not foresee: this op runs exactly
            self.refuse(plan, e, stats)
            return None
        hit = BucketHit(plan, t, [entry], [wiring])
        entry.msgs = [m[1:] for m in prog.msgs]     # (exception type, message) per flag
        avals = entry.res_avals
        buckets = self

        def call(arrays, scalars_):
            stats["bucketed_ops"] += 1
            r = _OpRun(entry, [None if a is None else _Arr(a) for a in arrays], scalars_, wiring)
            res, flags = buckets.execute(prog, hit, r.ext, r.scalars, r.outs, entry.dev)
            if len(res) != len(avals):
                # outputs an output mask leaves out (linear_backward's bias gradient): the
                # program has none; the op's results hold None there, as its own program's do
                got = iter(res)
                res = [None if a is None else next(got) for a in avals]
            return res, flags
        return call


_NONE = object()     # (_taken: no kept plan takes the version)


def _taken(plans, ints):
    """What the first of a family's kept ``plans`` that takes the version ``ints`` says: (plan,
    length), None for a refusal, or ``_NONE`` where none takes it."""
    for p in plans:
        t = p.fit.value(ints)
        if t is not None:
            if p.__class__ is Refusal:
                return None
            if len(p.seen) < 2:
                p.seen.add(t)
            return p, t
    return _NONE


def _family_key(fam) -> str | None:
    """The stable description of a region family (NOTE [bucket families]), or None."""
    from .diskcache import Unstable, describe
    try:
        return describe(fam)
    except (Unstable, AttributeError):
        return None


class _Shape:
    __slots__ = ("shape",)

    def __init__(self, shape):
        self.shape = shape


class _Arr:
    """An input array seen as a Value (what ``Buckets.execute`` reads of one)."""
    __slots__ = ("array", "dtype", "shape")

    def __init__(self, a):
        self.array, self.dtype, self.shape = a, a.dtype, a.shape

    def exact(self):
        return self.array


class _OpNode:
    __slots__ = ("name", "scalars")


class _OpRun:
    """One op as a region of one node (what ``Buckets.program`` and ``execute`` read of a run)."""
    __slots__ = ("nodes", "wirings", "out_sig", "scalars", "ext", "outs")

    def __init__(self, entry, ins, scalars, wiring):
        n = _OpNode()
        n.name, n.scalars = entry.name, scalars
        self.nodes, self.wirings, self.scalars = [n], [wiring], list(scalars)
        self.ext = [v if v is not None else _NoInput for v in ins]
        self.out_sig = tuple((0, i) for i, a in enumerate(entry.res_avals) if a is not None)
        self.outs = [_Shape(a[0]) for a in entry.res_avals if a is not None]


class _NoInput:
    array = None
    dtype = None

    @staticmethod
    def exact():
        return None


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


_NULL = _Null()
