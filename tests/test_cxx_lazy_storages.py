"""A kernel hit's outputs get their Python ``Storage`` on a reader's first ask (NOTE [lazy storages]
in deferfuse/_tpu_tensor.cpp; docs/cxx-plan.md, Session 11 (cxx22)): until then the output's
storage context holds its pending ``Value``. Every value equals CPU eager's, whichever reader asks
first and whenever it asks (before the flush, after it, after many more hits); an output no
reader asked for but kept alive is an output of its flush and reads right later; a Storage made
before the flush is one the flush reads back."""
import io

import pytest
import torch

import deferfuse
from deferfuse import plain
from deferfuse.engine import engine
from util import assert_same

EXT = plain.PLAIN.ext

pytestmark = [pytest.mark.modes("defer"),
              pytest.mark.skipif(not plain.LAZY, reason="DEFERFUSE_LAZY_STORAGES=0: nothing is lazy")]


def _lazy(t) -> bool:
    return EXT.lazy_state(t)[0]


def _chain(x, y, n):
    """n hits of two ops each; every output kept."""
    outs = []
    z = x
    for i in range(n):
        z = z * 0.5 + y
        outs.append(z)
    return outs


def _warm(x, y):
    for _ in range(3):      # plans, then keys learnt: hits from the third call
        _chain(x, y, 2)
    deferfuse.sync()


def _inputs(shape=(5, 4)):
    torch.manual_seed(3)
    cx, cy = torch.randn(shape), torch.randn(shape)
    x, y = cx.to("tpu"), cy.to("tpu")
    _warm(x, y)
    return cx, cy, x, y


def test_hits_make_no_storage_and_outputs_read_after_many_hits_equal_cpu():
    """Outputs of 60 hits hold their Value, no Storage made (counted), each in the lazy list; read
    afterwards in reverse order (the first after every later hit was recorded), each equals CPU's,
    and each read made one Storage."""
    cx, cy, x, y = _inputs()
    want = _chain(cx, cy, 30)
    s0, h0 = EXT.lazy_stats(), EXT.kernel_stats()["hits"]
    got = _chain(x, y, 30)
    s1 = EXT.lazy_stats()
    assert EXT.kernel_stats()["hits"] - h0 == 60
    assert s1["outputs"] - s0["outputs"] == 60 and s1["made"] == s0["made"]
    assert all(_lazy(g) for g in got)
    assert EXT.lazy_state(got[0]) == (True, True)
    for i in reversed(range(len(got))):
        assert_same(got[i], want[i])
        assert not _lazy(got[i])
    assert EXT.lazy_stats()["made"] - s0["made"] == 30


def test_an_output_never_read_but_kept_alive_is_flushed_and_reads_right_later():
    """No reader asks for the kept outputs' Storages before the sync: the flush outputs them (the
    lazy list), and after more syncs, hits and collections they read as CPU's, as inputs of later
    hits too."""
    import gc
    cx, cy, x, y = _inputs()
    want = _chain(cx, cy, 8)
    got = _chain(x, y, 8)
    kept = {0: got[0], 3: got[3], 7: got[7]}
    del got
    gc.collect()
    deferfuse.sync()
    for k, t in kept.items():
        assert _lazy(t), k
    for _ in range(3):      # other traces, their own lazy outputs, dropped
        _chain(x, y, 4)
        deferfuse.sync()
        gc.collect()
    later = kept[7] * 2 + kept[0]       # hits reading the ready lazy values as inputs
    assert _lazy(later)
    assert_same(later, want[7] * 2 + want[0])
    for k, t in kept.items():
        assert_same(t, want[k])


def test_the_flush_outputs_kept_lazy_values_only():
    """The trace's outputs are the kept outputs' values (read from the lazy list) and no dropped
    intermediate's: 2 values, as with Storages made at every hit; the trace recorded again (an
    interrupted flush's requeue) keeps them, and they read as CPU's."""
    cx, cy, x, y = _inputs()
    got = _chain(x, y, 6)
    keep = [got[2], got[5]]
    del got
    trace = engine.local.ts.trace
    with engine.lock:
        vals = EXT.lazy_outputs(trace)
        fl = trace.take("test")
        assert len(fl.outs) == 2 and {id(v) for v in fl.outs} <= {id(v) for v in vals}
        trace.requeue(fl, set())        # as an interrupted flush: recorded again, values kept
    want = _chain(cx, cy, 6)
    deferfuse.sync()
    assert_same(keep[0], want[2])
    assert_same(keep[1], want[5])


def test_a_storage_made_before_the_flush_is_read_back_by_it():
    """A reader asks for a pending output's Storage (the maker): the trace that holds its value
    reads it back at the flush, so after the sync it reads right (not an unmade value's zeros)."""
    cx, cy, x, y = _inputs()
    want = _chain(cx, cy, 4)
    got = _chain(x, y, 4)
    st = EXT.storage(got[1])
    assert st is not None and st.val.node is not None and not _lazy(got[1])
    assert EXT.storage(got[1]) is st and plain.PLAIN.storage(got[1]) is st
    assert EXT.state(got[2])[0] is EXT.storage(got[2])
    deferfuse.sync()
    assert st.val.node is None and st.val.array is not None
    for g, w in zip(got, want):
        assert_same(g, w)


def _written(t, c):
    t.mul_(3)           # an in-place hit: the written storage's Storage, made by the maker
    c.mul_(3)


def _resized(t, c):
    n = t.numel()
    t.resize_(n + 6)    # grows: the storage hook reads the lazy storage's Storage
    c.resize_(n + 6)
    return (t[:n], c[:n])


def _routed(t, c):
    return (torch.sort(t.reshape(-1))[0], torch.sort(c.reshape(-1))[0])


def _saved(t, c):
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    return (torch.load(buf), c)


def _viewed(t, c):
    return (t.t()[1:] * 2, c.t()[1:] * 2)


def _compiled(t, c):
    f = torch.compile(lambda a: (a * 2).sum(0), backend="tpu", fullgraph=True)
    return (f(t), (c * 2).sum(0))


_READERS = {"written": _written, "resized": _resized, "routed": _routed, "saved": _saved,
            "viewed": _viewed, "compiled": _compiled}


@pytest.mark.parametrize("reader", sorted(_READERS))
@pytest.mark.parametrize("when", ["pending", "ready"])
def test_every_reader_of_a_lazy_output_sees_cpus_value(reader, when):
    """Each reader kind asks for a lazy output's Storage, before the flush (its value pending) or
    after it (ready): an in-place hit, ``resize_`` growing it, a routed op, ``torch.save``, views
    and ops on them, compiled mode; each sees CPU's value."""
    cx, cy, x, y = _inputs((4, 3))
    c = _chain(cx, cy, 3)[-1]
    t = _chain(x, y, 3)[-1]
    assert _lazy(t)
    if when == "ready":
        deferfuse.sync()
        assert _lazy(t)
    got = _READERS[reader](t, c)
    if got is None:
        got = (t, c)
    assert_same(got[0], got[1])
    assert_same(t if reader != "resized" else t[:12], c if reader != "resized" else c[:12])


def test_a_fresh_out_tensor_holds_its_value_lazily():
    """A structured op's fresh out= tensor (NOTE [fresh out]) takes the hit's output Value in its
    storage context: lazy, not fresh again for the next call, and read right."""
    cx, cy, x, y = _inputs()
    for _ in range(4):
        o = torch.empty(5, 4, device="tpu")
        torch.add(x, y, alpha=2, out=o)
    assert _lazy(o)
    torch.mul(x, y, out=o)      # an out= with a value now: written, through its Storage
    assert not _lazy(o)
    assert_same(o, cx * cy)


def test_untyped_storage_resize_of_a_lazy_output():
    """``untyped_storage().resize_(0)`` on a lazy output frees its value through the Storage's
    hook (the maker first); restored and written, it reads as CPU."""
    cx, cy, x, y = _inputs()
    t = _chain(x, y, 2)[-1]
    assert _lazy(t)
    full = t.untyped_storage().nbytes()
    t.untyped_storage().resize_(0)
    assert t.untyped_storage().nbytes() == 0 and not _lazy(t)
    t.untyped_storage().resize_(full)
    with torch.no_grad():
        t.copy_(cy.to("tpu"))
    assert_same(t, cy)


def test_set_storage_drops_a_lazy_value_and_the_list_entry():
    """``set_storage`` (the router's fresh-out binding) replaces a lazy value: the context is
    unlinked, and a storage that dies unlinks its context (the list does not grow)."""
    cx, cy, x, y = _inputs()
    deferfuse.sync()
    linked0 = EXT.lazy_stats()["linked"]
    outs = _chain(x, y, 10)
    assert EXT.lazy_stats()["linked"] == linked0 + 10
    st = EXT.storage(outs[0])
    EXT.set_storage(outs[1], st)
    assert EXT.lazy_state(outs[1]) == (False, False)
    assert EXT.lazy_stats()["linked"] == linked0 + 8
    del outs
    assert EXT.lazy_stats()["linked"] == linked0
