"""The pending trace of defer mode: record ops as nodes, and at a sync point hand them to the runner.

Each recorded node extends two rolling hashes: ``h`` over op structure and wiring (the region's
compile-cache key, so a cache hit never walks the trace again) and ``hops`` over op structure
without sizes (loop-body detection: NOTE [shapeless loop bodies] in dispatch.py). Each thread records into a trace of its own (NOTE [threads] in
engine.py); the engine's lock is held while a trace records or runs.
"""
from __future__ import annotations

import sys

from ._fastpath import TraceState, trace_outputs
from .config import SKIP_PREFIXES, config
from .runtime import stats
from .runtime.runs import Flush
from .runtime.transfer import materialize_empty
from .scheduler import policy, steps
from .scheduler.cache import Cache
from .scheduler.records import Node, Value

S = stats.S


class SourceLines:
    """'file:line' of the user's frame for each recorded op, cached per code object and offset.

    Keyed by id(code): hashing a code object hashes its contents, and f_lineno decodes the line
    table; both cost more than recording the op. An entry keeps its code object alive, so an id is
    never reused while it is here."""

    def __init__(self, capacity: int = 1 << 16):
        self.codes = Cache("source lines", capacity)

    def _entry(self, code):
        e = (code, code.co_filename.startswith(SKIP_PREFIXES), {})
        self.codes[id(code)] = e
        return e

    def site(self, f) -> str:
        """The first frame from ``f`` outward that is outside torch and deferfuse; '<backward>' if
        none (autograd's device thread has no user frame)."""
        codes = self.codes
        while f is not None:
            code = f.f_code
            e = codes.get(id(code))
            if e is None or e[0] is not code:
                e = self._entry(code)
            if not e[1]:
                s = e[2].get(f.f_lasti)
                if s is None:
                    s = e[2][f.f_lasti] = f"{code.co_filename}:{f.f_lineno}"
                return s
            f = f.f_back
        return "<backward>"


class Bodies:
    """What step detection learned: loop bodies (length, op-structure hash), the body found per
    trace structure (or None), and each body's op hashes (NOTE [body phase]). ``known`` is a
    plain set, read at every recorded op; it is emptied (and counted) when it reaches
    ``capacity``."""

    def __init__(self, capacity: int = 8192):
        self.known: set = set()                             # (length, hops)
        self.capacity = capacity
        self.evictions = 0
        self.found = Cache("body searches", capacity)       # (trace hash, length) -> body or None
        self.ops = Cache("body ops", capacity)              # body -> its ops' structure hashes
        self.policy = policy.CutPolicy()                    # where to cut (scheduler/policy.py)
        self.outer = self.policy.outer                      # NOTE [outermost body]

    def learn(self, body) -> None:
        if body in self.outer.suppressed:
            return
        if len(self.known) >= self.capacity:
            self.evictions += len(self.known)
            self.known.clear()
        self.known.add(body)

    def stats(self) -> dict:
        return {"size": len(self.known), "capacity": self.capacity, "inserts": None,
                "evictions": self.evictions, "outer_loops": self.outer.found,
                "suppressed": len(self.outer.suppressed)}

    def clear(self) -> None:
        self.known.clear()
        self.found.clear()
        self.ops.clear()
        self.outer.clear()


# NOTE [outputs in trace order]: a trace's outputs (the values live tensors still hold) are listed
# by the op that makes them, then the output's index (``Trace.take``, through _fastpath.c's
# ``trace_outputs``). Their order is part of a region's key and of a bucket program's key, and the
# order in which storages were registered is not the same from one call of a loop to the next (a
# sampling loop's second call compiled a bucket program again for the same outputs, listed the
# other way round).


class Trace(TraceState):
    """One thread's pending ops (see the module docstring).

    NOTE [trace state in C] (deferfuse/_fastpath.c): the state read and written at every op is
    the C base's: ``nodes``, ``ext`` and ``scalars`` (lists: the Nodes, the external input
    Values, the nodes' runtime scalars), ``ext_uses`` (a new list of the node inputs reading each
    external value: the donation check), ``storages`` (weak refs of storages that may hold pending
    values), ``h`` and ``hops`` (the rolling hashes), ``cut`` (a cut decided at the last op, made
    before the next one), ``device`` (of its ops, one device per trace; None while empty),
    ``check_at`` (the next length to look for a loop body at), ``counted`` (nodes already in
    S["ops_recorded"]: metrics._pending), ``epoch`` and ``_known`` (engine.bodies.known). The C
    record path reads them as struct fields; Python reads and writes them as attributes; the
    lists are replaced only by ``reset_state()`` and external inputs added only by
    ``ext_index(v)``."""

    def __init__(self, engine):
        self.engine = engine
        self._known = engine.bodies.known       # read at every op: the set itself
        self._codes = engine.sources.codes      # (see record's source-line lookup)
        self.reset()

    def reset(self):
        self.reset_state()      # nodes, ext, ext_uses, scalars, storages, h, hops, cut, device, counted
        self.check_at = steps.LOOP_SPLIT_MIN_OPS     # next length to look for a loop body at
        self.after = None             # the body whose cut began this trace (NOTE [body phase])
        self.cut_body = None          # the body a pending "loop boundary" cut completes
        self.cut_wait = None          # a body found, cut once the trace reaches check_at
        self.epoch = self.engine.next_epoch()       # storages taken by an earlier trace are taken again

    def track(self, storage):
        """Keep ``storage`` (weakly) among those whose pending values the next flush reads back;
        once per trace, however many ops write it (an optimizer writes each state many times)."""
        if storage.ep != self.epoch:
            storage.ep = self.epoch
            storage.prev = 0
            self.storages.append(storage.wr)

    def track_mut(self, storage, v):
        """Called just before an op writes the pending value ``v`` into ``storage``: remember
        (by id, holding no reference) the value it held before this trace first wrote it."""
        if v.node is not None and storage.ep != self.epoch:
            storage.ep = self.epoch
            storage.prev = id(storage.val)
            self.storages.append(storage.wr)

    def write_all(self, storages, values):
        """``track_mut`` and the write, for each Storage and the pending value an op writes into
        it: a compiled optimizer step writes every parameter and state (84 on the GPT training
        step), in one call instead of a call per write."""
        ep, wrs = self.epoch, self.storages
        for st, v in zip(storages, values):
            if v.node is not None and st.ep != ep:
                st.ep = ep
                st.prev = id(st.val)
                wrs.append(st.wr)
            st.val = v

    def record(self, entry, ins, scalars, dev):
        """Append one op on device ``dev``; its output Values (pending, None for an absent output).
        The hot path of defer mode: keep it lean (DESIGN.md's hot-path budget). The caller holds
        the engine's lock."""
        if self.cut is not None or (dev != self.device and self.nodes):
            # Cut before this op, once the previous op's outputs are bound to their tensors (or
            # before an op on another device: a region runs on one device).
            self._cut_now("device switch" if self.cut is None else None)
        self.device = dev
        nodes = self.nodes
        pos = len(nodes)
        wiring = []
        for v in ins:
            if v is None:
                wiring.append(None)
                continue
            n = v.node
            if n is not None:
                p = n.pos
                if p < 0:   # its region's call is in flight: an input, read when this runs
                    wiring.append(self.ext_index(v))    # (NOTE [in flight] in execute.py)
                    continue
                if p < pos and nodes[p] is n:
                    wiring.append((p, v.idx))
                    continue
                self.engine.resolve(v, self)        # pending elsewhere: another thread's trace
            elif v.array is None and v.err is not None:
                self.engine.raise_failed(v)
            wiring.append(self._external(v))
        wiring = tuple(wiring)
        res = entry.res_avals
        if len(res) == 1:
            a = res[0]
            outs = (Value(a[0], a[1], a[2]),)
        else:
            outs = tuple([None if a is None else Value(a[0], a[1], a[2], None, None, k)
                          for k, a in enumerate(res)])
        if config.source_lines:
            # NOTE [record depth]: every path into record() passes record, _run and the dispatch
            # entry (__torch_dispatch__, a special, or a PrivateUse1 kernel), so the user's frame is
            # at least 3 frames up: start there.
            try:
                f = sys._getframe(3)
            except ValueError:      # autograd's device thread calls us with no Python caller
                f = None
            src = None
            if f is not None:       # SourceLines.site's first step, inlined
                e = self._codes.get(id(f.f_code))
                if e is not None and not e[1] and e[0] is f.f_code:
                    src = e[2].get(f.f_lasti)
            if src is None:
                src = self.engine.sources.site(f)
        else:
            src = None
        node = Node(entry, ins, wiring, len(self.scalars), scalars, outs, src, pos, self)
        for o in outs:
            if o is not None:
                o.node = node
        nodes.append(node)
        if scalars:
            self.scalars.extend(scalars)
        self.h = hash((self.h, entry.khash, wiring, len(scalars)))
        self.hops = hops = hash((self.hops, entry.ohash))   # NOTE [shapeless loop bodies]
        pos += 1
        bodies = self._known
        if bodies and (pos, hops) in bodies:
            self.cut = "loop boundary"
            self.cut_body = (pos, hops)
        elif pos >= config.trace_limit:
            self.cut = "trace limit"
        elif pos == self.check_at:
            if self.cut_wait is not None:       # NOTE [aligned cuts]: the loop's boundary
                self.cut, self.cut_body, self.cut_wait = "loop boundary", self.cut_wait, None
            else:
                self.check_at *= 2
                if config.step_detection and \
                        not self.engine.bodies.outer.within(pos, nodes[0].key.ohash) and \
                        self._find_body(align=True):
                    self.cut = "loop boundary"
        return outs

    def _find_body(self, align: bool = False) -> bool:
        """NOTE [early step detection]: at 256, 512, 1024 ... recorded ops, look for a loop body
        in the trace (steps.find_period: its last half repeats). If there is one, remember it and
        cut here: from now on the loop is cut at every repetition and each piece runs while the
        next is recorded. The trace limit alone left a loop that never syncs, and has no
        backward() to cut at (an evaluation loop collecting outputs), recording 20,000 ops with
        the device idle. Counts and hashes only, never timing.

        NOTE [aligned cuts]: with ``align``, the cut waits for the next boundary of the loop's
        own iterations (where its repetitions begin: steps.loop_phase), not 256 ops, which
        fall anywhere in one. Cut there, every later piece is one iteration as a fresh call of
        the same loop records it, so a second call finds the regions (and buckets) the first
        compiled; cut at 256, the pieces were the iteration rotated by some ops, and the next call
        compiled them all again. Returns whether to cut now."""
        bodies = self.engine.bodies
        key = (self.h, len(self.nodes), align)
        body = bodies.found.get(key, 0)
        if body == 0:
            ohashes = [n.key.ohash for n in self.nodes]
            L = steps.find_period(ohashes)
            if L is not None:
                # A short body (a chain of tiny ops) is cut every k repetitions: a cut costs a
                # flush and a launch, which per 8 ops made the 1,000-op overhead loop 1.2x slower
                # than one region. (k repetitions fit in any trace of 256 ops or more.) Not a
                # body whose shapes change from one repetition to the next (NOTE [shapeless loop
                # bodies]): each repetition is a region of its own, so they can share programs
                # (runtime/buckets.py), where k of them would be a new structure every time.
                n = len(ohashes)
                start, wait = steps.loop_phase(ohashes, L) if align else (0, 0)
                khashes = [n_.key.khash for n_ in self.nodes[-2 * L:]]
                # The body ends at the cut (wait ops from now): by periodicity, its ops are those
                # one period earlier, all recorded.
                shift = L if wait else 0
                k = -(-steps.CUT_MIN_OPS // L)
                if khashes[:L] != khashes[L:] or n + wait - shift - k * L < start:
                    k = 1
                if n + wait - shift - k * L < start:
                    wait = shift = 0            # too few iterations to align on: cut here
                period, L = L, L * k
                window = ohashes[n + wait - shift - L:n + wait - shift]
                body = (steps.body_signature(window, L), wait)
                bodies.ops[body[0]] = tuple(window)
                bodies.outer.learned(body[0], period)       # NOTE [outermost body]
            else:
                body = None
            bodies.found[key] = body
        if body is None:
            return False
        body, wait = body
        if body in bodies.outer.suppressed:
            return False
        bodies.learn(body)
        if wait:
            self.cut_wait = body
            self.check_at = len(self.nodes) + wait
            return False
        self.cut_body = body
        return True

    def _rephase(self) -> None:
        """NOTE [body phase]: a loop is cut where a trace that starts empty has recorded exactly one
        body, so the cuts hold their phase from cut to cut. A sync in the loop (it prints a running
        metric every N iterations) ends a trace after m < L ops of the body, and the next trace
        starts m ops into it: learn the body as seen from there (its rotation by m), so the loop is
        cut again after its next L ops, not only once 256 more ops show the body anew."""
        bodies = self.engine.bodies
        ops = bodies.ops.get(self.after)
        m = len(self.nodes)
        if ops is None or not 0 < m < len(ops):
            return
        for n, k in zip(self.nodes, ops):
            if n.key.ohash != k:
                return
        rot = ops[m:] + ops[:m]
        body = steps.body_signature(rot, len(rot))
        if body not in bodies.known:
            bodies.outer.rotated(body, self.after)
            bodies.learn(body)
            bodies.ops[body] = rot

    def _external(self, v) -> int:
        """The external-input index of the concrete value ``v``."""
        if v.array is None and v.node is None:     # (not in flight: NOTE [in flight])
            materialize_empty(v, self.device or 0)
        return self.ext_index(v)

    def _cut_now(self, reason=None):
        reason = reason or self.cut
        self.cut = None
        if self.engine.bodies.policy.search_at_cut(reason, config.step_detection):
            self._find_body()
        body, self.cut_body = self.cut_body, None
        if body is not None:
            self.engine.bodies.outer.cut_by(body)
        self.engine.sync(reason)        # the owning thread records: this is its trace
        self.after = body       # the new trace starts at this body's first op (or None)

    # ---------------------------------------------------------------------------------------
    def take(self, reason: str, want=None):
        """Consume the trace for a flush: the ``Flush`` record the runner runs (None when empty),
        and the trace starts afresh. The caller holds the engine's lock."""
        nodes = self.nodes
        if not nodes:
            return None
        # Outputs: pending values of this trace that a live storage still holds (weak refs), the
        # pending values kernel hits' outputs hold before any reader made their Storage (NOTE
        # [lazy storages] in _tpu_tensor.cpp), and the value the sync reads even when no storage
        # holds it (a bare value read back: NOTE [read-back outputs] in compiled.py), or the read
        # would find it never made. In the order of the trace, not of the storages: which storage
        # registered first changes from call to call (a loop's tensors are freed and made again),
        # and the order of the outputs is part of a program's key (NOTE [outputs in trace
        # order]). partner: output -> id of the value its storage held before this trace wrote
        # it. NOTE [trace outputs] in _fastpath.c.
        lazy = self.engine.lazy_outputs
        outs, partner = trace_outputs(self.storages, self, want,
                                      None if lazy is None else lazy(self))
        want = ((want.node.pos,) if want is not None and want.node is not None
                and want.node.trace is self and config.needed_first else None)
        S["ops_recorded"] += len(nodes) - self.counted
        bodies, detect = self.engine.bodies, config.step_detection
        plan = bodies.policy.at_sync(reason, len(nodes), nodes[0].key.ohash, self.after, detect)
        whole = plan.whole
        if plan.search == "body":
            self._find_body()
        elif plan.search == "rephase":
            self._rephase()
        period = None
        if plan.split_period:
            # The iterations the runner splits this trace into (NOTE [loop split]), once per
            # structure: an outer body needs a loop of short ones (NOTE [outermost body]).
            key = (self.h, len(nodes), "split")
            period = bodies.found.get(key, 0)
            if period == 0:
                period = bodies.found[key] = steps.split_period([n.key.ohash for n in nodes])
        forget = bodies.policy.trace_ended(reason, len(nodes), self.h, nodes[0].key.ohash, period,
                                           detect)
        if forget:
            bodies.known.difference_update(forget)
        fl = Flush(nodes, self.ext, self.ext_uses, self.scalars, self.h, outs, partner, want,
                   self.device or 0, self.storages, whole)
        self.reset()
        return fl

    def requeue(self, fl, done) -> None:
        """Record again the nodes of the flush ``fl`` that did not run (``done``: the positions
        that did), in order: a flush stopped by an interrupt before its programs ran. Their outputs
        are the same Values, so every tensor holding one is pending again, as before the flush."""
        self.device = fl.device
        for n in fl.nodes:
            if n.pos in done:
                continue
            wiring = []
            for v in n.ins:
                if v is None:
                    wiring.append(None)
                elif v.node is not None and v.node.trace is self:
                    wiring.append((v.node.pos, v.idx))
                else:
                    wiring.append(self._external(v))
            wiring = tuple(wiring)
            m = Node(n.key, n.ins, wiring, len(self.scalars), n.scalars, n.outs, n.src,
                     len(self.nodes), self)
            for o in n.outs:
                if o is not None and o.array is None and o.err is None:
                    o.node = m
            self.nodes.append(m)
            self.scalars.extend(n.scalars)
            self.h = hash((self.h, n.key.khash, wiring, len(n.scalars)))
            self.hops = hash((self.hops, n.key.ohash))
        for r in fl.storages:
            st = r()
            if st is not None and st.val.node is not None and st.val.node.trace is self:
                self.track(st)
