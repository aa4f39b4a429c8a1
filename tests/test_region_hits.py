"""NOTE [region hits] (runtime/flush.py): a sync whose trace was seen before goes straight to its
compiled region. Values are CPU eager's, compiles and region counts are those of the full path, and
what the hit stands for (the structure, a failed input, the caches it reads) sends a flush back
to the full path."""
import copy
import re
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import deferfuse
from deferfuse.engine import engine
from deferfuse.runtime import hits as hits_mod
from deferfuse.scheduler.policy import Cut
from util import assert_same, bench_module

pytestmark = pytest.mark.modes("defer")


def _path():
    return dict(deferfuse.metrics()["region_hit_path"])


def _step(w, x):
    """An in-place update (the old ``w`` is donated) and a read of one value."""
    w.mul_(0.9).add_(x * 0.1)
    return (w.tanh() * 2.0 + 1.0).sum().item()


def _run(dev, steps):
    torch.manual_seed(0)
    w, x = torch.randn(16).to(dev), torch.randn(16).to(dev)
    return [_step(w, x) for _ in range(steps)], w


def test_a_repeated_step_runs_from_its_region_hit():
    want, w_cpu = _run("cpu", 6)
    deferfuse.reset_metrics()
    torch.manual_seed(0)
    w, x = torch.randn(16).to("tpu"), torch.randn(16).to("tpu")
    deferfuse.sync()
    got, counts = [], []
    for _ in range(6):
        got.append(_step(w, x))
        m = deferfuse.metrics()
        counts.append((m["compiles"], m["regions_run"], m["cache_hits"],
                       m["region_hit_path"]["hits"]))
    assert got == pytest.approx(want, rel=1e-6)
    assert_same(w, w_cpu)
    # One region a step; from the third step on nothing compiles and every step is a hit that
    # counts as a region cache hit, as on the full path.
    for a, b in zip(counts[2:], counts[3:]):
        assert b[0] == a[0] and b[1] == a[1] + 1 and b[2] == a[2] + 1 and b[3] == a[3] + 1, counts
    assert deferfuse.metrics()["donated_bytes"] > 0      # the old w went to the program


def _warmed():
    """A tpu (w, x) and CPU copies after three steps each: the tpu step's structure is a hit."""
    torch.manual_seed(0)
    w, x = torch.randn(16).to("tpu"), torch.randn(16).to("tpu")
    w_cpu, x_cpu = w.cpu(), x.cpu()
    for _ in range(3):
        _step(w, x)
        _step(w_cpu, x_cpu)
    return w, x, w_cpu, x_cpu


def test_a_hit_compares_its_structure():
    w, x, w_cpu, x_cpu = _warmed()
    # Another structure under the same key (what a hash collision would be): each hit's recorded
    # ops are made to differ, so the comparison must send the flush to the full path.
    hits = [h for _, h in engine.runner.hits.items() if h.__class__ is hits_mod.Hit]
    assert hits
    for h in hits:
        h.entries = list(reversed(h.entries))
    before = _path()
    compiles = deferfuse.metrics()["compiles"]
    assert _step(w, x) == pytest.approx(_step(w_cpu, x_cpu), rel=1e-6)
    after = _path()
    assert after.get("another structure", 0) == before.get("another structure", 0) + 1
    assert after.get("hits", 0) == before.get("hits", 0)
    assert deferfuse.metrics()["compiles"] == compiles     # the full path found the region
    # The full path left a hit with the right structure again.
    assert _step(w, x) == pytest.approx(_step(w_cpu, x_cpu), rel=1e-6)
    assert _path()["hits"] == after.get("hits", 0) + 1
    assert_same(w, w_cpu)


def test_an_input_failed_after_it_was_recorded_takes_the_full_path():
    """An input whose index check fails between the op that reads it being recorded and the sync
    (another thread read the checks): the hit must not hand its buffer to the program."""
    emb_cpu = torch.randn(10, 4)
    emb = emb_cpu.to("tpu")
    good, bad = torch.tensor([1, 2]), torch.tensor([1, 30])
    with pytest.raises(IndexError) as cpu_error:
        emb_cpu[bad]
    said = re.escape(str(cpu_error.value))     # CPU's message, which the tpu error starts with

    def two_traces(idx):
        e = emb[idx.to("tpu")]
        engine.sync(Cut.BACKWARD)       # runs; its index check is read at the next real sync
        return e, (e * 2.0 + 1.0).sum()

    for _ in range(3):      # the second trace's structure becomes a hit
        e, y = two_traces(good)
        assert y.item() == pytest.approx((emb_cpu[good] * 2.0 + 1.0).sum().item(), rel=1e-6)
    e, y = two_traces(bad)
    _fail_elsewhere_then_read(y, said)


def _fail_elsewhere_then_read(y, said):
    """Another thread's sync reads every pending index check and raises the bad one's error;
    then reading ``y``, whose trace's input failed, raises it too and is no hit."""
    raised = []

    def other_thread():
        try:
            deferfuse.sync()
        except IndexError as err:
            raised.append(err)
    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert len(raised) == 1 and re.match(said, str(raised[0]))
    before = _path().get("a failed input", 0)
    with pytest.raises(IndexError, match=said):
        y.item()
    assert _path().get("a failed input", 0) == before + 1


def test_hits_go_with_the_regions():
    w, x, w_cpu, x_cpu = _warmed()
    assert len(engine.runner.hits) > 0
    engine.runner.evict()
    assert len(engine.runner.hits) == 0
    before = _path().get("hits", 0)
    compiles = deferfuse.metrics()["compiles"] + deferfuse.metrics()["disk_cache_hits"]
    assert _step(w, x) == pytest.approx(_step(w_cpu, x_cpu), rel=1e-6)
    m = deferfuse.metrics()
    assert m["compiles"] + m["disk_cache_hits"] == compiles + 1    # found again, not a stale hit
    assert _path().get("hits", 0) == before
    assert_same(w, w_cpu)


def test_debug_level_two_takes_the_full_path(monkeypatch, capsys):
    w, x, w_cpu, x_cpu = _warmed()
    monkeypatch.setattr(deferfuse.config, "debug", 2)
    before = _path()
    assert _step(w, x) == pytest.approx(_step(w_cpu, x_cpu), rel=1e-6)
    after = _path()
    assert after.get("hits", 0) == before.get("hits", 0)
    assert "region hit" in capsys.readouterr().err      # the level-2 line of a region hit


def test_the_c_structure_comparison_is_pythons():
    """deferfuse/_fastpath.c's same_structure says what the runner's Python one says."""
    from deferfuse import _fastpath
    from deferfuse.runtime import flush
    x = torch.randn(4).to("tpu")
    deferfuse.sync()
    y = (x * 2.0 + 1.0).tanh()
    nodes = list(engine.local.ts.trace.nodes)
    entries, wirings = [n.key for n in nodes], [n.wiring for n in nodes]
    other = [(0, 0) if w == (0,) else (0,) for w in wirings]
    cases = [(entries, wirings), (list(entries), [tuple(w) for w in wirings]),
             (list(reversed(entries)), wirings), (entries, other), (entries[:-1], wirings[:-1]),
             (entries + entries[:1], wirings + wirings[:1]), ([], [])]
    for es, ws in cases:
        assert _fastpath.same_structure(nodes, es, ws) is flush.same_structure(nodes, es, ws)
    assert _fastpath.same_structure(nodes, entries, wirings) is True
    assert _fastpath.same_structure(nodes, entries, other) is False
    with pytest.raises(TypeError):
        _fastpath.same_structure(nodes, tuple(entries), wirings)
    assert_same(y, (x.cpu() * 2.0 + 1.0).tanh())


# NOTE [piece hits] (runtime/hits.py): a sync that runs as several regions or in a bucket.
def _mlp_pair():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    model = copy.deepcopy(ref).to("tpu")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    return model, ref, opts, (x.to("tpu"), y.to("tpu")), (x, y)


def _train(model, opt, x, y):
    """A training step whose ``.item()`` runs as a needed-first split (NOTE [needed first])."""
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


_COUNTED = ("compiles", "regions_run", "cache_hits", "needed_first_splits", "bucketed_runs",
            "donated_bytes")


def _split_steps(steps, dispatch=False):
    """(losses, CPU's losses, each step's counters, each step's piece hits), the model checked.
    ``dispatch``: the dispatch thread on (NOTE [in flight])."""
    model, ref, opts, (xt, yt), (x, y) = _mlp_pair()
    deferfuse.sync()
    got, want, counts, hits = [], [], [], []
    with deferfuse.override(backward_cut=False, dispatch_thread=dispatch):
        for _ in range(steps):
            m0, p0 = deferfuse.metrics(), _path().get("piece hits", 0)
            got.append(_train(model, opts[0], xt, yt))
            want.append(_train(ref, opts[1], x, y))
            m = deferfuse.metrics()
            counts.append(tuple(m[k] - m0[k] for k in _COUNTED))
            hits.append(_path().get("piece hits", 0) - p0)
    deferfuse.sync()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach(), atol=1e-5, rtol=1e-4)
    return got, want, counts, hits


def test_a_split_step_runs_from_its_piece_hit(monkeypatch):
    got, want, counts, hits = _split_steps(7)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert hits[-3:] == [1, 1, 1], hits
    # The same step on the full path every time (no piece hit is ever left): the same counts.
    monkeypatch.setattr(hits_mod, "pieces_of", lambda *a: None)
    engine.runner.hits.clear()
    got2, _, counts2, hits2 = _split_steps(7)
    assert got2 == got and not any(hits2)
    assert counts[-3:] == counts2[-3:], (counts, counts2)
    assert counts[-1][:4] == (0, 2, 2, 1) and counts[-1][5] > 0, counts    # donated, as before


def test_a_split_step_with_the_dispatch_thread_stays_on_the_full_path():
    """Its second piece is handed to the dispatch thread: never recorded (NOTE [piece hits])."""
    before = deferfuse.metrics()["regions_dispatched"]
    got, want, counts, hits = _split_steps(5, dispatch=True)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert not any(hits) and deferfuse.metrics()["regions_dispatched"] >= before + 5
    assert counts[-1][:4] == (0, 2, 2, 1), counts


def test_a_piece_hit_compares_its_structure():
    model, ref, opts, (xt, yt), (x, y) = _mlp_pair()
    with deferfuse.override(backward_cut=False, dispatch_thread=False):
        for _ in range(4):
            assert _train(model, opts[0], xt, yt) == pytest.approx(
                _train(ref, opts[1], x, y), rel=1e-5, abs=1e-6)
        pieces = [h for _, h in engine.runner.hits.items() if h.__class__ is hits_mod.Pieces]
        assert pieces
        for h in pieces:
            h.entries = list(reversed(h.entries))
        before = _path()
        assert _train(model, opts[0], xt, yt) == pytest.approx(
            _train(ref, opts[1], x, y), rel=1e-5, abs=1e-6)
        after = _path()
        assert after.get("another structure", 0) == before.get("another structure", 0) + 1
        assert after.get("piece hits", 0) == before.get("piece hits", 0)
        # The full path left a piece hit with the right structure again.
        assert _train(model, opts[0], xt, yt) == pytest.approx(
            _train(ref, opts[1], x, y), rel=1e-5, abs=1e-6)
        assert _path()["piece hits"] == after.get("piece hits", 0) + 1


def test_an_input_failed_after_it_was_recorded_takes_the_full_path_from_a_piece_hit(
        monkeypatch):
    """As for a region hit: a failed input of a split trace is never handed to a piece."""
    emb_cpu = torch.randn(10, 4)
    emb = emb_cpu.to("tpu")
    good, bad = torch.tensor([1, 2]), torch.tensor([1, 30])
    with pytest.raises(IndexError) as cpu_error:
        emb_cpu[bad]
    said = re.escape(str(cpu_error.value))
    other_cpu = emb_cpu
    for _ in range(10):
        other_cpu = (other_cpu * 0.5).exp()

    def two_traces(idx):
        e = emb[idx.to("tpu")]
        engine.sync(Cut.BACKWARD)
        other = emb
        for _ in range(10):             # not what the read needs: the second piece
            other = (other * 0.5).exp()
        return e, (e * 2.0 + 1.0).sum(), other

    monkeypatch.setattr(deferfuse.config, "dispatch_thread", False)    # (as the test before)
    for _ in range(4):
        e, y, other = two_traces(good)
        assert y.item() == pytest.approx((emb_cpu[good] * 2.0 + 1.0).sum().item(), rel=1e-6)
        assert_same(other, other_cpu)
    assert _path().get("piece hits", 0) >= 1
    e, y, other = two_traces(bad)
    _fail_elsewhere_then_read(y, said)
    assert_same(other, other_cpu)


def test_a_sampling_loop_runs_its_buckets_from_piece_hits():
    """nanoGPT's sampling: a region per token, each in a bucket's program; from the third call on,
    each token's sync is a piece hit, with CPU's tokens and the full path's counts."""
    M = bench_module("models")
    torch.manual_seed(0)
    model = M.TinyGPT(layers=1).eval()
    x = torch.zeros((1, 1), dtype=torch.long)
    torch.manual_seed(1)
    want = model.sample(x, 30)
    model.to("tpu")
    counts = []
    for _ in range(4):
        m0, p0 = deferfuse.metrics(), _path().get("piece hits", 0)
        torch.manual_seed(1)
        assert_same(model.sample(x.to("tpu"), 30), want)
        m = deferfuse.metrics()
        counts.append(tuple(m[k] - m0[k] for k in _COUNTED) + (_path().get("piece hits", 0) - p0,))
    assert counts[-1][0] == 0 and counts[-1][4] > 0, counts     # no compile; bucketed
    assert counts[-1][6] >= counts[-1][4], counts               # every bucket run a hit
    assert counts[-1][:6] == counts[-2][:6], counts


def _outputs_in_python(storages, trace, want):
    """What Trace.take's outputs are (NOTE [trace outputs] in deferfuse/_fastpath.c), written out:
    each value pending in ``trace`` that a live storage holds, once, sorted by (node position,
    output index), storages' order among equals; partner from the first storage holding each."""
    outs, seen, partner = [], set(), {}
    for r in storages:
        st = r()
        if st is None:
            continue
        v = st.val
        n = v.node
        if n is not None and n.trace is trace and id(v) not in seen:
            seen.add(id(v))
            outs.append(v)
            if st.prev:
                partner[id(v)] = st.prev
    if want is not None and want.node is not None and want.node.trace is trace \
            and id(want) not in seen:
        outs.append(want)
    outs.sort(key=lambda v: (v.node.pos, v.idx))
    return outs, partner


def test_the_c_trace_outputs_are_pythons():
    """_fastpath.trace_outputs (Trace.take's outputs) says what the Python walk says: values of
    another trace, ready values, dead storages and in-flight values left out; a value held by two
    storages listed once, with the first storage's partner; the value read added once; trace order,
    storages' order among equal positions."""
    from deferfuse import _fastpath
    from deferfuse.runtime.execute import NO_TRACE
    from deferfuse.scheduler.records import Node, Value
    from deferfuse.tensor import Storage

    class SubValue(Value):      # not the exact class: read through getattr
        __slots__ = ()

    class InFlight:             # an in-flight job as a node (NOTE [in flight])
        pos, idx, trace = -1, 0, NO_TRACE

    mine, other = object(), object()
    nodes = [Node(None, [], (), 0, [], (), None, p, mine) for p in range(5)]
    far = Node(None, [], (), 0, [], (), None, 1, other)

    def val(node, idx=0, cls=Value):
        return cls((4,), None, 16, None, node, idx)

    a, b, c, d = val(nodes[3]), val(nodes[1], 1), val(nodes[1], 0), val(nodes[4], 0, SubValue)
    e, f, g = val(far), val(None), val(InFlight())
    read_alone, read_other = val(nodes[2]), val(far)
    held = [(a, 0), (b, 5), (c, 0), (a, 9), (e, 3), (f, 4), (g, 2), (d, 6), (c, 8), (b, 1)]
    sts = [Storage(v, 0, torch.float32) for v, _ in held]
    for st, (_, prev) in zip(sts, held):
        st.prev = prev
    dead = Storage(val(nodes[0]), 0, torch.float32)
    refs = [s.wr for s in sts[:4]] + [dead.wr] + [s.wr for s in sts[4:]]
    del dead
    for want in (None, a, b, read_alone, read_other, f, g):
        got = _fastpath.trace_outputs(refs, mine, want)
        ref = _outputs_in_python(refs, mine, want)
        assert [id(v) for v in got[0]] == [id(v) for v in ref[0]], want
        assert got[1] == ref[1]
    outs, partner = _fastpath.trace_outputs(refs, mine, read_alone)
    assert outs == [c, b, read_alone, a, d]     # by (pos, idx): (1,0) (1,1) (2,0) (3,0) (4,0)
    assert partner == {id(b): 5, id(d): 6}      # a's first storage and c's have prev 0
    assert _fastpath.trace_outputs([], mine, None) == ([], {})
    with pytest.raises(TypeError):
        _fastpath.trace_outputs(tuple(refs), mine, None)


def _floats(x, k):
    return (x * (0.5 + k) + 0.25).tanh().sum().item()


def _mixed(x, k):
    return ((x * (3 + k)).add(0.25) * 2.5).sum().item()


def test_a_hit_packs_its_scalars_as_the_full_path_does():
    """A region hit of all-float scalars packs them as one float64 array (execute.pack_floats);
    one with int and float scalars as the full path does: both run from the hit, compile nothing
    after their first steps, and give CPU's values."""
    from deferfuse.runtime import execute

    def steps(dev, fn):
        torch.manual_seed(0)
        x = torch.randn(8).to(dev)
        return [fn(x, k) for k in range(6)]

    for fn, pack in ((_floats, execute.pack_floats), (_mixed, execute.pack_scalars)):
        engine.runner.hits.clear()
        m0, p0 = deferfuse.metrics(), _path().get("hits", 0)
        got = steps("tpu", fn)
        m = deferfuse.metrics()
        assert got == pytest.approx(steps("cpu", fn), rel=1e-6)
        assert _path().get("hits", 0) - p0 >= 3
        assert m["compiles"] - m0["compiles"] <= 2
        assert m["regions_run"] - m0["regions_run"] == 6
        assert {h.pack for h in engine.runner.hits.values() if h.__class__ is hits_mod.Hit} \
            == {pack}
