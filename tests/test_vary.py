"""Programs that vary (issue 25): moving offsets, growing sequences and new shapes compile a few
programs, never one per offset or length, and compute what CPU computes."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import deferfuse
from util import assert_same, bench_module

M = bench_module("models")


def _compiles():
    return deferfuse.metrics()["compiles"]


# --------------------------------------------------------------------------- offsets are data
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_moving_windows_compile_once_and_match_cpu():
    d = torch.randn(40, 3)
    t = d.to("tpu")
    got, want, after = [], [], []
    for i in range(0, 30, 4):
        # slice, narrow, select (negative too), a strided slice, integer indexing of a view
        a = t[i:i + 5] * 2 + t.narrow(0, i + 1, 5).sum(0)
        b = t[i] - t[-1 - i] + t[i:i + 9:3].mean(0) + t[i + 2:i + 6][1]
        got.append(torch.cat([a.reshape(-1), b]).cpu())
        a = d[i:i + 5] * 2 + d.narrow(0, i + 1, 5).sum(0)
        b = d[i] - d[-1 - i] + d[i:i + 9:3].mean(0) + d[i + 2:i + 6][1]
        want.append(torch.cat([a.reshape(-1), b]))
        after.append(_compiles())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert after[1] == after[-1], after        # no offset after the first compiles anything
    m = deferfuse.metrics()
    assert m["recompiles"] == 0 and m["shape_fallbacks"] == 0 and m["shape_splits"] == 0


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_clamped_and_negative_starts_normalise_as_pytorch():
    d = torch.arange(24.).reshape(6, 4)
    t = d.to("tpu")
    for sl in [slice(-3, None), slice(-100, 2), slice(4, 100), slice(-2, -1), slice(5, 3),
               slice(1, None, 2), slice(None, -4)]:
        assert_same(t[sl] + 0, d[sl] + 0)
        assert_same(t[:, sl] * 1, d[:, sl] * 1)
    for i in (-6, -1, 0, 5):
        assert_same(t[i] + 0, d[i] + 0)
        assert_same(t.select(1, i % 4 - 4) + 0, d.select(1, i % 4 - 4) + 0)
    with pytest.raises(IndexError):
        t[6]
    with pytest.raises(IndexError):
        t.select(1, -5)


def test_writes_through_moving_windows_match_cpu():
    want = torch.zeros(12, 2)
    t = want.to("tpu")
    after = []
    for i in range(8):
        for x in (t, want):
            x[i:i + 3] += 1                     # in place through a slice
            x[i] = i + 0.25                     # a row
            x[i + 1:i + 4, 1].mul_(2)           # a slice of a select... of a slice
            x.narrow(0, i + 2, 2).copy_(x[i:i + 2] * 0.5)
        after.append(_compiles())
    assert_same(t, want)
    assert after[1] == after[-1], after


def test_as_strided_offset_is_data():
    d = torch.arange(30.)
    t = d.to("tpu")
    after = []
    for off in range(0, 20, 3):
        assert_same(t.as_strided((3, 2), (3, 1), off) * 2, d.as_strided((3, 2), (3, 1), off) * 2)
        assert_same(t[1:].as_strided((2, 2), (1, 2), off) + 1,
                    d[1:].as_strided((2, 2), (1, 2), off) + 1)
        after.append(_compiles())
    assert after[1] == after[-1], after
    with pytest.raises(RuntimeError):
        t.as_strided((3, 2), (3, 1), 28) + 0     # past the storage: PyTorch's error


def test_iterating_rows_is_one_program_and_writes_through():
    """``for t in x`` (unbind) gives every row the same signature, as ``x[i]`` does: a loop over a
    tensor's rows (a diffusion pipeline's ``for t in timesteps``) compiles once, not once a row,
    and each row is still a view (a write through it reaches ``x``, a negative dim works)."""
    d = torch.arange(12.).reshape(6, 2)
    t = d.to("tpu")
    y = torch.randn(2)
    yt = y.to("tpu")
    after = []
    for rt, rd in zip(t, d):
        assert_same(rt * yt + rt.sum(), rd * y + rd.sum())
        after.append(_compiles())
    assert after[1] == after[-1], after
    for x in (t, d):
        x.unbind(0)[4].add_(100)
        x.unbind(-1)[1].mul_(-1)
    assert_same(t, d)
    assert_same(torch.stack(t.unbind(1)) + 0, torch.stack(d.unbind(1)) + 0)
    assert len(torch.ones(1, 3).to("tpu").unbind(0)) == 1


def test_views_at_moving_offsets_keep_autograd():
    w = torch.randn(20, 4, requires_grad=True)
    wt = w.detach().to("tpu").requires_grad_()
    for i in range(0, 12, 5):
        (w[i:i + 4] * torch.arange(4.)[:, None]).sum().backward()
        (wt[i:i + 4] * torch.arange(4.).to("tpu")[:, None]).sum().backward()
    assert_same(wt.grad, w.grad)


# --------------------------------------------------------------------------- truncated BPTT
V, T, B = 20, 6, 3


def _bptt(model, data, dev, steps):
    """The classic truncated-BPTT loop: batches are slices of one long token tensor."""
    model = model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = data.to(dev)
    h, losses, compiles = None, [], []
    for k in range(steps):
        i = k * T
        x, y = data[i:i + T], data[i + 1:i + 1 + T]
        if isinstance(h, tuple):
            h = tuple(s.detach() for s in h)
        out, h = model(x, h)
        loss = F.cross_entropy(out.reshape(-1, V), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        compiles.append(_compiles())
    return losses, compiles


@pytest.mark.parametrize("arch", ["lstm", "transformer"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_bptt_over_slices_of_one_tensor_compiles_once(arch):
    torch.manual_seed(0)
    model = M.LSTMLM(V, 8) if arch == "lstm" else M.TransformerLM(V, 16, heads=2, ff=32, layers=1)
    data = torch.randint(0, V, (8 * T + 1, B))
    import copy
    want, _ = _bptt(copy.deepcopy(model), data, "cpu", 8)
    deferfuse.reset_metrics()
    got, compiles = _bptt(model, data, "tpu", 8)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert compiles[2] == compiles[-1], compiles      # every batch after the second: nothing
    m = deferfuse.metrics()
    assert m["shape_fallbacks"] == 0 and m["shape_splits"] == 0 and m["recompiles"] == 0, m
    assert "op by op" not in deferfuse.report(file=False)


# --------------------------------------------------------------------------- the program store
_SECOND_RUN = r"""
import sys, torch, torch.nn as nn, deferfuse
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(30, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 30)).to("tpu")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.randint(0, 30, (40,)).to("tpu")
losses = []
for i in range(0, 20, 5):
    x, y = data[i:i + 5], data[i + 1:i + 6]
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    losses.append(loss.item())
bad = torch.tensor([3, 31]).to("tpu")
try:
    model(bad).sum().item()
    err = "none"
except IndexError as e:
    err = "IndexError"
for t in (3, 5, 6, 7, 9):     # a growing length: bucket programs (pointwise ops on padding)
    x = torch.arange(t, dtype=torch.float32).to("tpu")
    losses.append(((x * 0.3 + 1).tanh() * 2).sum().item())
m = deferfuse.metrics()
print(",".join(f"{v:.6f}" for v in losses), err, m["compiles"], m["program_disk_hits"],
      "loaded from" in deferfuse.report(file=False), m["jax_disk_hits"],
      __import__("deferfuse.meta").meta.memo.hits, m["caches"]["op entries on disk"]["hits"],
      m["caches"]["op entries on disk"]["misses"])
"""


@pytest.mark.modes("defer", "strict")
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_second_process_compiles_nothing_and_says_so(tmp_path, tpu_mode):
    import subprocess
    import sys
    env = {**__import__("os").environ, "DEFERFUSE_CACHE_DIR": str(tmp_path),
           "TORCHTPU_MODE": tpu_mode}
    runs = [subprocess.run([sys.executable, "-c", _SECOND_RUN], env=env, capture_output=True,
                           text=True, check=True).stdout.split() for _ in range(2)]
    first, second = runs
    assert first[:2] == second[:2] and first[1] == "IndexError", runs   # losses, the error
    assert int(first[2]) > 0 and int(first[3]) == 0, first
    assert int(second[2]) == 0, second         # nothing compiled: every program came from disk
    assert int(second[3]) > 0 and second[4] == "True", second
    # ... from deferfuse's store, whole: none traced and lowered again for JAX's cache to answer
    # (bucket programs with a pointwise op on the padding had no stable key and were, each process)
    assert int(second[5]) == 0, second
    # Op entries came from the first process's (NOTE [entries on disk] in entries.py): no meta
    # kernel and no meta memo lookup (NOTE [meta memo] in meta.py) made one.
    assert int(first[6]) == 0 and int(first[7]) == 0 and int(first[8]) > 0, runs
    assert int(second[6]) == 0 and int(second[7]) > 0 and int(second[8]) == 0, runs
    want = [((torch.arange(t, dtype=torch.float32) * 0.3 + 1).tanh() * 2).sum().item()
            for t in (3, 5, 6, 7, 9)]
    assert [float(v) for v in first[0].split(",")[-5:]] == pytest.approx(want, rel=1e-5), first


def _learned_round(tmp_path):
    """A growing length on tpu, as a new process would run it: no region, bucket plan or fit
    learned in this process, the learned store read from ``tmp_path`` (programs may come from the
    program store); (values equal CPU's, metrics, the store's counters)."""
    from deferfuse.engine import engine
    from deferfuse.runtime.buckets import Buckets
    deferfuse.clear_caches()
    bk = engine.runner.buckets = Buckets()
    bk.learned.enable(str(tmp_path), lambda: "test environment")
    deferfuse.reset_metrics()
    w = torch.linspace(-1, 1, 12).reshape(3, 4)
    ok = True
    for t in (2, 3, 5, 9, 6):     # a growing length: a bucket from the second one on
        x = torch.arange(t * 3, dtype=torch.float32).reshape(t, 3) / 7
        want = ((x @ w).tanh().softmax(0) * 2).sum(0)
        got = ((x.to("tpu") @ w.to("tpu")).tanh().softmax(0) * 2).sum(0).cpu()
        ok = ok and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    bk.learned.save()
    return ok, deferfuse.metrics(), bk.learned.stats()


@pytest.mark.modes("defer")
def test_second_process_runs_its_first_length_in_the_learned_bucket(tmp_path):
    # NOTE [learned on disk] (runtime/learned.py): what bucketing learned is kept for the next
    # process, which runs its first length in the bucket at once; a kept fit that does not take
    # the version at hand, or a file that does not match its digest, is ignored (rebuilt).
    import glob
    import hashlib
    import os
    import pickle
    from deferfuse.engine import engine
    keep = engine.runner.buckets
    try:
        ok, m, st = _learned_round(tmp_path)
        assert ok and st["hits"] == 0 and m["bucket_programs"] > 0, (m, st)
        exact = m["region_compiles"] + m["program_disk_hits"] - m["bucket_programs"]
        assert exact > 0, m
        # the next "process": every length in a bucket, its first too (no exact program)
        ok, m, st = _learned_round(tmp_path)
        assert ok and st["hits"] == 1 and m["compiles"] == 0, (m, st)
        assert m["program_disk_hits"] == m["bucket_programs"] and m["bucketed_runs"] == 5, m
        (path,) = glob.glob(os.path.join(str(tmp_path), "buckets-*.pkl"))
        env_, tables = pickle.loads(open(path, "rb").read()[32:])
        # stale: fits whose versions do not take the first length (kept with a valid digest)
        tables["fits"] = {k: (tuple(a + 1 for a in v[0]), v[1])
                          for k, v in tables["fits"].items()}
        body = pickle.dumps((env_, tables))
        open(path, "wb").write(hashlib.sha256(body).digest() + body)
        ok, m, st = _learned_round(tmp_path)
        assert ok and st["stale"] >= 1 and m["compiles"] == 0, (m, st)
        assert m["program_disk_hits"] - m["bucket_programs"] == exact, m   # as a first process
        # corrupt: a byte changed; the file is ignored whole
        blob = bytearray(open(path, "rb").read())
        blob[-5] ^= 0xFF
        open(path, "wb").write(bytes(blob))
        ok, m, st = _learned_round(tmp_path)
        assert ok and st["corrupt"] == 1 and st["hits"] == 0 and m["compiles"] == 0, (m, st)
    finally:
        engine.runner.buckets = keep
        deferfuse.clear_caches()


@pytest.mark.modes("defer")
def test_learned_store_checks_what_it_reads(tmp_path):
    from deferfuse.runtime.learned import LearnedStore
    a = LearnedStore()
    a.enable(str(tmp_path), lambda: "env one")
    assert a.fit_versions("k") is None and a.misses == 1
    a.put("fits", "k", ((1, 2, 3), (1, 3, 5)))
    a.put("steps", "s", ((4, 5), (6, 7)))
    a.save()
    b = LearnedStore()
    b.enable(str(tmp_path), lambda: "env one")
    assert b.fit_versions("k") == ((1, 2, 3), (1, 3, 5)) and b.step("s") == ((4, 5), (6, 7))
    b.put("fits", "bad", ((1, 2), (3,)))       # two versions of different lengths
    assert b.fit_versions("bad") is None        # (kept for the next process, not read here)
    b.drop_fit("k")
    b.save()
    c = LearnedStore()
    c.enable(str(tmp_path), lambda: "env one")
    assert c.fit_versions("bad") is None and c.corrupt == 1
    assert c.fit_versions("k") is None and c.step("s") == ((4, 5), (6, 7))
    d = LearnedStore()              # another environment: another file, nothing read
    d.enable(str(tmp_path), lambda: "env two")
    assert d.step("s") is None and d.corrupt == 0
    with open(c.path, "r+b") as f:  # truncated
        n = len(f.read())
        f.truncate(n - 3)
    e = LearnedStore()
    e.enable(str(tmp_path), lambda: "env one")
    assert e.step("s") is None and e.corrupt == 1


def _entries_round(tmp_path, monkeypatch, env="test environment"):
    """Ops of several kinds (a matmul, layer norm, in-place and view ops, a two-output topk, a
    random op) on tpu as a new process would run them: no op entry made in this process, the
    entries' store read from ``tmp_path``; (values, CPU's, entries made by the meta kernels,
    the store's counters)."""
    from deferfuse import dispatch
    from deferfuse.engine import engine
    from deferfuse.entries import EntryStore
    engine.ops.clear()          # (the compiled regions stay: their keys are the same again)
    from deferfuse import plain
    plain.PLAIN.ext.kernel_clear()      # the C++ kernel's cached entries too, as in a new process
    store = engine.entry_store = EntryStore()
    store.enable(str(tmp_path), lambda: env)
    inferred = []
    real = dispatch.infer
    monkeypatch.setattr(dispatch, "infer", lambda *a, **k: inferred.append(1) or real(*a, **k))

    def run(dev):
        x = torch.linspace(-2, 2, 24).reshape(4, 6).to(dev)
        w = torch.linspace(1, -1, 36).reshape(6, 6).to(dev)
        h = F.layer_norm(x @ w, (6,))
        h.add_(1)
        v, i = h[:, 1:].topk(2, dim=1)
        return [h, v, i, h.softmax(-1)]
    got = run("tpu")
    torch.manual_seed(0)
    drawn = torch.multinomial(torch.ones(3, 5, device="tpu"), 2).cpu()
    store.save()
    return got, run("cpu"), drawn, len(inferred), store.stats()


@pytest.mark.modes("defer")
def test_a_second_process_makes_its_op_entries_from_disk(tmp_path, monkeypatch):
    """NOTE [entries on disk] (deferfuse/entries.py): the op entries' metadata (outputs' sizes,
    strides and dtypes; a random op's draws) is kept in the cache folder, and a second process
    makes its entries from it with no meta kernel and gives CPU's values; an entry of another
    form, a file that does not match its digest, or another environment's file is ignored."""
    import glob
    import hashlib
    import os
    import pickle
    from deferfuse.engine import engine
    keep = engine.entry_store
    try:
        got, want, drawn, inferred, st = _entries_round(tmp_path, monkeypatch)
        for a, b in zip(got, want):
            assert_same(a, b, atol=1e-5)
        assert inferred > 0 and st["hits"] == 0 and st["misses"] == inferred, (inferred, st)
        n = inferred
        # a factory without a dtype makes the default dtype's: the key holds it
        e = next(v for v in engine.ops.young.values() if v.__class__ is not str)
        k32 = engine.entry_store.key(e.key)
        torch.set_default_dtype(torch.float64)
        try:
            assert k32 is not None and engine.entry_store.key(e.key) != k32
        finally:
            torch.set_default_dtype(torch.float32)
        # the next "process": every entry from disk, none by the meta kernels; the same values
        # and the same draws
        got, want, drawn2, inferred, st = _entries_round(tmp_path, monkeypatch)
        for a, b in zip(got, want):
            assert_same(a, b, atol=1e-5)
        assert torch.equal(drawn, drawn2)
        assert inferred == 0 and st["hits"] == n and st["misses"] == 0, (inferred, st)
        # cross-checked against the meta kernels: all equal
        with deferfuse.override(cross_check=True):
            _, _, _, inferred, st = _entries_round(tmp_path, monkeypatch)
        assert inferred == n and st["hits"] == n and st["stale"] == 0, (inferred, st)
        (path,) = glob.glob(os.path.join(str(tmp_path), "entries-*.pkl"))
        env_, tables = pickle.loads(open(path, "rb").read()[32:])
        # an entry of another form (negative draws), with a valid digest: that entry is made again
        k0 = next(iter(tables["entries"]))
        tables["entries"][k0] = (tables["entries"][k0][0], -1)
        body = pickle.dumps((env_, tables))
        open(path, "wb").write(hashlib.sha256(body).digest() + body)
        got, want, _, inferred, st = _entries_round(tmp_path, monkeypatch)
        for a, b in zip(got, want):
            assert_same(a, b, atol=1e-5)
        assert inferred == 1 and st["corrupt"] == 1 and st["hits"] == n - 1, (inferred, st)
        # an entry whose answer is wrong (a size changed): the cross-check says so
        (path,) = glob.glob(os.path.join(str(tmp_path), "entries-*.pkl"))
        env_, tables = pickle.loads(open(path, "rb").read()[32:])
        for k, ((structure, metas), draws) in tables["entries"].items():
            if metas and metas[0] is not None:
                (size, stride, dt), rest = metas[0], metas[1:]
                tables["entries"][k] = ((structure, ((size + (1,), stride + (1,), dt),) + rest),
                                        draws)
                break
        body = pickle.dumps((env_, tables))
        open(path, "wb").write(hashlib.sha256(body).digest() + body)
        with deferfuse.override(cross_check=True), pytest.raises(AssertionError, match="on disk"):
            _entries_round(tmp_path, monkeypatch)
        # a file that does not match its digest: ignored whole, every entry made again
        blob = bytearray(open(path, "rb").read())
        blob[-5] ^= 0xFF
        open(path, "wb").write(bytes(blob))
        got, want, _, inferred, st = _entries_round(tmp_path, monkeypatch)
        for a, b in zip(got, want):
            assert_same(a, b, atol=1e-5)
        assert inferred == n and st["corrupt"] == 1 and st["hits"] == 0, (inferred, st)
        # another environment (other versions, another platform): another file, nothing read
        _, _, _, inferred, st = _entries_round(tmp_path, monkeypatch, env="another environment")
        assert inferred == n and st["hits"] == 0 and st["corrupt"] == 0, (inferred, st)
    finally:
        engine.entry_store = keep
        deferfuse.clear_caches()


# --------------------------------------------------------------------------- buckets
def _lengths_loop(fn, make, lengths):
    """``fn`` on inputs of each length, on tpu (defer) and on CPU: (got, want, metrics)."""
    got, want = [], []
    for t in lengths:
        x = make(t)
        want.append(fn(x))
        got.append(fn(x.to("tpu")).cpu())      # a read per length: one region each
    return got, want, deferfuse.metrics()


_C = 4
_RULES = {
    "pointwise": lambda x: (x * 3 + 1).tanh(),
    "sum": lambda x: (x * 3).sum(0),
    "mean": lambda x: (x * 3).mean(0) + (x * 2).mean(),
    "amax_argmax": lambda x: (x * 3).amax(0) + (x * 3).argmax(0) + torch.max(x, 0)[1],
    "softmax": lambda x: (x * 3).softmax(0) + (x * 2).log_softmax(0) + x.logsumexp(0),
    "contract": lambda x: (x * 2).t() @ (x + 1) + ((x * 2) @ (x + 1).t()).sum(),
    "cat": lambda x: torch.cat([x * 2, x[:2] + 1, x], 0) * 1.5,
    "reshape": lambda x: (x * 2).reshape(-1).cumsum(0),
    # reshapes with the growing dim behind another in its group, both ways (NOTE [compacting
    # reshapes]): (T, C) -> (2, 2T) -> (4T), and (C, T) -> (C * T)
    "merge_behind": lambda x: torch.cat([(x * 2).reshape(2, -1).cumsum(1).flatten(),
                                         (x + 1).t().contiguous().view(-1).cumsum(0)]),
    "window": lambda x: (x * 2)[-1] + x[-2] + x[1:].sum(0),
    "arange_mask": lambda x: ((x @ x.t()).masked_fill(torch.ones(
        x.shape[0], x.shape[0], dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        .softmax(-1) @ x) * torch.arange(x.shape[0], device=x.device)[:, None],
    "attention": lambda x: F.scaled_dot_product_attention(
        x[-1:].reshape(1, 1, 1, _C), x.reshape(1, 1, -1, _C) * 2, x.reshape(1, 1, -1, _C) + 1)
        + F.scaled_dot_product_attention(x.reshape(1, 1, -1, _C), x.reshape(1, 1, -1, _C),
                                         x.reshape(1, 1, -1, _C), is_causal=True)[..., -1:, :],
    "embedding": lambda ids: F.embedding(ids, torch.arange(20.).reshape(10, 2).to(ids.device)) * 2,
    # advanced indexing into the growing dim: -1 is the last valid position, not the padded end
    "advanced_index": lambda x: (x * 2)[[-1, 0]] + x[:, [1]].sum()
        + x[torch.tensor([-2], device=x.device)],
    # gather along the other dim with an index padded along the growing one, and along the
    # growing dim (its indices checked against the exact length)
    "gather": lambda x: (x * 2).gather(1, (x.abs() * 10).long() % _C).sum(1)
        + (x * 3).gather(0, torch.tensor([[4, 0, 2, 1]], device=x.device)).sum(),
    "index_select": lambda x: (x * 2).index_select(1, (x.abs() * 10).long()[:, 0] % _C).sum(1)
        + (x * 3).index_select(0, torch.tensor([4, 0, 2], device=x.device)).sum(),
    # top-k across the growing dim (elementwise in it) and along it (padding never selected)
    "topk": lambda x: torch.cat([(x * 2).topk(2, 1)[0].flatten(),
                                 (x * 3).topk(3, 0)[0].flatten(),
                                 (x * 3).topk(4, 0, largest=False)[1].flatten().float()]),
    # boolean-mask writes (nanoGPT's top-k masking; index_put_ and masked_fill_) and in-place
    # pointwise ops on a padded tensor
    "mask_write": lambda x: _mask_write(x * 2),
    # integer-index writes (index_put, in place and not): -1 is the last valid position
    "index_put": lambda x: _index_put(x),
    # scatter along the fixed dim with an index padded along the growing one (writes padding),
    # scatter_add with an index padded along the dim it writes (padded sources add nothing), and
    # both into the growing dim (indices checked against the exact length)
    "scatter": lambda x: _scatter(x),
    # masked_fill with a tensor value, where with a number, rsub: elementwise
    "masked_fill_tensor": lambda x: x.masked_fill(x > 0, torch.tensor(2.0, device=x.device))
        + torch.where(x > 0.5, x, 0.0) + (1 - x),
    # nll losses with padded targets (ignored: the mean's total weight is the exact one's)
    "nll": lambda x: _nll(x),
}


def _index_put(x):
    y = x * 2
    y[[-1, 0]] = 5.0
    y[:, [1, -1]] += 1
    y.index_put_((torch.tensor([0, -1], device=x.device),), torch.ones(_C, device=x.device),
                 accumulate=True)
    z = x.index_put((torch.tensor([-2], device=x.device),), torch.full((_C,), 3.0,
                                                                     device=x.device))
    return y.sum(0) + y[-1] + z.sum(0) + z[-2]


def _scatter(x):
    i = (x * 0).long() + torch.tensor([3, 1, 0, 2], device=x.device)    # (T, C), no repeats
    a = (x * 2).scatter(1, i, x)
    b = torch.zeros(3, _C, device=x.device).scatter_add(0, (x.abs() * 10).long() % 3, x)
    fixed = torch.tensor([[0, 2, 1, 4]], device=x.device)
    c = (x * 3).scatter_add(0, fixed, torch.ones(1, _C, device=x.device))
    d = (x * 2).scatter(0, fixed, 7.0)
    return torch.cat([a.sum(0), b.flatten(), c.sum(0) + c[-1], d.sum(0)])


def _nll(x):
    tg = (x.abs() * 10).long()[:, 0] % _C
    tg = torch.where(x[:, 1] > 1.0, -100, tg)          # some rows ignored
    return torch.stack([F.cross_entropy(x * 2, tg), F.cross_entropy(x, tg, reduction="sum"),
                        F.nll_loss(F.log_softmax(x, -1), tg.clamp(min=0), ignore_index=2)])


def _mask_write(y):
    y[y < y.topk(2, 1)[0][:, [-1]]] = -float("inf")        # index_put_, one mask, one value
    y[y[:, 0] > 0.5] = 7.0                                 # a mask over the leading dim
    y.masked_fill_(y > 1.5, 2.0).mul_(1.5)
    return y.softmax(-1) + y.softmax(0)


@pytest.mark.modes("defer")
@pytest.mark.parametrize("rule", list(_RULES))
def test_a_growing_dim_runs_in_buckets_as_cpu_computes(rule):
    fn = _RULES[rule]
    make = (lambda t: torch.randint(0, 10, (t,))) if rule == "embedding" else \
        (lambda t: torch.randn(t, _C))
    deferfuse.clear_caches()
    got, want, m = _lengths_loop(fn, make, range(5, 14))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert m["bucketed_runs"] == 8 and not m["bucket_refusals"], m["bucket_refusals"]
    # length 5 compiled exactly, 6..13 ran in the smallest bucket, 32 (MIN_BUCKET in bucket_fit.py)
    assert m["region_compiles"] + m["disk_cache_hits"] == 2, m["miss_reasons"]


@pytest.mark.modes("defer")
@pytest.mark.parametrize("case", ["sort", "flip", "std"])
def test_ops_without_a_padding_rule_refuse_buckets_and_stay_exact(case):
    fn = {"sort": lambda x: (x * 2).sort(0)[0],
          "flip": lambda x: (x * 2).flip(0) + 1,
          "std": lambda x: (x * 2).std(0)}[case]
    make = (lambda t: torch.randn(t, _C))
    deferfuse.clear_caches()
    got, want, m = _lengths_loop(fn, make, range(5, 10))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert m["bucketed_runs"] == 0
    assert sum(m["bucket_refusals"].values()) == 1, m["bucket_refusals"]
    # the refusal names the op's stated reason (its family's PAD, or the rule's check)
    why = {"sort": "the padding would be sorted in", "flip": "moves positions",
           "std": "a reduction with no padding rule"}[case]
    assert any(why in k for k in m["bucket_refusals"]), m["bucket_refusals"]
    assert "cannot run padded" in deferfuse.report(file=False)


@pytest.mark.modes("defer")
def test_every_lowering_has_a_padding_rule_or_a_stated_reason():
    """NOTE [padding rules]: each entry of the lowering table says how its op runs padded, or
    why it cannot; no op is left unclassified, and each rule is one ``plan_node`` plans."""
    from deferfuse.runtime.bucket_node import _PLANNERS
    from deferfuse.runtime.lowering import LOWERINGS
    from deferfuse.runtime.lowering.padding import Pad, Pointwise, Refuse
    assert len(LOWERINGS) > 500
    for o, low in LOWERINGS.items():
        rule = low.pad
        assert isinstance(rule, Pad), f"{o} has no padding rule nor a stated reason"
        if type(rule) is Refuse:
            assert len(rule.why) > 10, f"{o}: a refusal without a reason"
        else:
            assert type(rule) in _PLANNERS, f"{o}: no planner for {rule}"
        if torch.Tag.pointwise in o.tags and o is not torch.ops.aten.clone.default:
            assert type(rule) is Pointwise, (o, rule)
        for s in rule.sizes:
            assert type(s) in (int, str), (o, rule)


def _nan_padded(x):
    """``x`` in its valid positions, NaN in the padding a bucket adds (0 / 0 there)."""
    return x * (x / x.abs()).abs()


def _huge_padded(x):
    """``x`` in its valid positions, 1e30 in the padding a bucket adds."""
    return x + (1 - (x / x.abs()).abs().nan_to_num(0.0)) * 1e30


_POISONED = {
    "reductions": lambda y: torch.cat([y.sum(0), y.mean(0), y.amax(0), y.amin(0),
                                       y.logsumexp(0), y.softmax(0)[-1], y.cumsum(0)[-1]]),
    "contract": lambda y: (y.t() @ y).flatten(),
    "topk": lambda y: torch.cat([y.topk(3, 0)[0].flatten(),
                                 y.topk(3, 0, largest=False)[0].flatten()]),
    "attention": lambda y: F.scaled_dot_product_attention(
        y[-1:].reshape(1, 1, 1, _C), y.reshape(1, 1, -1, _C), y.reshape(1, 1, -1, _C),
        attn_mask=torch.zeros(1, y.shape[0], device=y.device)).flatten(),
    "loss": lambda y: torch.stack([F.cross_entropy(y, torch.arange(y.shape[0],
                                                                   device=y.device) % _C),
                                   F.nll_loss(y.log_softmax(-1), torch.arange(
                                       y.shape[0], device=y.device) % _C, reduction="sum")]),
    "indexing": lambda y: torch.cat([y[[-1, 0]].flatten(), y.gather(0, torch.tensor(
        [[1, 0, 2, 3]], device=y.device)).flatten(), torch.cat([y, y * 2]).sum(0)]),
    "scatter_add": lambda y: torch.zeros(3, _C, device=y.device).scatter_add(
        0, (torch.arange(y.shape[0], device=y.device) % 3)[:, None].expand(-1, _C), y).flatten(),
    "multinomial": lambda y: torch.multinomial((y == y.amax(-1, keepdim=True)).float(), 1)[-3:],
}


@pytest.mark.modes("defer")
@pytest.mark.parametrize("poison", ["nan", "huge"])
def test_padding_that_is_nan_or_huge_never_reaches_a_result(poison):
    """NOTE [padding rules]: a padded row that leaked into a sum, a softmax, a top-k, a loss or a
    scatter would be a silent wrong answer. Here the padding a bucket adds holds NaN or 1e30 (made
    inside the region from the zeros it is padded with), and every result equals CPU's. (One
    region for all the cases, two programs: a refusal names its op.)"""
    make = _nan_padded if poison == "nan" else _huge_padded

    def fn(x):
        y = make(x)
        return [f(y) for f in _POISONED.values()]
    deferfuse.clear_caches()
    got, want = [], []
    for t in range(5, 12):
        x = torch.randn(t, _C)
        want.append(fn(x))
        got.append([r.cpu() for r in fn(x.to("tpu"))])
    m = deferfuse.metrics()
    for gs, ws in zip(got, want):
        for case, g, w in zip(_POISONED, gs, ws):
            assert g.dtype == w.dtype and g.shape == w.shape, case
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=case)
    # (lengths 6..11 in buckets; the read of the first result may run first, on its own)
    assert m["bucketed_runs"] >= 6 and not m["bucket_refusals"], m["bucket_refusals"]


@pytest.mark.modes("defer")
def test_a_backward_pass_over_a_growing_dim_runs_in_buckets():
    """The backward ops a batch of another length needs (embedding's, layer norm's, softmax's
    and nll's backward, weight gradients summed over the padded rows) run padded, the padding
    NaN: the gradients equal CPU's."""
    def fn(x):
        w = (torch.arange(10 * _C, device=x.device, dtype=torch.float32) / 40).reshape(10, _C)
        w.requires_grad_()
        ids = (x.abs() * 10).long()[:, 0] % 10
        h = F.layer_norm(F.embedding(ids, w) * _nan_padded(x), (_C,))
        loss = F.cross_entropy(h.softmax(-1) * 3, ids % _C)
        (g,) = torch.autograd.grad(loss, w)
        return torch.cat([g.flatten(), loss.detach()[None]])
    deferfuse.clear_caches()
    got, want, m = _lengths_loop(fn, lambda t: torch.randn(t, _C), range(5, 12))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert m["bucketed_runs"] >= 6 and not m["bucket_refusals"], m["bucket_refusals"]


@pytest.mark.modes("defer")
def test_a_bad_index_in_a_bucketed_region_still_raises():
    table = torch.arange(20.).reshape(10, 2)
    deferfuse.clear_caches()
    for t in range(5, 12):
        ids = torch.randint(0, 10, (t,))
        got = F.embedding(ids.to("tpu"), table.to("tpu")) * 2
        assert_same(got, F.embedding(ids, table) * 2)
    assert deferfuse.metrics()["bucketed_runs"] > 0
    ids = torch.randint(0, 10, (11,))
    ids[7] = 10
    with pytest.raises(IndexError):
        (F.embedding(ids.to("tpu"), table.to("tpu")) * 2).cpu()


@pytest.mark.modes("defer", "strict")
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_a_bad_advanced_index_into_a_growing_dim_raises_cpus_error():
    """``x[[i]]`` along a padded dim is checked against the exact length (CPU's message)."""
    deferfuse.clear_caches()
    for t in range(5, 12):
        x = torch.randn(t, 3)
        assert_same((x.to("tpu") * 2)[[-1, t - 2]], (x * 2)[[-1, t - 2]])
    x = torch.randn(11, 3)
    with pytest.raises(IndexError) as cpu:
        (x * 2)[[11]]
    with pytest.raises(IndexError) as tpu:
        (x.to("tpu") * 2)[[11]].cpu()
    assert str(cpu.value) in str(tpu.value), (str(cpu.value), str(tpu.value))
    with pytest.raises(IndexError) as tpu:
        (x.to("tpu") * 2)[[-12]].cpu()
    assert "index -12 is out of bounds for dimension 0 with size 11" in str(tpu.value)


@pytest.mark.modes("defer")
def test_in_place_writes_to_a_growing_input_run_in_buckets():
    """A boolean-mask write and in-place ops on a padded region input: the input itself holds
    CPU's values after each length; a write of a mask's count of values (a data-dependent
    shape) still refuses."""
    def fn(x):
        x[x < 0] = -float("inf")
        x.masked_fill_(x > 1, 1.0).add_(0.5)
        return x.softmax(0)
    deferfuse.clear_caches()
    for t in range(5, 14):
        x = torch.randn(t, 3)
        xt = x.to("tpu")
        assert_same(fn(xt), fn(x))
        assert_same(xt, x)
    m = deferfuse.metrics()
    assert m["bucketed_runs"] == 8 and not m["bucket_refusals"], m["bucket_refusals"]

    def counted(x):
        y = x * 2
        y[y < 0] = y[y < 0] * 3
        return y + 1
    deferfuse.clear_caches()
    deferfuse.reset_metrics()
    got, want, m = _lengths_loop(counted, lambda t: torch.randn(t, 3), range(5, 10))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert m["bucketed_runs"] == 0 and m["bucket_refusals"], m


@pytest.mark.modes("defer")
def test_topk_along_a_growing_dim_never_selects_padding():
    """Padding is -inf for the largest and NaN (sorted last) for the smallest: valid NaNs and
    infinities are still chosen as CPU chooses them, integers too."""
    def make(t):
        x = torch.randn(t, 3)
        inf = float("inf")
        x[1, 0], x[2, 1], x[3, 2], x[4, 0] = float("nan"), -inf, inf, -inf
        return x

    def fn(x):
        ints = (x.nan_to_num(0, 0, 0) * 4).long()
        return torch.cat([(x * 2).topk(5, 0)[0], (x * 2).topk(5, 0, largest=False)[0],
                          ints.topk(5, 0, largest=False)[0].float()])
    deferfuse.clear_caches()
    got, want, m = _lengths_loop(fn, make, range(5, 14))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True)
    assert m["bucketed_runs"] == 8 and not m["bucket_refusals"], m["bucket_refusals"]


@pytest.mark.modes("defer")
def test_multinomial_over_rows_of_a_growing_dim_runs_in_buckets():
    """``multinomial`` over the last dim with rows padded: random draws, so shapes, dtypes and
    valid samples; one-hot probabilities give CPU's samples; a valid row of zeros still raises
    CPU's error (the padded rows never do)."""
    def fn(x, onehot):
        p = (x * 2).softmax(-1)
        if onehot:
            p = (p == p.amax(-1, keepdim=True)).float()
        return torch.cat([torch.multinomial(p, 1), torch.multinomial(p, 3, replacement=True)], 1)
    deferfuse.clear_caches()
    for t in range(5, 12):
        x = torch.randn(t, 6)
        got, want = fn(x.to("tpu"), False), fn(x, False)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert bool(((got >= 0) & (got < 6)).all().cpu())
        assert_same(fn(x.to("tpu"), True), fn(x, True))
    m = deferfuse.metrics()
    assert m["bucketed_runs"] == 12 and not m["bucket_refusals"], m["bucket_refusals"]
    x = torch.randn(11, 6)
    x[9] = -float("inf")                        # softmax of a row of -inf: NaN
    with pytest.raises(RuntimeError) as cpu:
        fn(x, True)
    with pytest.raises(RuntimeError) as tpu:
        fn(x.to("tpu"), True).cpu()
    assert str(cpu.value) in str(tpu.value), (str(cpu.value), str(tpu.value))


_BAD = {   # op along a growing dim at length 11 (bucket 16) with an index or k past it
    "gather": lambda x, i: (x * 2).gather(0, torch.tensor([[0, i, 1]], device=x.device)),
    "index_select": lambda x, i: (x * 2).index_select(0, torch.tensor([0, i], device=x.device)),
    "index_select_dim1": lambda x, i: (x * 2).t().index_select(1, torch.tensor([i],
                                                                             device=x.device)),
    "topk": lambda x, i: (x * 2).topk(min(i + 1, 16), 0)[0],
    "index_put": lambda x, i: (x * 2).index_put((torch.tensor([0, i], device=x.device),),
                                                torch.ones(3, device=x.device)),
    "scatter_add": lambda x, i: (x * 2).scatter_add(0, torch.tensor([[0, i, 1]], device=x.device),
                                                    torch.ones(1, 3, device=x.device)),
}


@pytest.mark.modes("defer", "strict")
@pytest.mark.parametrize("case", list(_BAD))
@pytest.mark.parametrize("bad", [11, 12, -1])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_a_bad_index_along_a_growing_dim_raises_cpus_error(case, bad):
    """gather, index_select and topk along a padded dim: an index (or k) valid in the bucket but
    past the exact length raises CPU's error with CPU's message (negative: out of range for
    these ops)."""
    fn = _BAD[case]
    deferfuse.clear_caches()
    for t in range(5, 12):
        x = torch.randn(t, 3)
        assert_same(fn(x.to("tpu"), 2), fn(x, 2))
    m = deferfuse.metrics()
    assert m["bucketed_runs"] + m["bucketed_ops"] > 0, m
    assert not m["bucket_refusals"], m["bucket_refusals"]
    if case == "topk" and bad < 0:
        return
    if case == "index_put" and bad < 0:     # (-1 is the last valid row for index_put)
        x = torch.randn(11, 3)
        assert_same(fn(x.to("tpu"), bad), fn(x, bad))
        return
    x = torch.randn(11, 3)
    with pytest.raises((IndexError, RuntimeError)) as cpu:
        fn(x, bad)
    with pytest.raises(cpu.type) as tpu:
        fn(x.to("tpu"), bad).cpu()
    assert str(cpu.value) in str(tpu.value), (str(cpu.value), str(tpu.value))
    m = deferfuse.metrics()
    runs = m["bucketed_runs"] + m["bucketed_ops"]
    assert_same(fn(x.to("tpu"), 2), fn(x, 2))      # a good one after it still runs padded
    # (topk's k is checked when it is recorded, its sizes exact: in defer mode the failed call's
    # ``x * 2`` is left to the next region, a new structure)
    m = deferfuse.metrics()
    assert m["bucketed_runs"] + m["bucketed_ops"] > runs or case == "topk"


@pytest.mark.modes("defer")
def test_growing_generate_compiles_per_bucket_and_learns_in_one_call():
    torch.manual_seed(0)
    model = M.TinyGPT().eval()
    prompt = {p: torch.randint(0, 40, (1, p), generator=torch.Generator().manual_seed(p))
              for p in (6, 9)}
    want = {p: model.generate(x, 30) for p, x in prompt.items()}
    model.to("tpu")
    deferfuse.clear_caches()
    compiles = []
    for p in (6, 6, 9):
        got = model.generate(prompt[p].to("tpu"), 30)
        assert_same(got, want[p])                 # tokens equal CPU greedy
        m = deferfuse.metrics()
        compiles.append(m["region_compiles"] + m["disk_cache_hits"])
    # One region per token (the loop body found though its shapes change), two exact lengths and
    # then one program per bucket (8, 16, 32, 64): never one per length.
    assert compiles[0] <= 9, deferfuse.metrics()["miss_reasons"]
    assert compiles[1] == compiles[0]             # the second identical call compiles nothing
    assert compiles[2] == compiles[1]             # nor a new prompt length in the same buckets
    m = deferfuse.metrics()
    assert m["bucketed_runs"] >= 60 and m["shape_fallbacks"] == 0 and m["shape_splits"] == 0
    text = deferfuse.report(file=False)
    assert "padded to the bucket of length 32" in text and "buckets" in text


@pytest.mark.modes("defer")
@pytest.mark.parametrize("temperature", [1.0, None], ids=["scaled", "view_write"])
def test_nanogpt_sampling_runs_in_buckets(temperature):
    """nanoGPT's ``generate`` (``x[:, [-1], :]``, top-k through a boolean-mask write, multinomial)
    gives CPU's tokens and compiles per bucket, not per length (it compiled ~600 programs); its
    second call compiles nothing. Each token is one region, whole: the mask write through a view
    of the model's output (``view_write``) once refused buckets and split every token into three
    regions, one of them a single ``cat`` (14 programs)."""
    torch.manual_seed(0)
    model = M.TinyGPT().eval()
    x = torch.zeros((1, 1), dtype=torch.long)
    want = model.sample(x, 30, temperature=temperature)
    model.to("tpu")
    deferfuse.clear_caches()
    got = model.sample(x.to("tpu"), 30, temperature=temperature)
    assert_same(got, want)
    m = deferfuse.metrics()
    assert not m["bucket_refusals"], m["bucket_refusals"]
    # one program: the bucket of 32, planned from the first trace's first two tokens, serves the
    # first length too (NOTE [buckets ahead] in runtime/flush.py), and the last token (it leaves
    # fewer outputs: NOTE [fewer outputs] in runtime/buckets.py)
    assert m["compiles"] + m["disk_cache_hits"] == 1, m["miss_reasons"]
    assert m["bucketed_runs"] == 30, m["bucketed_runs"]
    assert m["regions_run"] <= 31 and m["shape_splits"] == 0, m["regions_run"]
    # The second call makes nothing: its outputs are listed in the order of the trace (they came
    # in another order and compiled a bucket program again: NOTE [outputs in trace order]).
    deferfuse.reset_metrics()
    assert_same(model.sample(x.to("tpu"), 30, temperature=temperature), want)
    m = deferfuse.metrics()
    assert m["compiles"] + m["disk_cache_hits"] == 0, m["miss_reasons"]


@pytest.mark.modes("defer")
def test_a_learnt_sampling_loop_met_with_another_batch_relearns_its_buckets():
    """NOTE [new bases] (runtime/buckets.py): the sampling loop learnt from one token at batch 1,
    then met with a batch of two and a longer prompt, runs in buckets again after one program (a
    plan along the old base's line through the new base's first version: NOTE [a new base grows
    alike]; two before it, a plan through the two bases and then one along the new base's
    length; one per length before NOTE [new bases]). Tokens equal CPU's."""
    torch.manual_seed(0)
    model = M.TinyGPT(layers=1).eval()
    x1, x2 = torch.zeros((1, 1), dtype=torch.long), torch.randint(0, 40, (2, 3))
    want1, want2 = model.sample(x1, 20), model.sample(x2, 20)
    model.to("tpu")
    deferfuse.clear_caches()
    assert_same(model.sample(x1.to("tpu"), 20), want1)
    deferfuse.reset_metrics()
    assert_same(model.sample(x2.to("tpu"), 20), want2)
    m = deferfuse.metrics()
    assert m["compiles"] + m["disk_cache_hits"] == 1, m["miss_reasons"]
    assert m["bucketed_runs"] == 20 and m["shape_splits"] == 0 and m["shape_fallbacks"] == 0, m
    deferfuse.reset_metrics()           # the new base learnt: its second call compiles nothing
    assert_same(model.sample(x2.to("tpu"), 20), want2)
    assert deferfuse.metrics()["compiles"] == 0, deferfuse.metrics()["miss_reasons"]


def _gpt_phases(model, dev):
    """Train a small GPT at batch 8, evaluate it at batches 8, 3 and 5, train it at 3 and 5:
    (losses, compiles per phase)."""
    import torch.optim as optim
    opt = optim.SGD(model.parameters(), lr=0.1)
    losses, counts = [], []
    for b, train in ((8, True), (8, False), (3, False), (5, False), (3, True), (5, True)):
        c0 = _compiles()
        g = torch.Generator().manual_seed(b)
        for _ in range(3 if train else 1):
            x = torch.randint(0, 40, (b, 12), generator=g).to(dev)
            with torch.set_grad_enabled(train):
                loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, 40), x[:, 1:].reshape(-1))
            if train:
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(loss.item())
        counts.append(_compiles() - c0)
    return losses, counts


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_a_model_trained_at_one_batch_runs_other_batches_in_buckets():
    """A GPT trained at batch 8 and then evaluated and trained at batches 3 and 5 (a linear
    layer's and attention's backward over a padded batch have rules): losses equal CPU's, each
    new batch size of a phase costs at most its regions' programs once, the third size none."""
    import copy
    torch.manual_seed(0)
    model = M.TinyGPT()
    tmodel = copy.deepcopy(model).to("tpu")
    want, _ = _gpt_phases(model, "cpu")
    deferfuse.clear_caches()
    got, counts = _gpt_phases(tmodel, "tpu")
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert counts[3] == 0 and counts[5] == 0, counts    # batch 5 after 3: in their buckets
    assert sum(counts) <= 8, (counts, deferfuse.metrics()["miss_reasons"])
    m = deferfuse.metrics()
    assert not m["bucket_refusals"] and m["shape_splits"] == 0, m["bucket_refusals"]


# ------------------------------------------------------------------ real loops, as users write them
@pytest.mark.modes("defer")
@pytest.mark.parametrize("cache", [None, "static", "static compiled"])
def test_hugging_face_generate_second_call_compiles_nothing(cache):
    """HF ``generate()`` with the default dynamic cache (keys and values grow by one position per
    token) and with the static cache, its decode step run as recorded or (``static compiled``,
    transformers' default) through ``torch.compile``: CPU's greedy tokens, and the second
    identical call compiles nothing (the compiled static cache's second call compiled one program
    per length: the tokens' ``cat`` had no bucket, NOTE [bucket families] in
    runtime/buckets.py). The mask is made on the device before the first call and kept, as a
    script does: its op joined the first call's first trace, and the second call compiled that
    trace's other ops again (NOTE [setup first] in scheduler/cut.py)."""
    pytest.importorskip("transformers")
    import hf_matrix as hm
    want = hm.cpu_generate("llama", cache and "static")
    kw = hm._cache_kwargs(cache and "static")
    if cache == "static compiled":
        del kw["disable_compile"]
    model, batch = hm.cpu_reference("llama")[:2]
    tm = hm.to_tpu(model)
    tb = hm._dev(batch, "tpu")
    tb["attention_mask"] = torch.ones_like(tb["input_ids"])     # pending until the first call
    counts = []
    for _ in range(2):
        deferfuse.reset_metrics()
        with torch.no_grad():
            got = tm.generate(**hm._prompt(tb), **hm._gen_kwargs(do_sample=False),
                              **kw)
        assert_same(got, want, 0, 0)
        m = deferfuse.metrics()
        counts.append((m["compiles"], m["disk_cache_hits"]))
        if cache == "static compiled" and len(counts) == 1:
            assert m["dynamo_graphs"] >= 1      # transformers compiled the step with backend="tpu"
    # the first call made its programs (compiled, or loaded from the program store on disk)
    assert sum(counts[0]) > 0 and counts[1] == (0, 0), counts


def test_a_window_near_the_end_of_its_base_reads_its_own_rows():
    """A window whose length changes over a base that does not (the last, shorter batch of a
    dataset: ``data[i:i + n]``) never runs padded past the base's end: XLA would move the start
    back inside, and the valid rows would be the wrong ones."""
    d = torch.arange(1000, dtype=torch.float32)
    t = d.to("tpu")
    for off, n in ((990, 3), (990, 4), (993, 6), (995, 5), (40, 7)):
        assert_same(t[off:off + n] * 2, d[off:off + n] * 2, 0, 0)
        assert_same(t.narrow(0, off, n).sum(), d.narrow(0, off, n).sum())


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_a_ragged_last_batch_trains_as_cpu_and_its_second_epoch_compiles_nothing():
    """An epoch whose last batch is smaller (a DataLoader without drop_last): CPU's losses and
    weights, and nothing new to compile in the second epoch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 3))
    tmodel = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 3))
    tmodel.load_state_dict(model.state_dict())
    tmodel.to("tpu")
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(b, 8, generator=g), torch.randint(0, 3, (b,), generator=g))
            for b in (16, 16, 16, 5)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, tmodel)]
    counts = []
    for _ in range(2):
        c0 = _compiles()
        for x, y in data:
            losses = []
            for m, opt, dev in ((model, opts[0], "cpu"), (tmodel, opts[1], "tpu")):
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(m(x.to(dev)), y.to(dev))
                loss.backward()
                opt.step()
                losses.append(loss.item())
            assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-6)
        counts.append(_compiles() - c0)
    for p, q in zip(tmodel.parameters(), model.parameters()):
        assert_same(p.detach(), q.detach(), atol=1e-5)
    assert counts[1] == 0, counts
    # What this taught about the step's structure (split after two shapes) would shape the
    # regions of later tests that count them.
    deferfuse.clear_caches()


class _PosEnc(nn.Module):
    """Sine positions added to a (T, B, C) input, as word_language_model's ``PositionalEncoding``."""

    def __init__(self, d, max_len=64):
        super().__init__()
        import math
        pos = torch.arange(max_len, dtype=torch.float).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2).float() * (-math.log(10000.0) / d))
        pe = torch.zeros(max_len, d)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe.unsqueeze(1))

    def forward(self, x):
        return x + self.pe[:x.size(0), :]


class _WlmTransformer(nn.Transformer):
    """word_language_model's ``--model Transformer`` in its style: a causal mask made again when
    the length changes (the last, shorter bptt chunk), embedding, positions, the encoder, a
    decoder layer and log-softmax (no dropout, to compare with CPU)."""

    def __init__(self, ntoken, d, nhead, nhid, nlayers):
        super().__init__(d_model=d, nhead=nhead, dim_feedforward=nhid, num_encoder_layers=nlayers,
                         num_decoder_layers=1, dropout=0.0)
        self.src_mask, self.pos, self.d = None, _PosEnc(d), d
        self.emb, self.dec = nn.Embedding(ntoken, d), nn.Linear(d, ntoken)

    def forward(self, src):
        import math
        if self.src_mask is None or self.src_mask.size(0) != len(src):
            m = (torch.triu(torch.ones(len(src), len(src))) == 1).transpose(0, 1)
            self.src_mask = m.float().masked_fill(m == 0, float("-inf")).masked_fill(
                m == 1, 0.0).to(src.device)
        x = self.pos(self.emb(src) * math.sqrt(self.d))
        return F.log_softmax(self.dec(self.encoder(x, mask=self.src_mask)), dim=-1)


def _wlm_epochs(model, data, dev, bptt=8, epochs=2, lr=0.5):
    """word_language_model's training loop (``get_batch``, ``clip_grad_norm_``, the manual
    ``p.data.add_``): (losses, compiles per epoch)."""
    ntok = model.dec.out_features
    losses, counts = [], []
    src = data.to(dev)
    for _ in range(epochs):
        c0 = _compiles()
        for i in range(0, src.size(0) - 1, bptt):
            n = min(bptt, src.size(0) - 1 - i)
            x, y = src[i:i + n], src[i + 1:i + 1 + n].reshape(-1)
            model.zero_grad()
            loss = F.nll_loss(model(x).view(-1, ntok), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            for p in model.parameters():
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-lr)
            losses.append(loss.item())
        counts.append(_compiles() - c0)
    return losses, counts


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_word_language_model_transformer_with_chunks_of_many_lengths_runs_in_buckets():
    """Training chunks of eight lengths (a variable bptt; each chunk a window ``data[i:i + n]``
    and positions ``pe[:n]`` of a shorter buffer, both read from widened bases: NOTE [widened
    bases]): losses equal CPU's, and the forward and backward passes run padded in buckets (the
    loss's and the embedding's backward ops have rules), none refused."""
    import copy
    torch.manual_seed(0)
    model = _WlmTransformer(50, 16, 2, 32, 1)
    tmodel = copy.deepcopy(model).to("tpu")
    data = torch.randint(0, 50, (60, 4), generator=torch.Generator().manual_seed(1))

    def run(m, dev):
        src, out, i = data.to(dev), [], 0
        for n in (8, 5, 7, 6, 4, 8, 3, 7):
            x, y = src[i:i + n], src[i + 1:i + 1 + n].reshape(-1)
            i += n
            m.zero_grad()
            loss = F.nll_loss(m(x).view(-1, 50), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.25)
            for p in m.parameters():
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-0.5)
            out.append(loss.item())
        return out
    want = run(model, "cpu")
    deferfuse.clear_caches()
    got = run(tmodel, "tpu")
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    m = deferfuse.metrics()
    assert m["bucketed_runs"] >= 8 and not m["bucket_refusals"], m["bucket_refusals"]
    deferfuse.clear_caches()


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_word_language_model_transformer_ragged_last_chunk_over_two_epochs():
    """The last bptt chunk is shorter (38 rows, bptt 8: four chunks of 8 and one of 5): losses and
    weights equal CPU's over two epochs; the short chunk compiles its regions once, in the first
    epoch, and the second epoch compiles nothing."""
    import copy
    torch.manual_seed(0)
    model = _WlmTransformer(50, 16, 2, 32, 1)
    tmodel = copy.deepcopy(model).to("tpu")
    data = torch.randint(0, 50, (38, 4), generator=torch.Generator().manual_seed(1))
    want, _ = _wlm_epochs(model, data, "cpu")
    deferfuse.reset_metrics()
    got, counts = _wlm_epochs(tmodel, data, "tpu")
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert got[:5] != got[5:]           # (the second epoch trained on)
    for p, q in zip(tmodel.parameters(), model.parameters()):
        assert_same(p.detach(), q.detach(), atol=1e-5)
    regions = deferfuse.metrics()["regions_run"] // len(got)
    assert counts[1] == 0 and 0 < counts[0] <= 2 * regions, (counts, regions)
    deferfuse.clear_caches()


class _WlmLSTM(M.WlmLSTM):
    """pytorch/examples' word_language_model ``RNNModel`` with its LSTM (bench/models.py): the
    decoder's output flattened with ``decoded.view(-1, ntoken)``, merging the batch into the time
    dim; 30 tokens, 8 wide."""

    def __init__(self, ntoken=30, d=8):
        super().__init__(ntoken, d)


def _wlm_step(model, x, y, h, train):
    """One step of word_language_model's training loop (``train``) or of its ``evaluate()``:
    the hidden state detached, the forward pass and the loss, then ``clip_grad_norm_`` and the
    manual ``p.data.add_``. (loss.item(), the new hidden state)."""
    h = tuple(v.detach() for v in h)
    with torch.set_grad_enabled(train):
        out, h = model(x, h)
        loss = F.nll_loss(out, y)
    if train:
        model.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.5)
    return loss.item(), h


def _scans(jaxpr):
    """The scans of a jaxpr, outermost first, each with the count of products in its body."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            body = e.params["jaxpr"].jaxpr
            out.append(sum(b.primitive.name == "dot_general" for b in body.eqns))
    return out


@pytest.mark.modes("defer")
def test_lstm_backward_takes_its_gates_from_the_output_and_trains_as_cpu():
    """NOTE [gates from the output] (runtime/lowering/rnn.py): the backward pass of
    ``mkldnn_rnn_layer`` computes every step's gates from the forward pass's output instead of
    running the forward recurrence (a product per step) again: its program has one scan with one
    product a step and an elementwise one for the cell states (before: a scan with one product a
    step and one with two). word_language_model's step with a bidirectional two-layer LSTM (each
    direction's own order, the final states' gradients through the detached carry) trains as CPU
    does, in two regions a step, and its third step compiles nothing."""
    import copy
    import jax
    import jax.numpy as jnp
    from deferfuse.runtime.lowering.rnn import mkldnn_rnn_layer_backward as bwd
    t, b, h = 7, 3, 8
    z = [jnp.zeros(s, jnp.float32) for s in ((t, b, h), (4 * h, h), (4 * h, h), (4 * h,),
                                             (4 * h,), (1, b, h), (1, b, h), (t, b, h),
                                             (1, b, h), (1, b, h), (t, b, h), (1, b, h),
                                             (1, b, h))]
    for reverse in (False, True):
        jaxpr = jax.make_jaxpr(lambda *a: bwd(*a, reverse, 2, h, 1, True, True, False, [],
                                              False, None))(*z)
        assert sorted(_scans(jaxpr.jaxpr)) == [0, 1], jaxpr

    class Bidi(_WlmLSTM):
        def __init__(self):
            super().__init__(ntoken=30, d=8)
            self.rnn = nn.LSTM(8, 4, num_layers=2, bidirectional=True)

        def init_hidden(self, bsz):
            w = next(self.parameters())
            return (w.new_zeros(4, bsz, 4), w.new_zeros(4, bsz, 4))

    torch.manual_seed(0)
    model = Bidi()
    tmodel = copy.deepcopy(model).to("tpu")
    src = torch.randint(0, 30, (4 * 6 + 1, 3), generator=torch.Generator().manual_seed(2))
    runs = []
    for m, dev in ((model, "cpu"), (tmodel, "tpu")):
        data, hid, losses, counts = src.to(dev), m.init_hidden(3), [], []
        for i in range(0, 4 * 6, 6):
            r0, c0 = deferfuse.metrics()["regions_run"], _compiles()
            loss, hid = _wlm_step(m, data[i:i + 6], data[i + 1:i + 7].reshape(-1), hid, True)
            losses.append(loss)
            counts.append((deferfuse.metrics()["regions_run"] - r0, _compiles() - c0))
        runs.append((losses, counts))
    (want, _), (got, counts) = runs
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for p, q in zip(tmodel.parameters(), model.parameters()):
        assert_same(p.detach(), q.detach(), atol=1e-5)
    assert [r for r, _ in counts[1:]] == [2, 2, 2], counts
    assert [c for _, c in counts[2:]] == [0, 0], counts
    assert not deferfuse.metrics()["cpu_fallbacks"]


def _wlm_lstm_phases(model, dev, phases, bptt=6, rows=13, corpus_len=None, step=_wlm_step):
    """word_language_model's ``evaluate()`` (and its training loop) at each (batch, train) of
    ``phases``, over ``rows`` rows of data batchified at that batch (two bptt chunks), or, with
    ``corpus_len``, over one corpus of that length batchified as its ``batchify`` does (``N // B``
    rows; the first two chunks): (losses, compiles per phase)."""
    g = torch.Generator().manual_seed(3)
    corpus = torch.randint(0, model.ntoken, (corpus_len or rows * 32,), generator=g)
    losses, counts = [], []
    for b, train in phases:
        c0 = _compiles()
        n = corpus_len // b if corpus_len else rows
        src = corpus[:n * b].view(b, -1).t().contiguous().to(dev)
        h = model.init_hidden(b)
        model.train(train)
        for i in range(0, rows - 1, bptt):
            x, y = src[i:i + bptt], src[i + 1:i + 1 + bptt].reshape(-1)
            loss, h = step(model, x, y, h, train)
            losses.append(loss)
        counts.append(_compiles() - c0)
    return losses, counts


@pytest.mark.modes("defer")
def test_word_language_model_lstm_evaluated_at_new_batches_runs_in_buckets():
    """NOTE [compacting reshapes] (runtime/bucket_reshape.py): ``decoded.view(-1, ntoken)`` of
    the ``(T, B, V)`` output merges the padded batch behind the time dim; it runs compacted, so
    the evaluation at batch 10 after 20 runs its two regions in buckets (2 programs) and at
    batch 7 compiles nothing (it refused buckets before: 2 and 8 programs). Losses equal CPU's."""
    import copy
    torch.manual_seed(0)
    model = _WlmLSTM()
    tmodel = copy.deepcopy(model).to("tpu")
    phases = ((20, False), (10, False), (7, False), (10, False))
    want, _ = _wlm_lstm_phases(model, "cpu", phases)
    deferfuse.clear_caches()
    got, counts = _wlm_lstm_phases(tmodel, "tpu", phases)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert counts[1] <= 2 and counts[2] == 0 and counts[3] == 0, counts
    m = deferfuse.metrics()
    assert not m["bucket_refusals"] and m["shape_splits"] == 0 and m["shape_fallbacks"] == 0, m
    # two chunks and the initial state's zeros (NOTE [carried setup]) at batches 10, 7 and 10
    assert m["bucketed_runs"] == 9, m["bucketed_runs"]
    deferfuse.clear_caches()


@pytest.mark.modes("defer")
def test_word_language_model_lstm_over_one_corpus_batchified_at_new_batches():
    """NOTE [window bases] (runtime/bucket_fit.py): data batchified from one corpus at batch B has
    ``N // B`` rows, a second size moving against the batch; the windows' base follows its own
    bucket, so evaluating at batch 7 after 10 compiles the two regions once in buckets (rows 37
    and 26: bucket 64), and batch 8 (32 rows) and 10 again compile nothing (7 programs at batch
    7 before, shape churn). Losses equal CPU's."""
    import copy
    torch.manual_seed(0)
    model = _WlmLSTM()
    tmodel = copy.deepcopy(model).to("tpu")
    phases = ((10, False), (7, False), (8, False), (10, False))
    want, _ = _wlm_lstm_phases(model, "cpu", phases, corpus_len=260)
    deferfuse.clear_caches()
    got, counts = _wlm_lstm_phases(tmodel, "tpu", phases, corpus_len=260)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert counts[1] <= 2 and counts[2] == 0 and counts[3] == 0, counts
    m = deferfuse.metrics()
    assert not m["bucket_refusals"] and m["shape_splits"] == 0 and m["shape_fallbacks"] == 0, m
    # two regions and the initial state's zeros (NOTE [carried setup]) at batches 7 and 8
    assert m["bucketed_runs"] == 6, m["bucketed_runs"]
    deferfuse.clear_caches()


def _wlm_eval_inline(model, dev, phases, bptt=6, rows=13):
    """``_wlm_lstm_phases``'s evaluation with its step written inline, as ``evaluate()`` is
    (``h`` rebound in this frame, where a helper's caller still holds the ``h`` it passed)."""
    g = torch.Generator().manual_seed(3)
    corpus = torch.randint(0, model.ntoken, (rows * 32,), generator=g)
    losses, counts = [], []
    for b, _ in phases:
        c0 = _compiles()
        src = corpus[:rows * b].view(b, -1).t().contiguous().to(dev)
        h = model.init_hidden(b)
        model.eval()
        for i in range(0, rows - 1, bptt):
            x, y = src[i:i + bptt], src[i + 1:i + 1 + bptt].reshape(-1)
            h = tuple(v.detach() for v in h)
            with torch.no_grad():
                out, h = model(x, h)
                loss = F.nll_loss(out, y)
            losses.append(loss.item())
        counts.append(_compiles() - c0)
    return losses, counts


class _WlmRunner:
    """The step as a method, called from the loop (a third place for the same ops)."""

    def step(self, model, x, y, h, train):
        return _wlm_step(model, x, y, h, train)


@pytest.mark.modes("defer")
def test_the_same_step_inline_in_a_helper_or_a_method_runs_the_same_regions():
    """NOTE [carried setup] (scheduler/cut.py): the evaluation loop with its step inline, in a
    helper function and in a method runs the same regions, in buckets alike, with the same
    programs made or loaded per phase, and gives CPU's losses. (Inline, the initial hidden state
    is dead at the chunk's ``loss.item()``; through a helper its caller still holds it, and its
    zeros ran as a region of their own: 9 regions against 6 over these phases, 6 in buckets
    against 4.)"""
    import copy
    torch.manual_seed(0)
    model = _WlmLSTM()
    phases = ((20, False), (10, False), (7, False))
    want, _ = _wlm_lstm_phases(model, "cpu", phases)
    seen = {}
    for how in ("inline", "helper", "method"):
        deferfuse.clear_caches()
        deferfuse.reset_metrics()
        tmodel = copy.deepcopy(model).to("tpu")
        made = []
        for ph in phases:
            c0 = deferfuse.metrics()
            if how == "inline":
                got, _ = _wlm_eval_inline(tmodel, "tpu", (ph,))
            else:
                step = _wlm_step if how == "helper" else _WlmRunner().step
                got, _ = _wlm_lstm_phases(tmodel, "tpu", (ph,), step=step)
            assert got == pytest.approx(want[2 * len(made):2 * len(made) + 2], rel=1e-5,
                                        abs=1e-6), how
            c1 = deferfuse.metrics()
            made.append(sum(c1[k] - c0[k] for k in ("compiles", "disk_cache_hits")))
        m = deferfuse.metrics()
        seen[how] = (m["regions_run"], m["bucketed_runs"], m["setup_splits"], made)
        assert not m["bucket_refusals"] and m["shape_fallbacks"] == 0, (how, m)
    assert seen["inline"] == seen["helper"] == seen["method"], seen
    assert seen["inline"][2] == len(phases), seen     # each phase's zeros run first, once
    deferfuse.clear_caches()


def _wlm_lstm_chunks(model, dev, lens, train, b=4, rows=40):
    """word_language_model's loop at batch ``b`` over chunks of the given lengths (a ragged last
    chunk, a variable bptt): (losses, compiles after each chunk)."""
    g = torch.Generator().manual_seed(5)
    src = torch.randint(0, model.ntoken, (rows * b,), generator=g).view(b, -1).t().contiguous()
    src = src.to(dev)
    h, losses, counts, i = model.init_hidden(b), [], [], 0
    model.train(train)
    for n in lens:
        x, y = src[i:i + n], src[i + 1:i + 1 + n].reshape(-1)
        i += n
        loss, h = _wlm_step(model, x, y, h, train)
        losses.append(loss)
        counts.append(_compiles())
    return losses, counts


@pytest.mark.modes("defer")
@pytest.mark.parametrize("train", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_lstm_over_chunks_of_other_lengths_runs_in_buckets(train):
    """NOTE [padded steps] (runtime/lowering/rnn.py): ``nn.LSTM`` over a padded time dim (a
    ragged last bptt chunk, a variable bptt) keeps its states past the real steps, so the chunks
    of 4, 3, 5 and 2 steps after the 6-step ones run in one bucket: the first of them compiles its
    regions once, the rest nothing (an exact program per length before), and the losses (and
    trained weights) equal CPU's."""
    import copy
    torch.manual_seed(0)
    model = _WlmLSTM()
    tmodel = copy.deepcopy(model).to("tpu")
    lens = (6, 6, 4, 3, 5, 2)
    want, _ = _wlm_lstm_chunks(model, "cpu", lens, train)
    deferfuse.clear_caches()
    c0 = _compiles()
    got, counts = _wlm_lstm_chunks(tmodel, "tpu", lens, train)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for p, q in zip(tmodel.parameters(), model.parameters()):
        assert_same(p.detach(), q.detach(), atol=1e-5)
    assert counts[0] > c0 and counts[2] > counts[1], counts     # 4 steps: a bucket
    assert counts[-1] == counts[2], counts          # 3, 5 and 2 steps: nothing new
    m = deferfuse.metrics()
    assert not m["bucket_refusals"] and m["shape_splits"] == 0 and m["shape_fallbacks"] == 0, m
    assert m["bucketed_runs"] >= 4, m["bucketed_runs"]
    deferfuse.clear_caches()


class _BidiWlmLSTM(_WlmLSTM):
    """``_WlmLSTM`` with a bidirectional LSTM (a reversed layer starts in the padding)."""

    def __init__(self):
        super().__init__(ntoken=30, d=8)
        self.rnn = nn.LSTM(8, 4, bidirectional=True)

    def init_hidden(self, bsz):
        w = next(self.parameters())
        return (w.new_zeros(2, bsz, 4), w.new_zeros(2, bsz, 4))


@pytest.mark.modes("defer")
def test_a_bidirectional_lstm_trained_over_chunks_of_other_lengths_as_cpu():
    """NOTE [gates from the output] with NOTE [padded steps]: the backward pass of a reversed
    layer over a padded time dim takes its last real step's starting state from ``hx``, not from
    the padding of the forward pass's output (a bucket's input holds anything there): trained
    over chunks of 6, 6, 4, 3 and 5 steps with the state carried, the losses and weights equal
    CPU's, and the chunks after the first short one compile nothing."""
    import copy
    torch.manual_seed(0)
    model = _BidiWlmLSTM()
    tmodel = copy.deepcopy(model).to("tpu")
    lens = (6, 6, 4, 3, 5)
    want, _ = _wlm_lstm_chunks(model, "cpu", lens, True)
    deferfuse.clear_caches()
    got, counts = _wlm_lstm_chunks(tmodel, "tpu", lens, True)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for p, q in zip(tmodel.parameters(), model.parameters()):
        assert_same(p.detach(), q.detach(), atol=1e-5)
    assert counts[-1] == counts[2], counts          # 3 and 5 steps: in the bucket of 4
    assert deferfuse.metrics()["bucketed_runs"] >= 4, deferfuse.metrics()["bucketed_runs"]
    deferfuse.clear_caches()


@pytest.mark.modes("defer")
def test_window_bases_follow_a_bucket_of_their_own_and_buckets_follow_the_factor():
    """NOTE [window bases], the fit alone (no compile): a batch ``B`` with its ``T * B`` rows
    (``T`` = 35) and a window base of ``N // B`` rows (2 in the mask) moving against it."""
    from deferfuse.runtime.bucket_fit import FREE, fit

    def ints(b, n=7000):
        return [b, 35 * b, n // b, 35]
    mask = [True, True, FREE, False]
    f = fit([ints(20), ints(10)], mask)
    assert f is not None and f.free == {2} and f.forms[2] == (0, 1024)   # 350 and 700 rows
    s7 = f.value(ints(7))                          # 1000 rows: inside the bucket
    assert s7 is not None and f.bucket(s7) == f.bucket(f.value(ints(10)))    # B's bucket: 32
    assert f.value(ints(7, 7210)) is None and f.over(ints(7, 7210)) == {2: 2048}   # 1030 rows
    assert f.value([6, 211, 500, 35]) is None and f.over([6, 211, 500, 35]) is None  # off it
    assert fit([ints(20), ints(10)], [True, True, True, False]) is None   # not a window base
    assert fit([ints(20, 1400), ints(20, 2800)], mask).free == frozenset()   # alone: the line
    g = fit([[20, 700], [10, 350]], [True, True])
    assert g.pos0 == 0 and g.bucket(g.value([7, 245])) == g.bucket(g.value([10, 350]))


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_word_language_model_lstm_trained_at_new_batches_runs_in_buckets():
    """The same model trained at batch 20, then at 10 and 7 (the backward pass views the loss's
    gradient back to ``(T, B, V)``: a compacting split): weights and losses equal CPU's, batch 10
    compiles at most the step's regions, batch 7 nothing (its buckets follow the batch, not the
    ``T * B`` rows of the loss's gradient: one program before)."""
    import copy
    torch.manual_seed(0)
    model = _WlmLSTM()
    tmodel = copy.deepcopy(model).to("tpu")
    phases = ((20, True), (10, True), (7, True))
    want, _ = _wlm_lstm_phases(model, "cpu", phases)
    deferfuse.clear_caches()
    got, counts = _wlm_lstm_phases(tmodel, "tpu", phases)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for p, q in zip(tmodel.parameters(), model.parameters()):
        assert_same(p.detach(), q.detach(), atol=1e-5)
    assert counts[1] <= 3 and counts[2] == 0, counts
    m = deferfuse.metrics()
    assert not m["bucket_refusals"] and m["shape_splits"] == 0 and m["shape_fallbacks"] == 0, m
    deferfuse.clear_caches()


@pytest.mark.modes("defer")
def test_compacting_reshapes_match_the_exact_reshape():
    """NOTE [compacting reshapes], the padded function alone: merges and splits with the padded
    dim behind another (and plain ones) give the exact reshape's values in the valid prefix."""
    import jax.numpy as jnp
    import numpy as np
    from deferfuse.runtime import bucket_reshape
    from deferfuse.runtime.bucket_fit import at
    cases = [(((0, 5), (1, 3), (0, 4)), ((5, 15), (0, 4))),     # (T, B, V) -> (T * B, V)
             (((5, 15), (0, 4)), ((0, 5), (1, 3), (0, 4))),     # and back
             (((1, 3), (0, 6)), ((6, 18),)),                    # (B, C) -> (B * C): plain
             (((0, 2), (0, 3), (1, 1)), ((0, 6), (1, 1))),      # (2, 3, S) -> (6, S): plain
             (((0, 2), (1, 2), (0, 1), (0, 3)), ((0, 1), (6, 12)))]  # (2, S, 1, 3) -> (1, 6S)
    for fin, fout in cases:
        gs = bucket_reshape.plan(fin, fout, "view")
        for t in (0, 2, 5):
            P = 8
            exact_in = [at(f, t) for f in fin]
            x = np.arange(int(np.prod(exact_in)), dtype=np.float32).reshape(exact_in)
            padded = np.full([at(f, P) for f in fin], np.nan, np.float32)
            padded[tuple(slice(0, n) for n in exact_in)] = x
            if gs is None:
                got = np.asarray(jnp.reshape(padded, [at(f, P) for f in fout]))
            else:
                got = np.asarray(bucket_reshape.reshape(jnp.asarray(padded), fin, fout, gs,
                                                        jnp.int32(t), P))
            exact_out = [at(f, t) for f in fout]
            np.testing.assert_array_equal(got[tuple(slice(0, n) for n in exact_out)],
                                          x.reshape(exact_out))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_bucket_programs_are_keyed_by_dtype():
    """The same op whose sizes change, in bfloat16 then float16: each dtype gets its own bucket
    program (a program made for one was found by the other's key)."""
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randint(0, 4, (6, 40), generator=torch.Generator().manual_seed(0)).to(dt)
        t = x.to("tpu")
        for n in (16, 5, 7):
            assert_same(torch.argmax(t[:, :n], 1), torch.argmax(x[:, :n], 1), 0, 0)
            assert_same(t[:, :n].cumsum(1) * 2, x[:, :n].cumsum(1) * 2, 1e-2, 1e-2)


def test_meta_memo_keeps_only_what_every_process_describes_alike(tmp_path):
    # NOTE [meta memo] (deferfuse/meta.py): output shapes kept on disk for the next process, by a
    # description with no addresses and no values a meta kernel could read.
    from deferfuse.meta import MetaMemo, _run_meta
    from deferfuse.tensor import as_tpu     # the memo reads the op path's tensors (either form)
    add = torch.ops.aten.add.Tensor
    a, b = torch.randn(3, 4), torch.randn(4)
    ta, tb = as_tpu(a.to("tpu")), as_tpu(b.to("tpu"))
    memo = MetaMemo()
    memo.enable(str(tmp_path))
    k = memo.key(add, (ta, tb), {"alpha": 2})
    assert k is not None and k == memo.key(add, (as_tpu(torch.ones(3, 4).to("tpu")), tb),
                                           {"alpha": 2})
    assert k != memo.key(add, (ta, tb), {"alpha": 2.0})                  # the type counts
    assert k != memo.key(add, (as_tpu(ta.t().contiguous().t()), tb), {"alpha": 2})  # strides count
    assert memo.key(add, (ta, b), {}) is None                   # a CPU tensor: its values
    with torch.autocast("cpu", enabled=False):
        torch.set_default_dtype(torch.float64)
        try:
            assert memo.key(add, (ta, tb), {"alpha": 2}) != k
        finally:
            torch.set_default_dtype(torch.float32)
    assert memo.get(k) is None
    got = _run_meta(add, (ta, tb), {"alpha": 2})
    want = torch.add(a, b, alpha=2)
    assert got == ("one", ((tuple(want.shape), tuple(want.stride()), want.dtype),))
    memo.put(k, got)
    memo.save()
    again = MetaMemo()
    again.enable(str(tmp_path))
    assert again.get(k) == got and again.hits == 1


@pytest.mark.slow_params("strict")   # the test sets strict itself: one run is enough
def test_a_linear_trained_op_by_op_at_changing_batches_matches_cpu():
    # A linear layer whose input needs no gradient, trained in strict mode at a new batch size
    # each step: its backward op (linear_backward, bias and weight gradients only) runs padded in
    # a bucket once the sizes keep changing. The bucket program has no output for the gradient
    # the mask leaves out, and the op's results were matched against its outputs one place off:
    # AttributeError ('NoneType' object has no attribute 'shape') at the first bucketed step.
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    lt = nn.Linear(8, 4).to("tpu")
    lt.load_state_dict(lin.state_dict())
    before = deferfuse.metrics()["bucketed_ops"]
    with deferfuse.mode("strict"):
        for n in (3, 4, 5, 6, 7, 9, 11, 13):
            x = torch.randn(n, 8)
            for m, dev in ((lin, "cpu"), (lt, "tpu")):
                m.zero_grad()
                m(x.to(dev)).pow(2).sum().backward()
            assert_same(lt.weight.grad, lin.weight.grad, atol=1e-5, rtol=1e-5)
            assert_same(lt.bias.grad, lin.bias.grad, atol=1e-5, rtol=1e-5)
    assert deferfuse.metrics()["bucketed_ops"] > before     # the bucketed path ran
