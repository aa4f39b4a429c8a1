"""The C record path (deferfuse/_fastpath.c, NOTE [C record path]): it is the op path's entry (the
ops the router hands on, NOTE [plain router] in plain.py), it takes the common calls, and what it
records is what the Python path records (same op keys, wiring, scalars, rolling hashes and source
lines), so both share every compiled program; results equal CPU eager's either way."""
import os
import subprocess
import sys
import threading

import pytest
import torch

import deferfuse
from deferfuse import _fastpath
from deferfuse.engine import engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hits():
    return _fastpath.stats()["hits"]


def _mixed(x, w, idx):
    """Ops of every kind the C path takes (and some it passes on): scalars of each Python type,
    int lists, keywords, views, writes in place, a multi-output op, a view at a moving offset."""
    y = x @ w                                   # a plain op
    y = y * 3 + 2.5                             # int and float scalar inputs
    y = y * 2 - 1                               # special scalars: baked constants
    y = y.transpose(0, 1).contiguous().view(-1, 4)      # views, then a copy
    y = torch.where(y > 0, y, y * 0.5)
    y.mul_(1.5).add_(y, alpha=-0.25)            # in place, a keyword scalar
    y.t()[1].add_(2)                            # in place through a view at a moving offset
    y = torch.nn.functional.normalize(y, dim=1)     # ops called from torch's Python code
    y = y.to(torch.float64).to(y.device, torch.float32)    # casts on the device (keywords)
    y = y + y[:1][:, :][0] + y[:, :1].select(1, 0)[:, None]  # windows that do not move
    a, b = y.chunk(2, dim=0)                    # a multi-view op
    s = a.sum(dim=[0, 1], keepdim=True) + b.mean(dim=0).sum()
    v, m = torch.var_mean(y, dim=1, correction=0)      # a multi-output op
    z = torch.ones_like(y, dtype=torch.float32) * s     # a keyword
    r = y[idx]                                   # select at a moving offset (the Python path)
    z = z + r.sum() + v.sum() + m.sum()
    z = torch.softmax(z.detach(), dim=-1, dtype=torch.float32)
    return z


def _inputs(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g)
    w = torch.randn(8, 4, generator=g)
    return x.to(device), w.to(device)


def _record(fn, *args):
    """Run ``fn`` in defer mode and return its result and what its trace holds before the sync."""
    deferfuse.sync()
    out = fn(*args)
    tr = engine.local.ts.trace
    rec = dict(h=tr.h, hops=tr.hops, scalars=list(tr.scalars),
               nodes=[(n.key.key, n.wiring, n.s0, list(n.scalars), n.src) for n in tr.nodes])
    deferfuse.sync()
    return out, rec


@pytest.mark.modes("defer")
def test_the_c_path_is_the_op_paths_entry_and_takes_routed_ops(tpu_mode):
    """The router hands the ops the C++ kernel does not record to ``TpuTensor.__torch_dispatch__``
    (NOTE [plain router] in plain.py), whose first stop is the C record path: an optimizer's
    in-place foreach op, after its first call, is recorded there."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 3, generator=g) for _ in range(3)]
    ys = [torch.randn(4, 3, generator=g) for _ in range(3)]
    tx, ty = [x.to("tpu") for x in xs], [y.to("tpu") for y in ys]
    for k in range(3):
        before = _hits()
        torch._foreach_add_(tx, ty, alpha=0.5)
        assert _hits() - before == (1 if k else 0)     # the first call fills the op cache
        torch._foreach_add_(xs, ys, alpha=0.5)
    got = [t.cpu() for t in tx]
    for g_, w in zip(got, xs):
        torch.testing.assert_close(g_, w, rtol=0, atol=0)
    assert deferfuse.metrics()["c_record"]["hits"] >= 2


@pytest.mark.modes("strict")
def test_strict_mode_goes_the_python_way(tpu_mode):
    x, w = _inputs("tpu")
    x @ w
    before = _hits()
    y = x @ w
    assert _hits() == before
    torch.testing.assert_close(y.cpu(), _inputs("cpu")[0] @ _inputs("cpu")[1])


@pytest.mark.modes("defer")
def test_both_paths_record_the_same_trace(tpu_mode):
    xc, wc = _inputs("cpu")
    want = [_mixed(xc, wc, i) for i in range(3)]
    x, w = _inputs("tpu")
    recs = {}
    for on in (True, False):
        with deferfuse.override(c_record=on):
            for i in range(3):
                before = _hits()
                out, rec = _record(_mixed, x, w, i)
                recs.setdefault(on, []).append(rec)
                torch.testing.assert_close(out.cpu(), want[i], rtol=1e-5, atol=1e-6)
                assert (_hits() > before) == on
    for a, b in zip(recs[True], recs[False]):
        assert len(a["nodes"]) > 15
        assert a["nodes"] == b["nodes"]
        assert (a["h"], a["hops"], a["scalars"]) == (b["h"], b["hops"], b["scalars"])
    # The user's line: this file's, through either path
    assert all(__file__ in n[4] for n in recs[True][0]["nodes"])


def _mlp_losses(device, steps=6):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                            torch.nn.Linear(32, 5)).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 12, generator=g).to(device)
    y = torch.randint(0, 5, (16,), generator=g).to(device)
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(x * (1 + i)), y)     # an int scalar that moves
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.modes("defer")
def test_training_equals_cpu_and_shares_programs_across_paths(tpu_mode):
    want = _mlp_losses("cpu")
    with deferfuse.override(c_record=True):
        got_c = _mlp_losses("tpu")
    compiles = deferfuse.metrics()["compiles"]
    with deferfuse.override(c_record=False):
        got_py = _mlp_losses("tpu")
    torch.testing.assert_close(got_c, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_py, want, rtol=1e-5, atol=1e-6)
    # the Python path finds every program the C path's trace compiled
    assert deferfuse.metrics()["compiles"] == compiles


def _foreach_steps(ts, flat):
    """In-place foreach ops as optimizers call them (scalars, scalar lists, tensor lists), with
    inputs that read what the op writes elsewhere in its list, then over views of one flat buffer
    (those two: the Python path, one write at a time)."""
    for i in range(2):
        torch._foreach_mul_(ts, 0.5 + i)
        torch._foreach_add_(ts, ts[::-1], alpha=0.25)
        torch._foreach_addcdiv_(ts, ts, [t.abs() + 1 for t in ts],
                                [0.1 * (j + 1) for j in range(len(ts))])
        torch._foreach_lerp_(ts, ts[1:] + ts[:1], 0.3)
    views = list(flat.split(3))
    torch._foreach_add_(views, 1.0)
    torch._foreach_mul_(views, views[::-1])
    return [t.clone() for t in ts], flat.clone()


@pytest.mark.modes("defer")
def test_foreach_ops_in_place(tpu_mode):
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(2, 3, generator=g) for _ in range(5)]
    flat = torch.randn(12, generator=g)
    want = _foreach_steps([t.clone() for t in ts], flat.clone())
    recs = {}
    for on in (True, False):
        with deferfuse.override(c_record=on):
            for k in range(2):
                before = _hits()
                got, rec = _record(_foreach_steps, [t.to("tpu") for t in ts], flat.to("tpu"))
                recs.setdefault(on, []).append(rec)
                torch.testing.assert_close([t.cpu() for t in got[0]], want[0])
                torch.testing.assert_close(got[1].cpu(), want[1])
                assert (_hits() > before) == on
    assert recs[True][1]["nodes"] == recs[False][1]["nodes"]
    assert recs[True][1]["scalars"] == recs[False][1]["scalars"]
    # one call, one hit: the optimizer's common case is the C path's (more than 64 tensors too)
    ts = [torch.randn(3, generator=g) for _ in range(70)]
    xs = [t.to("tpu") for t in ts]
    for k in range(2):
        before = _hits()
        torch._foreach_addcmul_(xs, xs, xs, 0.5)
        torch._foreach_mul_(xs, 0.75)
        assert _hits() - before == 2 * k        # the first call fills the op cache
        ts = [(t + 0.5 * t * t) * 0.75 for t in ts]
    torch.testing.assert_close([x.cpu() for x in xs], ts)


@pytest.mark.modes("defer")
def test_an_error_mid_training_then_good_steps(tpu_mode):
    """An op that fails (an index out of range) while the C path records the ops around it: the
    error is raised, and training on good data goes on with CPU's values."""
    def run(device):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 4).to(device)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        out = []
        for ids in ([1, 2], [3, 12], [4, 5]):
            try:
                loss = (emb(torch.tensor(ids, device=device)) * 2.0).sum()
                out.append(loss.item())         # tpu raises here, CPU at emb()
                loss.backward()
                opt.step()
                opt.zero_grad()
            except IndexError as e:
                out.append(type(e))
        return out, emb.weight.detach().cpu()
    want, got = run("cpu"), run("tpu")
    assert got[0][1] is IndexError and want[0][1] is IndexError
    torch.testing.assert_close([got[0][0], got[0][2]], [want[0][0], want[0][2]])
    torch.testing.assert_close(got[1], want[1])


@pytest.mark.modes("defer")
def test_threads_record_through_the_c_path(tpu_mode):
    xc, wc = _inputs("cpu")
    want = [_mixed(xc * k, wc, k % 3) for k in range(1, 5)]
    x, w = _inputs("tpu")
    got, errs = {}, []

    def work(k):
        try:
            with deferfuse.mode("defer"):
                got[k] = _mixed(x * k, w, k % 3).cpu()
        except BaseException as e:      # noqa: BLE001  (reported below)
            errs.append(e)
    before = _hits()
    ts = [threading.Thread(target=work, args=(k,)) for k in range(1, 5)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errs, errs
    assert _hits() > before
    for k in range(1, 5):
        torch.testing.assert_close(got[k], want[k - 1], rtol=1e-5, atol=1e-6)


@pytest.mark.modes("defer")
def test_views_made_by_the_c_path_alias_their_base(tpu_mode):
    for device in ("cpu", "tpu"):
        x = torch.arange(24.0).reshape(4, 6).to(device)
        t = x.t()
        t = x.t()               # the second is made by the C path (the first filled the cache)
        d = x.detach()
        t[1, 2] = -5.0          # writes through views land in the base
        d[0, 0] = 7.0
        res = (x.cpu(), t.cpu(), d.cpu(), t.stride(), d.storage_offset())
        if device == "cpu":
            want = res
    torch.testing.assert_close(res[0], want[0])
    torch.testing.assert_close(res[1], want[1])
    torch.testing.assert_close(res[2], want[2])
    assert res[3:5] == want[3:5]


@pytest.mark.modes("strict")     # a build in a child process: the mode plays no part
def test_a_missing_compiler_is_a_clear_install_error(tmp_path):
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), LDSHARED=str(tmp_path / "no-such-cc"))
    out = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                          "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "deferfuse needs a C and C++ compiler" in out.stdout + out.stderr


@pytest.mark.modes("defer")
def test_backward_on_autograd_device_thread_records_the_same(tpu_mode):
    """Backward ops recorded on PyTorch's autograd device thread (no Python caller): both paths
    name the site '<backward>', and the gradients equal CPU's."""
    def grads(device, srcs=None):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(device)
        x = torch.randn(5, 6).to(device)
        m(x).pow(2).sum().backward()
        if srcs is not None:        # every thread's pending ops, before anything reads them
            srcs.extend(n.src for t in list(engine.traces) for n in t.nodes)
        return [p.grad.cpu() for p in m.parameters()]
    want = grads("cpu")
    srcs = {}
    for on in (True, True, False):      # the first fills the op cache (the Python path)
        with deferfuse.override(backward_thread=True, c_record=on, backward_cut=False):
            deferfuse.sync()
            srcs[on] = []
            before = _hits()
            got = grads("tpu", srcs[on])
            hits = _hits() - before
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert hits == 0 and "<backward>" in srcs[True]
    assert sorted(srcs[True]) == sorted(srcs[False])
