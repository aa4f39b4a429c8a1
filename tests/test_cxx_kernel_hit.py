"""A kernel hit's own costs (docs/cxx-plan.md, Session 9 (cxx20), Session 10 (cxx21)): the thread's
state memoised per thread (NOTE [thread state memo] in deferfuse/_fastpath.c), the engine lock
taken in C (NOTE [engine lock in C]); each hit records into the calling thread's own trace, a
thread's state dies with its thread, and the results equal CPU eager's; a hit's outputs made from
cached metadata (NOTE [hit outputs] in deferfuse/_tpu_tensor.cpp) have CPU eager's layout."""
import gc
import sys
import threading
import weakref

import pytest
import torch

import deferfuse
from deferfuse import _fastpath, plain
from deferfuse.engine import ThreadState, engine
from deferfuse.record import Trace
from util import assert_same

EXT = plain.PLAIN.ext

pytestmark = pytest.mark.modes("defer")


def _hits():
    return EXT.kernel_stats()["hits"]


def _ops(x, y):
    return [x + y, x * 1.75, (x - y) * y]


def _inputs():
    torch.manual_seed(11)
    cx, cy = torch.randn(6, 5), torch.randn(6, 5)
    deferfuse.sync()
    x, y = cx.to("tpu"), cy.to("tpu")
    for _ in range(3):      # each op's plan, then its key learnt: hits from the third call
        _ops(x, y)
    deferfuse.sync()
    return cx, cy, x, y


def test_many_short_threads_record_their_own_trace_and_their_state_dies_with_them():
    """More threads than the memo has entries, one after another and four at a time: each
    thread's hits go into its own trace (its ThreadState's), equal CPU eager's, and no thread's
    ThreadState outlives it (the memo holds weak references only)."""
    cx, cy, x, y = _inputs()
    want = _ops(cx, cy)
    states, errors, counts = [], [], []
    h0, m0 = _hits(), _fastpath.stats()

    def work():
        try:
            ts = engine.local.ts
            states.append(weakref.ref(ts))
            before = len(ts.trace.nodes)
            h = _hits()
            got = _ops(x, y)
            counts.append((len(ts.trace.nodes) - before, _hits() - h))
            deferfuse.sync()
            for g, w in zip(got, want):
                assert_same(g, w)
        except BaseException as e:     # noqa: B902 (reported by the main thread)
            errors.append(e)

    for _ in range(40):
        t = threading.Thread(target=work)
        t.start()
        t.join()
    for _ in range(6):
        ts = [threading.Thread(target=work) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert not errors, errors
    assert len(states) == 64
    # the four ops of _ops (x + y, x * 1.75, x - y, * y) per thread, each a node of that thread's
    # trace, each a kernel hit (other threads' hits may land between a thread's two reads)
    assert all(n == 4 and k >= 4 for n, k in counts), counts
    assert _hits() - h0 >= 4 * 64
    st = _fastpath.stats()
    assert st["ts_memo_hits"] - m0["ts_memo_hits"] >= 64
    gc.collect()
    alive = [r for r in states if r() is not None]
    assert not alive, f"{len(alive)} dead threads' ThreadStates are still alive"
    got = _ops(x, y)    # the main thread's own state, after all of them
    for g, w in zip(got, want):
        assert_same(g, w)


def test_setting_local_ts_is_seen_by_the_next_hit():
    """engine.local.ts replaced (and put back) between hits: the next hit records into the state
    set, never into the one the memo saw before (NOTE [thread state memo]: the epoch)."""
    cx, cy, x, y = _inputs()
    want = _ops(cx, cy)
    old = engine.local.ts
    new = ThreadState()
    new.mode, new.trace, new.device, new.backward_errors = "defer", Trace(engine), 0, []
    engine.traces.add(new.trace)
    n_old = len(old.trace.nodes)
    h = _hits()
    try:
        engine.local.ts = new
        got = _ops(x, y)
        assert len(new.trace.nodes) == 4 and len(old.trace.nodes) == n_old
        deferfuse.sync()        # the new state's trace
    finally:
        engine.local.ts = old
    assert _hits() - h == 4
    for g, w in zip(got, want):
        assert_same(g, w)
    got = _ops(x, y)
    assert len(old.trace.nodes) == n_old + 4 and not new.trace.nodes
    deferfuse.sync()
    for g, w in zip(got, want):
        assert_same(g, w)


@pytest.mark.skipif(sys.implementation.name != "cpython" or sys.version_info >= (3, 13),
                    reason="the C lock path reads CPython 3.11/3.12's RLock layout")
def test_engine_lock_in_c_waits_for_another_thread_and_nests():
    """NOTE [engine lock in C]: a hit while another thread holds the engine lock waits for it
    (through the Python acquire: counted), a hit inside the thread's own hold nests, and after
    each the lock is as it was: free, or held once by its owner."""
    cx, cy, x, y = _inputs()
    want = _ops(cx, cy)
    assert _fastpath.stats()["lock_in_c"] == 1
    held, go = threading.Event(), threading.Event()

    def holder():
        with engine.lock:
            held.set()
            go.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(5)
    w0, h = _fastpath.stats()["lock_waits"], _hits()
    timer = threading.Timer(0.2, go.set)
    timer.start()
    got = _ops(x, y)        # waits for the holder's release
    t.join()
    assert _fastpath.stats()["lock_waits"] - w0 >= 1 and _hits() - h == 4
    assert not engine.lock._is_owned()
    deferfuse.sync()
    for g, w in zip(got, want):
        assert_same(g, w)
    with engine.lock:
        got = _ops(x, y)
        assert engine.lock._is_owned()
    assert not engine.lock._is_owned()
    other = []
    t = threading.Thread(target=lambda: other.append(engine.lock.acquire(timeout=5) and
                                                     engine.lock.release() is None))
    t.start()
    t.join()
    assert other == [True]
    deferfuse.sync()
    for g, w in zip(got, want):
        assert_same(g, w)


@pytest.mark.parametrize("shape", [(), (7,), (2, 3, 1, 2, 1, 3, 2)])
def test_hits_on_bases_of_any_rank_and_their_views_equal_cpu(shape):
    """A storage's base sizes and strides in small vectors (StorageCtx): a 0-d, a 1-d and a 7-d
    base (past the vectors' inline size), their views and the ops' keys; the same kernel hits on
    every round from the third, and values, dtypes and shapes equal CPU eager's."""
    torch.manual_seed(len(shape))
    cx, cy = torch.randn(shape), torch.randn(shape)

    def ops(x, y):
        v = x.t() if x.dim() == 2 else x.flatten()[1:] if x.dim() else x
        w = y.t() if y.dim() == 2 else y.flatten()[:-1] if y.dim() else y
        return [x + y, (x * 1.5).sum(), v * w, (x - y).transpose(0, -1) if x.dim() else x - y]

    want = ops(cx, cy)
    for r in range(4):
        deferfuse.sync()
        x, y = cx.to("tpu"), cy.to("tpu")
        deferfuse.sync()
        h = _hits()
        got = ops(x, y)
        if r >= 2:
            assert _hits() - h >= 4, (r, _hits() - h)
        deferfuse.sync()
        for g, w in zip(got, want):
            assert_same(g, w)


def _layout(t):
    return (tuple(t.shape), t.stride(), t.dtype, t.storage_offset(), t.is_contiguous(),
            t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last),
            t.untyped_storage().nbytes())


_LAYOUTS = {
    "contiguous": (lambda a, b: a + b, (5, 3), None),
    "transposed": (lambda a, b: a.t() + b.t(), (5, 3), None),
    "channels_last": (lambda a, b: a * b, (2, 3, 4, 5), torch.channels_last),
    "0d": (lambda a, b: (a - b).sum() * 2.5, (4,), None),
    "empty": (lambda a, b: a[:0] * b[:0], (4, 2), None),
    "int": (lambda a, b: (a > b).int() + 3, (4,), None),
    "bool": (lambda a, b: a > b, (4, 6), None),
}


@pytest.mark.parametrize("case", sorted(_LAYOUTS))
def test_hit_outputs_have_cpu_eager_layout_and_storage(case):
    """NOTE [hit outputs]: a hit's new output is made from the Entry's cached metadata, not by
    `empty_strided`: its sizes, strides, dtype, offset, contiguity flags (channels-last included)
    and storage bytes equal CPU eager's on every hit, and so do its values, and an in-place op
    on it (through its storage) and a view of it."""
    f, shape, fmt = _LAYOUTS[case]
    torch.manual_seed(5)
    ca, cb = torch.randn(shape), torch.randn(shape)
    if fmt is not None:
        ca, cb = ca.to(memory_format=fmt), cb.to(memory_format=fmt)
    a, b = ca.to("tpu"), cb.to("tpu")
    want = f(ca, cb)
    for r in range(4):
        h = _hits()
        got = f(a, b)
        if r >= 2:
            assert _hits() - h >= 1, (case, r)
        assert _layout(got) == _layout(want), (case, r)
        if got.dtype.is_floating_point:
            got.mul_(3)
            assert_same(got, want * 3)
        else:
            assert_same(got, want)
        assert_same(got.reshape(-1)[:2], (want * 3 if got.dtype.is_floating_point else want).reshape(-1)[:2])
        deferfuse.sync()


def test_hits_on_tensors_only_the_call_holds_equal_cpu():
    """NOTE [call tensors]: a Call keeps the addresses of its tensors in the call's stack, no
    reference of its own: tensors only the call holds (temporaries, a list built in the call,
    foreach lists of temporaries), on their key's first call (learnt after the router dropped
    the stack) and on hits, with a collection between rounds, give CPU eager's values."""
    import gc
    torch.manual_seed(9)
    cx, cy = torch.randn(4, 3), torch.randn(4, 3)

    def ops(x, y):
        return [(x + y) * (y - x), torch.cat([x * 2, y + 1, x - y]),
                torch.stack([x.t() * 0.5, y.t()]),
                torch._foreach_mul([x + 1, y * 3], [y - 2, x + 4]),
                torch.where(x > y, x * y, y + 2)]

    want = ops(cx, cy)
    x, y = cx.to("tpu"), cy.to("tpu")
    for r in range(5):
        h = _hits()
        got = ops(x, y)
        if r >= 2:
            assert _hits() - h >= 12, (r, _hits() - h)
        gc.collect()
        deferfuse.sync()
        for g, w in zip(got, want):
            assert_same(g, w)
