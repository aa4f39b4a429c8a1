"""NOTE [run tables in C] (deferfuse/_fastpath.c): the C helpers a region's run uses after its call
(bind the outputs, drop the donated inputs, the unchecked inputs' records, an index-check record's
tables) do exactly what their Python versions in runtime/ do, on exact Values and on a subclass."""
import weakref

import numpy as np
import pytest
import torch

import deferfuse
from deferfuse import _fastpath as FP
from deferfuse.engine import engine
from deferfuse.runtime import checks as C, inflight as I
from deferfuse.runtime.memory import COUNTERS, LARGE
from deferfuse.scheduler.records import Value

from util import assert_same

# The helpers do not depend on the mode: each test runs once (in defer mode).
pytestmark = pytest.mark.modes("defer")


class SubValue(Value):      # not the exact class: read and written through its attributes
    __slots__ = ()


def _values(make_arrays=True):
    """Small and large values, one of them a subclass; arrays when ``make_arrays``."""
    out = []
    for k, nbytes in enumerate([16, LARGE + 8, 4, 64, LARGE * 3]):
        cls = SubValue if k == 3 else Value
        a = np.zeros(2, np.float32) if make_arrays else None
        v = cls((2,), np.float32, nbytes, a)
        v.node = object()           # a pending value's node (bind and fail clear it)
        out.append(v)
    return out


def _counts(peaks=True):
    s = COUNTERS
    if not peaks:       # (a first count may raise a peak that a second one only reaches)
        return s.cur, s.freed, s.n, s.nfreed, s.lcur, s.lfreed, s.ln, s.lnfreed
    return (s.cur, s.peak, s.freed, s.n, s.npeak, s.nfreed, s.lcur, s.lpeak, s.lfreed, s.ln,
            s.lnpeak, s.lnfreed)


def _state(vs):
    return [(v.array is None, v.node is None, v.err) for v in vs]


def test_the_runners_and_checks_use_the_c_ones():
    assert engine.runner.hit_parts is FP.hit_parts
    assert engine.runner.bind_values is FP.bind_values
    assert engine.runner.drop_values is FP.drop_values
    assert engine.runner.checks.unchecked_inputs is FP.unchecked_inputs
    assert engine.runner.checks.check_tables is FP.check_tables


@pytest.mark.parametrize("short", [False, True])
def test_bind_values_is_pythons(short):
    res = {}
    for name, f in (("py", I.bind_values), ("c", FP.bind_values)):
        vs = _values(make_arrays=False)
        arrays = [np.ones(2, np.float32) * k for k in range(len(vs) - (2 if short else 0))]
        sums = f(vs, arrays, LARGE)
        res[name] = (sums, _state(vs), [v.array is a for v, a in zip(vs, arrays)])
        assert all(res[name][2])
        del vs      # their __del__ un-counts nothing here: never counted
    assert res["py"] == res["c"]
    assert res["c"][0][1] == (3 if short else 5)


def test_drop_values_is_pythons():
    err = RuntimeError("donated")
    res = {}
    for name, f in (("py", I.drop_values), ("c", FP.drop_values)):
        vs = _values()
        vs[2].array = None          # no array: not dropped, err untouched
        vs[2].node = None
        flags = [True, True, True, True, False]
        before = _counts()
        COUNTERS.add(*f(vs, flags, err, LARGE))
        after = _counts()
        res[name] = ([a - b for a, b in zip(after, before)], _state(vs),
                     [v.err is err for v in vs])
        for v in vs:                # un-count what is left, as the program's frees would
            v.fail(err)
    assert res["py"] == res["c"]
    delta, state, errs = res["c"]
    assert errs == [True, True, False, True, False]
    assert state[4] == (False, False, None)         # not flagged: untouched
    assert delta[0] == -(16 + LARGE + 8 + 64) and delta[3] == -3       # cur, n
    assert delta[6] == -(LARGE + 8) and delta[9] == -1                  # large pool


def _records():
    a = C.Checks((), (), [], [], (), None, False)
    b = C.Checks((), (), [], [], (), None, False)
    return a, b


def test_check_tables_are_pythons():
    res = {}
    for name, f in (("py", C.check_tables), ("c", FP.check_tables)):
        vs = _values(make_arrays=False)
        outs = vs + [vs[1]]         # one value twice: the later position wins, as dict(zip) does
        rec, _ = _records()
        refs, at = f(outs, rec)
        assert [r() for r in refs] == outs
        assert all(v.chk is rec for v in vs)
        res[name] = (len(refs), {k: at[id(v)] for k, v in enumerate(vs)}, len(at))
    assert res["py"] == res["c"]
    assert res["c"][1][1] == 5


def test_unchecked_inputs_are_pythons():
    for f in (C.unchecked_inputs, FP.unchecked_inputs):
        assert f([]) is None
    vs = _values(make_arrays=False)
    a, b = _records()
    a.outs, a.at = C.check_tables([vs[0], vs[2], vs[3]], a)
    b.outs, b.at = C.check_tables([vs[1]], b)
    ext = [vs[0], vs[1], vs[4], vs[3], vs[2], vs[0]]        # a, b, none, a (a subclass), a, a
    py, c = C.unchecked_inputs(ext), FP.unchecked_inputs(ext)
    assert py == c == [(0, a, 0), (1, b, 0), (3, a, 2), (4, a, 1), (5, a, 0)]
    assert all(x[1] is y[1] for x, y in zip(py, c))
    b.done = True                   # a record read already names nothing
    assert C.unchecked_inputs(ext) == FP.unchecked_inputs(ext) == [
        (0, a, 0), (3, a, 2), (4, a, 1), (5, a, 0)]
    a.done = True
    assert C.unchecked_inputs(ext) is None and FP.unchecked_inputs(ext) is None
    a.done = False
    del a.at[id(vs[2])]             # a record that does not list it: both raise KeyError
    for f in (C.unchecked_inputs, FP.unchecked_inputs):
        with pytest.raises(KeyError):
            f(ext)


def test_a_bad_index_after_hits_raises_and_the_rest_is_cpus():
    """Hits with donation and index checks (the C tables): a bad index in a later step raises
    CPU's IndexError at the sync that reads it, and the steps before it are CPU's."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    ref = torch.nn.Embedding(10, 4)
    ref.load_state_dict(emb.state_dict())
    emb = emb.to("tpu")
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    idx = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]), torch.tensor([7, 8, 9]),
           torch.tensor([0, 1, 2]), torch.tensor([3, 11, 2])]
    before = deferfuse.metrics()["region_hit_path"]["hits"]
    for k, i in enumerate(idx):
        if k == 4:
            loss = emb(i.to("tpu")).sum()
            with pytest.raises(IndexError) as tpu_err:
                loss.backward()
                opt.step()
                loss.item()
            with pytest.raises(IndexError) as cpu_err:
                ref(i).sum()
            assert "out of range" in str(tpu_err.value) and "out of range" in str(cpu_err.value)
            break
        opt.zero_grad()
        ropt.zero_grad()
        loss = emb(i.to("tpu")).sum()
        loss.backward()
        opt.step()
        rloss = ref(i).sum()
        rloss.backward()
        ropt.step()
        assert_same(loss, rloss)
        assert_same(emb.weight, ref.weight)
    assert deferfuse.metrics()["region_hit_path"]["hits"] > before


def test_the_value_finalizer_uncounts_as_del_does():
    """NOTE [value finalizer]: the exact class's C finalizer and a subclass's Python ``__del__``
    un-count a freed value's array alike; a value with no array un-counts nothing."""
    res = []
    for cls in (Value, SubValue):
        before = _counts(False)
        vs = [cls((2,), np.float32, nb, np.zeros(2, np.float32)) for nb in (24, LARGE + 16)]
        vs.append(cls((2,), np.float32, 40))                # empty: never counted
        mid = _counts(False)
        del vs
        after = _counts(False)
        res.append(([a - b for a, b in zip(mid, before)], [a - b for a, b in zip(after, mid)]))
    assert res[0] == res[1]
    made, freed = res[0]
    assert made[0] == 24 + LARGE + 16 and made[2] == 2                  # cur, n
    assert freed[0] == -(24 + LARGE + 16) and freed[2] == -2 and freed[3] == 2     # cur, n, nfreed
    assert freed[4] == -(LARGE + 16) and freed[6] == -1                 # large pool


def test_the_value_finalizer_keeps_del_s_errors():
    """A counting function that raises TypeError (at interpreter shutdown it is None) is ignored,
    as ``Value.__del__`` ignores it; any other error reaches ``sys.unraisablehook``, as an error in
    ``__del__`` does. Either way the value is freed."""
    import sys
    from deferfuse.scheduler import records
    seen = []

    def boom(nbytes, n):
        raise ValueError("counting failed")

    hook, account = sys.unraisablehook, records._account[0]
    sys.unraisablehook = lambda u: seen.append(type(u.exc_value))
    try:
        for cls in (Value, SubValue):
            for f in (None, boom):
                records._account[0] = f
                v = cls((2,), np.float32, 8)
                v.array = np.zeros(2, np.float32)       # bound without counting
                r = weakref.ref(v)
                del v
                assert r() is None
    finally:
        sys.unraisablehook, records._account[0] = hook, account
    assert seen == [ValueError, ValueError]


def test_hit_parts_are_pythons():
    """NOTE [hit key parts]: held (something beyond the ext list and the trace's node inputs
    holds an input: a storage) and out_sig, in C as in Python, for values held 0-2 times more."""
    from deferfuse.runtime.hits import hit_parts
    from deferfuse.scheduler.records import Node
    ext = [Value((2,), np.float32, 8) for _ in range(6)]
    reads = [[ext[1]], [ext[2], ext[2]], [ext[3]]]      # node inputs reading them
    uses = [0, 1, 2, 1, 0, 0]
    keep = [ext[3], ext[4], ext[5], ext[5]]           # storages, say
    nodes = [Node(None, r, (), 0, [], (), None, p) for p, r in enumerate(reads)]
    outs = [Value((2,), np.float32, 8, None, nodes[p], i) for p, i in ((0, 0), (2, 1), (1, 0))]
    outs.append(SubValue((2,), np.float32, 8, None, nodes[1], 3))
    py, c = hit_parts(ext, uses, outs), FP.hit_parts(ext, uses, outs)
    assert py == c == ((False, False, False, True, True, True), ((0, 0), (2, 1), (1, 0), (1, 3)))
    del keep
    assert FP.hit_parts(ext, uses, outs)[0] == hit_parts(ext, uses, outs)[0] == (False,) * 6
    with pytest.raises(IndexError):
        FP.hit_parts(ext, uses[:3], outs)
    with pytest.raises(IndexError):
        hit_parts(ext, uses[:3], outs)
