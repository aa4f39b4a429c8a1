"""The dispatch thread (``DEFERFUSE_DISPATCH_THREAD``, NOTE [in flight] in runtime/execute.py):
the regions the host does not wait for are called on the engine's dispatch thread and their
outputs are in flight until a reader needs them. Every value stays CPU eager's, whoever reads it
(the next step, ``.item()``, ``.cpu()``, a print, a checkpoint, an in-place op, strict mode,
another thread), errors come back as they do without it, and nothing compiles that the same
steps without it did not compile."""
import io
import threading

import pytest
import torch
import torch.nn as nn

import deferfuse
from deferfuse.runtime import execute
from deferfuse.runtime.stats import S
from deferfuse.tensor import storage_of
from util import assert_same

pytestmark = pytest.mark.modes("defer")


def _model(dev):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _data(dev):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
    return x.to(dev), y.to(dev)


def _step(m, opt, x, y):
    opt.zero_grad()
    loss = (m(x) - y).square().mean()
    loss.backward()
    opt.step()
    return loss.item()


def _in_flight(t) -> bool:
    return storage_of(t).val.node.__class__ is execute.Job


def test_training_is_cpus_and_the_optimizer_region_runs_off_the_host():
    m, opt = _model("cpu")
    x, y = _data("cpu")
    want = [_step(m, opt, x, y) for _ in range(6)]
    tm, topt = _model("tpu")
    tx, ty = _data("tpu")
    with deferfuse.override(dispatch_thread=True):
        n0 = S["regions_dispatched"]
        got = [_step(tm, topt, tx, ty) for _ in range(6)]
        assert S["regions_dispatched"] - n0 >= 6      # at least the step after each loss
        # After .item() the backward pass and the optimizer step are still in flight.
        assert any(_in_flight(p) for p in tm.parameters())
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    for p, q in zip(tm.parameters(), m.parameters()):
        assert_same(p.detach(), q.detach(), atol=1e-5, rtol=1e-5)
    for k, s in topt.state.items():
        for n, v in s.items():
            if torch.is_tensor(v) and v.device.type == "tpu":
                assert not _in_flight(v)


def test_the_same_programs_as_without_it():
    """Same regions, same donation (its bookkeeping holds no value a storage does not): the
    steps with the thread compile nothing the steps without it did not."""
    tm, topt = _model("tpu")
    tx, ty = _data("tpu")
    for _ in range(3):
        _step(tm, topt, tx, ty)
    deferfuse.sync()
    c0, d0 = S["compiles"], S["donated_bytes"]
    _step(tm, topt, tx, ty)
    deferfuse.sync()
    donated_off = S["donated_bytes"] - d0
    with deferfuse.override(dispatch_thread=True):
        n0 = S["regions_dispatched"]
        for _ in range(3):
            _step(tm, topt, tx, ty)
        deferfuse.sync()
        d1 = S["donated_bytes"]
        _step(tm, topt, tx, ty)
        deferfuse.sync()
        assert S["regions_dispatched"] - n0 >= 4
    assert S["compiles"] == c0
    assert S["donated_bytes"] - d1 == donated_off > 0


def test_every_reader_waits_for_a_value_in_flight():
    m, opt = _model("cpu")
    x, y = _data("cpu")
    tm, topt = _model("tpu")
    tx, ty = _data("tpu")
    w = tm[0].weight
    with deferfuse.override(dispatch_thread=True):
        _step(tm, topt, tx, ty)
        _step(m, opt, x, y)
        assert _in_flight(w)
        assert_same(w.detach(), m[0].weight.detach(), atol=1e-6, rtol=1e-6)      # .cpu()
        _step(tm, topt, tx, ty)
        _step(m, opt, x, y)
        assert _in_flight(w)
        r = repr(tm[0].bias.detach())                                               # a print
        assert r.startswith("tensor([") and "device='tpu:0'" in r
        assert float(r[8:].split(",")[0]) == pytest.approx(m[0].bias[0].item(), abs=1e-4)
        _step(tm, topt, tx, ty)
        _step(m, opt, x, y)
        buf = io.BytesIO()
        torch.save(tm.state_dict(), buf)        # a checkpoint reads every parameter
        buf.seek(0)
        sd = torch.load(buf, map_location="cpu")
        for k, v in m.state_dict().items():
            torch.testing.assert_close(sd[k], v, atol=1e-5, rtol=1e-5)
        _step(tm, topt, tx, ty)
        _step(m, opt, x, y)
        assert _in_flight(w)
        with torch.no_grad():
            w.mul_(0.5)                         # an in-place op on a value in flight
            m[0].weight.mul_(0.5)
        with deferfuse.mode("strict"):
            assert_same(tm[2].weight * 2, m[2].weight.detach() * 2, atol=1e-5, rtol=1e-5)
        _step(tm, topt, tx, ty)
        _step(m, opt, x, y)
        torch.tpu.synchronize()
        assert not _in_flight(w)
        assert_same(w.detach(), m[0].weight.detach(), atol=1e-5, rtol=1e-5)


def test_a_value_in_flight_read_from_another_thread():
    m, opt = _model("cpu")
    x, y = _data("cpu")
    tm, topt = _model("tpu")
    tx, ty = _data("tpu")
    got = {}
    with deferfuse.override(dispatch_thread=True):
        for _ in range(2):
            _step(tm, topt, tx, ty)
            _step(m, opt, x, y)
        assert _in_flight(tm[2].bias)

        def read():
            with deferfuse.mode("defer"):
                got["b"] = tm[2].bias.detach().cpu()
        t = threading.Thread(target=read)
        t.start()
        t.join()
    torch.testing.assert_close(got["b"], m[2].bias.detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_an_index_error_in_a_region_in_flight(opt_name):
    """test_errors' reproduction with the thread: the bad step's error is raised, later values
    are CPU's or raise it, never NaN."""
    import test_errors as E
    with deferfuse.override(dispatch_thread=True):
        E._bad_batch_then_good("defer", opt_name)
        E.test_reloading_the_last_good_state_after_an_index_error_trains_as_cpu(
            "sgd_momentum" if opt_name == "sgd" else opt_name)


@pytest.mark.slow       # a training process of its own, ~10 s
def test_timed_keyboard_interrupts_lose_nothing(monkeypatch):
    import test_interrupts as I
    monkeypatch.setenv("DEFERFUSE_DISPATCH_THREAD", "1")
    I._run("defer", 25, 6)
