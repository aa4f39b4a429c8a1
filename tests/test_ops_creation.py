"""Factories and *_like ops against CPU eager (dtype and values), then the _foreach ops and the
optimizers' foreach / for-loop / fused paths and GradScaler step for step against CPU."""
import copy

import pytest
import torch
import torch.nn.functional as F

import deferfuse
from util import assert_same

T = "tpu"


def same_factory(fn, atol=0.0, rtol=0.0):
    """fn(device) on tpu and on CPU: same dtype, shape and values."""
    assert_same(fn(T), fn("cpu"), atol=atol, rtol=rtol)


def fallbacks():
    deferfuse.sync()
    return dict(deferfuse.metrics()["cpu_fallbacks"])


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_zeros_ones_full_tensor():
    deferfuse.reset_metrics()
    same_factory(lambda d: torch.zeros(3, device=d))
    same_factory(lambda d: torch.zeros(2, 3, dtype=torch.int32, device=d))
    same_factory(lambda d: torch.ones(2, 0, 4, device=d))
    same_factory(lambda d: torch.ones((), dtype=torch.bool, device=d))
    same_factory(lambda d: torch.full((2,), 7, device=d, dtype=torch.int64))
    same_factory(lambda d: torch.full((2, 2), 1.5, device=d))
    same_factory(lambda d: torch.full((3,), 7, device=d))            # int fill -> int64
    same_factory(lambda d: torch.full((3,), True, device=d))
    same_factory(lambda d: torch.tensor([1.5, 2, 3], device=d))
    same_factory(lambda d: torch.tensor([[1, 2], [3, 4]], device=d))
    same_factory(lambda d: torch.tensor(3.25, device=d, dtype=torch.float64))
    same_factory(lambda d: torch.scalar_tensor(4, device=d))
    same_factory(lambda d: torch.scalar_tensor(4, dtype=torch.int32, device=d))
    assert fallbacks() == {}


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_arange_linspace_logspace():
    deferfuse.reset_metrics()
    same_factory(lambda d: torch.arange(0, 1, 0.1, device=d))
    same_factory(lambda d: torch.arange(5, device=d))
    same_factory(lambda d: torch.arange(2, 11, 3, device=d))
    same_factory(lambda d: torch.arange(1, 2.5, 0.3, device=d))
    same_factory(lambda d: torch.arange(10, 0, -1.5, device=d, dtype=torch.float64))
    same_factory(lambda d: torch.arange(0.5, 5, 1.5, device=d, dtype=torch.int64))
    same_factory(lambda d: torch.arange(-3, 3, device=d, dtype=torch.float32))
    same_factory(lambda d: torch.arange(0, 0, device=d))
    same_factory(lambda d: torch.linspace(0, 1, 7, device=d), atol=1e-7)
    same_factory(lambda d: torch.linspace(-2.5, 10, 50, device=d), atol=1e-6)
    same_factory(lambda d: torch.linspace(3, 3, 1, device=d))
    same_factory(lambda d: torch.linspace(0, 1, 0, device=d))
    same_factory(lambda d: torch.linspace(0.5, 10.7, 5, dtype=torch.int64, device=d))
    same_factory(lambda d: torch.logspace(0, 2, 5, device=d), rtol=1e-6)
    same_factory(lambda d: torch.logspace(-1, 1, 6, base=2, device=d), rtol=1e-6)
    start, end = torch.tensor(1.0), torch.tensor(4.0)
    same_factory(lambda d: torch.linspace(start.to(d), end.to(d), 4, device=d), atol=1e-6)
    assert fallbacks() == {}


def test_eye_tri_indices():
    deferfuse.reset_metrics()
    same_factory(lambda d: torch.eye(3, device=d))
    same_factory(lambda d: torch.eye(3, 4, device=d))
    same_factory(lambda d: torch.eye(4, 2, dtype=torch.int64, device=d))
    same_factory(lambda d: torch.eye(2, dtype=torch.bool, device=d))
    same_factory(lambda d: torch.tril_indices(4, 3, device=d))
    same_factory(lambda d: torch.tril_indices(3, 5, 1, device=d))
    same_factory(lambda d: torch.triu_indices(4, 4, -1, device=d))
    same_factory(lambda d: torch.triu_indices(3, 2, device=d, dtype=torch.int32))
    assert fallbacks() == {}


def test_like_and_new():
    deferfuse.reset_metrics()
    x = torch.randn(2, 3)
    i = torch.arange(4, dtype=torch.int32)
    for src in (x, i):
        same_factory(lambda d: torch.zeros_like(src.to(d)))
        same_factory(lambda d: torch.ones_like(src.to(d), dtype=torch.float64))
        same_factory(lambda d: torch.full_like(src.to(d), 3))
        same_factory(lambda d: torch.full_like(src.to(d), 2.5, dtype=torch.float32))
        same_factory(lambda d: src.to(d).new_zeros(2, 2))
        same_factory(lambda d: src.to(d).new_ones((3,), dtype=torch.bool))
        same_factory(lambda d: src.to(d).new_full((2, 1), 9))
        same_factory(lambda d: src.to(d).new_tensor([1, 2]))
        assert torch.empty_like(src.to(T)).dtype == src.dtype
        assert torch.empty_like(src.to(T)).shape == src.shape
    same_factory(lambda d: torch.zeros_like(x.t().to(d)))
    assert fallbacks() == {}


def test_factories_with_indexing_users():
    # composite ops that build index tensors with factories on the tensor's device
    deferfuse.reset_metrics()
    i = torch.tensor([[0, 4], [2, 1]])
    assert_same(F.one_hot(i.to(T), 5), F.one_hot(i, 5))
    assert_same(F.one_hot(i.to(T)), F.one_hot(i))
    v = torch.randn(3)
    assert_same(torch.diag(v.to(T)), torch.diag(v))
    assert_same(torch.block_diag(v.to(T), v[:2].to(T)), torch.block_diag(v, v[:2]))
    assert fallbacks() == {}


def test_tensor_from_a_list_of_tpu_scalars():
    # torch.tensor(data) reads tensors in data with item() below Python dispatch (qwen3_asr's
    # chunk lengths, udop's): on tpu as on CPU, whatever device the result is made on
    lens = torch.tensor([5, 3, 7])
    scores = torch.randn(3)
    want = torch.tensor([lens[i] for i in range(3)])
    assert_same(torch.tensor([lens.to(T)[i] for i in range(3)], device=T), want)
    assert_same(torch.tensor([lens.to(T)[i] for i in range(3)], device=T).cumsum(-1, dtype=torch.int32),
                want.cumsum(-1, dtype=torch.int32))
    assert_same(torch.tensor([scores.to(T)[0], scores.to(T)[2]], device=T), torch.tensor([scores[0], scores[2]]))
    on_cpu = torch.tensor([scores.to(T)[0], scores.to(T)[2]])
    assert on_cpu.device.type == "cpu" and on_cpu.dtype == torch.float32
    assert torch.equal(on_cpu, torch.tensor([scores[0], scores[2]]))



@pytest.mark.parametrize("bad", [[0, 3, 5], [0, -1, 2]])
def test_one_hot_class_out_of_range_raises_as_on_cpu(bad):
    # PyTorch's composite one_hot skips its range check on PrivateUse1: without one of our own, a
    # class >= num_classes became a row of zeros.
    with pytest.raises(RuntimeError) as cpu_err:
        F.one_hot(torch.tensor(bad), 4)
    with pytest.raises(RuntimeError, match=str(cpu_err.value)):
        F.one_hot(torch.tensor(bad).to(T), 4).cpu()
    ok = torch.tensor([[0, 3], [2, 1]])
    assert_same(F.one_hot(ok.to(T), 4), F.one_hot(ok, 4))

# --------------------------------------------------------------------------------------------
# foreach

def _lists(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (5,), (2, 2, 2)][:n]
    return [torch.randn(s, generator=g) for s in shapes]


def _tpu(xs):
    return [x.to(T) for x in xs]


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_foreach_functional_and_inplace():
    a, b, c = _lists(), _lists(seed=1), [x.abs() + 0.5 for x in _lists(seed=2)]
    ta, tb, tc = _tpu(a), _tpu(b), _tpu(c)
    cases = [
        lambda a, b, c: torch._foreach_add(a, b, alpha=0.3),
        lambda a, b, c: torch._foreach_sub(a, 1.25),
        lambda a, b, c: torch._foreach_mul(a, [0.5, -2.0, 3.0]),
        lambda a, b, c: torch._foreach_mul(a, torch.tensor(1.7, device=a[0].device)),
        lambda a, b, c: torch._foreach_div(a, c),
        lambda a, b, c: torch._foreach_maximum(a, b),
        lambda a, b, c: torch._foreach_clamp_max(a, 0.2),
        lambda a, b, c: torch._foreach_pow(c, 2.5),
        lambda a, b, c: torch._foreach_sqrt(c),
        lambda a, b, c: torch._foreach_neg(a),
        lambda a, b, c: torch._foreach_addcmul(a, b, c, value=0.1),
        lambda a, b, c: torch._foreach_addcdiv(a, b, c, [0.1, 0.2, -0.3]),
        lambda a, b, c: torch._foreach_lerp(a, b, 0.3),
        lambda a, b, c: torch._foreach_lerp(a, b, 0.8),
        lambda a, b, c: torch._foreach_lerp(a, b, c),
        lambda a, b, c: torch._foreach_norm(a),
        lambda a, b, c: torch._foreach_norm(a, float("inf")),
        lambda a, b, c: torch._foreach_norm(a, 1),
        lambda a, b, c: torch._foreach_max(a),
    ]
    for k, f in enumerate(cases):
        assert_same(f(ta, tb, tc), f(a, b, c), atol=1e-5, rtol=1e-5, msg=f"case {k}")

    def inplace(a, b, c):
        a = [x.clone() for x in a]
        torch._foreach_mul_(a, 0.9)
        torch._foreach_add_(a, b, alpha=-0.1)
        torch._foreach_addcdiv_(a, b, c, value=0.5)
        torch._foreach_lerp_(a, b, 0.25)
        torch._foreach_maximum_(a, c)
        torch._foreach_sqrt_(a)
        torch._foreach_div_(a, [2.0, 3.0, 4.0])
        torch._foreach_mul_(a, torch.tensor(0.5, device=a[0].device))
        torch._foreach_zero_(a[:1])
        return a
    assert_same(inplace(ta, tb, tc), inplace(a, b, c), atol=1e-5, rtol=1e-5)


def test_foreach_inplace_reading_its_own_written_tensor():
    """An in-place foreach op whose single tensor argument is one it writes runs one element at a
    time, as CPU writes (the last element reads the middle one's new value); the one-element call
    that leaves is one op (it recursed for ever before)."""
    zs = [torch.tensor(v) for v in (2.0, 3.0, 5.0)]
    ts = _tpu(zs)
    for xs in (zs, ts):
        torch._foreach_mul_(xs, xs[1])
        torch._foreach_add_(xs[2:], xs[2])
    assert_same(ts, zs)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train(model, opt_cls, kw, device, steps=3, clip=False, dtype=torch.float32):
    model = copy.deepcopy(model).to(device, dtype)
    opt = opt_cls(model.parameters(), **kw)
    g = torch.Generator().manual_seed(1)
    params = []
    for _ in range(steps):
        x = torch.randn(5, 4, generator=g).to(device, dtype)
        y = torch.randn(5, 2, generator=g).to(device, dtype)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        params.append([p.detach().cpu().clone() for p in model.parameters()])
    return params


OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
    (torch.optim.Adam, dict(lr=0.01)),
    (torch.optim.Adam, dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=0.01)),
    (torch.optim.AdamW, dict(lr=0.01, amsgrad=True)),
]


# The default (foreach=None) takes the multi-tensor path on tpu: deferfuse adds TpuTensor to the
# types torch.optim's _default_to_fused_or_foreach accepts (test_optimizer_default_is_foreach).
VARIANTS = {"foreach=True": ({"foreach": True}, [OPTIMIZERS[k] for k in (1, 2, 4, 5)]),
            "foreach=False": ({"foreach": False}, OPTIMIZERS[1::2]),
            "default": ({}, OPTIMIZERS[1::3]),
            "fused=False": ({"fused": False}, OPTIMIZERS[4:5])}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_optimizers_match_cpu(variant):
    model = _model()
    extra, configs = VARIANTS[variant]
    for k, (cls, kw) in enumerate(configs):
        kw = dict(kw, **extra)
        clip = k % 2 == 1
        got = _train(model, cls, kw, T, clip=clip)
        want = _train(model, cls, kw, "cpu", clip=clip)
        for step, (gs, ws) in enumerate(zip(got, want)):
            for g, w in zip(gs, ws):
                torch.testing.assert_close(g, w, atol=2e-6, rtol=2e-5,
                                           msg=lambda m: f"{cls.__name__} {kw} step {step}: {m}")


def test_optimizer_default_is_foreach():
    from torch.optim.optimizer import _default_to_fused_or_foreach
    from torch.utils._foreach_utils import _has_foreach_support
    params = list(torch.nn.Linear(3, 2).to(T).parameters())
    assert _default_to_fused_or_foreach(params, differentiable=False) == (False, True)
    # on the tensors clip_grad_norm_ hands it (gradients): a Parameter's own type is not in
    # PyTorch's list, on cuda either (representation-neutral: was the parameters, TpuTensors)
    grads = [torch.zeros_like(p) for p in params]
    assert _has_foreach_support(grads, torch.device(T))


@pytest.mark.slow_params("strict")
def test_optimizer_foreach_runs_on_jax():
    deferfuse.reset_metrics()
    model = _model()
    for cls, kw in (OPTIMIZERS[1], OPTIMIZERS[4]):
        _train(model, cls, dict(kw, foreach=True), T, steps=2, clip=True)
    ran_on_cpu = {k for k in fallbacks() if "_foreach" in k}
    # In-place _foreach_*_ ops return nothing (schema "-> ()"): meta inference and the dispatcher
    # must accept that, else they run on CPU.
    assert not ran_on_cpu, f"foreach ops ran on CPU: {sorted(ran_on_cpu)}"


# fused=True: one op per parameter group (aten._fused_adam_ and friends), run on JAX.
FUSED = [
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=torch.tensor(0.1), momentum=0.9, dampening=0.1, maximize=True)),
    (torch.optim.Adam, dict(lr=0.01)),
    (torch.optim.Adam, dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=torch.tensor(0.02), weight_decay=0.05)),
    (torch.optim.AdamW, dict(lr=0.01, amsgrad=True, maximize=True)),
    (torch.optim.Adagrad, dict(lr=0.1)),
    (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, maximize=True)),
]


@pytest.mark.parametrize("k", range(len(FUSED)))
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_fused_optimizers_match_cpu(k):
    cls, kw = FUSED[k]
    kw = dict(kw, fused=True)
    deferfuse.reset_metrics()
    got = _train(_model(), cls, kw, T, steps=4, clip=k % 2 == 1)
    want = _train(_model(), cls, kw, "cpu", steps=4, clip=k % 2 == 1)
    for step, (gs, ws) in enumerate(zip(got, want)):
        for g, w in zip(gs, ws):
            torch.testing.assert_close(g, w, atol=2e-6, rtol=2e-5,
                                       msg=lambda m: f"{cls.__name__} {kw} step {step}: {m}")
    assert not fallbacks(), f"{cls.__name__}(fused=True) ran ops on CPU"


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_fused_adamw_bfloat16():
    """Half types compute in float32 and store back rounded, as CPU's fused kernel does."""
    g = torch.Generator().manual_seed(2)
    init = [[torch.randn(3, 5, generator=g).abs().bfloat16() for _ in range(2)] for _ in range(4)]
    init.append([torch.tensor(3.0), torch.tensor(3.0)])

    def state(device):
        return [[t.to(device) for t in ts] for ts in init]

    def step(ts):
        torch._fused_adamw_(ts[0], ts[1], ts[2], ts[3], [], ts[4], lr=0.01, beta1=0.9,
                            beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
        return ts[0] + ts[2] + ts[3]

    got, want = step(state(T)), step(state("cpu"))
    assert_same(got, want, atol=1e-5, rtol=1.6e-2)


def _scaled_train(device, opt_cls, fused):
    """GradScaler with a scale that grows every 2 steps; step 3's loss is inf, so that step is
    skipped and the scale backs off. Returns per step: weights, gradients, scale, growth count."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(device)
    opt = opt_cls(model.parameters(), lr=0.01, **({"fused": True} if fused else {}))
    scaler = torch.amp.GradScaler(device, init_scale=1024.0, growth_interval=2)
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(5):
        x = torch.randn(5, 4, generator=g)
        if i == 3:
            x[0, 0] = float("inf")
        x = x.to(device)
        opt.zero_grad()
        loss = F.mse_loss(model(x), torch.zeros(5, 2, device=device))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        out.append([t.detach().cpu().clone() for t in (model.weight, model.weight.grad,
                                                        scaler._scale, scaler._growth_tracker)])
    return out


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD], ids=["AdamW", "SGD"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_grad_scaler_matches_cpu(opt_cls, fused):
    """torch.amp.GradScaler: unscaling, the inf check and the scale update run on JAX; a fused
    optimizer takes grad_scale and found_inf itself, so a step needs no sync."""
    deferfuse.reset_metrics()
    got = _scaled_train(T, opt_cls, fused)
    want = _scaled_train("cpu", opt_cls, fused)
    for step, (gs, ws) in enumerate(zip(got, want)):
        for name, g, w in zip(("weight", "grad", "scale", "growth tracker"), gs, ws):
            torch.testing.assert_close(g, w, atol=2e-6, rtol=2e-5, equal_nan=True,
                                       msg=lambda m: f"step {step} {name}: {m}")
    assert [s[2].item() for s in want] == [1024.0, 2048.0, 2048.0, 1024.0, 1024.0]
    assert not fallbacks(), "GradScaler ran ops on CPU"


def test_default_dtype_changes_are_followed():
    # NOTE [default dtype] (device.py): entries made under one default dtype must not answer for
    # another; each call repeated under float32, float64, float32 gives CPU's dtype and values.
    x = torch.arange(5, device=T)
    xc = torch.arange(5)

    def calls(d, xi):
        return [torch.zeros(2, 3, device=d), torch.ones(3, device=d) * 2,
                torch.arange(0.0, 3.0, device=d), torch.full((2,), 1.5, device=d),
                torch.linspace(0, 1, 5, device=d), xi / 2, torch.sqrt(xi)]
    try:
        for dt in (torch.float32, torch.float64, torch.float32, torch.float64):
            torch.set_default_dtype(dt)
            for a, b in zip(calls(T, x), calls("cpu", xc)):
                assert_same(a, b)
                assert a.dtype == b.dtype
    finally:
        torch.set_default_dtype(torch.float32)


# Out-of-range float -> integer casts (NOTE [float to int casts] in runtime/lowering/creation.py):
# CPU's C cast, not XLA's saturation; NaN, infinities and values past 2**31 and 2**63 included.
_OUT_OF_RANGE = [-1e19, -1e10, -2.0 ** 31 - 1, -70000.5, -40000.0, -300.7, -257.0, -129.0, -1.5,
                 -0.5, 0.7, 127.9, 128.0, 200.0, 255.9, 256.0, 300.0, 65535.0, 70000.0,
                 2.0 ** 31 - 1, 2.0 ** 31 + 256, 2.0 ** 32 + 5, 1e10, 1e19, 1e30, float("inf"),
                 float("-inf"), float("nan")]


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_float_to_int_casts_out_of_range():
    deferfuse.reset_metrics()
    for src in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        x = torch.tensor(_OUT_OF_RANGE, dtype=torch.float64).to(src)
        for dst in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
            assert_same(x.to(T).to(dst), x.to(dst), msg=f"{src} -> {dst}")
            # inside a computation, and written into an integer tensor by copy_
            assert_same((x.to(T) * 2).to(dst), (x * 2).to(dst), msg=f"{src} * 2 -> {dst}")
            assert_same(torch.zeros(len(_OUT_OF_RANGE), dtype=dst, device=T).copy_(x.to(T)),
                        torch.zeros(len(_OUT_OF_RANGE), dtype=dst).copy_(x), msg=f"copy_ {dst}")
    x = torch.tensor([200.0], dtype=torch.float64)
    assert_same((x.to(T) * 2).to(torch.uint8), (x * 2).to(torch.uint8))   # 144, not 255
    assert not fallbacks()
