"""The plain PrivateUse1 tpu tensor (docs/cxx-plan.md): its C++ view
kernels give PyTorch's sizes, strides, offsets, contiguity, ``_base`` and autograd, and ops routed
through the existing op path (NOTE [plain router] in deferfuse/plain.py) equal CPU eager."""
import warnings

import pytest
import torch

import deferfuse


# (name, view of a 4x6 tensor); every one a C++ kernel
VIEWS = [
    ("t", lambda x: x.t()),
    ("transpose", lambda x: x.transpose(0, 1)),
    ("permute", lambda x: x.unsqueeze(0).permute(2, 0, 1)),
    ("view", lambda x: x.view(2, 12)),
    ("view_infer", lambda x: x.view(-1, 3)),
    ("reshape_alias", lambda x: x.t().reshape(24) if False else x.reshape(3, 8)),
    ("slice", lambda x: x[1:3]),
    ("slice_step", lambda x: x[:, 1::2]),
    ("slice_neg", lambda x: x[-3:-1, -5:]),
    ("slice_empty", lambda x: x[3:1]),
    ("select", lambda x: x[2]),
    ("select_neg", lambda x: x[:, -1]),
    ("expand", lambda x: x[0:1].expand(5, 6)),
    ("expand_new_dim", lambda x: x.expand(2, 4, 6)),
    ("unsqueeze", lambda x: x.unsqueeze(1)),
    ("unsqueeze_end", lambda x: x.unsqueeze(-1)),
    ("squeeze", lambda x: x[0:1].squeeze()),
    ("squeeze_dim", lambda x: x[:, 2:3].squeeze(1)),
    ("squeeze_dims", lambda x: x[0:1, 0:1].squeeze((0, 1))),
    ("as_strided", lambda x: x.as_strided((3, 2), (1, 6), 2)),
    ("as_strided_of_view", lambda x: x[1:].as_strided((2, 2), (2, 1))),
    ("detach", lambda x: x.detach()),
    ("alias", lambda x: torch.ops.aten.alias(x)),
    ("chain", lambda x: x.t()[1:5].unsqueeze(0).transpose(0, 2)[2]),
]
# views the Python view path makes (no C++ kernel), and C++ views of them
PY_VIEWS = [
    ("diagonal", lambda x: x.diagonal()),
    ("unbind", lambda x: x.unbind(1)[2]),
    ("split", lambda x: x.split(4, 1)[1]),
    ("diagonal_then_slice", lambda x: x.diagonal(1)[1:]),
    ("unbind_then_unsqueeze_expand", lambda x: x.unbind(0)[1].unsqueeze(0).expand(3, 6)),
    ("split_then_t_then_as_strided", lambda x: x.split(3, 1)[1].t().as_strided((2, 2), (1, 6), 1)),
]


def _pair():
    c = torch.randn(4, 6)
    return c, c.to("tpu")


@pytest.mark.parametrize("name,fn", VIEWS, ids=[v[0] for v in VIEWS])
def test_view_metadata_and_values_as_on_cpu(name, fn):
    c, x = _pair()
    assert type(x) is torch.Tensor and x.device.type == "tpu"
    vc, vx = fn(c), fn(x)
    assert vx.shape == vc.shape and vx.stride() == vc.stride()
    assert vx.storage_offset() == vc.storage_offset()
    assert vx.is_contiguous() == vc.is_contiguous()
    assert vx.dtype == vc.dtype
    assert (vx._base is x) == (vc._base is c)
    assert vx.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    torch.testing.assert_close(vx.cpu(), vc, rtol=0, atol=0)


@pytest.mark.parametrize("name,fn", PY_VIEWS, ids=[v[0] for v in PY_VIEWS])
def test_python_views_and_their_cxx_views_as_on_cpu(name, fn):
    c, x = _pair()
    vc, vx = fn(c), fn(x)
    assert vx.shape == vc.shape and vx.stride() == vc.stride()
    assert vx.storage_offset() == vc.storage_offset()
    torch.testing.assert_close(vx.cpu(), vc, rtol=0, atol=0)
    if "expand" not in name:    # a write through an expanded view raises, on CPU too
        vc.mul_(3)
        vx.mul_(3)
        torch.testing.assert_close(x.cpu(), c, rtol=0, atol=0)


def test_write_through_a_conj_view_as_on_cpu():
    # the view's conj bit stays off (a chain step): with it on, PyTorch's Conjugate fallback
    # copied through the same fallback without end and the process crashed
    c = torch.randn(3, dtype=torch.complex64)
    x = c.to("tpu")
    vc, vx = c.conj(), x.conj()
    torch.testing.assert_close(vx.cpu(), vc.resolve_conj())
    vc.mul_(2)
    vx.mul_(2)
    torch.testing.assert_close(x.cpu(), c)


def test_out_op_decomposed_into_a_fresh_tensor_equals_cpu():
    # eye(out=) decomposes into ops whose result is a plain tensor made inside the op path; it was
    # copied into out as if it were a CPU tensor, reading the storage record's bytes
    c, x = torch.empty(3, 4), torch.empty(3, 4, device="tpu")
    with torch.no_grad():
        torch.eye(3, 4, out=c)
        torch.eye(3, 4, out=x)
    torch.testing.assert_close(x.cpu(), c, rtol=0, atol=0)


@pytest.mark.parametrize("name,fn", VIEWS, ids=[v[0] for v in VIEWS])
def test_view_autograd_as_on_cpu(name, fn):
    c = torch.randn(4, 6, requires_grad=True)
    x = c.detach().to("tpu").requires_grad_()
    vc, vx = fn(c), fn(x)
    assert vx.requires_grad == vc.requires_grad
    assert (vx.grad_fn is None) == (vc.grad_fn is None)
    if not vc.requires_grad:
        return
    k = torch.randn(vc.shape)
    (vc * k).sum().backward()
    (vx * k.to("tpu")).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), c.grad)


def test_view_errors_are_cpus():
    c, x = _pair()
    for fn in (lambda t: t[4], lambda t: t.select(1, -7), lambda t: t.t().view(24),
               lambda t: t.permute(0, 0), lambda t: t.as_strided((5, 6), (6, 1)),
               lambda t: t.expand(3, 6), lambda t: t.t().t().t().squeeze(2)):
        with pytest.raises(Exception) as want:
            fn(c)
        with pytest.raises(type(want.value)) as got:
            fn(x)
        assert str(got.value).split("\n")[0] == str(want.value).split("\n")[0]


def test_write_through_views_is_seen_by_base_and_views():
    c, x = _pair()
    for t in (c, x):
        v = t.t()[1:3]
        v.mul_(2)
        t[0].fill_(7)
    torch.testing.assert_close(x.cpu(), c)
    torch.testing.assert_close(x.t()[1:3].cpu(), c.t()[1:3])


def test_arithmetic_matmul_and_backward_equal_cpu():
    torch.manual_seed(0)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    x, y = a.to("tpu"), b.to("tpu")
    for f in (lambda p, q: p + q, lambda p, q: q * 1.0001, lambda p, q: p @ q,
              lambda p, q: (p - q).relu().sum(0), lambda p, q: torch.tanh(p) / (q.abs() + 1)):
        got, want = f(x, y), f(a, b)
        assert type(got) is torch.Tensor and got.device.type == "tpu"
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.cpu(), want)
    w = a.clone().requires_grad_()
    wx = a.to("tpu").requires_grad_()
    (w @ b).sum().backward()
    (wx @ y).sum().backward()
    torch.testing.assert_close(wx.grad.cpu(), w.grad)


def test_mlp_training_steps_equal_cpu():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    net.load_state_dict(ref.state_dict())
    net.to("tpu")
    assert all(type(p) is torch.nn.Parameter and p.device.type == "tpu" for p in net.parameters())
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        xb, yb = torch.randn(5, 8), torch.randn(5, 2)
        losses = []
        for m, o, dev in ((ref, opt_r, "cpu"), (net, opt, "tpu")):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(xb.to(dev)), yb.to(dev))
            loss.backward()
            o.step()
            losses.append(loss)
        assert losses[1].shape == losses[0].shape and losses[1].device.type == "tpu"
        torch.testing.assert_close(losses[1].detach().cpu(), losses[0].detach())
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach())


@pytest.mark.modes("defer")
def test_ops_are_recorded_in_defer_mode():
    c = torch.randn(3, 3)
    x = c.to("tpu")
    deferfuse.sync()
    before = deferfuse.metrics().get("ops_recorded", 0)
    y = (x + 1) * x
    assert deferfuse.plain.PLAIN.ext.storage(y).val.node is not None     # pending, not run
    torch.testing.assert_close(y.cpu(), (c + 1) * c)
    assert deferfuse.metrics().get("ops_recorded", 0) > before


@pytest.mark.modes("defer")
def test_compiled_mode_takes_plain_tensors():
    # Ported (NOTE [compiled plain tensors] in compiled.py; tests/test_cxx_compiled.py): it
    # had read inner tensors' Python state and returned wrong values on plain tensors.
    c = torch.randn(3, 4)
    f = torch.compile(lambda a: (a * 2).sin().sum(), backend="tpu")
    got = f(c.to("tpu"))
    want = (c * 2).sin().sum()
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


# -- the C++ recording kernel (NOTE [C++ recording kernel] in _tpu_tensor.cpp): cache hits are
# recorded in C++ from metadata learnt on an earlier call; each case runs its ops three times
# (plan, learn, hit) and compares every result, dtype, shape and stride with CPU's.

def _kernel_hits():
    return deferfuse.plain.PLAIN.ext.kernel_stats()["hits"]


def _same(got, want):
    assert type(got) is torch.Tensor and got.device.type == "tpu"
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


KERNEL_CASES = [
    # Python numbers: runtime inputs, their type in the key (int * int tensor stays int; a float
    # makes it float), special values constants
    ("int_then_float_scalars", lambda p, q, i, f: [i * 3, i * 3.5, i * 7, i * 2.5, p * 3, p * 3.5,
                                                   i + 2, i + 2.0, p * 0.5, p * 1.25]),
    ("bool_and_negative_scalars", lambda p, q, i, f: [p * True, i * -1, i * -3, p - 1e30]),
    # broadcasting: one key per broadcast shape
    ("broadcasting", lambda p, q, i, f: [p + q[0], p + q[:, :1], p + q[1:2], p * q[2, 3],
                                         p[:1] + q[:, 2:3]]),
    # the same shapes, other strides and offsets (C++ view steps in the signature)
    ("strides_and_offsets", lambda p, q, i, f: [p + q, p.t() + q, p + q.t(), p.t() + q.t(),
                                                p[1:] + q[:3], p[:3] + q[1:], p[:, 1:] * q[:, :3],
                                                p[::2] - q[1::2], p.t()[1] + q[2]]),
    # dtypes: the same shapes in float32, float64, int64 and mixed
    ("dtypes", lambda p, q, i, f: [p + q, f + f, i + i, p + i, f * p, i * 2.5, (i > 0) & (p > 0)]),
    # ops with one or several new outputs, reductions, matmul
    ("several_outputs", lambda p, q, i, f: [*p.max(1), *torch.var_mean(q, 0), p.sum(0),
                                            (p @ q).relu(), torch.tanh(q) / (p.abs() + 1),
                                            p.mean(1, keepdim=True)]),
]


@pytest.mark.parametrize("name,fn", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_cxx_kernel_results_equal_cpu(name, fn):
    torch.manual_seed(0)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    ai, af = torch.randint(-5, 5, (4, 4)), torch.randn(4, 4, dtype=torch.float64)
    x, y, xi, xf = a.to("tpu"), b.to("tpu"), ai.to("tpu"), af.to("tpu")
    before = _kernel_hits()
    with warnings.catch_warnings():
        # a program called with other argument types than it was compiled for warns, then runs
        # op by op: a key that mixed two structures
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(3):
            got, want = fn(x, y, xi, xf), fn(a, b, ai, af)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                _same(g, w)
    if deferfuse.mode() == "defer":
        assert _kernel_hits() > before      # the third round was recorded in C++


def test_cxx_kernel_in_place_ops_and_fresh_out_equal_cpu():
    torch.manual_seed(1)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    x, y = a.to("tpu"), b.to("tpu")
    for k in range(4):
        a.add_(b, alpha=0.5)        # in-place: the router, every time
        x.add_(y, alpha=0.5)
        a[1:3].mul_(1.5)            # in-place on a view
        x[1:3].mul_(1.5)
        _same(x + y * k, a + b * k)     # reads the written values (kernel hits after the first)
        o, oc = torch.empty(4, 4, device="tpu"), torch.empty(4, 4)
        _same(torch.mul(x, y, out=o), torch.mul(a, b, out=oc))   # a fresh out= tensor
        _same(o, oc)
        _same(torch.add(x, 2.5, out=o), torch.add(a, 2.5, out=oc))   # no longer fresh
        _same(o, oc)
    _same(x, a)


@pytest.mark.modes("defer")
def test_cxx_kernel_hits_are_recorded_nodes_and_refusals_route():
    ext = deferfuse.plain.PLAIN.ext
    a = torch.randn(5, 3)
    x = a.to("tpu")
    for _ in range(3):
        x * 1.5
    deferfuse.sync()
    before = ext.kernel_stats()
    y = x * 2.5
    z = (x * 3.5) * 4.5
    after = ext.kernel_stats()
    assert after["hits"] == before["hits"] + 3, str((sorted(before.items()), sorted(after.items())))
    st = ext.storage(y)
    assert st.val.node is not None and st.val.node.scalars == [2.5]    # pending, the scalar an input
    _same(y, a * 2.5)
    _same(z, (a * 3.5) * 4.5)
    # a tensor with a Python view step (as the router makes one): no C++ signature, the router
    u = ext.make_view(x, (3,), (4,), 0, ((torch.ops.aten.diagonal.default, (), ()),))
    assert ext.sig(u) == -1 and ext.sig(x) >= 0
    for _ in range(3):
        _same(u * 1.5, a.diagonal() * 1.5)
    assert ext.sig_desc(ext.sig(x))[1:6] == (2, 5, 3, 3, 1)    # base: rank, sizes, strides


def test_cxx_kernel_off_gives_the_same_results():
    ext = deferfuse.plain.PLAIN.ext
    a = torch.randn(3, 3)
    x = a.to("tpu")
    try:
        ext.set_kernel(False)
        before = ext.kernel_stats()["hits"]
        for _ in range(3):
            _same(x * 1.5 + x, a * 1.5 + a)
        assert ext.kernel_stats()["hits"] == before
    finally:
        ext.set_kernel(True)


@pytest.mark.modes("defer")
def test_cxx_kernel_takes_a_functional_op_first_seen_as_out():
    # atan2.out on a tensor with a value first (the router writes it), then the functional op:
    # the kernel's plan for atan2.out must not be refused for good
    ext = deferfuse.plain.PLAIN.ext
    a, b = torch.randn(3, 5), torch.randn(3, 5)
    x, y = a.to("tpu"), b.to("tpu")
    o, oc = torch.zeros(3, 5, device="tpu"), torch.zeros(3, 5)
    _same(torch.atan2(x, y, out=o), torch.atan2(a, b, out=oc))
    before = ext.kernel_stats()["hits"]
    for _ in range(4):
        _same(torch.atan2(x, y), torch.atan2(a, b))
    assert ext.kernel_stats()["hits"] > before


def test_cxx_kernel_keeps_int_and_float_scalars_apart():
    # hardtanh's Scalar bounds reach the kernel as they are (PyTorch does not structure it): int
    # bounds, then float ones, must be two keys (one key for both ran a program with the other
    # argument types: it warned and ran op by op)
    a, ai = torch.randn(4, 4) * 4, torch.randint(-9, 9, (4, 4))
    x, xi = a.to("tpu"), ai.to("tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for lo, hi in [(-3, 3)] * 3 + [(-2.5, 2.5)] * 3 + [(-1, 4)] * 2 + [(-0.5, 1.5)] * 2:
            _same(torch.ops.aten.hardtanh(xi, lo, hi), torch.ops.aten.hardtanh(ai, lo, hi))
            _same(torch.ops.aten.hardtanh(x, lo, hi), torch.ops.aten.hardtanh(a, lo, hi))


@pytest.mark.modes("defer")
def test_cxx_kernel_records_in_place_ops_on_bases_and_views():
    ext = deferfuse.plain.PLAIN.ext
    torch.manual_seed(2)
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    x, y = a.to("tpu"), b.to("tpu")
    hits = []
    for k in range(5):
        before = ext.kernel_stats()["hits"]
        for t, u in ((a, b), (x, y)):
            t.sub_(u * 0.1)             # in place on a base (sub.out, out=t)
            t[1:3, ::2].mul_(1.5)       # through a view: the base's storage takes the scatter
            t.add_(t, alpha=0.5)        # the written tensor read too
            u.t()[2].fill_(0.25 * k)    # a self-writing op on a view of a view
            r = u.clamp_(-1.0, 1.0)     # returns its argument
            assert r is u
        hits.append(ext.kernel_stats()["hits"] - before)
        _same(x, a)
        _same(y, b)
    assert hits[-1] >= 5                # the last rounds were recorded in C++


def test_router_signatures_from_cxx_ids_equal_the_op_paths():
    # NOTE [C++ signatures]: the router maps a C++ signature id to the op path's _sig; it must be
    # the signature the op path computes from the tensor's description
    from deferfuse.tensor import make
    P = deferfuse.plain.PLAIN
    x = torch.randn(4, 6).to("tpu")
    xi = torch.randint(0, 5, (4, 6)).to("tpu")
    for p in (x, xi, x.t(), x[1:3], x[1:3, ::2], x.t()[2], x.unsqueeze(0).expand(2, 4, 6), x[2:],
              x.view(6, 4), x.as_strided((2, 2), (1, 6), 3)):
        for _ in range(2):      # the second read from the cache
            w = P.wrapper(p)
            fresh = make(w._s, w._chain, w.shape, w.stride(), w.storage_offset(), w.dtype)
            assert P.ext.sig(p) >= 0 and w._sig == fresh._sig
    assert P.ext.sig(x) != P.ext.sig(xi) and P.ext.sig(x[0:2]) != P.ext.sig(x[2:4])
    assert P.ext.sig(x[0:2]) == P.ext.sig(x[0:2])


def test_fresh_output_named_other_than_out_equals_cpu():
    # threshold_backward.grad_input (relu's backward) writes a keyword-only output that is not
    # called `out`: the router's fresh path and the kernel take it as the functional op
    P = deferfuse.plain.PLAIN
    assert P.out_name(torch.ops.aten.threshold_backward.grad_input) == "grad_input"
    assert P.functional_of(torch.ops.aten.threshold_backward.grad_input) is \
        torch.ops.aten.threshold_backward.default
    assert P.out_name(torch.ops.aten.add_.Tensor) is None
    a = torch.randn(6, 5)
    for _ in range(3):
        w, wx = a.clone().requires_grad_(), a.to("tpu").requires_grad_()
        (torch.relu(w) * 2.5).sum().backward()
        (torch.relu(wx) * 2.5).sum().backward()
        _same(wx.grad, w.grad)


# -- NOTE [mixed arguments]: plain tensors made inside the op path meet TpuTensors there


@pytest.mark.parametrize("name", ["bincount", "bincount_weights", "histc", "eye_", "unique"])
def test_ops_whose_path_makes_plain_tensors_equal_cpu(name):
    # each makes a tpu tensor with a factory inside the op path and mixes it with the op path's
    # own tensors: read as a CPU tensor it raised "two devices, tpu:0 and tpu:0" or gave garbage
    torch.manual_seed(0)
    i, w, v = torch.randint(0, 5, (20,)), torch.randn(20), torch.randn(50)
    fns = {
        "bincount": lambda d: torch.bincount(i.to(d)),
        "bincount_weights": lambda d: torch.bincount(i.to(d), w.to(d)),
        "histc": lambda d: torch.histc(v.to(d), bins=7, min=-2, max=2),
        "eye_": lambda d: torch.nn.init.eye_(torch.empty(3, 4, device=d)),
        "unique": lambda d: torch.unique(i.to(d)),
    }
    want, got = fns[name]("cpu"), fns[name]("tpu")
    assert type(got) is torch.Tensor and got.device.type == "tpu"
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def test_is_tpu_and_storage_of_know_both_representations():
    from deferfuse.tensor import TpuTensor, as_tpu, is_tpu, storage_of
    x = torch.randn(2, 3).to("tpu")
    v = x.t()[1:]
    assert is_tpu(x) and is_tpu(v) and not is_tpu(torch.randn(2)) and not is_tpu(3)
    assert storage_of(v) is storage_of(x)
    w = as_tpu(v)
    assert type(w) is TpuTensor and w._s is storage_of(x)
    assert w.shape == v.shape and w.stride() == v.stride()
    torch.testing.assert_close(w.cpu(), v.cpu())


# -- storage semantics


def test_resize_growing_a_storage_that_holds_a_value():
    c = torch.arange(6.)
    x = c.to("tpu")
    for t in (c, x):
        t.resize_(2, 5)
    assert x.shape == c.shape and x.stride() == c.stride()
    assert x.untyped_storage().nbytes() == c.untyped_storage().nbytes()
    # CPU leaves the new elements uninitialised (tpu: zeros): the old ones are kept
    torch.testing.assert_close(x.view(-1)[:6].cpu(), c.view(-1)[:6], rtol=0, atol=0)
    x.view(-1)[6:].fill_(1)
    c.view(-1)[6:].fill_(1)
    torch.testing.assert_close(x.cpu(), c, rtol=0, atol=0)
    # and shrinking back keeps the storage, as on CPU
    for t in (c, x):
        t.resize_(3)
    torch.testing.assert_close(x.cpu(), c, rtol=0, atol=0)
    assert x.untyped_storage().nbytes() == c.untyped_storage().nbytes()


def test_resize_growing_a_shared_storage_raises():
    x = torch.arange(4.).to("tpu")
    v = x[1:]
    with pytest.raises(RuntimeError, match="other tensors"):
        x.resize_(10)
    assert x.shape == (4,)          # unchanged
    torch.testing.assert_close(v.cpu(), torch.arange(1., 4.))


def test_untyped_storage_resize_frees_and_restores_as_fsdp2_does():
    c = torch.randn(3, 4)
    x = c.to("tpu")
    full = c.untyped_storage().nbytes()
    assert x.untyped_storage().nbytes() == full
    for t in (c, x):
        t.untyped_storage().resize_(0)
    assert x.untyped_storage().nbytes() == c.untyped_storage().nbytes() == 0
    for t in (c, x):
        t.untyped_storage().resize_(full)
    assert x.untyped_storage().nbytes() == full
    new = torch.randn(3, 4)
    with torch.no_grad():
        c.copy_(new)
        x.copy_(new.to("tpu"))
    torch.testing.assert_close(x.cpu(), c, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="resized to 0"):
        x.untyped_storage().resize_(5)


@pytest.mark.parametrize("shape", [(3, 4), ()])
def test_reading_a_freed_storage_raises_and_loses_nothing_else(shape):
    """NOTE [storage resize]: CPU reads freed memory (it may crash); a tpu tensor whose storage was
    resized to 0 raises when read (an op on it, a copy to CPU), never reads as zeros, and nothing
    recorded beside it is lost; resized back and written, it reads CPU's values."""
    c = torch.randn(shape)
    x = c.to("tpu")
    other = torch.randn(5)
    before = other.to("tpu") * 2
    x.untyped_storage().resize_(0)
    for read in (lambda: (x + 1).cpu(), lambda: x.cpu(), lambda: x.sum().item()):
        with pytest.raises(RuntimeError, match="storage was freed"):
            read()
    after = before + 1
    torch.testing.assert_close(after.cpu(), other * 2 + 1, rtol=0, atol=0)
    x.untyped_storage().resize_(c.untyped_storage().nbytes())
    new = torch.randn(shape)
    with torch.no_grad():
        x.copy_(new.to("tpu"))
    torch.testing.assert_close(x.cpu(), new, rtol=0, atol=0)


def test_deepcopy_equals_cpu_and_is_independent():
    import copy
    c = torch.randn(3, requires_grad=True)
    c.grad = torch.ones(3)
    x = c.detach().to("tpu").requires_grad_()
    x.grad = torch.ones(3, device="tpu")
    x.note = "kept"
    for t in (c, x):
        d = copy.deepcopy(t)
        assert d.requires_grad and d.is_leaf and d.device == t.device and d is not t
        torch.testing.assert_close(d.detach().cpu(), c.detach())
        torch.testing.assert_close(d.grad.cpu(), c.grad)
        with torch.no_grad():
            d.mul_(0)
        torch.testing.assert_close(t.detach().cpu(), c.detach())   # the original is untouched
    assert copy.deepcopy(x).note == "kept"
    m = torch.nn.Linear(3, 2).to("tpu")
    m2 = copy.deepcopy(m)
    assert type(m2.weight) is torch.nn.Parameter and m2.weight.device.type == "tpu"
    torch.testing.assert_close(m2.weight.detach().cpu(), m.weight.detach().cpu())


@pytest.mark.parametrize("where", [None, "cpu", "tpu"])
def test_save_and_load_as_cpu_tensors(where, tmp_path):
    torch.manual_seed(0)
    ref = torch.nn.Linear(3, 2)
    m = torch.nn.Linear(3, 2).to("tpu")
    m.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3)
    obj = {"sd": m.state_dict(), "t": x.to("tpu"), "p": m.weight}
    f = tmp_path / "ck.pt"
    torch.save(obj, f)
    got = torch.load(f) if where is None else torch.load(f, map_location=where)
    dev = "tpu" if where is None else where
    assert got["t"].device.type == dev and got["sd"]["weight"].device.type == dev
    assert type(got["p"]) is torch.nn.Parameter and got["p"].requires_grad
    torch.testing.assert_close(got["t"].cpu(), x, rtol=0, atol=0)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got["sd"][k].cpu(), v, rtol=0, atol=0)


def test_set_as_on_cpu():
    c, x = _pair()
    for t in (c, x):
        a = torch.zeros(2, 2, device=t.device)
        a.set_(t)                           # set_(tensor): shares the storage and geometry
        assert a.shape == t.shape and a.stride() == t.stride()
        assert a.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        a[0].fill_(5)                       # seen by t
        b = torch.zeros(1, device=t.device)
        b.set_(t.untyped_storage(), 2, (2, 3), (1, 6))     # a geometry over t's storage
        b.mul_(2)
        e = torch.ones(3, device=t.device).set_()
        assert e.shape == (0,) and e.untyped_storage().nbytes() == 0
    assert a.shape == (4, 6) and b.shape == (2, 3)
    torch.testing.assert_close(x.cpu(), c, rtol=0, atol=0)
    torch.testing.assert_close(b.cpu(), c.as_strided((2, 3), (1, 6), 2), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="out of bounds"):
        torch.zeros(1, device="tpu").set_(x.untyped_storage(), 20, (3, 3), (3, 1))


def test_as_subclass_and_make_subclass_keep_the_value():
    class Mine(torch.Tensor):
        pass
    c, x = _pair()
    m = x.as_subclass(Mine)
    assert type(m) is Mine and m.device.type == "tpu"
    torch.testing.assert_close((m * 2).cpu().as_subclass(torch.Tensor), c * 2)
    p = torch.Tensor._make_subclass(Mine, x, True)
    assert type(p) is Mine and p.requires_grad
    torch.testing.assert_close(p.detach().cpu().as_subclass(torch.Tensor), c)


def test_convolution_and_its_backward_equal_cpu():
    # NOTE [whole ops]: convolution reaches the op path whole, not as convolution_overrideable
    torch.manual_seed(0)
    xc, wc = torch.randn(2, 3, 8, 8, requires_grad=True), torch.randn(4, 3, 3, 3, requires_grad=True)
    xt = xc.detach().to("tpu").requires_grad_()
    wt = wc.detach().to("tpu").requires_grad_()
    yc = torch.nn.functional.conv2d(xc, wc, padding=1, stride=2)
    yt = torch.nn.functional.conv2d(xt, wt, padding=1, stride=2)
    assert yt.shape == yc.shape and yt.dtype == yc.dtype
    torch.testing.assert_close(yt.detach().cpu(), yc.detach(), rtol=1e-4, atol=1e-4)
    yc.square().sum().backward()
    yt.square().sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), xc.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(wt.grad.cpu(), wc.grad, rtol=1e-4, atol=1e-4)


def test_composite_explicit_ops_reach_the_op_path_whole():
    # NOTE [whole ops]: native_group_norm ran PyTorch's math version on plain tensors (not CPU's
    # bits); linear was decomposed below its one-op autograd kernel
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 6, 1, generator=g) * 0.0662).expand(2, 6, 3).contiguous()
    w, b = torch.randn(6, generator=g), torch.randn(6, generator=g)
    want = torch.ops.aten.native_group_norm(x, w, b, 2, 6, 3, 6, 1e-6)
    got = torch.ops.aten.native_group_norm(*[t.to("tpu") for t in (x, w, b)], 2, 6, 3, 6, 1e-6)
    for gt, wt in zip(got, want):
        torch.testing.assert_close(gt.cpu(), wt, rtol=0, atol=0)
    xl, wl = torch.randn(3, 5), torch.randn(4, 5)
    deferfuse.sync()
    deferfuse.reset_metrics()
    y = torch.nn.functional.linear(xl.to("tpu"), wl.to("tpu"))
    deferfuse.sync()
    m = deferfuse.metrics()
    assert m["ops_recorded"] + m["ops_eager"] == 1
    torch.testing.assert_close(y.cpu(), torch.nn.functional.linear(xl, wl))
