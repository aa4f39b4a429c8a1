"""The op-side suite files on the plain PrivateUse1 tpu tensor (issue 34,
docs/cxx-plan.md, "Session 3 (cxx5)"): each fix here against CPU eager (values, dtypes, shapes)."""
import pytest
import torch

import deferfuse
from util import train_beside


def _same(got, want):
    assert got.device.type == "tpu"
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    torch.testing.assert_close(got.cpu(), want)


def _geom(t):
    return tuple(t.shape), t.stride(), t.storage_offset()


INPLACE_VIEWS = [
    ("squeeze_", lambda x: x.squeeze_()),
    ("squeeze_dim", lambda x: x.squeeze_(0)),
    ("squeeze_dims", lambda x: x.squeeze_((0, 2))),
    ("unsqueeze_", lambda x: x.unsqueeze_(-1)),
    ("t_", lambda x: x[0].t_()),
    ("transpose_", lambda x: x.transpose_(0, 2)),
    ("swapdims_", lambda x: x.swapdims_(1, 2)),
    ("as_strided_", lambda x: x.as_strided_((2, 3), (1, 2), 1)),
    ("chain", lambda x: x.squeeze_(0).t_().unsqueeze_(1).transpose_(0, 2)),
]


@pytest.mark.parametrize("name,fn", INPLACE_VIEWS, ids=[v[0] for v in INPLACE_VIEWS])
def test_inplace_view_ops_change_the_tensor_as_on_cpu(name, fn):
    # NOTE [in-place views]: through the router only the op path's wrapper changed
    c = torch.arange(24.0).reshape(1, 4, 6)
    x = c.to("tpu")
    rc, rx = fn(c), fn(x)
    assert _geom(rx) == _geom(rc)
    _same(rx, rc)
    rc.mul_(2)
    rx.mul_(2)          # a write through the changed tensor reaches its storage's other views
    _same(x, c)


def test_vector_matrix_product_as_on_cpu():
    # at::matmul ends 1-D @ 2-D with squeeze_(0): the result was (1, 4)
    v, m = torch.randn(3), torch.randn(3, 4)
    _same(v.to("tpu") @ m.to("tpu"), v @ m)
    _same(m.t().to("tpu") @ v.to("tpu"), m.t() @ v)


@pytest.mark.parametrize("case", ["select", "select_neg"])
def test_select_backward_is_one_op(case):
    # NOTE [whole ops]: select_backward's only composite kernel is a NonFunctional one; it was
    # decomposed (zeros, a copy through a select view: two ops)
    read = {"select": lambda x: x[:, 0], "select_neg": lambda x: x[-1]}[case]
    x, g = torch.randn(4, 6), torch.randn(read(torch.empty(4, 6)).shape)
    xc = x.clone().requires_grad_()
    read(xc).backward(g)
    xt = x.to("tpu").requires_grad_()
    y = read(xt)
    deferfuse.sync()
    deferfuse.reset_metrics()
    y.backward(g.to("tpu"))
    deferfuse.sync()
    m = deferfuse.metrics()
    assert m["ops_recorded"] + m["ops_eager"] == 1
    _same(xt.grad, xc.grad)
    src = torch.randn(g.shape)
    dim, i = (1, 0) if case == "select" else (0, -1)
    _same(torch.select_scatter(x.to("tpu"), src.to("tpu"), dim, i), torch.select_scatter(x, src, dim, i))


def test_resize_as_and_out_resized_by_a_decomposition_as_on_cpu():
    # resize_as_ and PyTorch's own _maybe_resize_out (arange's out=) resized only the router's
    # wrapper: the plain tensor kept its shape (or the grow was refused as "shared")
    r, rc = torch.zeros(5, device="tpu"), torch.zeros(5)
    r.resize_as_(torch.ones(2, 2))
    rc.resize_as_(torch.ones(2, 2))
    assert _geom(r) == _geom(rc)
    for start in (0, 2):
        o, oc = torch.empty(start, dtype=torch.long).to("tpu"), torch.empty(start, dtype=torch.long)
        torch.arange(5, out=o)
        torch.arange(5, out=oc)
        _same(o, oc)
    with pytest.raises(RuntimeError) as want:
        torch.arange(6).resize_(-1)
    with pytest.raises(RuntimeError) as got:
        torch.arange(6, device="tpu").resize_(-1)
    assert str(got.value) == str(want.value)


def test_cpu_index_tensors_as_on_cpu():
    # the op path moved a CPU index to the device with .to(): a plain tensor among its TpuTensors
    # ("two devices, tpu:0 and tpu:0")
    x, i = torch.randn(5, 3), torch.tensor([[0, 4], [2, 2]])
    xt = x.to("tpu").requires_grad_()
    xc = x.clone().requires_grad_()
    got, want = (xt * 2)[i], (xc * 2)[i]
    _same(got, want)
    got.sum().backward()
    want.sum().backward()
    _same(xt.grad, xc.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64, torch.float64], ids=str)
def test_eigvals_runs_on_the_device_as_on_cpu(dtype):
    # linalg_eigvals reaches _linalg_eigvals on a plain tensor (a subclass went to linalg_eig)
    a = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(0), dtype=dtype)
    deferfuse.reset_metrics()
    got = torch.linalg.eigvals(a.to("tpu"))
    assert not deferfuse.metrics()["cpu_fallbacks"]
    want = torch.linalg.eigvals(a)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_sparse_to_tpu_raises_the_dense_refusal():
    for make in (lambda: torch.ones(2, 2).to_sparse().to("tpu"),
                 lambda: torch.ones(2, 2).to_sparse_csr().to("tpu"),
                 lambda: torch.ones(2, 2, device="tpu").to_sparse()):
        with pytest.raises(NotImplementedError, match="dense"):
            make()


def test_a_bad_device_index_raises_in_the_cxx_factories():
    # the C++ empty kernels took any index (no error, a tensor on a device that does not exist)
    n = torch.tpu.device_count()
    x = torch.ones(2, device="tpu")
    for call in (lambda: torch.empty(2, device=f"tpu:{n}"),
                 lambda: torch.empty_like(x, device=f"tpu:{n}"),
                 lambda: torch.empty_strided((2,), (1,), device=f"tpu:{n}")):
        with pytest.raises(RuntimeError, match=rf"invalid device ordinal: tpu:{n} does not exist"):
            call()
    assert torch.tpu.current_device() == 0
    _same(x + 1, torch.full((2,), 2.0))


def test_ddp_bucket_views_train_as_on_cpu(group):
    # DDP writes each gradient into a view of a flat bucket (mul.out into a slice of a fresh
    # tensor): the router took the view as a fresh out= and gave the whole bucket the gradient's
    # Storage ([6, 4] under a chain over [50]: IndexError in the region)
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    model.load_state_dict(ref.state_dict())
    model = DDP(model.to("tpu"))
    train_beside(ref, model)
    got = model.module.state_dict()
    for k, v in ref.state_dict().items():
        _same(got[k], v)


def test_fsdp2_streams_and_storage_resize_train_as_on_cpu(group):
    # fully_shard makes torch.tpu streams and events (the C++ device guard had none: "Backend
    # doesn't support create a new Stream") and frees/reallocates parameter storage
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model.load_state_dict(ref.state_dict())
    model = model.to("tpu")
    fully_shard(model[0])
    fully_shard(model)
    train_beside(ref, model)
    got = {k: v.full_tensor() for k, v in model.state_dict().items()}
    for k, v in ref.state_dict().items():
        _same(got[k], v)
    s, e = torch.tpu.Stream(), torch.tpu.Event()
    e.record(s)
    assert e.query() and s.query()


def test_all_to_all_of_lists_in_a_group_of_one(group):
    # the collective's own cat/empty made plain tensors, which it read as TpuTensors (no ._s)
    import torch.distributed as dist
    src = torch.arange(3.0)
    out = [torch.empty(3, device="tpu")]
    dist.all_to_all(out, [src.to("tpu")])
    _same(out[0], src)


def test_storage_resize_frees_and_its_data_ptr_is_zero():
    t = torch.arange(6.0, device="tpu")
    v = t.view(2, 3)
    st = t.untyped_storage()
    assert st.size() == 24 and st.data_ptr() == v.untyped_storage().data_ptr() != 0
    st.resize_(0)
    assert t.untyped_storage().size() == 0 and st.data_ptr() == 0
    st.resize_(24)
    assert st.data_ptr() == v.untyped_storage().data_ptr() != 0
    t.copy_(torch.ones(6))
    _same(v, torch.ones(2, 3))
