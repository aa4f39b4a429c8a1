"""Ops whose output size depends on the data (nonzero, masked_select, x[mask], unique,
unique_consecutive) run on the device: CPU's values, dtypes, shapes and errors, no CPU fallback,
one host read of the size, and one compile per bucket of sizes, not per size."""
import pytest
import torch

import deferfuse
from util import assert_same, to_tpu

# float16 and int32 as bfloat16 and int64 (the OpInfo sweep runs every dtype)
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def _sample(dtype, shape=(5, 6)):
    x = (torch.randn(shape) * 3).round()
    x[torch.rand(shape) < 0.4] = 0
    return x.to(dtype)


def _check(fn, *xs):
    want = fn(*xs)
    got = fn(*to_tpu(xs))
    assert_same(got, want)


def _no_fallback():
    deferfuse.sync()
    assert dict(deferfuse.metrics()["cpu_fallbacks"]) == {}


OPS = {
    "nonzero": lambda x: torch.nonzero(x),
    "argwhere": lambda x: torch.argwhere(x),
    "nonzero_tuple": lambda x: torch.nonzero(x, as_tuple=True),
    "bool_index": lambda x: x[x != 0],
    "bool_index_rows": lambda x: x[(x != 0).any(1)],
    "bool_index_mixed": lambda x: x[1:, (x != 0).all(0)],
    "masked_select": lambda x: torch.masked_select(x, x != 0),
    "masked_select_broadcast": lambda x: torch.masked_select(
        x[:, :1], torch.arange(6, device=x.device) % 2 == 0),
    "unique": lambda x: torch.unique(x),
    "unique_all": lambda x: torch.unique(x, return_inverse=True, return_counts=True),
    "unique_unsorted_inverse": lambda x: torch.unique(x, sorted=False, return_inverse=True)[1],
    "unique_consecutive": lambda x: torch.unique_consecutive(x, return_inverse=True,
                                                             return_counts=True),
    "unique_consecutive_dim": lambda x: torch.unique_consecutive(
        x[[0, 0, 1, 2, 2, 3]], return_inverse=True, return_counts=True, dim=0),
    "unique_consecutive_dim1": lambda x: torch.unique_consecutive(x[:, [0, 0, 1, 2, 2, 3]], dim=-1),
    "unique_consecutive_plain": lambda x: torch.unique_consecutive(x.flatten().sort()[0]),
}
EVERY_DTYPE = ("nonzero", "bool_index", "masked_select", "unique_all", "unique_consecutive",
               "unique_consecutive_dim")


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_matches_cpu(op, tpu_mode):
    for dtype in (DTYPES if op in EVERY_DTYPE else DTYPES[:1]):
        _check(OPS[op], _sample(dtype))
    _no_fallback()


@pytest.mark.parametrize("x", [torch.tensor(3.0), torch.zeros(0, 3), torch.zeros(4, 4),
                               torch.tensor([1.0, float("nan"), 1.0, float("nan"), -0.0, 0.0])],
                         ids=["0d", "empty", "all_zero", "nan"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_edge_inputs(x, tpu_mode):
    for name in ("nonzero", "masked_select", "unique_all", "unique_consecutive"):
        _check(OPS[name], x)
    _no_fallback()


@pytest.mark.parametrize("fn,args", [
    (lambda a, m: torch.masked_select(a, m), (torch.randn(3), torch.ones(4, dtype=torch.bool))),
    (lambda a, m: torch.masked_select(a, m), (torch.randn(3), torch.ones(3))),
    (lambda a, m: a[m], (torch.randn(3, 4), torch.ones(4, dtype=torch.bool))),
    (lambda a, m: a[m], (torch.randn(3), torch.ones(3, 1, dtype=torch.bool))),
], ids=["shapes", "mask_dtype", "mask_shape", "too_many"])
def test_errors_as_on_cpu(fn, args, tpu_mode):
    with pytest.raises(Exception) as want:
        fn(*args)
    with pytest.raises(type(want.value)) as got:
        fn(*to_tpu(args))
    assert str(got.value) == str(want.value)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_backward(tpu_mode):
    x = torch.randn(4, 5, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    m = torch.rand(4, 5) > 0.5
    for a, mask in ((x, m), (xt, m.to("tpu"))):
        ((torch.masked_select(a, mask) * 2).sum() + (a[mask] ** 2).sum()
         + a[(a > 0).any(1)].sum()).backward()
        y = a.clone()
        y[mask] = torch.arange(1.0, 1.0 + int(m.sum()), device=a.device)
        (y * y).sum().backward()
    assert_same(xt.grad, x.grad)
    _no_fallback()


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_varying_count_compiles_per_bucket(tpu_mode):
    """A loop whose count changes every step within one bucket (65 .. 128): the first step
    compiles, every later one compiles nothing, and each op reads one count from the device."""
    ar = torch.arange(256)
    art = ar.to("tpu")
    compiles = []
    for k in range(65, 129, 6):
        idx = (art < k).nonzero()
        vals = torch.masked_select(art * 2, art < k)
        u, c = torch.unique(art % k, return_counts=True)
        assert_same(idx, (ar < k).nonzero())
        assert_same(vals, torch.masked_select(ar * 2, ar < k))
        assert_same((u, c), torch.unique(ar % k, return_counts=True))
        compiles.append(deferfuse.metrics()["compiles"])
    if tpu_mode != "debug":      # debug mode runs op by op (no compile counted)
        assert compiles[0] > 0
    assert compiles[1] == compiles[-1], compiles
    if tpu_mode == "defer":
        assert deferfuse.metrics()["syncs"].get("data-dependent shape", 0) >= 3 * len(compiles)
    _no_fallback()


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_bincount_on_tpu():
    """bincount: its length read from the data once (the input's smallest and largest values),
    counts or weights added on the device; weights' dtypes, minlength, an empty input, and CPU's
    errors (a negative value, a float input) as CPU raises them; no CPU fallback."""
    x = torch.tensor([1, 3, 3, 0, 7])
    before = dict(deferfuse.metrics()["cpu_fallbacks"])
    for args in [(x,), (x, None, 10), (x, torch.linspace(0, 1, 5)),
                 (x.int(), torch.ones(5, dtype=torch.int32)), (torch.tensor([], dtype=torch.long),),
                 (torch.tensor([], dtype=torch.long), None, 3)]:
        want = torch.bincount(*args)
        got = torch.bincount(*[a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args])
        assert_same(got, want)
    assert deferfuse.metrics()["cpu_fallbacks"] == before
    for bad in (torch.tensor([-1, 2]), x.float()):
        with pytest.raises(Exception) as cpu:
            torch.bincount(bad)
        with pytest.raises(type(cpu.value), match=str(cpu.value).replace("(", r"\(").replace(
                ")", r"\)").replace(".", r"\.")):
            torch.bincount(bad.to("tpu"))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_repeat_interleave_on_tpu(tpu_mode):
    """repeat_interleave with a repeats tensor (Hugging Face's grouped and packed attention use
    it): CPU's values and dtype, with and without output_size (then nothing is read: the sum and
    the sign are checked on the device); CPU's errors; no fallback for valid input."""
    x = torch.randn(4, 3)
    deferfuse.reset_metrics()
    for r, given in ((torch.tensor([1, 0, 3, 2]), False), (torch.tensor([0, 0, 0, 0]), False),
                     (torch.tensor([2, 2, 1, 2], dtype=torch.int32), True)):
        kw = {"output_size": int(r.sum())} if given else {}
        _check(lambda r: torch.repeat_interleave(r, **kw), r)
        _check(lambda x, r: x.repeat_interleave(r, dim=0, **kw), x, r)
    _check(lambda x, r: x.repeat_interleave(r[:3], dim=1), x, torch.tensor([2, 0, 1]))
    _no_fallback()
    for bad, kw in ((torch.tensor([1, -1, 2]), {}), (torch.tensor([1, 2]), {"output_size": 5}),
                    (torch.tensor([[1, 2]]), {})):
        with pytest.raises(RuntimeError) as want:
            torch.repeat_interleave(bad, **kw)
        with pytest.raises(RuntimeError) as got:
            torch.repeat_interleave(bad.to("tpu"), **kw).cpu()
        assert str(got.value).startswith(str(want.value))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_unique_dim_on_tpu(tpu_mode):
    """unique(x, dim=d): the distinct slices sorted lexicographically (one sort with every column
    a key), inverse and counts, in CPU's values and dtypes (bool, bfloat16, -0.0 equal to 0.0);
    no CPU fallback."""
    torch.manual_seed(0)
    deferfuse.reset_metrics()
    cases = [torch.tensor([[1, 2], [0, 5], [1, 2], [0, 1]]), torch.randint(0, 3, (7, 3)),
             torch.randn(5, 4) > 0, torch.randint(0, 2, (3, 6, 2)).to(torch.bfloat16),
             torch.tensor([[-0.0, 1.0], [0.0, 1.0], [0.0, -1.0]])]
    for x, dims in zip(cases, ((0, 1), (0,), (0,), (1,), (0,))):
        for d in dims:
            _check(lambda x: torch.unique(x, dim=d, return_inverse=True, return_counts=True), x)
    _no_fallback()
