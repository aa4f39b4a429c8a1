"""Run a consumed trace: look the region up in the compile cache (or compile it), execute, bind.

The region key is the trace's rolling structural hash plus which values leave it, so a cache hit
costs O(outputs), never a walk over the trace.
"""
from __future__ import annotations

import sys

from . import execute, stats
from . import memory as memory_stats
from ..scheduler import cut, memory, pieces, steps
from ..scheduler.records import SIG_OF
from .errors import RegionError

S = stats.S
LAST = None            # [nodes, reason, src, pieces] of the latest trace; pieces: the node positions
                       # of each region when it ran split (None: one region)
_REGIONS: dict = {}     # key -> _Region
_SPLITS: dict = {}      # (trace hash, length, wanted nodes) -> needed-first order or None
_LOOP_CUTS: dict = {}   # (trace hash, length) -> loop-split cuts or None (NOTE [loop split])
_PLANS: dict = {}       # (trace hash, length, cuts, order) -> [pieces.Piece]
_STRUCT: dict = {}      # ops and wiring -> [number of compiles, first op keys, positions that varied]
_ONCE: set = set()      # region keys run once split (shape churn): compiled if they come back
MAX_REGIONS = [4096]    # set from deferfuse's config (DEFERFUSE_MAX_REGIONS)
# Cuts nobody waits for: the trace runs and recording goes on. Their regions are dispatched without
# first reading the index checks of the regions before them (those raise at the next real sync).
ASYNC_CUTS = ("loop boundary", "trace limit", "backward")


class _Region:
    __slots__ = ("compiled", "node_keys", "nops", "summary", "runs", "temp_bytes", "lowered", "elided",
                 "msgs", "transient", "order")


def clear():
    _REGIONS.clear()
    _SPLITS.clear()
    _LOOP_CUTS.clear()
    _PLANS.clear()
    _STRUCT.clear()
    _ONCE.clear()


def _evict() -> None:
    """Drop every compiled region and JAX's in-process executables: each compiled program holds
    memory mappings of XLA's CPU JIT, and a process that compiles thousands (generate() over many
    prompt lengths, a model zoo in one process) would otherwise run out of them and abort. The
    on-disk cache makes recompiling what comes back cheap."""
    import jax
    clear()
    jax.clear_caches()
    S["region_evictions"] += 1


def _diff(a, b) -> str:
    """What differs between two op keys, in words."""
    fa, ta, kwa, sa = a
    fb, tb, kwb, sb = b
    if fa is not fb:
        return f"op {fb.name} where the cached region had {fa.name}"
    fb = fb.name
    # a tensor's signature: (base shape, base dtype, view chain, shape, strides, dtype)
    for i, (x, y) in enumerate(zip(sa, sb)):
        x, y = SIG_OF[x], SIG_OF[y]
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
        return f"{fb}: arguments {tb} {dict(kwb)}, cached {ta} {dict(kwa)} (a baked-in value, a static argument or a Python scalar's type changed)"
    return f"{fb}: the wiring between ops differs"


def _explain_miss(keys: list) -> str:
    best, best_same = None, -1
    for r in _REGIONS.values():
        if r.__class__ is tuple or len(r.node_keys) != len(keys):
            continue
        # Same ops in the same places first, then identical op keys.
        same = sum(2 * (x[0] is y[0]) + (x == y) for x, y in zip(r.node_keys, keys))
        if same > best_same:
            best, best_same = r, same
    if best is None:
        return "new region structure (no cached region has this many ops)"
    first = None    # the first op key that differs, when every op is the same
    for k, (x, y) in enumerate(zip(best.node_keys, keys)):
        if x[0] is not y[0]:
            # Other ops, not other shapes: name the first op that differs, never a shape
            # difference between two unrelated regions that happen to start alike.
            return (f"new region structure (no cached region runs these ops; the closest one of "
                    f"this length has {x[0].name} where this has {y[0].name}, op {k})")
        if first is None and x != y:
            first = (x, y)
    return _diff(*first) if first else "same ops, different outputs or wiring"


def run_trace(nodes, ext, ext_uses, scalars, h, outs, reason, src, debug_level=0,
              cross_check=False, planner=True, shape_limit=8, budget=0, want=None, held=None,
              later=False, out_sig=None, partner=None, loop_split=False):
    """Run ``nodes`` (a whole trace, or a piece of one). ``want``: positions of the nodes whose
    values the sync reads (see NOTE [needed first]); ``held``: per external input, whether anything
    outside this run still holds it (worked out here from reference counts when not given);
    ``later``: this run's index checks are read at the next sync, not this one; ``partner``:
    id(output value) -> id of the value its storage held before the trace wrote it (see
    NOTE [alias order])."""
    global LAST
    lf = 0 if later else None       # pieces of a later run are later too
    if held is None:
        LAST = [nodes, reason, src, None]   # nodes keep their name, wiring and source line only
        # Who else holds each input value: its holders are the ext list, the node inputs reading
        # it and getrefcount's argument; anything more is a storage (see NOTE [donation safety]).
        getrc = sys.getrefcount
        held = [getrc(ext[i]) - 2 - ext_uses[i] > 0 for i in range(len(ext))]
        if loop_split and len(nodes) >= steps.LOOP_SPLIT_MIN_OPS and not cross_check:
            lk = (h, len(nodes))
            cuts = _LOOP_CUTS.get(lk, 0)
            if cuts == 0:
                cuts = _LOOP_CUTS[lk] = steps.periodic_cuts([n.key.khash for n in nodes])
            if cuts is not None:        # see NOTE [loop split] in scheduler/steps.py
                S["loop_splits"] += 1
                return _run_pieces(nodes, ext, outs, cuts, reason, src, debug_level, planner,
                                   shape_limit, budget, held, h, later_from=lf, partner=partner)
    if want is not None and not cross_check:
        sk = (h, len(nodes), want)
        split = _SPLITS.get(sk, 0)
        if split == 0:
            split = _SPLITS[sk] = cut.needed_first([n.wiring for n in nodes], want)
        if split is not None:
            return _run_needed_first(nodes, ext, outs, split, held, h, reason, src,
                                     debug_level, planner, shape_limit, budget, partner)
    mplan = memory.plan([v.nbytes for v in ext], held, [v.nbytes for v in outs], 0, None,
                        planner and not cross_check)
    donate = mplan.donate
    if out_sig is None:
        out_sig = tuple((v.node.pos, v.idx) for v in outs)
    key = (h, len(nodes), len(ext), out_sig, donate, budget)
    reg = _REGIONS.get(key)
    if reg.__class__ is tuple:      # split for the memory budget on an earlier run
        return _run_pieces(nodes, ext, outs, reg, reason, src, debug_level, planner,
                           shape_limit, budget, held, h, later_from=lf, partner=partner)
    ext_arrays = [v.array for v in ext]
    don = [a for a, d in zip(ext_arrays, donate) if d]
    keep = [a for a, d in zip(ext_arrays, donate) if not d]
    if reg is None:
        keys = [n.key.key for n in nodes]
        # The structure: which ops, wired how; shapes, dtypes and static arguments left out.
        struct = tuple([(k[0], n.wiring) for k, n in zip(keys, nodes)])
        seen = _STRUCT.get(struct)
        n_compiled = seen[0] if seen else 0
        if n_compiled >= shape_limit and key not in _ONCE:
            # NOTE [shape churn]: this structure keeps coming back with new shapes (generate()
            # growing its sequence and KV cache by one token per step). Split it: runs of ops whose
            # keys never changed become regions of their own, compiled once; the ops whose shapes
            # change run apart (as regions until those too churn, then op by op). A version that
            # comes back (a bucketed batch shape, the same prompt length again) compiles whole on
            # its second run.
            _ONCE.add(key)
            cuts = cut.churn_cuts(seen[1], keys, seen[2])
            if cuts is not None:
                S["shape_splits"] += 1
                return _run_pieces(nodes, ext, outs, cuts, reason, src, debug_level,
                                   planner, shape_limit, budget, held, h, later_from=lf,
                                   partner=partner)
            S["shape_fallbacks"] += 1
            env = None
            for _, _, env in _replay(nodes, ext, scalars, block=False):
                pass
            for v in outs:
                v.bind(env[(v.node.pos, v.idx)])
            return
        if len(_REGIONS) >= MAX_REGIONS[0]:
            _evict()
        why = _explain_miss(keys)
        plan = [(n.fn, n.wiring, n.s0, len(n.scalars)) for n in nodes]
        order = _alias_order(outs, ext, donate, partner)
        sig = out_sig if order is None else tuple([out_sig[j] for j in order])
        try:
            compiled, lowered, dt, msgs = execute.compile_region(plan, sig, donate, don, keep,
                                                                 scalars)
        except Exception as e:   # a lowering failed while tracing: find the op
            _localize(nodes, ext, scalars, e)
            raise
        reg = _Region()
        reg.compiled, reg.node_keys, reg.nops, reg.runs = compiled, keys, len(nodes), 0
        reg.order = order
        reg.msgs = msgs
        reg.lowered = lowered
        reg.summary = f"{len(nodes)} ops ({nodes[0].name} .. {nodes[-1].name}), synced by {reason} at {src}"
        try:
            reg.temp_bytes = compiled.memory_analysis().temp_size_in_bytes
        except Exception:
            reg.temp_bytes = None
        out_bytes = sum(v.nbytes for v in outs)
        if budget and len(nodes) > 1:
            est = sum(v.nbytes for v in ext) + out_bytes + (reg.temp_bytes or 0)
            if est > budget:
                cuts = _budget_cuts(nodes, ext, held, outs)
                if len(cuts) > 1:
                    _REGIONS[key] = cuts
                    S["budget_splits"] += 1
                    if debug_level >= 2:
                        print(f"[deferfuse] region of {len(nodes)} ops needs ~{est / 2**20:.1f} MB "
                              f"> budget {budget / 2**20:.1f} MB: split at {cuts[:-1]}", file=sys.stderr)
                    return _run_pieces(nodes, ext, outs, cuts, reason, src, debug_level,
                                       planner, shape_limit, budget, held, h, later_from=lf,
                                       partner=partner)
        node_bytes = sum(o.nbytes for n in nodes for o in n.outs if o is not None)
        reg.elided = max(node_bytes - out_bytes, 0)
        # What running it needs beyond what is allocated (outputs and donation are in the key).
        reg.transient = (reg.temp_bytes or 0) + out_bytes - mplan.donated_bytes
        if n_compiled:
            S["recompiles"] += 1
        if seen:
            seen[0] += 1
        else:
            _STRUCT[struct] = [1, keys, set()]
        _REGIONS[key] = reg
        S["miss_reasons"].append((reg.summary, why, dt))
        if debug_level >= 2:
            print(f"[deferfuse] region MISS ({why}): {reg.summary}; compiled in {dt*1e3:.1f} ms",
                  file=sys.stderr)
        if debug_level >= 4:
            print(lowered.as_text(), file=sys.stderr)
    else:
        S["cache_hits"] += 1
        if debug_level >= 2:
            print(f"[deferfuse] region hit: {reg.summary}", file=sys.stderr)
    if debug_level >= 3:
        for n in nodes:
            print(f"    {n.pos:5d} {n.name} {n.wiring} at {n.src}", file=sys.stderr)
    if not later and reason not in ASYNC_CUTS:
        # A piece the sync does not wait for, or one of a cut nobody waits for, runs without
        # waiting on the pieces before it: their checks are read after the sync has dispatched
        # everything (state.sync).
        check_flags()
    memory_stats.transient(reg.transient)
    try:
        res, flags = execute.run_region(reg.compiled, don, keep, scalars)
    except Exception as e:
        _raise_oom(e, reg)
        _localize(nodes, ext, scalars, e)
        raise
    reg.runs += 1
    if flags:
        (_LATER_FLAGS if later else _PENDING_FLAGS).append((flags, reg.msgs, nodes))
    S["donated_bytes"] += mplan.donated_bytes
    S["elided_bytes"] += reg.elided
    if don:
        # Donated buffers now belong to the outputs (no storage holds those values: see
        # NOTE [donation safety]): stop counting them before the outputs are counted.
        freed = 0
        for v, d in zip(ext, donate):
            if d and v.array is not None:
                v.array = None
                freed += v.nbytes
        memory_stats.account(-freed)
    if reg.order is not None:
        outs = [outs[j] for j in reg.order]
    n = 0
    for v, r in zip(outs, res):     # Value.bind, with one account() for all
        v.array = r
        v.node = None
        n += v.nbytes
    memory_stats.account(n)
    if memory_stats.peak > _peak_seen[0]:
        _peak_seen[0] = memory_stats.peak
        S["peak_region"] = reg.summary
    if cross_check:
        _cross_check(nodes, ext, scalars, outs)


_peak_seen = [0]


def _alias_order(outs, ext, donate, partner):
    """NOTE [alias order]: JAX gives each output, in output order, the first donated input buffer of
    the same shape and dtype still free. A training step's outputs come in the order their storages
    were first written: the gradients (backward), then the parameters and optimizer states (the
    optimizer step). So a parameter's donated buffer went to its gradient, and XLA copied the old
    parameter out first (the backward pass and the update still read it), then copied the gradient
    in: two copies of every parameter per step. Outputs that are a storage's new value, whose old
    value is a donated input, come first here, in the order of those inputs, so each takes its own
    storage's buffer and is written in place (measured: the MLP step's optimizer region went from 12
    copies to 2; the full-size MLP step took 54.8 ms against 58.5, alternating in one process; at
    quick sizes the difference is within noise).
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


def _budget_cuts(nodes, ext, held, outs) -> tuple:
    return cut.budget_cut([n.wiring for n in nodes],
                          [[0 if o is None else o.nbytes for o in n.outs] for n in nodes],
                          [v.nbytes for v in ext], held, {(v.node.pos, v.idx) for v in outs})


def _run_pieces(nodes, ext, outs, cuts, reason, src, debug_level, planner, shape_limit, budget,
                held, h, order=None, later_from=None, partner=None):
    """Run pieces of a trace as regions of their own, one after another: ``nodes`` in ``order``
    (a topological order; trace order when None) cut at ``cuts``. For the memory budget, shape
    churn and needed first. ``held[i]``: external input i is held outside the trace (never
    donated); pieces from index ``later_from`` on have their index checks read at the next sync.
    The plan is cached by structure, so a piece that hits the compile cache costs O(its inputs
    and outputs), not a walk over its nodes."""
    pk = (h, len(nodes), cuts, order)
    plan = _PLANS.get(pk)
    if plan is None:
        if nodes.__class__ is pieces.PieceNodes:
            iter(nodes)         # the plan reads wiring: build the renumbered nodes
        plan = _PLANS[pk] = pieces.plan(nodes, order or range(len(nodes)), cuts)
    if LAST is not None and LAST[0] is nodes:
        LAST[3] = [pc.pos for pc in plan]
    live = {}       # id(node) -> its outputs that tensors hold (a node: see pieces.PieceNodes)
    for v in outs:
        live.setdefault(id(v.node), []).append(v)
    live_ids = {id(v) for v in outs}
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
        if pc.needed:
            have = {id(v) for v in piece_outs}
            for j, i in pc.needed:
                v = nodes[pc.pos[j]].outs[i]
                if id(v) not in have:
                    piece_outs.append(v)
                    sig.append((j, i))
        sub = pieces.PieceNodes(nodes, pc)
        try:
            run_trace(sub, sub_ext, None, sc, pc.h, piece_outs, reason, src, debug_level, False,
                      planner, shape_limit, budget, None, sub_held,
                      later_from is not None and k >= later_from, tuple(sig), partner)
        finally:
            sub.release()


_PENDING_FLAGS: list = []   # index-check flags of regions already run, read at the next sync
_LATER_FLAGS: list = []     # those of regions the sync did not wait for (NOTE [needed first])


def check_flags(later: bool = True) -> None:
    """Raise the error of the first index check that failed in a region run so far; with
    ``later=False`` only in regions that a sync waited for."""
    if later and _LATER_FLAGS:
        _PENDING_FLAGS.extend(_LATER_FLAGS)
        _LATER_FLAGS.clear()
    while _PENDING_FLAGS:
        flags, msgs, nodes = _PENDING_FLAGS.pop(0)
        execute.raise_flags(flags, ((exc, f"{m} ({nodes[pos].name} recorded at {nodes[pos].src})")
                                    for pos, exc, m in msgs))


def _run_needed_first(nodes, ext, outs, split, held, h, reason, src, debug_level, planner,
                      shape_limit, budget, partner=None):
    """NOTE [needed first]: a sync that reads one value (``loss.item()`` after a training step)
    needs only the ops that value depends on: the forward pass, not the backward pass and the
    optimizer step recorded after it. Those run first, as one region; the rest follows as a second
    region that the host does not wait for, so it executes while Python records the next step
    (strict mode gets this overlap from JAX's asynchronous dispatch; one fused region would make
    the host wait for all of it). Values the second region reads from the first leave the first
    as outputs. The split depends only on the trace's structure, so it is cached with it and both
    regions hit the compile cache from the second step on. Index checks of the second region are
    read at the next sync."""
    order, n_first = split
    S["needed_first_splits"] += 1
    _run_pieces(nodes, ext, outs, (n_first, len(nodes)), reason, src, debug_level, planner,
                shape_limit, budget, held, h, order, later_from=1, partner=partner)


def _raise_oom(e, reg):
    text = str(e)
    if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text:
        import torch
        from . import memory as mem
        raise torch.OutOfMemoryError(
            f"tpu out of memory running a fused region ({reg.summary}). Live device buffers "
            f"{mem.allocated / 2**20:.1f} MB, peak {mem.peak / 2**20:.1f} MB, this region's XLA "
            f"temporaries {(reg.temp_bytes or 0) / 2**20:.1f} MB. Set DEFERFUSE_MEMORY_BUDGET to split "
            f"regions, or reduce the batch size. XLA said: {text.splitlines()[0]}") from e


def _replay(nodes, ext, scalars, block=True):
    """Run nodes one by one (per-op jits); yields (node, outputs, env)."""
    import jax
    env = {}
    for n in nodes:
        arrays = [None if w is None else (ext[w].array if type(w) is int else env[w]) for w in n.wiring]
        entry = n.key
        if entry.jit is None:
            entry.msgs = []
            entry.jit = jax.jit(execute.with_flags(entry.fn, entry.msgs))
        with execute.x64(True):
            res, flags = entry.jit(arrays, list(n.scalars))
            if flags:
                execute.raise_flags(flags, entry.msgs, f" ({n.name} recorded at {n.src})")
            if block:
                jax.block_until_ready(res)
        for i, o in enumerate(res):
            env[(n.pos, i)] = o
        yield n, res, env


def _localize(nodes, ext, scalars, err):
    try:
        for _ in _replay(nodes, ext, scalars):
            pass
    except Exception as e:
        # the generator stopped at the failing node; find which one by replaying step by step
        env_nodes = []
        try:
            for n, _, _ in _replay(nodes, ext, scalars):
                env_nodes.append(n)
        except Exception:
            failing = nodes[len(env_nodes)]
            raise RegionError(
                f"{failing.name} failed inside a fused region, recorded at {failing.src}: "
                f"{type(e).__name__}: {e}\nRerun with TORCHTPU_MODE=debug (or "
                "`with deferfuse.mode('debug'):`) to raise at the line that fails.") from e
    raise RegionError(f"a fused region of {len(nodes)} ops failed ({type(err).__name__}: {err}), but "
                      "every op succeeds on its own; rerun with TORCHTPU_MODE=strict to compare") from err


def _cross_check(nodes, ext, scalars, outs):
    import numpy as np
    for n, res, env in _replay(nodes, ext, scalars):
        for i, (o, r) in enumerate(zip(n.outs, res)):
            if o is None or r is None or o.array is None:
                continue
            a, b = np.asarray(o.array), np.asarray(r)
            if a.dtype.kind in "fc":
                ok = np.allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-4, atol=1e-5, equal_nan=True)
            else:
                ok = np.array_equal(a, b)
            if not ok:
                raise RegionError(f"cross-check: {n.name} recorded at {n.src} gives different results "
                                  f"fused and op by op (max abs diff "
                                  f"{np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))):.3g})")
