"""The engine core: keys that cannot collide, errors that lose nothing, threads, real tpu:N, one
owned state. Every check compares with CPU eager PyTorch on the same inputs."""
import math
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn as nn

import deferfuse
from deferfuse.engine import engine
from deferfuse.tensor import as_tpu, storage_of
from util import assert_same

aten = torch.ops.aten


# --- keys ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda dev: [torch.full((3,), 2, device=dev), torch.full((3,), 2.0, device=dev)],
    lambda dev: [torch.arange(5, device=dev), torch.arange(5.0, device=dev)],
    lambda dev: [torch.full((2,), 1, device=dev), torch.full((2,), True, device=dev)],
    lambda dev: [torch.full((2,), True, device=dev), torch.full((2,), 1, device=dev)],
    lambda dev: [torch.arange(3, device=dev) * 2, torch.arange(3, device=dev) * 2.0],
    lambda dev: [torch.arange(3, device=dev) * 2.0, torch.arange(3, device=dev) * 2],
    lambda dev: [torch.arange(4, device=dev).clamp(max=3), torch.arange(4, device=dev).clamp(max=3.0)],
    lambda dev: [torch.arange(4, device=dev).clamp(min=1.0), torch.arange(4, device=dev).clamp(min=1)],
    lambda dev: [torch.full((2,), 0.0, device=dev), torch.full((2,), -0.0, device=dev)],
    lambda dev: [torch.ones(2, device=dev) * 0.0, torch.ones(2, device=dev) * -0.0],
    lambda dev: [torch.ones(2, device=dev) * -0.0, torch.ones(2, device=dev) * 0.0],
    lambda dev: [torch.full((2,), math.nan, device=dev), torch.full((2,), math.nan, device=dev)],
    lambda dev: [torch.arange(3, device=dev) + True, torch.arange(3, device=dev) + 1],
    lambda dev: [torch.ones(3, dtype=torch.bool, device=dev) * 2, torch.ones(3, dtype=torch.bool, device=dev) * 2.0],
    lambda dev: [torch.tensor([1.0, -2.0], device=dev).nan_to_num(posinf=1),
                 torch.tensor([1.0, -2.0], device=dev).nan_to_num(posinf=1.0)],
], ids=lambda f: "")
def test_baked_constants_never_share_an_entry(make):
    """NOTE [typed constants]: 2 == 2.0 == True and 0.0 == -0.0 in Python; each program after the
    first one must still have CPU's dtype and values."""
    got, want = make("tpu"), make("cpu")
    for g, w in zip(got, want):
        assert_same(g, w)
        if w.dtype.is_floating_point:
            # the sign of zero too
            assert torch.equal(torch.signbit(g.cpu()), torch.signbit(w))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_optional_scalars_are_inputs_not_recompiles():
    x = torch.randn(16)
    xt = x.to("tpu")
    deferfuse.sync()
    for lo, hi in ((0.1, 0.5), (0.2, 0.7), (-0.3, 0.9)):
        assert_same(xt.clamp(min=lo, max=hi), x.clamp(min=lo, max=hi))
        assert_same(xt.nan_to_num(nan=lo, posinf=hi), x.nan_to_num(nan=lo, posinf=hi))
        assert_same(xt.var(correction=hi), x.var(correction=hi), atol=1e-5, rtol=1e-5)
    m = deferfuse.metrics()
    assert m["compiles"] <= 6, m["miss_reasons"]     # 3 programs, compiled once each


def _dummy(t, dev):
    """A placeholder argument of schema type ``t`` (never run: keys only)."""
    if isinstance(t, torch.OptionalType):
        return None
    if isinstance(t, torch.TensorType):
        return dev
    if isinstance(t, torch.ListType):
        e = t.getElementType()
        if isinstance(e, (torch.TensorType, torch.OptionalType)):
            return [dev]
        if isinstance(e, torch.IntType) or isinstance(e, torch.SymIntType):
            return [1]
        if isinstance(e, torch.BoolType):
            return [True]
        return [1.5]
    if isinstance(t, (torch.IntType, torch.SymIntType)):
        return 0
    if isinstance(t, torch.BoolType):
        return False
    if isinstance(t, (torch.FloatType, torch.NumberType)):
        return 1.5
    if isinstance(t, torch.StringType):
        return "none"
    return None


def _is_number(t):
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch.ListType):
        t = t.getElementType()
    return isinstance(t, (torch.NumberType, torch.FloatType, torch.IntType, torch.SymIntType,
                          torch.BoolType, torch.ComplexType))


def test_every_number_slot_of_every_lowering_is_lifted_or_keyed_by_type():
    """Schema-driven: for each lowered overload and each argument that can hold a Python number,
    the op's key differs between 2, 2.0 and True, and between 0.0 and -0.0, in that slot (the key
    builder is the op path's own, opkey.op_key)."""
    from deferfuse.opkey import op_key
    from deferfuse.opinfo import op_info
    from deferfuse.runtime.lowering import LOWERINGS
    dev = as_tpu(torch.zeros(2, device="tpu"))    # op_key reads the op path's tensors
    checked = 0
    for op in LOWERINGS:
        info = op_info(op)
        args = op._schema.arguments
        base = [_dummy(a.type, dev) for a in args]
        for i, a in enumerate(args):
            if not _is_number(a.type):
                continue
            lst = isinstance(a.type, torch.ListType) or (
                isinstance(a.type, torch.OptionalType)
                and isinstance(a.type.getElementType(), torch.ListType))
            keys = []
            for v in (2, 2.0, True, 0.0, -0.0):
                vals = list(base)
                vals[i] = [v] if lst else v
                pos = [x for x, s in zip(vals, args) if not s.kwarg_only]
                kw = {s.name: x for x, s in zip(vals, args) if s.kwarg_only}
                keys.append(op_key(info, pos, kw)[0])
            assert len(set(keys)) == 5, (op, a.name, keys)
            checked += 1
    assert checked > 300


# --- errors -------------------------------------------------------------------------------------

@pytest.mark.modes("defer")
def test_an_index_error_never_zeroes_unrelated_parameters():
    """The issue's reproduction: an out-of-range embedding index that is never read, then a Linear
    step with SGD; after the IndexError the Linear's weight holds CPU's values, never zeros."""
    torch.manual_seed(0)
    emb = nn.Embedding(5, 3)
    lin = nn.Linear(4, 1, bias=False)
    ref = nn.Linear(4, 1, bias=False)
    ref.load_state_dict(lin.state_dict())
    emb, lin = emb.to("tpu"), lin.to("tpu")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (lin, ref))
    e = emb(torch.tensor([7], device="tpu"))        # never read
    x = torch.ones(2, 4)
    xt = x.to("tpu")
    raised = 0
    for _ in range(3):
        try:
            loss = lin(xt).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
        except IndexError as err:
            assert "embedding" in str(err)
            raised += 1
        ref_loss = ref(x).sum()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert raised == 1
    assert_same(lin.weight, ref.weight.detach())
    with pytest.raises(IndexError, match="index out of range"):   # the failed value itself
        e.cpu()


@pytest.mark.modes("defer")
def test_a_failing_lowering_fails_its_dependents_only(monkeypatch):
    from deferfuse.runtime.lowering import LOWERINGS, Lowering
    op = aten.sin.default
    low = LOWERINGS[op]

    def broken(x):
        raise ValueError("boom")
    monkeypatch.setitem(LOWERINGS, op, Lowering(broken))
    deferfuse.clear_caches()
    a = torch.ones(3, device="tpu") * 3
    s = a.sin() + 1                  # fails, and what reads it
    b = a + 1                        # does not depend on it
    with pytest.raises(deferfuse.RegionError, match="(?s)sin.*boom"):
        deferfuse.sync()
    assert_same(b, torch.full((3,), 4.0))
    with pytest.raises(deferfuse.RegionError, match="sin"):
        s.cpu()
    monkeypatch.setitem(LOWERINGS, op, low)
    deferfuse.clear_caches()
    w = torch.ones(3, device="tpu")
    w.add_(1)
    assert_same(w, torch.full((3,), 2.0))


@pytest.mark.modes("defer")
def test_a_donated_buffer_is_never_read_as_zeros(monkeypatch):
    """NOTE [value states]: a donated value has its own state; reading one is an internal error
    naming the program it was given to."""
    from deferfuse.scheduler.records import Donated, Value
    marked = []
    real = engine.runner.drop_values    # fails the donated inputs (NOTE [run tables in C])

    def spy(values, flags, err, large):
        marked.extend((id(v), err) for v, d in zip(values, flags) if d and v.array is not None)
        return real(values, flags, err, large)
    monkeypatch.setattr(engine.runner, "drop_values", spy)
    x = torch.randn(100).to("tpu")
    deferfuse.sync()
    old_id = id(storage_of(x).val)
    x.mul_(2)
    deferfuse.sync()
    assert deferfuse.metrics()["donated_bytes"] >= 400
    (err,) = [e for i, e in marked if i == old_id]
    assert isinstance(err, Donated) and "mul" in str(err)
    v = Value((3,), storage_of(x).val.dtype, 12)
    v.fail(err)
    with pytest.raises(RuntimeError, match="internal error.*donated.*mul"):
        engine.ready(v)


@pytest.mark.modes("defer")
def test_an_elided_value_is_never_read_as_zeros():
    """NOTE [value states]: only an empty value (``torch.empty``: no producer) reads as zeros. A
    value whose op was recorded, held by no storage when its trace ran, was not computed: reading
    it is an internal error, never zeros (the silent wrong answer NOTE [read-back outputs] in
    compiled.py fixed had this shape)."""
    a = torch.randn(4)
    x = a.to("tpu")
    v = storage_of(x * 3).val          # the product's tensor dies here: only v holds the value
    keep = x + 1
    deferfuse.sync()                   # runs the trace; the product is no output of it
    assert v.array is None and v.node is not None
    with pytest.raises(RuntimeError, match="internal error.*mul.*not computed"):
        engine.ready(v)
    assert_same(keep, a + 1)
    e = torch.empty(3, device="tpu")   # an empty value still reads (as uninitialised memory may)
    assert e.cpu().shape == (3,)


@pytest.mark.modes("defer")
def test_an_earlier_async_error_keeps_the_work_recorded_since():
    torch.manual_seed(0)
    lin = nn.Linear(4, 2)
    ref = nn.Linear(4, 2)
    ref.load_state_dict(lin.state_dict())
    lin = lin.to("tpu")
    table = torch.randn(5, 3).to("tpu")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (lin, ref))
    x = torch.randn(3, 4)
    bad = torch.nn.functional.embedding(torch.tensor([9], device="tpu"), table)   # never read
    loss = lin(x.to("tpu")).pow(2).sum()
    loss.backward()                   # the backward cut dispatches the embedding, unchecked
    opt.step()                        # recorded after it
    ref(x).pow(2).sum().backward()
    ref_opt.step()
    with pytest.raises(IndexError, match="embedding"):
        deferfuse.sync()
    assert_same(lin.weight, ref.weight.detach())
    assert_same(lin.bias, ref.bias.detach())
    with pytest.raises(IndexError):
        bad.sum().item()


class _FailOnce(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        _FailOnce.calls += 1
        if _FailOnce.calls == 2:
            raise ValueError("backward failed")
        return g * 2


def _train(dev, fail_step, opt_fails=False):
    """A small training loop on ``dev`` whose step ``fail_step`` raises in backward (or in the
    optimizer step); the loop catches it, zeroes the gradients and goes on."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _FailOnce.calls = 0
    data = [(torch.randn(4, 6), torch.randn(4, 2)) for _ in range(5)]
    losses = []
    for step, (x, y) in enumerate(data):
        x, y = x.to(dev), y.to(dev)
        try:
            out = _FailOnce.apply(model(x))
            loss = ((out - y) ** 2).mean()
            loss.backward()
            if opt_fails and step == fail_step:
                with torch.no_grad():
                    for i, p in enumerate(model.parameters()):
                        p.add_(p.grad, alpha=-0.1)
                        if i == 1:
                            raise RuntimeError("optimizer failed")
            opt.step()
            losses.append(loss.item())
        except (ValueError, RuntimeError) as e:
            assert "failed" in str(e)
            losses.append(None)
        opt.zero_grad()
    return losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("opt_fails", [False, True], ids=["backward", "optimizer"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_training_goes_on_after_an_error_in_backward_or_the_optimizer(opt_fails):
    got, gp = _train("tpu", 1, opt_fails)
    want, wp = _train("cpu", 1, opt_fails)
    assert [g is None for g in got] == [w is None for w in want]
    assert [g for g in got if g is not None] == pytest.approx([w for w in want if w is not None],
                                                              rel=1e-5, abs=1e-6)
    for a, b in zip(gp, wp):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.modes("defer")
@pytest.mark.parametrize("when", ["compile", "run"])
def test_a_keyboard_interrupt_during_a_flush_loses_nothing(monkeypatch, when):
    """Ctrl-C while a flush compiles (or between programs): what did not run is recorded again and
    runs at the next sync; training goes on and matches CPU."""
    from deferfuse.runtime import execute
    target = "compile_region" if when == "compile" else "run_region"
    real = getattr(execute, target)
    armed = []

    def interrupted(*a, **k):
        if armed:
            armed.clear()
            raise KeyboardInterrupt
        return real(*a, **k)
    torch.manual_seed(2)
    ref = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 1))
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 1))
    model.load_state_dict(ref.state_dict())
    model = model.to("tpu")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    deferfuse.clear_caches()
    monkeypatch.setattr(execute, target, interrupted)
    xs = [torch.randn(3, 5) for _ in range(4)]
    for i, x in enumerate(xs):
        for m, opt, xx in ((model, opts[0], x.to("tpu")), (ref, opts[1], x)):
            m(xx).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if i == 1:
            armed.append(1)
            with pytest.raises(KeyboardInterrupt):
                deferfuse.sync()
            assert not armed
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p, q.detach(), atol=1e-6, rtol=1e-5)


# --- threads --------------------------------------------------------------------------------

def test_mode_is_per_thread():
    seen = {}

    def other():
        seen["start"] = deferfuse.current_mode()
        with deferfuse.mode("debug"):
            seen["inner"] = deferfuse.current_mode()
    with deferfuse.mode("strict"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert deferfuse.current_mode() == "strict"
    assert seen == {"start": engine.default_mode, "inner": "debug"}


def test_override_mode_changes_the_mode():
    with deferfuse.override(mode="strict"):
        assert deferfuse.current_mode() == "strict"
        x = torch.ones(2, device="tpu") + 1
        assert deferfuse.metrics()["ops_eager"] >= 1
    with deferfuse.override(mode="defer"):
        assert deferfuse.current_mode() == "defer"
    assert_same(x, torch.full((2,), 2.0))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_eight_threads_in_mixed_modes_match_cpu():
    errors = []
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    wt = w.to("tpu")
    deferfuse.sync()

    def work(i):
        try:
            mode = ("defer", "strict", "debug")[i % 3]
            with deferfuse.mode(mode):
                for k in range(200):
                    c = 0.5 + 0.01 * k + i
                    x = torch.full((4, 8), c)
                    xt = torch.full((4, 8), c, device="tpu")
                    y = torch.tanh(xt @ wt) * (k % 3) + i
                    want = torch.tanh(x @ w) * (k % 3) + i
                    if k % 7 == 0:
                        torch.testing.assert_close(y.cpu(), want, rtol=1e-5, atol=1e-5)
                got = y.sum().item()
                assert got == pytest.approx(float(want.sum()), rel=1e-5, abs=1e-4)
        except BaseException as e:      # noqa: BLE001 (reported to the main thread)
            errors.append(repr(e))
    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in ts)
    assert errors == []


def test_a_tensor_made_in_one_thread_is_read_in_another():
    box = {}

    def make():
        with deferfuse.mode("defer"):
            box["t"] = torch.arange(6.0, device="tpu").reshape(2, 3) * 2     # pending here
            box["ready"] = True
    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert_same(box["t"] + 1, torch.arange(6.0).reshape(2, 3) * 2 + 1)


def test_a_thread_that_raises_does_not_block_the_others():
    results, errors = [], []

    def bad():
        with deferfuse.mode("defer"):
            x = torch.ones(3, device="tpu")
            torch.nn.functional.embedding(torch.tensor([5], device="tpu"), x.reshape(3, 1)).sum().item()

    def good(i):
        with deferfuse.mode("defer"):
            for _ in range(20):
                v = (torch.ones(3, device="tpu") * i).sum().item()
            results.append(v)

    def run(fn, *a):
        try:
            fn(*a)
        except IndexError as e:
            errors.append(e)
    ts = [threading.Thread(target=run, args=(bad,))] + \
        [threading.Thread(target=run, args=(good, i)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts)
    assert sorted(results) == [0.0, 3.0, 6.0] and len(errors) == 1


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_a_server_thread_pool_answers_with_one_model():
    from concurrent.futures import ThreadPoolExecutor
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3)).eval()
    tmodel = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3)).eval()
    tmodel.load_state_dict(model.state_dict())
    tmodel = tmodel.to("tpu")
    reqs = [torch.randn(2, 6) for _ in range(24)]

    def answer(x):
        with deferfuse.mode("defer"), torch.no_grad():
            return tmodel(x.to("tpu")).softmax(-1).cpu()
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(answer, reqs))
    with torch.no_grad():
        for g, x in zip(got, reqs):
            torch.testing.assert_close(g, model(x).softmax(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_training_thread_beside_an_evaluation_thread():
    torch.manual_seed(3)
    ref = nn.Linear(5, 1)
    model = nn.Linear(5, 1)
    model.load_state_dict(ref.state_dict())
    model = model.to("tpu")
    data = [(torch.randn(4, 5), torch.randn(4, 1)) for _ in range(20)]
    evals, errors = [], []

    def train():
        try:
            with deferfuse.mode("defer"):
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
                for x, y in data:
                    ((model(x.to("tpu")) - y.to("tpu")) ** 2).mean().backward()
                    opt.step()
                    opt.zero_grad()
                deferfuse.sync()
        except BaseException as e:  # noqa: BLE001
            errors.append(repr(e))

    def evaluate():
        try:
            with deferfuse.mode("defer"), torch.no_grad():
                for _ in range(10):
                    evals.append(model(torch.ones(1, 5, device="tpu")).item())
        except BaseException as e:  # noqa: BLE001
            errors.append(repr(e))
    ts = [threading.Thread(target=train), threading.Thread(target=evaluate)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    assert errors == [] and len(evals) == 10
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for x, y in data:
        ((ref(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert_same(model.weight, ref.weight.detach(), atol=1e-6, rtol=1e-5)
    assert all(math.isfinite(v) for v in evals)


# --- devices and views ------------------------------------------------------------------------

@pytest.mark.modes("strict")
def test_tpu_n_is_jax_device_n():
    """tpu:N places on JAX device N in every mode; .to moves between devices; mixing raises;
    set_device changes the default (two forced host devices, in a fresh process). Arrays are read
    through ``Value.exact``: ``zeros(2) + 1`` after ``c + 1`` of size 3 runs in a bucket, and its
    value is lazily cut (NOTE [lazy cuts] in runtime/buckets.py)."""
    code = textwrap.dedent("""
        import torch, deferfuse
        from deferfuse.tensor import storage_of
        assert torch.tpu.device_count() == 2
        for mode in ("strict", "defer", "debug"):
            with deferfuse.mode(mode):
                a = torch.ones(3, device="tpu:1")
                b = a * 2 + torch.arange(3, device="tpu:1")
                assert b.device == torch.device("tpu:1")
                deferfuse.sync()
                assert {d.id for d in storage_of(b).val.exact().devices()} == {1}, mode
                c = b.to("tpu:0")
                assert c.device == torch.device("tpu:0")
                e = c + 1
                deferfuse.sync()
                assert {d.id for d in storage_of(e).val.exact().devices()} == {0}, mode
                assert torch.equal(e.cpu(), torch.tensor([3., 4., 5.]))
                try:
                    c + b
                except RuntimeError as e:
                    assert "same device" in str(e) and "tpu:0" in str(e) and "tpu:1" in str(e)
                else:
                    raise AssertionError("mixing tpu:0 and tpu:1 did not raise")
                torch.tpu.set_device(1)
                d = torch.zeros(2, device="tpu") + 1
                assert d.device == torch.device("tpu:1"), d.device
                deferfuse.sync()
                assert {x.id for x in storage_of(d).val.exact().devices()} == {1}
                torch.tpu.set_device(0)
                assert (torch.ones(1, device="tpu") + 0).device == torch.device("tpu:0")
                # a device= names where the result goes (it stayed on tpu:0); moves keep strides
                a = torch.ones(2, 3, device="tpu:0").t()
                for f in (lambda: a.new_ones(2, device="tpu:1"), lambda: a.to("tpu:1"),
                          lambda: torch.zeros_like(a, device="tpu:1"),
                          lambda: torch.rand_like(a, device="tpu:1")):
                    r = f()
                    assert r.device == torch.device("tpu:1") and r.dtype == a.dtype, mode
                    deferfuse.sync()
                    assert {x.id for x in storage_of(r).val.exact().devices()} == {1}, mode
                assert a.to("tpu:1").stride() == a.stride()
                torch.accelerator.set_device_index(1)
                assert torch.tpu.current_device() == torch.accelerator.current_device_index() == 1
                torch.accelerator.set_device_index(0)
                try:
                    torch.ones(1, device="tpu:2")
                except RuntimeError as e:
                    assert "tpu:2 does not exist: this machine has 2 tpu device(s), tpu:0 .. tpu:1" in str(e)
                else:
                    raise AssertionError("tpu:2 did not raise")
        print("ok")
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_as_strided_reads_memory_order_of_a_channels_last_base():
    x = torch.arange(24.).reshape(1, 2, 3, 4).contiguous(memory_format=torch.channels_last)
    t = x.to("tpu")
    assert t.stride() == x.stride()
    assert_same(t.as_strided(t.shape, t.stride()), x.as_strided(x.shape, x.stride()))
    assert_same(t.as_strided((6,), (2,), 1), x.as_strided((6,), (2,), 1))
    y = torch.randn(2, 3, 4, 5).permute(0, 2, 3, 1)
    yt = y.to("tpu").contiguous(memory_format=torch.contiguous_format) + 0
    assert_same(yt.as_strided((10,), (3,), 2), (y.contiguous() + 0).as_strided((10,), (3,), 2))


# --- one owned state ----------------------------------------------------------------------------

@pytest.mark.modes("defer")
def test_a_region_hit_checks_the_structure_not_the_hash():
    x = torch.arange(4.0).to("tpu")
    deferfuse.sync()
    deferfuse.clear_caches()
    assert_same((x + 1).sum(), torch.arange(4.0).add(1).sum())
    (key,) = list(engine.runner.regions.young) + list(engine.runner.regions.old)
    # Another structure of the same length, inputs and outputs, made to carry the same rolling
    # hash: the cached region must not run for it.
    y = (x * 3).exp()
    engine.state.trace.h = key[0]
    assert_same(y, (torch.arange(4.0) * 3).exp())
    assert deferfuse.metrics()["hash_collisions"] == 1


def test_caches_are_bounded_and_counted():
    from deferfuse.scheduler.cache import Cache
    c = Cache("test", 8)
    for i in range(100):
        c[i] = i
        assert len(c) <= 8
    assert c.get(99) == 99 and c.get(0) is None
    assert c.stats()["evictions"] >= 90
    m = deferfuse.metrics()["caches"]
    for name in ("ops", "views", "regions", "trace structures", "signatures"):
        assert {"size", "capacity", "evictions"} <= set(m[name]), name
        assert m[name]["size"] <= m[name]["capacity"]


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_programs_are_dropped_near_the_mapping_cap(tpu_mode):
    """NOTE [JIT mappings]: every compiled program holds memory mappings, and a process past
    vm.max_map_count crashed inside XLA. Near the cap the engine drops every compiled program
    (here the guard says so at each program made): training goes on, with CPU's values."""
    from deferfuse.runtime import jitmaps
    assert jitmaps.mappings() > 0 and jitmaps.map_cap() > 0
    guard = engine.runner.maps
    saved = guard.every, guard.limit, guard.last
    guard.every, guard.limit, guard.last = 1, 0, 0

    def train(device):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        x, y = torch.randn(5, 6), torch.randn(5, 1)
        losses = []
        for n in (5, 4, 5, 3):               # new shapes keep compiling
            loss = ((m(x[:n].to(device)) - y[:n].to(device)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses, [p.detach() for p in m.parameters()]

    try:
        deferfuse.reset_metrics()
        drops = guard.drops
        got = train("tpu")
        assert guard.drops > drops
        assert deferfuse.metrics()["region_evictions"] > 0
        assert deferfuse.metrics()["caches"]["memory mappings"]["drops"] == guard.drops
    finally:
        guard.every, guard.limit, guard.last = saved
    assert_same(got, train("cpu"))


@pytest.mark.modes("defer", "strict")
def test_an_error_ends_in_the_users_frames():
    """NOTE [user frames]: an error raised at a read (a deferred index error) or at the call (a
    bad argument) shows the user's line and at most one frame of deferfuse."""
    import traceback
    w = torch.randn(10, 4).to("tpu")
    for bad in (lambda: torch.nn.functional.embedding(torch.tensor([3, 12], device="tpu"), w).sum().item(),
                lambda: torch.ones(3, 4, device="tpu") @ torch.ones(5, 6, device="tpu")):
        with pytest.raises((IndexError, RuntimeError)) as info:
            bad()
        frames = traceback.extract_tb(info.value.__traceback__)
        assert frames[0].filename == __file__
        assert len([f for f in frames if os.sep + "deferfuse" + os.sep in f.filename]) <= 1, frames
