"""Reductions, scans, sorting and selection on tpu against CPU eager PyTorch.

float32 cases run in both modes; the dtype sweeps (same lowerings, other dtypes) run in defer mode
only, where a whole case is one compiled region, to keep the file fast.
"""
import math

import pytest
import torch

import deferfuse
from util import assert_same, to_tpu as tpu

# (atol, rtol) per dtype, about what PyTorch's own device tests allow for reductions.
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-10, 1e-10),
       torch.bfloat16: (1e-2, 1.6e-2)}


def check(fn, *inputs, tol=None):
    """``fn`` on tpu copies of ``inputs`` matches ``fn`` on CPU, without any CPU fallback."""
    want = fn(*inputs)
    deferfuse.reset_metrics()
    got = fn(*tpu(inputs))
    atol, rtol = tol or TOL.get(inputs[0].dtype, (0, 0))
    if isinstance(want, tuple):   # torch.return_types -> plain tuple
        want, got = tuple(want), tuple(got)
    assert_same(got, want, atol=atol, rtol=rtol)
    fb = deferfuse.metrics()["cpu_fallbacks"]
    assert not fb, f"fell back to CPU: {fb}"


def make(shape, dtype, nan=False, ties=False):
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if not dtype.is_floating_point or ties:
        x = torch.randint(-4, 5, shape).to(dtype)
    else:
        x = torch.randn(shape, dtype=dtype)
    if nan:
        x.view(-1)[::7] = float("nan")
    return x


# --------------------------------------------------------------------------------------------
# float32, both modes

@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_sums():
    x = make((3, 4, 5), torch.float32)
    check(lambda x: (x.sum(), x.sum(1), x.sum((0, 2), keepdim=True), x.sum(-1, dtype=torch.float64),
                     x.prod(1), x.mean(), x.mean(0, keepdim=True), x.count_nonzero(1),
                     x.cumsum(1), x.cumprod(2)), x)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_nan_reductions():
    x = make((4, 6), torch.float32, nan=True)
    check(lambda x: (x.sum(1), x.nansum(1), x.nansum(), x.nanmean(0), x.any(1), x.all(),
                     x.any((0, 1)), torch.all(x, dim=())), x)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_var_std():
    x = make((4, 5, 6), torch.float32)
    check(lambda x: (x.var(1), x.std(1, unbiased=False), torch.var(x, (0, 2), keepdim=True),
                     torch.std(x, dim=None, correction=3), torch.var(x, 2, correction=2.5),
                     torch.var_mean(x, 1), torch.std_mean(x, (0, 1), correction=0, keepdim=True),
                     x.var()), x)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_extremes_nan_and_ties():
    x = make((5, 8), torch.float32, ties=True)
    x[1, 3] = x[1, 6] = x[3, 0] = float("nan")
    check(lambda x: (x.amax(1), x.amin(0), x.max(1), x.min(1, keepdim=True), x.argmax(1),
                     x.argmin(1), x.max(), x.argmax(), torch.aminmax(x, dim=0), x[4].argmax()), x)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_logsumexp_and_norms():
    x = make((4, 6), torch.float32)
    x[1] = -math.inf
    x[2, 2] = math.inf
    x[0, 1] = 0
    check(lambda x: (x.logsumexp(1), torch.logcumsumexp(x, 1),
                     torch.linalg.vector_norm(x[3:]), torch.linalg.vector_norm(x, math.inf, 1),
                     torch.linalg.vector_norm(x[3:], 0), torch.linalg.vector_norm(x[3:], 3, 1),
                     torch.linalg.vector_norm(x[3:], -1.5, 1), x[3:].norm(p=1, dim=0)), x)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_scans_ties_nan():
    x = make((5, 6), torch.float32, ties=True)
    x[1, 2] = x[3, 4] = x[3, 5] = float("nan")
    check(lambda x: (x.cummax(1), x.cummin(0)), x)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_sort_select():
    x = make((4, 9), torch.float32, ties=True)
    x[1, 3] = x[1, 5] = x[2, 0] = float("nan")
    y = torch.randperm(36).reshape(4, 9).float()   # topk's order of ties is unspecified
    y[1, 3] = float("nan")
    check(lambda x, y: (x.sort(), x.sort(0, descending=True), torch.sort(x, stable=True, dim=1),
                        torch.argsort(x, dim=1, descending=True, stable=True), y.topk(3),
                        y.topk(2, 0, largest=False)), x, y)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_median_mode():
    x = torch.randperm(40).reshape(5, 8).float()
    x[1, 3] = float("nan")
    x[2, :] = float("nan")
    x[3, 1:5] = float("nan")
    y = torch.tensor([[1, 2, 2, 1, 3, 3], [5, 5, 4, 4, 4, 0], [7, 6, 5, 4, 3, 2]]).float()
    # (the index nanmedian reports for an all-NaN row is arbitrary on CPU: not compared)
    check(lambda x, y: (x.median(), x.median(1), x[3:].nanmedian(1), x.nanmedian(),
                        x.nanmedian(1)[0], x[3:].kthvalue(3, 1), y.mode(1)), x, y)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_zero_dim_and_empty():
    s = torch.tensor(2.5)
    check(lambda s: (s.sum(0), s.max(0), s.argmax(0, True), s.sort(), s.topk(1), s.cumsum(0),
                     s.cummax(0), s.logsumexp(0), s.median(), s.kthvalue(1)), s)
    e = torch.randn(3, 0)
    check(lambda e: (e.sum(1), e.prod(1), e.mean(0), e.any(1), e.all(1), e.logsumexp(1),
                     e.amax(0), e.sort(1), e.norm(dim=1), e.argmax(0), e.max(0)[0]), e)
    check(lambda e: e.median(), torch.empty(0))
    for f in (lambda e: e.amax(1), lambda e: e.max(1), lambda e: e.argmax(1),
              lambda e: e.median(1), lambda e: e.mode(1), lambda e: e.amin(-1),
              lambda e: torch.aminmax(e, dim=1), lambda e: e.amax(), lambda e: e.max(),
              lambda e: e.min(), lambda e: torch.aminmax(e), lambda e: e.nanmedian(-1),
              lambda e: e.kthvalue(1, 1), lambda e: e.max(-1), lambda e: e.argmin()):
        with pytest.raises((IndexError, RuntimeError)) as cpu_err:
            f(e)
        # the same type and words, at the call
        with pytest.raises(type(cpu_err.value)) as err:
            f(e.to("tpu"))
            deferfuse.sync()
        assert str(cpu_err.value) in str(err.value)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_under_autograd():
    x = torch.randn(4, 5, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    f = lambda x: (x.sum(1).prod() + x.var(0).sum() + x.logsumexp(1).sum() + x.amax(1).sum()
                   + x.norm(dim=1).sum() + x.cumsum(1).sum())
    g, = torch.autograd.grad(f(x), x)
    gt, = torch.autograd.grad(f(xt), xt)
    assert_same(gt, g, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# dtype sweeps (defer mode: one region per case)

SWEEP = [torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.bool]


@pytest.mark.modes("defer")
@pytest.mark.parametrize("dtype", SWEEP, ids=str)
def test_sum_prod_dtypes(dtype):
    # int and bool inputs accumulate (and return) int64, bfloat16 accumulates in float32
    x = make((3, 4, 5), dtype)
    check(lambda x: (x.sum(), x.sum(1), x.sum((0, 2), keepdim=True), x.sum(-1, dtype=torch.float64),
                     x.sum([]), x.prod(), x.prod(1), x.nansum(0), x.count_nonzero((0, 1)),
                     x.any(1), x.all(2, keepdim=True), torch.cumsum(x, 1),
                     torch.cumprod(x[..., :3], 2)), x, tol=(2e-2, 2e-2) if dtype == torch.bfloat16 else None)


@pytest.mark.modes("defer")
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_float_stats_dtypes(dtype):
    x = make((4, 5, 6), dtype)
    check(lambda x: (x.mean(), x.mean(0), x.var(1), x.std(1, unbiased=False),
                     torch.var(x, 2, correction=2.5), torch.var_mean(x, 1), x.logsumexp(1),
                     torch.logcumsumexp(x, 2), torch.linalg.vector_norm(x, 2, 1),
                     torch.linalg.vector_norm(x, math.inf, (0, 2)), x.norm(p=3, dim=0),
                     torch.linalg.vector_norm(x, dtype=torch.float64)), x)


@pytest.mark.modes("defer")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64], ids=str)
def test_order_dtypes(dtype):
    x = make((4, 9), dtype, ties=True)
    if dtype.is_floating_point:
        x[1, 3] = x[1, 5] = x[2, 0] = float("nan")
    y = torch.randperm(36).reshape(4, 9).to(dtype)   # topk's order of ties is unspecified
    z = torch.tensor([[1, 2, 2, 1, 3, 3], [5, 5, 4, 4, 4, 0], [7, 6, 5, 4, 3, 2]]).to(dtype)
    check(lambda x, y, z: (x.amax(1), x.amin(), x.max(1), x.min(0), x.argmax(1), x.argmin(0),
                           torch.aminmax(x), x.cummax(1), x.cummin(0), x.sort(0, descending=True),
                           torch.argsort(x, dim=1, stable=True), y.topk(3),
                           y.topk(2, 0, largest=False), z.mode(1)), x, y, z)


@pytest.mark.modes("defer")
def test_median_int():
    x = torch.randperm(40).reshape(5, 8)
    check(lambda x: (x.median(), x.median(1), x.median(0, keepdim=True), x.nanmedian(1),
                     x.kthvalue(3, 1), x[:, :7].median(1)), x)


@pytest.mark.modes("defer")
def test_bool_extremes_and_sort():
    x = make((4, 7), torch.bool)
    check(lambda x: (x.amax(), x.amin(1), x.max(), x.max(1), x.min(0, keepdim=True),
                     torch.aminmax(x, dim=1), x.sort(1), x.sort(0, descending=True)), x)


@pytest.mark.modes("defer")
def test_degenerate_and_views():
    x = torch.randn(3, 1)
    y = torch.randn(6, 8)
    with pytest.warns(UserWarning):
        check(lambda x, y: (x.var(1), x.std(1), torch.var(x, 0, correction=5), x[0, 0].var(),
                            y.t().sum(1), y[:, ::2].amax(0), y.t().sort(1), y[1:, 2:].var(0),
                            y.t().cumsum(0), y.t().argmax(1)), x, y)


@pytest.mark.modes("defer")
def test_bfloat16_sum_accumulates_wide():
    x = torch.full((4096,), 1.0, dtype=torch.bfloat16) + torch.rand(4096).to(torch.bfloat16) * 0.01
    check(lambda x: (x.sum(), x.mean()), x, tol=(1e-2, 1e-2))


@pytest.mark.parametrize("values", [[True, True], [True, False], [False, False], []])
def test_is_all_true_and_is_any_true(values):
    # torch.distributions checks its arguments with these (then .item()); they ran on CPU before.
    t = torch.tensor(values, dtype=torch.bool)
    for f in (torch._is_all_true, torch._is_any_true):
        assert_same(f(tpu(t)), f(t))
    deferfuse.sync()
    assert dict(deferfuse.metrics()["cpu_fallbacks"]) == {}


_DIM_OPS = {
    "softmax": lambda x, d: x.softmax(d), "log_softmax": lambda x, d: x.log_softmax(d),
    "sort": lambda x, d: x.sort(d), "sort_stable": lambda x, d: x.sort(dim=d, stable=True),
    "argsort": lambda x, d: x.argsort(d), "sum": lambda x, d: x.sum(d),
    "cumsum": lambda x, d: x.cumsum(d), "topk": lambda x, d: x.topk(1, d),
    "max": lambda x, d: x.max(d), "logsumexp": lambda x, d: x.logsumexp(d),
}


@pytest.mark.parametrize("name", sorted(_DIM_OPS))
@pytest.mark.parametrize("shape,dim", [((2, 3), 5), ((2, 3), -3), ((), 1)])
def test_dim_out_of_range_raises_as_cpu(name, shape, dim):
    # softmax and sort took any dim: softmax failed later inside a fused region, sort answered
    # along dim % rank; CPU raises IndexError at the call.
    f = _DIM_OPS[name]
    with pytest.raises(IndexError) as want:
        f(torch.ones(shape), dim)
    with pytest.raises(IndexError) as got:
        f(torch.ones(shape, device="tpu"), dim)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("f", [lambda x: x.var(), lambda x: x.std(0), lambda x: torch.var_mean(x),
                               lambda x: x.var(unbiased=False)])
def test_var_std_of_integers_raise_as_cpu(f):
    # Their meta kernels take integer tensors; CPU refuses them.
    with pytest.raises(RuntimeError) as want:
        f(torch.ones(3, dtype=torch.long))
    with pytest.raises(RuntimeError) as got:
        f(torch.ones(3, dtype=torch.long, device="tpu"))
    assert str(got.value) == str(want.value)


@pytest.mark.modes("defer")
def test_histogram_and_histogramdd():
    """torch.histogram / histogramdd on tpu (CPU kernels only in PyTorch; deferfuse/histogram.py):
    edges from the data, a range, or given edges; weights, density; values on inner edges, on the
    right edge, outside the range and NaN; one value (the range widened by 0.5); errors CPU's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=g)
    x[0, :4] = torch.tensor([0.0, 1.0, -1.0, float("nan")])
    w = torch.rand(3, 40, generator=g)
    for kw in ({}, {"range": (0.0, 1.0), "weight": w, "density": True}):
        check(lambda t, kw=kw: torch.histogram(t, 7, **{k: tpu(v) if k == "weight" and
                                                        t.device.type == "tpu" else v
                                                        for k, v in kw.items()}),
              x.nan_to_num() if "range" not in kw else x)
    edges = torch.tensor([-2.0, -0.5, 0.0, 1.0, 3.0])
    check(lambda t: torch.histogram(t, edges.to(t.device)), x)
    check(lambda t: torch.histogram(t, 4), torch.full((5,), 2.0))      # one value: widened
    pts = torch.randn(50, 2, generator=g)
    check(lambda t: torch.histogramdd(t, [3, 2], range=[-1.0, 1.0, 0.0, 2.0], density=True), pts)
    check(lambda t: torch.histogramdd(t, [e.to(t.device) for e in (edges, edges[1:])]), pts)
    for bad in (torch.tensor([1.0, float("inf")]), torch.tensor([float("nan"), 1.0])):
        with pytest.raises(RuntimeError) as cpu:
            torch.histogram(bad, 3)
        with pytest.raises(RuntimeError) as got:
            torch.histogram(tpu(bad), 3)
        assert str(got.value) == str(cpu.value)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_histc_of_integers_counts_like_float(dtype):
    """CPU refuses an integer histc; CUDA (and tpu) count in the input's dtype, and transformers'
    MoE layers call it with integer expert ids off CPU. The counts are CPU's float histc's."""
    x = torch.tensor([0, 1, 1, 3, 5, 2, 7, 3], dtype=dtype)
    for kw in (dict(bins=4, min=0, max=3), dict(bins=3)):
        want = torch.histc(x.float(), **kw).to(dtype)
        assert_same(torch.histc(x.to("tpu"), **kw), want, 0, 0)
    with pytest.raises(NotImplementedError):
        torch.histc(x, bins=4)      # CPU still refuses it
