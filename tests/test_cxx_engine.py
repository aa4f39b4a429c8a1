"""The engine side on the plain PrivateUse1 tpu tensor (docs/cxx-plan.md,
Session 3 (cxx4)): moving windows, step detection, cuts and errors behave as on the wrapper
subclass, and every result equals CPU eager."""
import pytest
import torch

import deferfuse
from util import assert_same


def _compiles():
    return deferfuse.metrics()["compiles"]


# NOTE [plain moving windows]: a C++ view names its offset; the router writes it as a dynamic step
MOVING = [
    ("slice", lambda x, i: x[i:i + 3] * 2),
    ("select", lambda x, i: x[i] + 1),
    ("strided_slice", lambda x, i: x[i:i + 7:3].sum(0)),
    ("narrow_of_t", lambda x, i: x.t()[:, i:i + 2] - 1),
    ("slice_of_slice", lambda x, i: x[i:i + 6][1:3] * 3),
    ("as_strided", lambda x, i: x.as_strided((2, 2), (3, 1), i) + 0),
    ("select_of_view", lambda x, i: x.view(-1)[i] * 2),
]


@pytest.mark.parametrize("case", [c[1] for c in MOVING], ids=[c[0] for c in MOVING])
def test_a_window_at_each_offset_is_one_program_and_matches_cpu(case):
    d = torch.randn(20, 3)
    t = d.to("tpu")
    after = []
    for i in range(0, 10, 2):
        got = case(t, i)
        assert_same(got, case(d, i))
        after.append(_compiles())
    assert after[1] == after[-1], after     # no offset after the first compiles anything


def test_writes_through_a_moving_window_match_cpu():
    want = torch.zeros(10, 2)
    t = want.to("tpu")
    after = []
    for i in range(6):
        for x in (t, want):
            x[i:i + 3] += 1
            x[i + 1].mul_(2)
        after.append(_compiles())
    assert_same(t, want)
    assert after[1] == after[-1], after


def test_a_whole_slice_and_a_one_row_select_stay_static_and_match_cpu():
    """The windows the view path does not move (all of a dim, a dim of one) equal CPU too."""
    d = torch.randn(1, 4)
    t = d.to("tpu")
    assert_same(t[0:1] * 2, d[0:1] * 2)
    assert_same(t[0] + 1, d[0] + 1)
    assert_same(t[:, 0:4] - 1, d[:, 0:4] - 1)


def test_a_tensor_that_requires_grad_comes_back_from_a_checkpoint(tmp_path):
    """torch.save of a plain tpu leaf that requires grad pickles its values detached, so the load
    can set requires_grad on the rebuilt tensor (it raised "you can only change requires_grad
    flags of leaf variables")."""
    c = torch.randn(3).requires_grad_()
    t = c.detach().to("tpu").requires_grad_()
    path = tmp_path / "t.pt"
    torch.save({"t": t, "v": t.detach()[1:]}, path)
    back = torch.load(path)
    assert back["t"].device.type == "tpu" and back["t"].is_leaf and back["t"].requires_grad
    assert_same(back["t"].detach(), c.detach())
    assert_same(back["v"], c.detach()[1:])


REPRS = [
    ("base", lambda x: x),
    ("view", lambda x: x[1]),
    ("bf16", lambda x: x.to(torch.bfloat16)),
    ("scalar", lambda x: x.sum()),
    ("empty", lambda x: x[:0]),
    ("bool", lambda x: x > 0),
    ("int", lambda x: (x * 10).long()),
    ("grad_fn", lambda x: x.clone().requires_grad_() * 2),
    ("parameter", lambda x: torch.nn.Parameter(x.clone())),
    ("summarised", lambda x: x.repeat(100, 100)),
]


def _text(s):
    return "".join(s.split()).replace(",device='tpu:0'", "")      # CPU's text, wrapped alike


@pytest.mark.parametrize("case", [c[1] for c in REPRS], ids=[c[0] for c in REPRS])
def test_repr_and_tolist_read_the_values_once_as_cpu_prints_them(case):
    """NOTE [plain host reads]: repr is PyTorch's text for the CPU tensor with the device added,
    tolist CPU's list, each synced with its own reason (as the wrapper subclass does)."""
    c = torch.randn(3, 4)
    got = case(c.to("tpu") * 1)
    want = case(c * 1)
    deferfuse.reset_metrics()
    text = repr(got)
    assert "device='tpu:0'" in text
    assert _text(text) == _text(repr(want))
    if deferfuse.current_mode() == "defer":
        assert deferfuse.metrics()["syncs"].get("print", 0) == 1, deferfuse.metrics()["syncs"]
    lst = got.detach().mul(1).tolist()
    assert lst == want.detach().tolist()
    if deferfuse.current_mode() == "defer":
        assert deferfuse.metrics()["syncs"].get("tolist", 0) == 1, deferfuse.metrics()["syncs"]


def test_an_error_through_the_router_ends_in_the_users_frames():
    """NOTE [user frames]: an op's error raised through the router (plain.Plain.route) shows the
    user's line and at most one frame of deferfuse, as on the wrapper subclass; the type and
    message are CPU's."""
    import os
    import traceback
    a, b = torch.ones(3, 4), torch.ones(5, 6)
    with pytest.raises(RuntimeError) as cpu:
        a @ b
    with pytest.raises(RuntimeError) as info:
        a.to("tpu") @ b.to("tpu")
    assert str(info.value) == str(cpu.value)
    frames = traceback.extract_tb(info.value.__traceback__)
    assert frames[0].filename == __file__
    assert len([f for f in frames if os.sep + "deferfuse" + os.sep in f.filename]) <= 1, frames


@pytest.mark.modes("strict")     # the child process runs both modes itself
def test_to_and_copy_between_tpu_devices_match_cpu():
    """``x.to("tpu:0")`` of a plain tensor on tpu:1 is an empty tensor on tpu:0 and a copy_
    between devices, which moves the value over (it raised "two devices"); in a fresh process with
    two host devices."""
    import os
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent("""
        import torch, deferfuse
        from deferfuse.tensor import storage_of
        c = torch.arange(6.).reshape(2, 3)
        for mode in ("strict", "defer"):
            with deferfuse.mode(mode):
                b = c.to("tpu:1")
                m = b.to("tpu:0")
                assert m.device == torch.device("tpu:0") and storage_of(m).device == 0, mode
                assert torch.equal(m.cpu(), c) and m.stride() == c.stride(), mode
                z = torch.zeros(3, 2, device="tpu:0")
                z.copy_(b.t())
                assert torch.equal(z.cpu(), c.t()) and storage_of(z).device == 0, mode
                assert torch.equal(b.to("tpu:0", torch.float64).cpu(), c.double()), mode
        print("ok")
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.modes("defer")
def test_an_lstm_on_plain_tensors_is_one_op_a_layer_and_matches_cpu():
    """deferfuse/rnn.py's kernels take plain tpu tensors too: a float32 nn.LSTM is one recorded
    op a layer (a scan), not three a time step (step detection read those as a loop), and its
    outputs and gradients equal CPU's."""
    torch.manual_seed(0)
    m = torch.nn.LSTM(8, 16)
    x = torch.randn(20, 3, 8)
    mt = torch.nn.LSTM(8, 16).to("tpu")
    mt.load_state_dict(m.state_dict())
    out, (h, c) = m(x)
    deferfuse.sync()
    deferfuse.reset_metrics()
    out_t, (h_t, c_t) = mt(x.to("tpu"))
    assert deferfuse.metrics()["ops_recorded"] < 20, deferfuse.metrics()["ops_recorded"]
    for g, w in ((out_t, out), (h_t, h), (c_t, c)):
        assert_same(g.detach(), w.detach(), atol=1e-5, rtol=1e-5)
    (out.sum() + c.sum()).backward()
    (out_t.sum() + c_t.sum()).backward()
    for p, q in zip(m.parameters(), mt.parameters()):
        assert_same(q.grad, p.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.modes("defer")
def test_clear_caches_drops_the_kernels_entries_so_growing_lengths_still_bucket():
    """After ``deferfuse.clear_caches()`` the C++ kernel's Entries go with the op cache (a hit on
    a stale Entry recorded ops no new region shared: a compile per length, no buckets)."""
    for fn in (lambda x: (x * 3 + 1).tanh(), lambda x: (x * 3).sum(0)):
        deferfuse.clear_caches()
        deferfuse.reset_metrics()
        for t in range(5, 14):
            x = torch.randn(t, 4)
            got = fn(x.to("tpu"))
            assert_same(got, fn(x), atol=1e-5, rtol=1e-5)
        m = deferfuse.metrics()
        assert m["bucketed_runs"] == 8 and m["region_compiles"] + m["disk_cache_hits"] == 2, \
            m["miss_reasons"]


CASTS = [
    ("long", lambda x: x.long()),
    ("double", lambda x: x.to(torch.float64)),
    ("bf16_of_t", lambda x: x.t().to(torch.bfloat16)),
    ("int_of_slice", lambda x: x[1:].int()),
    ("to_cpu", lambda x: x.to("cpu")),
    ("contiguous_format", lambda x: x.t().to(memory_format=torch.contiguous_format)),
]


@pytest.mark.parametrize("case", [c[1] for c in CASTS], ids=[c[0] for c in CASTS])
def test_a_cast_is_one_op_and_matches_cpu(case):
    """NOTE [plain _to_copy]: ``_to_copy`` of a plain tpu tensor is the op path's one cast (its
    composite, an empty tensor and an in-place copy_, refused buckets); values, dtypes, shapes,
    strides and devices as on CPU, and a CPU tensor's move to tpu still works."""
    c = torch.randn(3, 4)
    got, want = case(c.to("tpu")), case(c)
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    assert got.device.type == ("cpu" if want.device.type == "cpu" and case is CASTS[4][1] else "tpu")
    assert torch.equal(got.cpu(), want)
    moved = c.t().to("tpu", torch.float64)
    assert moved.device.type == "tpu" and moved.stride() == c.t().stride()
    assert torch.equal(moved.cpu(), c.t().double())


MULTI = [
    ("max_dim", lambda x: torch.max(x, 0)),
    ("min_keepdim_of_view", lambda x: torch.min(x[1:], 1, keepdim=True)),
    ("topk", lambda x: x.topk(2, 1)),
    ("sort", lambda x: x.sort(0)),
    ("max_of_t", lambda x: x.t().max(1)),
    ("cross_entropy", lambda x: torch.nn.functional.cross_entropy(
        x, torch.tensor([0, 1, 3, 2, -100, 1], device=x.device))),
]


@pytest.mark.parametrize("case", [c[1] for c in MULTI], ids=[c[0] for c in MULTI])
def test_structured_ops_with_several_outputs_match_cpu(case):
    """NOTE [fresh outs]: a structured op with several outputs reaches the backend as its out op
    with PyTorch's fresh empties; the functional op is recorded and each empty takes its result's
    storage (values, dtypes, shapes, strides as on CPU)."""
    c = torch.randn(6, 4)
    got, want = case(c.to("tpu")), case(c)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride()
        assert_same(g, w)


@pytest.mark.modes("defer")
def test_casts_and_several_outputs_along_a_growing_dim_run_in_buckets():
    """Lengths 5..13 of a region with a cast and a two-output op: the first compiles exactly,
    the other eight run in one bucket (an in-place out write refused them)."""
    def fn(x):
        return (x * 2).topk(2, 1)[0].sum() + torch.max(x, 0)[0] + (x * 10).long().sum(0)
    deferfuse.clear_caches()
    deferfuse.reset_metrics()
    for t in range(5, 14):
        x = torch.randn(t, 4)
        assert_same(fn(x.to("tpu")), fn(x), atol=1e-5, rtol=1e-5)
    m = deferfuse.metrics()
    assert m["bucketed_runs"] == 8 and not m["bucket_refusals"], m["bucket_refusals"]


LIKES = [
    ("ones_like", lambda x, **k: torch.ones_like(x, **k)),
    ("zeros_like_of_t", lambda x, **k: torch.zeros_like(x.t(), **k)),
    ("full_like_f64", lambda x, **k: torch.full_like(x, 2.5, dtype=torch.float64, **k)),
    ("empty_like_filled", lambda x, **k: torch.empty_like(x, **k).fill_(1)),
    ("new_full", lambda x, **k: x.new_full((2,), 3, **k)),
    ("new_zeros", lambda x, **k: x.new_zeros(2, 3, **k)),
    ("new_ones", lambda x, **k: x.new_ones(1, **k)),
    ("new_empty_filled", lambda x, **k: x.new_empty(2, **k).fill_(0)),
]


@pytest.mark.parametrize("case", [c[1] for c in LIKES], ids=[c[0] for c in LIKES])
def test_like_and_new_factories_are_one_op_and_match_cpu(case):
    """NOTE [plain _to_copy]: the *_like and new_* factories of a plain tpu tensor reach the op
    path whole (one op, as on the wrapper: a ones_like before a loop is a setup op again), and a
    CPU input with device="tpu" or a tpu input with device="cpu" lands where CPU's rules say."""
    c = torch.randn(3, 4)
    t = c.to("tpu")
    deferfuse.sync()
    deferfuse.reset_metrics()
    got = case(t)
    if deferfuse.current_mode() == "defer":
        assert deferfuse.metrics()["ops_recorded"] <= 2     # the factory (and the test's fill_)
    want = case(c)
    for g, w in ((got, want), (case(c, device="tpu"), want), (case(t, device="cpu"), want)):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride()
        assert torch.equal(g.cpu(), w)
    assert case(c, device="tpu").device.type == "tpu" and case(t, device="cpu").device.type == "cpu"
