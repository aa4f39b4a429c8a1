"""Indexing and shape ops against CPU eager: cat/stack, gather/scatter, advanced indexing,
index_put, index_* ops, masks, padding, flips, diagonals, sorted search."""
import pytest
import torch
import torch.nn.functional as F

import deferfuse
from util import assert_same

T = "tpu"


def both(fn, *args, **kw):
    """fn on the same args moved to tpu and on CPU copies (fn may write its inputs)."""
    def mv(a, dev):
        if isinstance(a, torch.Tensor):
            return a.to(dev) if dev == T else a.clone()
        if isinstance(a, (list, tuple)):
            return type(a)(mv(x, dev) for x in a)
        return a
    got = fn(*[mv(a, T) for a in args], **{k: mv(v, T) for k, v in kw.items()})
    return got, fn(*[mv(a, "cpu") for a in args], **{k: mv(v, "cpu") for k, v in kw.items()})


def check(fn, *args, atol=1e-5, rtol=1.3e-6, **kw):
    got, want = both(fn, *args, **kw)
    assert_same(got, want, atol=atol, rtol=rtol)


pytestmark = pytest.mark.usefixtures("no_cpu_fallbacks")


def test_cat_stack():
    a, b = torch.randn(2, 3), torch.randn(4, 3)
    check(lambda x, y: torch.cat([x, y]), a, b)
    check(lambda x, y: torch.cat([x.t(), y.t()], dim=-1), a, b)
    # legacy empty 1-D tensors are skipped; dtypes promote
    check(lambda x, y, e: torch.cat([x, e, y]), a, b, torch.empty(0))
    check(lambda x, i: torch.cat([x, i], 1), a, torch.arange(6).reshape(2, 3))
    check(lambda x, e: torch.cat([e, x, e[:, :0]], 1), a, torch.empty(2, 0))
    check(lambda x, y: torch.stack([x, y, x], dim=1), a, b[:2])
    check(lambda x, y: torch.stack([x, y], dim=-1), a, b[:2].int())


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_gather_scatter():
    x = torch.randn(4, 5)
    idx = torch.tensor([[0, 3, 4], [2, 1, 1]])
    check(lambda x, i: torch.gather(x, 1, i), x, idx)
    check(lambda x, i: torch.gather(x, 0, i), x, idx % 4)
    src = torch.randn(3, 4)
    uniq = torch.tensor([[0, 3, 1], [2, 4, 1]])
    check(lambda x, i, s: x.scatter(1, i, s), x, uniq, src)
    check(lambda x, i: x.scatter(1, i, 2.5), x, uniq)
    check(lambda x, i, s: x.scatter(1, i, s, reduce="add"), x, idx, src)
    check(lambda x, i, s: x.scatter(1, i, s, reduce="multiply"), x, idx, src)
    dup = torch.tensor([[0, 0, 1], [2, 2, 2]])
    check(lambda x, i, s: x.scatter_add(1, i, s), x, dup, src)
    check(lambda z, i, s: z.scatter_add_(1, i, s), torch.zeros(3, 5, dtype=torch.long), dup,
          torch.ones(2, 3, dtype=torch.long))


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
def test_scatter_reduce(reduce):
    x = torch.randn(3, 6)
    src = torch.randn(3, 4)
    idx = torch.tensor([[0, 0, 5, 4], [1, 2, 2, 2], [3, 3, 3, 0]])
    for inc in (True, False):
        check(lambda x, i, s: x.scatter_reduce(1, i, s, reduce, include_self=inc), x, idx, src,
              atol=1e-5, rtol=1e-5)
    xi = torch.randint(-5, 5, (3, 6))
    check(lambda x, i, s: x.scatter_reduce(1, i, s, reduce), xi, idx, torch.randint(-5, 5, (3, 4)))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_index_select_take():
    x = torch.randn(4, 5, 3)
    check(lambda x, i: x.index_select(1, i), x, torch.tensor([4, 1, 0, 0]))
    check(lambda x, i: x.index_select(0, i), x, torch.tensor(2))
    check(lambda x, i: torch.take(x, i), x, torch.tensor([[0, -1], [59, 7]]))
    check(lambda x, i: torch.take_along_dim(x, i, dim=1), x, torch.randint(0, 5, (4, 2, 3)))
    check(lambda x, i: torch.take_along_dim(x, i), x, torch.tensor([3, 7, 59]))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_advanced_indexing():
    x = torch.randn(5, 6, 7)
    i, j = torch.tensor([0, -1, 2]), torch.tensor([[1], [-5]])
    check(lambda x, i: x[i], x, i)
    check(lambda x, i: x[:, i], x, i)
    check(lambda x, i, j: x[i, j], x, i, j)                 # broadcast (2, 3)
    check(lambda x, i, j: x[j, :, i], x, i, j)              # non-adjacent: index dims first
    check(lambda x, i, j: x[:, j, i], x, i, j)
    check(lambda x, i: x[None, ..., i], x, i)
    check(lambda x, i: x[1:4, i, ::2], x, i)
    check(lambda x, i: x[i.int()], x, i)
    check(lambda x, i: torch.ops.aten.index.Tensor(x, [None, i, i]), x, i)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_index_put():
    x = torch.randn(5, 4)
    i = torch.tensor([0, -1, 2])
    v = torch.randn(3, 4)
    check(lambda x, i, v: x.index_put((i,), v), x, i, v)
    check(lambda x, i, v: x.index_put((i,), v[0]), x, i, v)
    dup = torch.tensor([1, 1, -4, 0])
    check(lambda x, i: x.index_put((i,), torch.ones_like(x[:4]), accumulate=True), x, dup)
    check(lambda x, i: x.index_put((i, i), torch.full((4,), 2.0, device=x.device), accumulate=True),
          x, dup)
    check(lambda x, j, v: torch.ops.aten.index_put.default(x, [None, j], v), x, torch.tensor([3, 0]),
          torch.tensor(7.0))

    def setitem(x, i):
        x = x.clone()
        x[i] = 3.0
        x[:, [1, 2]] += 1
        x[i, 0] = torch.tensor([0.0, 1.0, 2.0]).to(x.device)
        return x
    check(setitem, x, i)

    def inplace(x, i, v):
        y = x.clone()
        y.index_put_((i,), v, accumulate=True)
        torch.ops.aten._index_put_impl_(y, (i,), v * 2, True, True)
        return y
    check(inplace, x, dup, torch.randn(4, 4))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_index_put_bool_mask():
    x = torch.randn(4, 5)
    m = x > 0
    check(lambda x, m: x.masked_fill(m, 0.5), x, m)

    def put_scalar(x, m):
        x = x.clone()
        x[m] = -1.0
        return x

    def put_vector(x, m):
        x = x.clone()
        x[m] = torch.arange(int(m.sum().item()), dtype=x.dtype).to(x.device)
        return x

    def put_rows(x, r):
        x = x.clone()
        x[r] = torch.ones(5, device=x.device) * 9
        x[r, 1:3] = torch.tensor([[1.0, 2.0]]).to(x.device)
        return x
    check(put_scalar, x, m)
    check(put_vector, x, m)
    check(put_rows, x, torch.tensor([True, False, True, True]))
    check(lambda x, m: x.index_put((m,), torch.tensor(2.0, device=x.device), accumulate=True), x, m)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_index_add_copy_fill():
    x = torch.randn(5, 3)
    i = torch.tensor([0, 4, 0, 2])
    s = torch.randn(4, 3)
    check(lambda x, i, s: x.index_add(0, i, s), x, i, s)
    check(lambda x, i, s: x.index_add(0, i, s, alpha=2.5), x, i, s)
    check(lambda x, i, s: x.t().index_add(1, i, s.t()), x, i, s)
    u = torch.tensor([4, 1, 0])
    check(lambda x, i, s: x.index_copy(0, i, s), x, u, s[:3])
    check(lambda x, i: x.index_fill(1, i, -2.0), x, torch.tensor([0, -1]))
    check(lambda x, i: x.index_fill(0, i, torch.tensor(3.0, device=x.device)), x, u)
    # a CPU scalar tensor as the value (PyTorch allows it beside an accelerator's tensors; the
    # meta kernel refused it: "index_copy(): self, index and source expected to be in the same
    # device")
    check(lambda x, i: x.index_fill(0, i, torch.tensor(-1.5)), x, u)
    check(lambda x, i: x.long().index_fill_(1, i, torch.tensor(2)), x, torch.tensor([0, -1]))
    check(lambda x, i, s: x.clone().index_add_(0, i, s), x, i, s)
    for red in ("prod", "mean", "amax"):
        check(lambda x, i, s: x.index_reduce(0, i, s, red, include_self=False), x, i, s, rtol=1e-5)


@pytest.mark.parametrize("case", ["gather", "scatter_add", "index_select", "index", "index_put",
                                  "take", "index_fill"])
def test_out_of_range_indices_raise(case):
    x = torch.randn(4, 5)
    bad = torch.tensor([[0, 5]]) if case in ("gather", "scatter_add") else torch.tensor([1, -6])
    fns = {
        "gather": lambda x, i: torch.gather(x, 1, i),
        "scatter_add": lambda x, i: x.scatter_add(1, i, torch.ones(1, 2, device=x.device)),
        "index_select": lambda x, i: x.index_select(1, i),
        "index": lambda x, i: x[:, i],
        "index_put": lambda x, i: torch.ops.aten.index_put.default(x, [None, i],
                                                                   torch.tensor(1.0, device=x.device)),
        "take": lambda x, i: torch.take(x, i * 4),
        "index_fill": lambda x, i: x.index_fill(1, i, 0.0),
    }
    f = fns[case]
    with pytest.raises(Exception) as cpu_err:
        f(x, bad)
    with pytest.raises(type(cpu_err.value)):
        f(x.to(T), bad.to(T)).cpu()
    # the device keeps working afterwards
    assert_same(f(x.to(T), (bad % 4).to(T)), f(x, bad % 4))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_masked():
    x = torch.randn(3, 4)
    m = torch.rand(3, 4) > 0.5
    check(lambda x, m: x.masked_fill(m, -1.5), x, m)
    check(lambda x, m: x.masked_fill(m[0], torch.tensor(2.0, device=x.device)), x, m)
    # a CPU scalar tensor as the value, as PyTorch allows on an accelerator (HF's sew-d): the
    # meta kernel once refused it ("Expected `value` to be on same device as `a`")
    check(lambda x, m: x.masked_fill(m, torch.tensor(-2.5)), x, m)
    check(lambda x, m: x.clone().masked_fill_(m[0], torch.tensor(3.25, dtype=torch.float64)), x, m)
    check(lambda x, m: x.long().masked_fill(m, torch.tensor(1.5)), x, m)
    check(lambda x, m: x.long().masked_fill(m, 7), x, m)
    check(lambda x, m: x.clone().masked_fill_(m, float("-inf")), x, m)
    check(lambda x, m, s: x.masked_scatter(m, s), x, m, torch.randn(20))
    check(lambda x, m, s: x.masked_scatter(m[1], s), x, m, torch.randn(3, 4))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_padding_forward_backward():
    x = torch.randn(2, 3, 5, 6)
    check(lambda x: F.pad(x, (1, 2, 0, 3), value=1.5), x)
    check(lambda x: F.pad(x, (-1, 2, 1, -2)), x)
    check(lambda x: F.pad(x, (2, 1, 1, 3), mode="reflect"), x)
    check(lambda x: F.pad(x, (2, 1, 1, 3), mode="replicate"), x)
    check(lambda x: F.pad(x[0], (2, 3), mode="reflect"), x)
    check(lambda x: F.pad(x[0], (3, 1), mode="replicate"), x)
    check(lambda x: F.pad(x, (-1, 2, 1, -2), mode="replicate"), x)

    def grad(x, mode, pad):
        x = x.detach().requires_grad_(True)
        y = F.pad(x, pad, mode=mode)
        w = torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).to(y.device)
        (y * w).sum().backward()
        return x.grad
    for mode in ("reflect", "replicate", "constant"):
        check(lambda x: grad(x, mode, (2, 1, 1, 3)), x, atol=1e-3)
        check(lambda x: grad(x[0], mode, (2, 3)), x, atol=1e-3)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_rearrange():
    x = torch.randn(3, 4, 5)
    check(lambda x: x.flip(0, -1), x)
    check(lambda x: torch.roll(x, 2), x)
    check(lambda x: torch.roll(x, (1, -2), (0, 2)), x)
    check(lambda x: x.repeat(2, 1, 3), x)
    check(lambda x: x.repeat(2, 1, 1, 2), x)
    check(lambda x: x.tile((2,)), x)
    check(lambda x: torch.rot90(x, 1, (1, 2)), x)
    check(lambda x: x.tril(), x)
    check(lambda x: x.triu(1), x)
    check(lambda x: x.tril(-2) + x.triu(3), x)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_diagonals():
    v = torch.randn(2, 4)
    check(lambda v: torch.diag_embed(v), v)
    check(lambda v: torch.diag_embed(v, offset=1), v)
    check(lambda v: torch.diag_embed(v, offset=-2, dim1=0, dim2=2), v)
    check(lambda v: torch.diag(v[0], 1), v)
    check(lambda v: torch.diag(v, -1), v)
    check(lambda v: torch.diagflat(v), v)
    check(lambda a, b: torch.block_diag(a, b, a[:1]), v, torch.randn(3, 2))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_searchsorted_bucketize():
    seq = torch.sort(torch.randn(10)).values
    vals = torch.randn(3, 4)
    check(lambda s, v: torch.searchsorted(s, v), seq, vals)
    check(lambda s, v: torch.searchsorted(s, v, right=True, out_int32=True), seq, seq)
    check(lambda s, v: torch.searchsorted(s, v, side="right"), seq, seq[3:6])
    bs = torch.sort(torch.randn(3, 6), dim=-1).values
    check(lambda s, v: torch.searchsorted(s, v), bs, vals)
    perm = torch.randperm(10)
    check(lambda s, v, p: torch.searchsorted(s, v, sorter=p), seq[torch.argsort(perm)], vals, perm)
    check(lambda v, b: torch.bucketize(v, b), vals, seq)
    check(lambda v, b: torch.bucketize(v, b, right=True), seq, seq)


@pytest.mark.parametrize("shape,dim", [((3,), 0), ((2, 3), 0), ((2, 3), 1), ((2, 3, 4), 1),
                                       ((2, 3, 4), 2), ((2, 3), -1)])
def test_index_select_out_of_range_raises_as_cpu(shape, dim):
    # CPU raises IndexError, except its kernel for dim 1 (RuntimeError); this raised RuntimeError
    # for every case.
    idx = torch.tensor([0, 9])
    with pytest.raises((IndexError, RuntimeError)) as want:
        torch.ones(shape).index_select(dim, idx)
    with pytest.raises((IndexError, RuntimeError)) as got:
        torch.ones(shape, device="tpu").index_select(dim, idx.to("tpu")).cpu()
    assert type(got.value) is type(want.value)


@pytest.mark.parametrize("mask_shape", [(2, 5, 1), (2, 5, 4)])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_masked_scatter_gradients(mask_shape):
    # masked_scatter_backward (the source's gradient), once a CPU fallback: a vision-language
    # model that puts image features into its token embeddings synced on it every step.
    torch.manual_seed(0)
    x, src = torch.randn(2, 5, 4), torch.randn(3, 7, 4)
    mask = torch.rand(mask_shape) > 0.5

    def run(dev):
        a, s = x.to(dev).requires_grad_(), src.to(dev).requires_grad_()
        out = a.masked_scatter(mask.to(dev), s)
        go = torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape) / 10
        return [out] + list(torch.autograd.grad(out, (a, s), go.to(dev)))

    want = run("cpu")
    deferfuse.reset_metrics()
    for a, b in zip(run("tpu"), want):
        assert_same(a, b)
    assert deferfuse.metrics()["cpu_fallbacks"] == {}


@pytest.mark.modes("strict")     # the test sets each mode itself
@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_indexing_an_empty_dim_after_other_sizes_as_cpu(mode):
    # The sizes change from call to call, so the ops run padded in buckets (NOTE [buckets]):
    # an index's padding reads position 0, which is out of range of a dim of length 0; only the
    # index's exact entries are checked (sort's indices of an empty row, then take_along_dim:
    # the OpInfo sweep's sort and argsort ties view).
    torch.manual_seed(0)
    with deferfuse.mode(mode):
        for n in (5, 3, 0, 4, 0):
            x = torch.randn(n)
            check(lambda v: torch.take_along_dim(v, torch.argsort(v), -1), x)
            check(lambda v: torch.sort(v, descending=True).values, x)
            check(lambda v: torch.gather(v, 0, torch.argsort(v)), x)
            check(lambda v: v.index_select(0, torch.argsort(v)), x)
            check(lambda v: v[torch.argsort(v)], x)
            m = torch.randn(n, 3)
            check(lambda v: torch.take_along_dim(v, v.argsort(0), 0), m)
    # an index that is out of range still raises as on CPU once the dim is empty
    with deferfuse.mode("strict"):
        for n in (5, 3, 0):
            x, i = torch.randn(n), torch.zeros(2, dtype=torch.long)
            if n:
                check(lambda v, j: torch.gather(v, 0, j), x, i)
                continue
            with pytest.raises(RuntimeError, match="index 0 is out of bounds for dimension 0 with size 0"):
                torch.gather(x, 0, i)
            with pytest.raises(RuntimeError, match="index 0 is out of bounds for dimension 0 with size 0"):
                torch.gather(x.to(T), 0, i.to(T)).cpu()
