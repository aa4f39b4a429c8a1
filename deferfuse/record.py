"""The pending trace of defer mode: record ops as nodes, and at a sync point run them.

Each recorded node extends two rolling hashes: ``h`` over op structure and wiring (the region's
compile-cache key, so a cache hit never walks the trace again) and ``hops`` over op structure
alone (loop-body detection).
"""
from __future__ import annotations

import sys

from .config import SKIP_PREFIXES, config
from .runtime import stats
from .runtime.transfer import materialize_empty
from .scheduler import steps
from .scheduler.records import Node, Value

S = stats.S
_BODIES: set = set()          # (length, hops) of detected loop bodies
_PERIODS: dict = {}           # (trace hash, length) -> the loop body step detection found, or None
_BODY_OPS: dict = {}          # a body in _BODIES -> its ops' structure hashes (NOTE [body phase])
# id(code) -> (code, inside torch or deferfuse, {f_lasti: 'file:line'}). Keyed by id: hashing a code
# object hashes its contents, and f_lineno decodes the line table; both cost more than recording
# the op. The entry keeps its code object alive, so an id is never reused while it is here.
_CODES: dict = {}


def _code_entry(code):
    e = _CODES[id(code)] = (code, code.co_filename.startswith(SKIP_PREFIXES), {})
    return e


def _site(e, f) -> str:
    s = e[2][f.f_lasti] = f"{e[0].co_filename}:{f.f_lineno}"
    return s


def user_site(f) -> str:
    """'file:line' of the first frame from ``f`` outward that is outside torch and deferfuse;
    '<backward>' if none (autograd's device thread has no user frame)."""
    while f is not None:
        code = f.f_code
        e = _CODES.get(id(code))
        if e is None or e[0] is not code:
            e = _code_entry(code)
        if not e[1]:
            return e[2].get(f.f_lasti) or _site(e, f)
        f = f.f_back
    return "<backward>"


class Trace:
    def __init__(self):
        self.reset()

    def reset(self):
        self.nodes: list[Node] = []
        self.ext: list[Value] = []
        self.ext_uses: list[int] = []  # node inputs reading each external value (donation check)
        self._ext_ids: dict = {}
        self.scalars: list = []
        self.h = 0
        self.hops = 0
        self.storages: list = []      # weak refs of storages that may hold pending values
        self.cut = None               # a cut decided at the last op, made before the next one
        self.counted = 0              # nodes already in S["ops_recorded"] (see metrics._pending)
        self.check_at = steps.LOOP_SPLIT_MIN_OPS     # next length to look for a loop body at
        self.after = None             # the body whose cut began this trace (NOTE [body phase])
        self.cut_body = None          # the body a pending "loop boundary" cut completes
        Trace.epoch += 1              # storages taken by an earlier trace are taken again

    epoch = 0

    def track(self, storage):
        """Keep ``storage`` (weakly) among those whose pending values the next flush reads back;
        once per trace, however many ops write it (an optimizer writes each state many times)."""
        if storage.ep != Trace.epoch:
            storage.ep = Trace.epoch
            storage.prev = 0
            self.storages.append(storage.wr)

    def track_mut(self, storage, v):
        """Called just before an op writes the pending value ``v`` into ``storage``: remember
        (by id, holding no reference) the value it held before this trace first wrote it."""
        if v.node is not None and storage.ep != Trace.epoch:
            storage.ep = Trace.epoch
            storage.prev = id(storage.val)
            self.storages.append(storage.wr)

    def record(self, entry, ins, scalars):
        """Append one op; its output Values (pending, None for an absent output). The hot path of
        defer mode: keep it lean (see DESIGN.md's hot-path budget)."""
        if self.cut is not None:
            # Cut before this op, once the previous op's outputs are bound to their tensors.
            self._cut_now()
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
                if p >= pos or nodes[p] is not n:
                    raise RuntimeError(f"deferfuse internal error: a value of {n.name} recorded at "
                                       f"{n.src} was dropped by an earlier sync but is still read")
                wiring.append((p, v.idx))
                continue
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
            # NOTE [record depth]: every path into record() passes record, _run (or run_node and
            # _run) and dispatch.torch_dispatch (the __torch_dispatch__ itself, or a special, or a
            # PrivateUse1 kernel), so the user's frame is at least 3 frames up: start there.
            try:
                f = sys._getframe(3)
            except ValueError:      # autograd's device thread calls us with no Python caller
                f = None
            src = None
            if f is not None:       # user_site's first step, inlined
                e = _CODES.get(id(f.f_code))
                if e is not None and not e[1] and e[0] is f.f_code:
                    src = e[2].get(f.f_lasti)
            if src is None:
                src = user_site(f)
        else:
            src = None
        khash = entry.khash
        node = Node(entry, ins, wiring, len(self.scalars), scalars, outs, src, pos)
        for o in outs:
            if o is not None:
                o.node = node
        nodes.append(node)
        if scalars:
            self.scalars.extend(scalars)
        self.h = hash((self.h, khash, wiring, len(scalars)))
        self.hops = hops = hash((self.hops, khash))
        pos += 1
        if _BODIES and (pos, hops) in _BODIES:
            self.cut = "loop boundary"
            self.cut_body = (pos, hops)
        elif pos >= config.trace_limit:
            self.cut = "trace limit"
        elif pos == self.check_at:
            self.check_at *= 2
            if config.step_detection and self._find_body():
                self.cut = "loop boundary"
        return outs

    def _find_body(self) -> bool:
        """NOTE [early step detection]: at 256, 512, 1024 ... recorded ops, look for a loop body
        in the trace (steps.find_period: its last half repeats). If there is one, remember it and
        cut here: from now on the loop is cut at every repetition and each piece runs while the
        next is recorded. The trace limit alone left a loop that never syncs, and has no
        backward() to cut at (an evaluation loop collecting outputs), recording 20,000 ops with
        the device idle. Counts and hashes only, never timing."""
        key = (self.h, len(self.nodes))
        body = _PERIODS.get(key, 0)
        if body == 0:
            if len(_PERIODS) > 10000:     # traces whose shapes keep changing (generate())
                _PERIODS.clear()
            khashes = [n.key.khash for n in self.nodes]
            L = steps.find_period(khashes)
            if L is not None:
                # A short body (a chain of tiny ops) is cut every k repetitions: a cut costs a
                # flush and a launch, which per 8 ops made the 1,000-op overhead loop 1.2x slower
                # than one region. (k repetitions fit in any trace of 256 ops or more.)
                k = -(-steps.CUT_MIN_OPS // L)
                if k * L <= len(khashes):
                    L *= k
                body = steps.body_signature(khashes, L)
                _BODY_OPS[body] = tuple(khashes[-L:])
            else:
                body = None
            _PERIODS[key] = body
        if body is None:
            return False
        _BODIES.add(body)
        self.cut_body = body
        return True

    def _rephase(self) -> None:
        """NOTE [body phase]: a loop is cut where a trace that starts empty has recorded exactly one
        body, so the cuts hold their phase from cut to cut. A sync in the loop (it prints a running
        metric every N iterations) ends a trace after m < L ops of the body, and the next trace
        starts m ops into it: learn the body as seen from there (its rotation by m), so the loop is
        cut again after its next L ops, not only once 256 more ops show the body anew."""
        ops = _BODY_OPS.get(self.after)
        m = len(self.nodes)
        if ops is None or not 0 < m < len(ops):
            return
        for n, k in zip(self.nodes, ops):
            if n.key.khash != k:
                return
        rot = ops[m:] + ops[:m]
        body = steps.body_signature(rot, len(rot))
        if body not in _BODIES:
            _BODIES.add(body)
            _BODY_OPS[body] = rot

    def _external(self, v) -> int:
        """The external-input index of the concrete value ``v``."""
        if v.array is None:
            materialize_empty(v, 0)
        i = self._ext_ids.get(id(v))
        if i is None:
            i = self._ext_ids[id(v)] = len(self.ext)
            self.ext.append(v)
            self.ext_uses.append(1)
        else:
            self.ext_uses[i] += 1
        return i

    def _cut_now(self):
        from .state import sync
        reason, self.cut = self.cut, None
        if reason == "trace limit" and config.step_detection:
            self._find_body()
        body, self.cut_body = self.cut_body, None
        sync(reason)
        self.after = body       # the new trace starts at this body's first op (or None)

    # ---------------------------------------------------------------------------------------
    def flush(self, reason: str, src: str, want=None, later: bool = False):
        from .runtime.flush import ASYNC_CUTS, MAX_REGIONS, run_trace
        MAX_REGIONS[0] = config.max_regions
        nodes = self.nodes
        if not nodes:
            return
        # Outputs: pending values that a live storage still holds (weak references).
        # partner: output -> id of the value its storage held before this trace wrote it.
        outs, seen, partner = [], set(), {}
        for r in self.storages:
            st = r()
            if st is None:
                continue
            v = st.val
            if v.node is not None and id(v) not in seen:
                seen.add(id(v))
                outs.append(v)
                if st.prev:
                    partner[id(v)] = st.prev
        # Reset first: whatever happens in execution, the trace is consumed exactly once.
        ext, uses, scalars, h = self.ext, self.ext_uses, self.scalars, self.h
        want = ((want.node.pos,) if want is not None and want.node is not None
                and config.needed_first else None)
        S["ops_recorded"] += len(nodes) - self.counted
        if config.step_detection and reason not in ASYNC_CUTS:
            if len(nodes) >= steps.LOOP_SPLIT_MIN_OPS:
                # A sync after many repetitions of a loop body (a loop that logs every N steps):
                # the loop goes on after the sync, so cut it at every repetition from here on.
                self._find_body()
            elif self.after is not None:
                self._rephase()
        self.reset()
        try:
            run_trace(nodes, ext, uses, scalars, h, outs, reason, src, config.debug,
                      config.cross_check, config.memory_planner, config.shape_recompile_limit,
                      config.memory_budget, want, later=later, partner=partner,
                      loop_split=config.step_detection)
        finally:
            # Values and nodes reference each other (Value.node, Node.outs): break the cycles so
            # buffers are released by reference counting, right away, not by the cyclic GC.
            for n in nodes:
                n.ins = n.outs = None
            for v in outs:
                v.node = None
