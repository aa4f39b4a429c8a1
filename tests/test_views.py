"""Aliasing through views and in-place writes matches CPU eager exactly."""
import pytest
import torch

from util import assert_same

WRITES = {
    "setitem_row": lambda x: x.__setitem__(0, 1.0),
    "column_add_": lambda x: x[:, 1].add_(2),
    "t_mul_": lambda x: x.t().mul_(3),
    "view_flat_setitem": lambda x: x.view(-1).__setitem__(3, 0.0),
    "diagonal_zero_": lambda x: x.diagonal().zero_(),
    "unsqueeze_copy_": lambda x: x[2:4, ::2].unsqueeze(0).copy_(torch.full((1, 2, 3), 7.0)),
    "split_neg_": lambda x: x.split(2, dim=1)[1].neg_(),
    "unbind_add_": lambda x: x.unbind(0)[3].add_(100),
    "narrow_fill_": lambda x: x.narrow(1, 2, 3).fill_(-5),
    "strided_slice": lambda x: x[::2, 1::2].mul_(-1),
    "select_neg_idx": lambda x: x[-1, -2:].sub_(9),
    "chunk_clamp_": lambda x: x.chunk(2, 0)[0].clamp_(0, 10),
    "permute_view": lambda x: x.view(2, 2, 6).permute(2, 0, 1)[1].add_(1),
    "index_put": lambda x: x.__setitem__((torch.tensor([0, 2]), torch.tensor([1, 3])), -3.0),
    "masked_fill_": lambda x: x.masked_fill_(x > 10, 0.0),
    "unfold_mul_": lambda x: x[0].unfold(0, 2, 2).mul_(10),
    "as_strided": lambda x: x.as_strided((2, 2), (6, 1), 1).add_(0.5),
    "transpose_copy_": lambda x: x.transpose(0, 1)[1:3].copy_(torch.zeros(2, 4)),
    "expand_read": lambda x: x[1:].add_(x[0:1].clone().expand(3, 6)),
    "squeeze_write": lambda x: x[1:2].squeeze(0).add_(4),
}


def _on(dev, write):
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(dev)
    other = x[1]                      # a view taken before the write
    t = x.t()
    write_dev = write

    def move(a):
        return a.to(dev) if isinstance(a, torch.Tensor) else a
    orig_full, orig_zeros, orig_tensor = torch.full, torch.zeros, torch.tensor
    try:
        torch.full = lambda *a, **k: orig_full(*a, **{**k, "device": dev})
        torch.zeros = lambda *a, **k: orig_zeros(*a, **{**k, "device": dev})
        torch.tensor = lambda *a, **k: orig_tensor(*a, **{**k, "device": dev})
        write_dev(x)
    finally:
        torch.full, torch.zeros, torch.tensor = orig_full, orig_zeros, orig_tensor
    return x, other, t, other * 1


@pytest.mark.parametrize("name", list(WRITES))
def test_write_through_view(name):
    want = _on("cpu", WRITES[name])
    got = _on("tpu", WRITES[name])
    for g, w in zip(got, want):
        assert_same(g, w, msg=name)


def test_view_metadata_matches_cpu():
    x = torch.randn(4, 6)
    t = x.to("tpu")
    for f in (lambda a: a.t(), lambda a: a[:, 1:5:2], lambda a: a.view(2, 12), lambda a: a.permute(1, 0),
              lambda a: a.unsqueeze(1), lambda a: a[1], lambda a: a.diagonal(), lambda a: a.expand(3, 4, 6),
              lambda a: a.t().contiguous(), lambda a: a + 1, lambda a: a.t() * 2):
        w, g = f(x), f(t)
        assert g.shape == w.shape and g.stride() == w.stride()
        assert g.storage_offset() == w.storage_offset()
        assert g.is_contiguous() == w.is_contiguous()
        assert_same(g, w)


def test_inplace_view_ops_change_the_tensor_itself():
    def run(dev):
        x = torch.arange(24, dtype=torch.float32).reshape(1, 4, 6).to(dev)
        base = x
        y = x[0:1]                 # a view taken before the in-place view ops
        x.squeeze_(0)
        x.t_()
        x.unsqueeze_(1)
        x.transpose_(0, 2)
        x.swapdims_(1, 2)
        x.mul_(2)                  # a write through the reshaped tensor reaches y
        meta = (tuple(x.shape), x.stride(), x.storage_offset(), x is base)
        return meta, x, y
    (wm, w, wy), (gm, g, gy) = run("cpu"), run("tpu")
    assert gm == wm
    assert_same(g, w)
    assert_same(gy, wy)


def test_vector_matrix_products():
    # at::matmul lowers 1-D @ 2-D through unsqueeze(0) ... squeeze_(0)
    v, m = torch.randn(3), torch.randn(3, 4)
    assert_same(v.to("tpu") @ m.to("tpu"), v @ m, rtol=1e-5)
    assert_same(m.t().to("tpu") @ v.to("tpu"), m.t() @ v, rtol=1e-5)
    b = torch.randn(2, 5, 3)
    assert_same(b.to("tpu") @ v.to("tpu"), b @ v, rtol=1e-5)
    assert_same(v.to("tpu") @ b.transpose(1, 2).to("tpu"), v @ b.transpose(1, 2), rtol=1e-5)


def test_view_of_noncontiguous_raises_like_cpu():
    x = torch.randn(4, 6)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        x.t().view(-1)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        x.to("tpu").t().view(-1)
    assert_same(x.to("tpu").t().reshape(-1), x.t().reshape(-1))


def test_out_argument():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    out_cpu = torch.empty(3, 4)
    out_tpu = torch.empty(3, 4, device="tpu")
    r = torch.add(a.to("tpu"), b.to("tpu"), out=out_tpu)
    torch.add(a, b, out=out_cpu)
    assert r is out_tpu
    assert_same(out_tpu, out_cpu)
    view = out_tpu[1]
    torch.mul(a[0].to("tpu"), 2, out=view)
    torch.mul(a[0], 2, out=out_cpu[1])
    assert_same(out_tpu, out_cpu)


def test_nn_init_in_place():
    for init in (torch.nn.init.zeros_, torch.nn.init.ones_, lambda w: torch.nn.init.constant_(w, 0.3),
                 torch.nn.init.eye_):
        w_cpu, w = torch.empty(3, 5), torch.empty(3, 5, device="tpu")
        init(w_cpu)
        init(w)
        assert_same(w, w_cpu)
    w = torch.empty(64, 64, device="tpu")
    torch.nn.init.kaiming_uniform_(w, a=5 ** 0.5)
    bound = 1 / 8
    assert w.abs().max().item() <= bound + 1e-6 and w.std().item() > bound / 3


def test_detach_shares_storage():
    x = torch.zeros(3, device="tpu", requires_grad=True)
    d = x.detach()
    d.add_(1)
    assert torch.equal(x.detach().cpu(), torch.ones(3))


@pytest.mark.parametrize("case", ["slice", "slice_step_neg", "slice_clamped", "select", "select_neg"])
def test_slice_and_select_backward_and_scatter_are_one_op(case, no_cpu_fallbacks):
    """The gradient of a slice or a selected row, and slice_scatter/select_scatter, record one op
    each (they were composites: new_zeros and a copy through a view), with CPU's values."""
    import deferfuse
    read, scatter = {
        "slice": (lambda x: x[:, 1:5], lambda x, s: torch.slice_scatter(x, s, 1, 1, 5)),
        "slice_step_neg": (lambda x: x[-3:, ::2], lambda x, s: torch.slice_scatter(x, s, 0, -3, None, 1)),
        "slice_clamped": (lambda x: x[2:100], lambda x, s: torch.slice_scatter(x, s, 0, 2, 100)),
        "select": (lambda x: x[:, 0], lambda x, s: torch.select_scatter(x, s, 1, 0)),
        "select_neg": (lambda x: x[-1], lambda x, s: torch.select_scatter(x, s, 0, -1)),
    }[case]
    x = torch.randn(4, 6)
    src = torch.randn(read(x).shape)
    g = torch.randn(read(x).shape)
    xc = x.clone().requires_grad_()
    read(xc).backward(g)
    xt = x.to("tpu").requires_grad_()
    gt = g.to("tpu")
    y = read(xt)
    deferfuse.sync()
    deferfuse.reset_metrics()
    y.backward(gt)
    deferfuse.sync()
    m = deferfuse.metrics()
    assert m["ops_recorded"] + m["ops_eager"] == (2 if case == "slice_step_neg" else 1)  # a slice each
    assert_same(xt.grad, xc.grad)
    # slice_scatter's source has the slice's shape: for "slice_step_neg" the rows -3: whole
    if case == "slice_step_neg":
        src = torch.randn(3, 6)
    assert_same(scatter(x.to("tpu"), src.to("tpu")), scatter(x, src))


def _windows(dev):
    """Views with an offset or index argument, taken one after another on one tensor and on views
    of it, so that each meets the view cache entries of the ones before (NOTE [view cache keys])."""
    x = torch.arange(36, dtype=torch.float32).reshape(6, 6).to(dev)
    outs = [torch.as_strided(x, (2, 2), (4, 1)), torch.as_strided(x, (2, 2), (4, 1), 1),
            torch.as_strided(x, (2, 2), (4, 1), 2), x[2:1], x[1:3], x[2:1, 1]]
    for i in range(3):
        row, rows = x[i], x[i:i + 2]
        outs += [torch.as_strided(row, (2, 2), (1, 1)), torch.as_strided(row, (2, 2), (1, 1), 3),
                 torch.as_strided(rows, (2,), (1,)), rows.select(0, 1).as_strided((2,), (2,)),
                 rows.narrow(1, i, 2), x.narrow(0, i, 2), x.select(1, i), x[i:i + 2],
                 torch.diagonal(x, i), torch.diagonal(rows, 1 - i), x.unfold(0, 2, i + 1),
                 rows.unfold(1, 3, 3 - i)]
    torch.as_strided(x[2], (2,), (1,)).mul_(-1)     # a write through an as_strided of a moved row
    x[3:4].as_strided((3,), (2,)).add_(100)
    return [(o.stride(), o.storage_offset(), o.clone()) for o in outs] + [((), 0, x)]


@pytest.mark.modes("defer")   # views record nothing: the cache is the same in every mode
def test_view_cache_keys_hold_the_whole_view():
    """as_strided with and without an offset, x[2:1] and x[i:i+2], and as_strided (no offset) of
    x[i] for each i were served one another's cached views: a ValueError, or silently the first
    row's values."""
    want = _windows("cpu")
    got = _windows("tpu")
    for i, ((gs, go, g), (ws, wo, w)) in enumerate(zip(got, want)):
        assert (gs, go) == (ws, wo), i
        assert_same(g, w, msg=str(i))


def test_as_strided_with_and_without_offset():
    x = torch.randn(4, 4)
    t = x.to("tpu")
    assert_same(torch.as_strided(t, (2, 2), (4, 1)), torch.as_strided(x, (2, 2), (4, 1)))
    assert_same(torch.as_strided(t, (2, 2), (4, 1), 1), torch.as_strided(x, (2, 2), (4, 1), 1))
