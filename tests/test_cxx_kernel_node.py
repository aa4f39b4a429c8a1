"""The node of the C++ recording kernel (docs/cxx-plan.md, Session 5
(cxx9)): the kernel hands its cache hits to the C record path without a Python call (NOTE [C++
node hand-over] in deferfuse/_fastpath.c), and the trace it records is the one the Python call
recorded: the same nodes, wiring, scalars and rolling hashes, and results equal to CPU eager."""
import pytest
import torch

import deferfuse
from deferfuse import _fastpath, plain
from deferfuse.engine import engine
from util import assert_same


EXT = plain.PLAIN.ext


def _hits():
    return EXT.kernel_stats()["hits"]


def _steps(x, y, o, b):
    """Ops the kernel takes on hits: new outputs, runtime and constant scalars, in place on a
    base and on a view, a fresh out=, two outputs."""
    a = x + y
    m = a * 1.75
    s = (m - y).sum(0)
    x.mul_(0.5)
    b[1:3].add_(2.25)
    torch.mul(a, y, out=o)
    mx, ix = torch.max(m, 1)
    return [a, m, s, x, b, o, mx, ix]


def _trace_state():
    t = engine.local.ts.trace
    return (t.h, t.hops, len(t.nodes),
            [(n.key.khash, n.wiring, tuple(n.scalars), n.s0) for n in t.nodes], list(t.scalars))


def _inputs(seed):
    """Three CPU tensors and, per round, their tpu copies and an out= tensor, made between two
    syncs: outside the trace each round records."""
    torch.manual_seed(seed)
    cpu = torch.randn(5, 4), torch.randn(5, 4), torch.randn(4, 4)

    def upload():
        deferfuse.sync()
        x, y, b = (t.to("tpu") for t in cpu)
        o = torch.empty(5, 4, device="tpu")
        deferfuse.sync()
        return x, y, o, b
    return cpu, upload


def _run(handover):
    EXT.install_record_capi(_fastpath.record_capi if handover else None)
    _, upload = _inputs(3)
    states, results, hits = [], [], []
    for _ in range(3):
        x, y, o, b = upload()
        h = _hits()
        got = _steps(x, y, o, b)
        hits.append(_hits() - h)
        states.append(_trace_state())
        deferfuse.sync()
        results.append(got)
    return states, results, hits


@pytest.mark.modes("defer")
def test_handover_records_the_trace_the_python_call_records_and_equals_cpu():
    try:
        with_c = _run(True)
        with_call = _run(False)
    finally:
        EXT.install_record_capi(_fastpath.record_capi)
    (cx, cy, cb), _ = _inputs(3)
    want = _steps(cx.clone(), cy.clone(), torch.empty(5, 4), cb.clone())
    for states, results, hits in (with_c, with_call):
        for got in results:
            for g, w in zip(got, want):
                assert_same(g, w)
        # the last call is all hits (the first learnt each key)
        assert hits[-1] >= 7, hits
    # the same trace, node by node, and the same rolling hashes
    assert with_c[0][-1] == with_call[0][-1]
    assert with_c[0][-1][2] >= 7


def test_install_record_capi_refuses_another_capsule():
    import datetime  # a module with a capsule of another name
    with pytest.raises(ValueError):
        EXT.install_record_capi(datetime.datetime_CAPI)
    assert _fastpath.record_capi is not None
    EXT.install_record_capi(_fastpath.record_capi)


def _record_once(c_record):
    """The trace _steps records, with the C record path on (the kernel's hits, NOTE [rolling
    hashes in C]) or off (every op through the router into Trace.record, in Python)."""
    (cx, cy, cb), upload = _inputs(4)
    states, hits = [], []
    with deferfuse.override(c_record=c_record):
        for _ in range(2):
            x, y, o, b = upload()
            h = _hits()
            got = _steps(x, y, o, b)
            hits.append(_hits() - h)
            states.append(_trace_state())
            deferfuse.sync()
    want = _steps(cx.clone(), cy.clone(), torch.empty(5, 4), cb.clone())
    for g, w in zip(got, want):
        assert_same(g, w)
    return states[-1], hits


@pytest.mark.modes("defer")
@pytest.mark.parametrize("own_hash", [True, False], ids=["lanes", "packed"])
def test_rolling_hashes_in_c_equal_trace_record_in_python(own_hash):
    assert _fastpath.set_own_hash(True), "setup's check of the tuple hash failed"
    try:
        _fastpath.set_own_hash(own_hash)
        in_c, c_hits = _record_once(True)
        in_py, py_hits = _record_once(False)
    finally:
        _fastpath.set_own_hash(True)
    assert c_hits[-1] >= 7 and py_hits == [0, 0], (c_hits, py_hits)
    # nodes, wiring, scalars and both rolling hashes: the same values
    assert in_c == in_py
    assert in_c[0] != 0 and in_c[1] != 0


# --- NOTE [trace state in C]: the trace's per-op state as the C base's fields --------------------

def _live_outputs(t) -> int:
    """How many values the flush would read back (Trace.take's outputs): pending values of ``t``
    that live storages hold or, NOTE [lazy storages] in _tpu_tensor.cpp, that kernel hits'
    outputs hold before a reader made their Storage (those add no ``storages`` entry)."""
    seen = set()
    for r in t.storages:
        st = r()
        if st is not None and st.val.node is not None and st.val.node.trace is t:
            seen.add(id(st.val))
    if engine.lazy_outputs is not None:
        seen.update(id(v) for v in engine.lazy_outputs(t))
    return len(seen)


def _full_state():
    """_trace_state and the rest of the per-op state the C base holds."""
    t = engine.local.ts.trace
    return (_trace_state(), t.ext_uses, [id(v) for v in t.ext], t.device, t.cut, t.check_at,
            _live_outputs(t))


def _mixed(split):
    """_steps twice into one trace: the first ``split`` ops of the pair recorded in Python
    (c_record off: the router into Trace.record), the rest by the kernel's hits."""
    (cx, cy, cb), upload = _inputs(5)
    # a second round learns keys
    for _ in range(2):
        x, y, o, b = upload()
        h = _hits()
        with deferfuse.override(c_record=split == 0):
            a = x + y
            m = a * 1.75
        with deferfuse.override(c_record=split <= 2):
            s = (m - y).sum(0)
            x.mul_(0.5)
            b[1:3].add_(2.25)
        with deferfuse.override(c_record=split <= 5):
            torch.mul(a, y, out=o)
            mx, ix = torch.max(m, 1)
            z = (y + 1.5) * a
        hits = _hits() - h
        state = _full_state()
        got = [a, m, s, x, b, o, mx, ix, z]
        deferfuse.sync()
    a = cx + cy
    m = a * 1.75
    xc, bc, oc = cx.clone(), cb.clone(), torch.empty(5, 4)
    s = (m - cy).sum(0)
    xc.mul_(0.5)
    bc[1:3].add_(2.25)
    torch.mul(a, cy, out=oc)
    mx, ix = torch.max(m, 1)
    for g, w in zip(got, [a, m, s, xc, bc, oc, mx, ix, (cy + 1.5) * a]):
        assert_same(g, w)
    return state, hits


@pytest.mark.modes("defer")
def test_one_trace_recorded_by_python_then_c_equals_python_alone():
    """The C path reads what Trace.record in Python wrote (nodes, external inputs and their use
    counts, scalars, hashes, device) and writes what Python reads next: a trace recorded half in
    Python, half by the kernel, is the trace Python records alone, field by field."""
    want, py_hits = _mixed(6)      # all in Python
    assert py_hits == 0
    for split in (0, 2, 5):
        got, hits = _mixed(split)
        assert hits > 0, split
        # ids of the external Values differ from run to run: compare their count
        assert got[0] == want[0] and got[1] == want[1] and len(got[2]) == len(want[2]), split
        assert got[3:] == want[3:], split
    assert max(want[1]) >= 2        # an external input read by several nodes


def test_trace_state_fields_round_trip_and_refuse_bad_values():
    from deferfuse.record import Trace
    t = Trace(engine)
    try:
        assert isinstance(t, _fastpath.TraceState)
        assert (t.nodes, t.ext, t.ext_uses, t.scalars, t.storages) == ([], [], [], [], [])
        assert (t.h, t.hops, t.cut, t.device, t.counted) == (0, 0, None, None, 0)
        assert t._known is engine.bodies.known
        for v in (0, 1, -1, 2 ** 63 - 1, -2 ** 63, 2 ** 61 - 1):
            t.h = v
            t.hops = v
            assert (t.h, t.hops) == (v, v)
        with pytest.raises(OverflowError):
            t.h = 2 ** 63
        t.device = 3
        assert t.device == 3
        t.device = None
        assert t.device is None
        for bad in (-1, "tpu:0", 1.0):
            with pytest.raises((TypeError, ValueError, OverflowError)):
                t.device = bad
        assert t.device is None
        with pytest.raises(AttributeError):
            t.nodes = []
        with pytest.raises(AttributeError):
            t.ext_uses = []
        t.cut = "loop boundary"
        assert t.cut == "loop boundary"
        # ext_index: one entry per Value (by identity), its use count per call
        from deferfuse.scheduler.records import Value
        vs = [Value((2,), torch.float32, 8) for _ in range(200)]     # past the map's first growth
        for k, v in enumerate(vs):
            assert t.ext_index(v) == k
        assert t.ext_index(vs[7]) == 7 and t.ext_index(vs[7]) == 7 and t.ext_index(vs[199]) == 199
        assert t.ext == vs
        uses = t.ext_uses
        assert uses[7] == 3 and uses[199] == 2 and uses.count(1) == 198
        t.reset()
        assert (t.ext, t.ext_uses, t.h, t.cut, t.device) == ([], [], 0, None, None)
        assert t.ext_index(vs[7]) == 0 and t.ext_uses == [1]
        # by hand, the list and the counts would disagree: refused, not read past the counts
        t.ext.append(vs[8])
        with pytest.raises(RuntimeError, match="outside ext_index"):
            t.ext_index(vs[9])
        with pytest.raises(RuntimeError, match="outside ext_index"):
            t.ext_uses
        for k, v in enumerate(vs * 30):         # a big table is dropped at the next reset
            t.reset() if k == 0 else t.ext_index(v)
        assert len(t.ext) == 200 and t.ext_uses == [30] * 199 + [29]
    finally:
        engine.traces.discard(t)


@pytest.mark.modes("defer")
@pytest.mark.parametrize("start", [2 ** 62 + 12345, -2 ** 63, 2 ** 61 - 1, -(2 ** 61 - 1), 2 ** 61])
def test_rolling_hashes_from_any_start_equal_python(start):
    """The C path hashes h and hops from the C words (an int's hash is |n| mod 2**61 - 1, not n):
    from a start of any size and sign, one kernel hit extends them as Trace.record does."""
    cx, cy = torch.randn(3, 3), torch.randn(3, 3)
    got = {}
    for c_record in (True, False):
        with deferfuse.override(c_record=c_record):
            for _ in range(2):          # the first round learns the key
                deferfuse.sync()
                x, y = cx.to("tpu"), cy.to("tpu")
                deferfuse.sync()
                t = engine.local.ts.trace
                t.h = start
                t.hops = -start if start != -2 ** 63 else start
                h = _hits()
                z = x + y
                hits = _hits() - h
                got[c_record] = (t.h, t.hops, hits)
                deferfuse.sync()
                assert_same(z, cx + cy)
    assert got[True][2] == 1 and got[False][2] == 0, got
    assert got[True][:2] == got[False][:2]


def _lines(x, y):
    """Kernel hits called from this frame and from inside torch's (F.relu's frame calls the op:
    its user line is found by walking out, from two lines of this frame); the lines of each call,
    in order."""
    import inspect
    import torch.nn.functional as F
    here = inspect.currentframe().f_lineno
    a = x + y           # here + 1
    b = F.relu(a)       # here + 2: the op called from torch's frame
    c = F.relu(y)       # here + 3: the same torch frame and offset, another user line
    d = a * y           # here + 4
    return [a, b, c, d], [f"{__file__}:{here + k}" for k in (1, 2, 3, 4)]


@pytest.mark.modes("defer")
def test_source_lines_of_kernel_hits_memoised_per_user_frame():
    """NOTE [source-line memo] in _fastpath.c: the kernel's hits carry the user's source line,
    memoised by code object and offset only where the op's caller is the user's frame; the ops
    called from torch's frame still walk out to the line that called it; a clear of the source
    line cache drops the memo's entries; values equal CPU eager's."""
    torch.manual_seed(5)
    cx, cy = torch.randn(4, 3), torch.randn(4, 3)
    want, _ = _lines(cx, cy)
    memo = []
    for r in range(6):
        # rounds 0-1: each op's plan, then its key, learnt (the router records those)
        if r in (2, 5):
            engine.sources.codes.clear()
        deferfuse.sync()
        x, y = cx.to("tpu"), cy.to("tpu")
        deferfuse.sync()
        h, st = _hits(), _fastpath.stats()
        got, lines = _lines(x, y)
        assert _hits() - h == 4 or r < 2, (r, _hits() - h)
        memo.append(_fastpath.stats()["source_memo_hits"] - st["source_memo_hits"])
        srcs = [n.src for n in engine.local.ts.trace.nodes[-4:]]
        assert srcs == lines, (r, srcs)
        deferfuse.sync()
        for g, w in zip(got, want):
            assert_same(g, w)
    # after a clear of the source line cache, round 2 fills it, round 3 fills the memo for x + y
    # and a * y (their caller is this file's frame), round 4 hits it for both; the relu calls
    # never use it; the clear before round 5 empties it
    assert memo[2:] == [0, 0, 2, 0], memo
