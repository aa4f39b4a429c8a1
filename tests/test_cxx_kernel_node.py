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


def _run(handover):
    EXT.install_record_capi(_fastpath.record_capi if handover else None)
    torch.manual_seed(3)
    cx, cy, cb = torch.randn(5, 4), torch.randn(5, 4), torch.randn(4, 4)
    states, results, hits = [], [], []
    for _ in range(3):
        deferfuse.sync()
        x, y, b = cx.to("tpu"), cy.to("tpu"), cb.to("tpu")
        o = torch.empty(5, 4, device="tpu")
        deferfuse.sync()
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
    torch.manual_seed(3)
    cx, cy, cb = torch.randn(5, 4), torch.randn(5, 4), torch.randn(4, 4)
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
    torch.manual_seed(4)
    cx, cy, cb = torch.randn(5, 4), torch.randn(5, 4), torch.randn(4, 4)
    states, hits = [], []
    with deferfuse.override(c_record=c_record):
        for _ in range(2):
            deferfuse.sync()
            x, y, b = cx.to("tpu"), cy.to("tpu"), cb.to("tpu")
            o = torch.empty(5, 4, device="tpu")
            deferfuse.sync()
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
