"""Pointwise ops (runtime/lowering/pointwise.py) against CPU eager PyTorch: unary math, binary
arithmetic with PyTorch's type promotion, comparisons, clamp/where overloads, activations and their
backward ops, in-place and out= variants (through views too). Every check also asserts that the op
did not fall back to CPU.

Compile time dominates this file, so: the value checks run in defer mode only (the lowerings are the
same functions in both modes), in-place/out= write-back (which the two modes do differently) runs
in both, and a strict-mode smoke test runs a representative subset op by op. Inputs share one
shape, (2, 12), so checks of the same op and dtype reuse one compiled program.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import deferfuse
from util import assert_same, to_tpu as tpu

aten = torch.ops.aten
NAN, INF = float("nan"), float("inf")
DEFER = pytest.mark.modes("defer")

TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-10, 1e-10), torch.bfloat16: (1e-2, 1.6e-2),
       torch.float16: (1e-3, 1e-3)}


def tol(*ts):
    a = r = 0.0
    for t in ts:
        if isinstance(t, torch.Tensor) and t.dtype in TOL:
            a, r = max(a, TOL[t.dtype][0]), max(r, TOL[t.dtype][1])
    return a, r


def fallbacks():
    return deferfuse.metrics()["cpu_fallbacks"]


def check(fn, *args, **kwargs):
    """fn on CPU and on tpu (same inputs) agree and nothing fell back to CPU; returns False (and
    checks nothing) when CPU rejects the inputs, so sweeps can run ops over every dtype."""
    try:
        want = fn(*args, **kwargs)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    before = fallbacks()
    got = fn(*tpu(args), **{k: tpu(v) for k, v in kwargs.items()})
    name = getattr(fn, "__name__", str(fn))
    assert fallbacks() == before, f"{name} fell back to CPU: {fallbacks()}"
    a, r = tol(*(want if isinstance(want, tuple) else (want,)), *args)
    assert_same(got, want, atol=a, rtol=r, msg=name)
    return True


def vec(vals, dtype=torch.float32):
    """``vals`` cycled to 24 elements, shape (2, 12) (the shape every check here uses)."""
    t = torch.tensor(vals, dtype=torch.float64 if dtype.is_floating_point else None)
    return t.repeat(24 // len(t) + 1)[:24].reshape(2, 12).to(dtype)


def sample(dtype, lo=-4.0, hi=4.0):
    """A (2, 12) tensor of dtype with a spread of values (and nan/inf/-0 for floats)."""
    g = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        return torch.rand(24, generator=g).reshape(2, 12) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(int(lo) * 2, int(hi) * 2 + 1, (24,), generator=g).to(dtype).reshape(2, 12)
    x = torch.rand(24, generator=g, dtype=torch.float64) * (hi - lo) + lo
    x[:6] = torch.tensor([NAN, INF, -INF, -0.0, 0.0, 0.5], dtype=torch.float64)
    return x.to(dtype).reshape(2, 12)


# --------------------------------------------------------------------------------------------
# unary

# Ops with their own logic in the lowering (plain jnp mappings such as tan or asinh are left to
# the OpInfo sweep).
UNARY = [torch.abs, torch.neg, torch.sign, torch.sgn, torch.exp, torch.expm1, torch.log, torch.log1p,
         torch.sqrt, torch.rsqrt, torch.reciprocal, torch.sin, torch.tanh, torch.atanh, torch.erf,
         torch.erfc, torch.erfinv, torch.lgamma, torch.digamma, torch.floor, torch.ceil, torch.round,
         torch.trunc, torch.frac, torch.sigmoid, torch.logit, torch.nan_to_num, torch.isnan,
         torch.isinf, torch.isfinite, torch.isposinf, torch.isneginf, torch.signbit, torch.angle,
         torch.conj_physical, torch.square, torch.i0, torch.sinc, torch.bitwise_not, torch.logical_not,
         torch.special.entr, torch.special.ndtri, torch.special.log_ndtr, torch.special.erfcx, torch.relu]
# Ops whose int/bool handling (identity, promotion to float, bool results) differs by dtype.
UNARY_INT = [torch.abs, torch.neg, torch.sign, torch.exp, torch.sqrt, torch.erfinv, torch.floor,
             torch.round, torch.sigmoid, torch.nan_to_num, torch.isnan, torch.isfinite, torch.signbit,
             torch.angle, torch.bitwise_not, torch.logical_not, torch.relu, torch.digamma]
UNARY_HALF = [torch.exp, torch.rsqrt, torch.tanh, torch.erf, torch.sigmoid, torch.round,
              torch.nan_to_num, torch.lgamma, torch.reciprocal]


@DEFER
@pytest.mark.parametrize("dtype,ops,least", [
    (torch.float32, UNARY, 43), (torch.int64, UNARY_INT, 16), (torch.bool, UNARY_INT, 12),
    (torch.int32, UNARY_INT[:7], 6), (torch.uint8, UNARY_INT[:7], 5),
    (torch.bfloat16, UNARY_HALF, 9), (torch.float16, UNARY_HALF, 9)],
    ids=["float32", "int64", "bool", "int32", "uint8", "bfloat16", "float16"])
def test_unary(dtype, ops, least):
    x = sample(dtype, lo=0 if dtype == torch.uint8 else -4)
    n = sum(check(f, x) for f in ops)
    assert n >= least, n


@DEFER
def test_unary_domain_edges():
    x = vec([0.0, -0.0, 1.0, -1.0, 2.0, -2.5, 1e-30, 0.999, -0.999, 100.0, -100.0, 3.5])
    for f in (torch.digamma, torch.lgamma, torch.erfinv, torch.atanh, torch.acosh, torch.log1p,
              torch.special.entr, torch.sinc, torch.sign, torch.frac, torch.special.ndtri,
              torch.special.erfcx, torch.special.log_ndtr, torch.signbit, torch.rsqrt):
        check(f, x)
    check(torch.logit, vec([-0.5, 0.0, 0.2, 1.0, 1.5, NAN]), eps=0.25)
    check(torch.frexp, vec([INF, NAN, 0.0, -3.0, 1e-30, 1e30, -0.0, 0.75]))
    check(torch.nan_to_num, vec([NAN, INF, -INF, 1.0], torch.float16))
    check(torch.nan_to_num, vec([NAN, INF, -INF, 1.0]), nan=2.0, posinf=5.0, neginf=-7.5)
    check(torch.round, vec([0.5, 1.5, 2.5, -0.5, -2.5, 3.49]))
    for d in (3, -2):
        check(torch.round, vec([1.23456, 1250.0, -1350.0, 0.0025]), decimals=d)
    for n in (1, 2, 3):
        check(torch.polygamma, n, vec([-2.5, -1.5, -1.0, 0.0, 0.5, 3.0, 10.0, -7.95]))
    check(torch.special.zeta, vec([1.0, 0.5, 2.0, 2.0, 3.0, 2.0, 4.0, INF, INF, INF]),
          vec([1.0, 1.0, 0.0, -1.0, -1.5, 2.5, -3.25, 0.5, 1.0, 2.0]))
    check(torch.igamma, vec([0.0, -0.0, 1.0, INF, 2.0, -1.0, 3.0]), vec([0.5, 1.0, 0.0, 2.0, INF, 1.0, 2.5]))
    check(torch.mvlgamma, vec([2.5, 3.0, 7.25]), p=3)
    check(torch.angle, vec([NAN, -1.0, 0.0, -0.0, 2.0]))
    check(torch.angle, vec([-3, 0, 3], torch.int64))


# --------------------------------------------------------------------------------------------
# binary

BINARY = [torch.add, torch.sub, torch.mul, torch.div, torch.floor_divide, torch.remainder,
          torch.fmod, torch.pow, torch.atan2, torch.hypot, torch.maximum, torch.minimum, torch.fmax,
          torch.copysign, torch.nextafter, torch.logaddexp, torch.eq, torch.lt, torch.logical_and,
          torch.logical_xor, torch.heaviside, torch.xlogy, torch.special.xlog1py, torch.rsub,
          torch.special.zeta, torch.igamma, torch.igammac,
          lambda a, b: torch.div(a, b, rounding_mode="trunc"),
          lambda a, b: torch.div(a, b, rounding_mode="floor"),
          lambda a, b: torch.add(a, b, alpha=2), lambda a, b: torch.sub(a, b, alpha=3)]
BINARY_INT = [torch.add, torch.sub, torch.mul, torch.div, torch.floor_divide, torch.remainder,
              torch.fmod, torch.pow, torch.maximum, torch.fmin, torch.bitwise_and, torch.bitwise_or,
              torch.bitwise_xor, torch.bitwise_left_shift, torch.bitwise_right_shift, torch.logical_xor,
              torch.eq, torch.lt, torch.heaviside, torch.gcd, torch.lcm, torch.rsub, torch.copysign,
              lambda a, b: torch.div(a, b, rounding_mode="trunc"),
              lambda a, b: torch.div(a, b, rounding_mode="floor"),
              lambda a, b: torch.add(a, b, alpha=2)]
BINARY_MIXED = [torch.add, torch.div, torch.floor_divide, torch.pow, torch.maximum, torch.eq]
PAIRS = [(torch.float32, torch.float32, BINARY, 30), (torch.int64, torch.int64, BINARY_INT, 26),
         (torch.int32, torch.int64, BINARY_MIXED, 6), (torch.int64, torch.float32, BINARY_MIXED, 6),
         (torch.bfloat16, torch.bfloat16, BINARY_MIXED, 6), (torch.float16, torch.float32, BINARY_MIXED, 6),
         (torch.uint8, torch.int8, BINARY_MIXED, 6), (torch.bool, torch.int32, BINARY_MIXED, 5)]


def _nonzero(y):
    # Integer division by zero raises on CPU; keep divisors nonzero for integer inputs.
    if y.dtype.is_floating_point or y.dtype == torch.bool:
        return y
    return torch.where(y == 0, torch.full_like(y, 3), y).clamp(-5, 6)


@DEFER
@pytest.mark.parametrize("da,db,ops,least", PAIRS,
                         ids=[f"{str(a)[6:]}-{str(b)[6:]}" for a, b, _, _ in PAIRS])
def test_binary(da, db, ops, least):
    a = sample(da, lo=0 if da == torch.uint8 else -4)
    b = _nonzero(sample(db, lo=0 if db == torch.uint8 else -4)).flip(-1)
    n = sum(check(f, a, b) for f in ops)
    assert n >= least, n


@DEFER
def test_broadcast_and_zero_dim_operands():
    a, b = sample(torch.float32), sample(torch.float32).flip(-1)
    check(torch.mul, a, b[:1])
    check(torch.add, a, b[0, 3])                          # 0-dim tpu tensor
    check(torch.add, a.half(), torch.tensor(2.5, dtype=torch.float64))   # 0-dim CPU tensor: half wins
    check(torch.mul, sample(torch.int64), torch.tensor(1.5))             # ...but float beats int


SCALAR_OPS = [torch.add, torch.mul, torch.div, torch.remainder, torch.pow, torch.lt,
              lambda x, s: s - x, lambda x, s: torch.where(x > 1, x, s)]


@DEFER
@pytest.mark.parametrize("dtype,ops,scalars", [
    (torch.float32, SCALAR_OPS, (-3, 2.5)), (torch.int64, SCALAR_OPS, (-3, 2.5)),
    (torch.bool, SCALAR_OPS[:4], (True, 2.5)), (torch.uint8, SCALAR_OPS[:4], (-3, 2.5))],
    ids=["float32", "int64", "bool", "uint8"])
def test_binary_python_scalars(dtype, ops, scalars):
    a = sample(dtype, lo=0 if dtype == torch.uint8 else -4)
    n = sum(check(f, a, s) for s in scalars for f in ops)
    n += check(lambda x: torch.where(x > 1, 2.5, -1.0), a)
    n += check(lambda x: torch.where(x > 1, 2, 7), a)
    assert n >= 8, n


@DEFER
def test_integer_division_and_remainder_signs():
    a = vec([-7, 7, -7, 7, 0, -1, 5, -9223372036854775807], torch.int64)
    b = vec([2, -2, -2, 2, 3, 4, -5, 3], torch.int64)
    for f in (torch.floor_divide, torch.remainder, torch.fmod,
              lambda x, y: torch.div(x, y, rounding_mode="trunc"),
              lambda x, y: torch.div(x, y, rounding_mode="floor"), torch.div):
        check(f, a, b)
        check(f, a.to(torch.int32), b.to(torch.int8))
    fa = vec([-7.5, 7.5, -0.0, 1.0, -1.0, 5.0, 1e30, NAN, INF, 0.3, -0.3, 7.0])
    fb = vec([2.0, -2.0, 3.0, 0.0, 0.0, INF, 7.0, 1.0, 2.0, 0.1, 0.1, -INF])
    for f in (torch.floor_divide, torch.remainder, torch.fmod,
              lambda x, y: torch.div(x, y, rounding_mode="floor"),
              lambda x, y: torch.div(x, y, rounding_mode="trunc")):
        check(f, fa, fb)
    check(torch.remainder, -7, vec([2, -3], torch.int64))
    check(torch.remainder, vec([200, 5], torch.uint8), vec([7, 3], torch.uint8))


@DEFER
def test_pow_overloads():
    i = vec([2, -1, 1, 0, 3, -2, 7, -3], torch.int64)
    e = vec([-1, -3, -5, 3, 0, 63, 2, 5], torch.int64)
    check(torch.pow, i, e)                                   # negative exponents give 0 unless |base| is 1
    check(torch.pow, i.to(torch.int32), e.to(torch.int32))
    check(torch.pow, i.to(torch.uint8), e.abs().to(torch.uint8))
    base = vec([-2.0, -0.0, 0.0, 0.25, 3.0, INF, -INF, NAN])
    for s in (0, 1, 2, 3, 0.5, 2.5, -1.0, -2.0, -0.5):       # PyTorch special-cases several of these
        check(torch.pow, base, s)
    for s in (1, 2, 2.5):
        check(torch.pow, s, base)
    check(torch.pow, i, 2)
    check(torch.pow, i, 3)
    check(torch.pow, i, 2.5)
    check(torch.pow, 2, e.clamp(0, 20))
    check(torch.pow, vec([True, False], torch.bool), vec([False, True, True], torch.bool))
    check(torch.pow, vec([1.5, -2.0], torch.bfloat16), vec([2.0, 3.0, -1.0]))


@DEFER
def test_nan_semantics_max_min_fmax_clamp():
    a = vec([NAN, 1.0, NAN, -0.0, 3.0])
    b = vec([2.0, NAN, NAN, 0.0, -INF])
    for f in (torch.maximum, torch.minimum, torch.fmax, torch.fmin, torch.max, torch.min):
        check(f, a, b)
    x = vec([0.0, 5.0, 10.0, NAN, -3.0])
    check(torch.clamp, x, min=6, max=4)              # min > max: everything is max
    check(torch.clamp, x, min=NAN)
    check(torch.clamp, x, max=NAN)
    check(torch.clamp, x, min=vec([NAN, 0.0, 1.0, 0.0, 8.0]), max=vec([1.0, NAN, 2.0, 3.0, 4.0]))
    check(torch.clamp, x, min=torch.tensor([1.0]))
    check(torch.clamp, x, max=torch.tensor(2.0))
    check(torch.clamp_min, x, vec([1.0]))
    check(torch.clamp_max, x, vec([1.0]))
    i = vec(list(range(-4, 5)), torch.int64)
    check(torch.clamp, i, -2, 3)
    check(torch.clamp, i, min=0.5)                    # promotes to float
    check(torch.clamp, i, max=torch.tensor([2]))
    check(torch.clamp, i.abs().to(torch.uint8), 1, 3)
    check(torch.clip, x.to(torch.bfloat16), -1.0, 1.0)


@DEFER
def test_bool_arithmetic_and_bitwise():
    a = vec([True, True, False, False], torch.bool)
    b = vec([True, False, True, False], torch.bool)
    for f in (torch.add, torch.mul, torch.maximum, torch.minimum, torch.bitwise_and, torch.bitwise_or,
              torch.bitwise_xor, torch.logical_xor, torch.eq, torch.lt, torch.div, torch.fmax):
        check(f, a, b)
    check(lambda x: x * 3, a)
    check(lambda x: x + 1.5, a)
    check(lambda x: ~x, a)
    check(lambda x: x & True, a)
    check(torch.add, a, b, alpha=True)
    check(torch.logical_and, vec([0.0, NAN, 2.0]), vec([1, 1, 0], torch.int64))


@DEFER
def test_shifts_and_unsigned():
    for dt in (torch.int64, torch.int32, torch.int8):
        a = vec([-5, 5, 100, -128, 1], dt)
        b = vec([70, -1, 3, 1, 0, 8], dt)
        check(torch.bitwise_left_shift, a, b)         # out-of-range shifts: 0 / sign fill
        check(torch.bitwise_right_shift, a, b)
    check(lambda x: x << 2, vec([-5, 5, 100], torch.int64))
    check(lambda x: x >> 1, vec([-5, 5, 100], torch.int64))
    u = vec([200, 5, 100], torch.uint8)
    v = vec([70, 8, 3, 1], torch.uint8)
    check(torch.bitwise_left_shift, u, v)
    check(torch.bitwise_right_shift, u, v)
    w = vec([200, 0, 255, 3], torch.uint8)
    check(torch.lt, w, -1)                            # -1 wraps to 255 as in PyTorch
    check(torch.add, w, -1)
    check(torch.sub, w, 5, alpha=-1)


@DEFER
def test_ternary():
    g = torch.Generator().manual_seed(2)
    x, t1, t2 = (torch.randn(2, 12, generator=g) for _ in range(3))
    w = torch.rand(2, 12, generator=g) * 1.4 - 0.2
    check(torch.lerp, x, t1, 0.3)
    check(torch.lerp, x, t1, 0.75)
    check(torch.lerp, x, t1, w)
    check(torch.lerp, x.to(torch.bfloat16), t1.to(torch.bfloat16), 0.6)
    check(torch.addcmul, x, t1, t2, value=-0.5)
    check(torch.addcmul, x.long(), t1.long(), t2.long(), value=3)
    check(torch.addcdiv, x, t1, t2, value=2.0)
    check(torch.addcdiv, x.half(), t1.half(), t2.half())
    c = x > 0
    check(torch.where, c, x, t1)
    check(torch.where, c, x, t1.double())
    check(torch.where, c, x.long(), 2.5)
    check(torch.where, c, 1, x.half())
    check(torch.where, c, x.int(), t1.long())
    check(torch.where, c, x, t1[0])


# --------------------------------------------------------------------------------------------
# activations and their backward ops

ACTS = [
    (F.relu, {}), (F.relu6, {}), (F.leaky_relu, {"negative_slope": 0.2}), (F.elu, {"alpha": 0.7}),
    (F.selu, {}), (F.celu, {"alpha": 1.3}), (F.gelu, {}), (F.gelu, {"approximate": "tanh"}),
    (F.silu, {}), (F.mish, {}), (F.softplus, {"beta": 2.0, "threshold": 5.0}),
    (F.hardtanh, {"min_val": -0.5, "max_val": 2.0}), (F.hardsigmoid, {}), (F.hardswish, {}),
    (F.hardshrink, {"lambd": 0.7}), (F.softshrink, {"lambd": 0.3}),
    (F.threshold, {"threshold": 0.4, "value": -2.0}),
]


@DEFER
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_activations(dtype):
    x = vec([NAN, -6.0, -3.0, -2.5, -1.0, -0.7, -0.3, 0.0, 0.3, 0.30078125, 0.7, 1.0, 2.0, 3.0, 4.5,
             6.0, 21.0, -0.0, 0.5, -0.5, 2.9, -2.9, 3.1, -3.1], dtype)
    for f, kw in ACTS:
        check(f, x, **kw)


@DEFER
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_activation_backward_ops(dtype):
    g = torch.Generator().manual_seed(4)
    x = vec([-6.0, -3.0, -2.5, -1.0, -0.7, -0.5, -0.3, 0.0, 0.3, 0.30078125, 0.5, 0.7, 1.0, 2.0,
             2.9, 3.0, 4.5, 6.0, 21.0, -3.1, 3.1, -0.0, 0.1, 8.0], dtype)
    gy = torch.randn(2, 12, generator=g).to(dtype)
    y = torch.sigmoid(x)
    check(aten.threshold_backward, gy, x, 0.3)
    check(aten.gelu_backward, gy, x)
    check(aten.gelu_backward, gy, x, approximate="tanh")
    check(aten.silu_backward, gy, x)
    check(aten.sigmoid_backward, gy, y)
    check(aten.tanh_backward, gy, torch.tanh(x))
    check(aten.leaky_relu_backward, gy, x, 0.1, False)
    check(aten.elu_backward, gy, 1.2, 1.0, 1.0, False, x)
    check(aten.elu_backward, gy, 1.2, 1.05, 0.5, True, F.elu(x, 1.2))
    check(aten.hardtanh_backward, gy, x, -1.0, 2.0)
    check(aten.softplus_backward, gy, x, 1.5, 3.0)
    check(aten.hardswish_backward, gy, x)
    check(aten.hardsigmoid_backward, gy, x)
    check(aten.mish_backward, gy, x)
    check(aten.hardshrink_backward, gy, x, 0.3)      # lambd rounds to x's dtype (bfloat16)
    check(aten.softshrink_backward, gy, x, 0.3)
    check(aten.logit_backward, gy, y * 1.2 - 0.1)
    check(aten.logit_backward, gy, y, 0.2)


@DEFER
def test_activation_grads_through_autograd():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 12, generator=g) * 3
    up = torch.randn(2, 12, generator=g)
    for f, kw in ACTS[:4] + ACTS[6:10]:
        c = x.clone().requires_grad_()
        f(c, **kw).backward(up)
        t = x.to("tpu").requires_grad_()
        before = fallbacks()
        f(t, **kw).backward(up.to("tpu"))
        assert fallbacks() == before
        assert_same(t.grad, c.grad, *tol(c), msg=f"grad of {f.__name__} {kw}")


# --------------------------------------------------------------------------------------------
# in-place and out= variants, through views (both modes: their write-back differs)

def _both(fn, *inputs):
    """Run fn (mutating its first input) on CPU clones and tpu copies; compare every input."""
    cpu = [t.clone() for t in inputs]
    dev = [t.to("tpu") for t in inputs]
    before = fallbacks()
    r_cpu, r_dev = fn(*cpu), fn(*dev)
    assert fallbacks() == before, f"fell back to CPU: {fallbacks()}"
    for c, d in zip(cpu, dev):
        assert_same(d, c, *tol(c))
    if isinstance(r_cpu, torch.Tensor):
        assert_same(r_dev, r_cpu, *tol(r_cpu))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_inplace_through_views():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 5, generator=g)
    y = torch.randn(4, generator=g)
    _both(lambda a, b: a[:, 1].add_(b), x, y)
    _both(lambda a, b: a.t().mul_(3), x, y)
    _both(lambda a, b: a[1:3].clamp_(min=-0.1, max=0.2), x, y)
    _both(lambda a, b: a[:, ::2].sigmoid_(), x, y)
    _both(lambda a, b: a.t()[2].sub_(b, alpha=2), x, y)
    _both(lambda a, b: a[2].pow_(2), x, y)
    _both(lambda a, b: a.view(20)[3:9].abs_(), x, y)
    _both(lambda a, b: a.transpose(0, 1)[1:].div_(2.5), x, y)
    _both(lambda a, b: a[:, 0].where(a[:, 0] > 0, b), x, y)     # functional on a view


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_inplace_variants_and_out():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 4, generator=g)
    y = torch.randn(3, 4, generator=g)
    i = torch.randint(-9, 10, (3, 4), generator=g)
    j = torch.randint(1, 4, (3, 4), generator=g)
    _both(lambda a, b: a.pow_(b.abs()), x, y)                 # pow_.Tensor (lowered directly)
    _both(lambda a, b: a.addcmul_(b, b, value=0.5), x, y)
    _both(lambda a, b: a.floor_divide_(b), i, j)              # floor_divide_.Tensor (lowered directly)
    _both(lambda a, b: a.__ilshift__(b), i, j)
    _both(lambda a, b: a.__iand__(b), i, j)
    _both(lambda a, b: a.mul_(b.double()), x, y)             # result cast back to float32
    _both(lambda a, b: a.add_(b), x, i)                       # int operand into float self
    _both(lambda a, b: a.clamp_max_(0.1).clamp_min_(-0.2), x, y)
    _both(lambda a, b: torch.add(a, b, alpha=2, out=a), x, y)
    _both(lambda o, a, b: torch.mul(a, b, out=o), torch.empty(3, 4, dtype=torch.float64), x, y)
    _both(lambda o, a, b: torch.div(a, b, rounding_mode="floor", out=o), torch.empty(3, 4), i, j)
    _both(lambda o, a, b: torch.lt(a, b, out=o), torch.empty(3, 4, dtype=torch.bool), x, y)
    _both(lambda o, a: torch.exp(a, out=o[:, 1:3]), torch.zeros(3, 4), x[:, :2].contiguous())
    _both(lambda a, b: F.relu(a, inplace=True), x, y)
    _both(lambda a, b: F.hardtanh(a, -0.5, 0.5, inplace=True), x, y)
    _both(lambda a, b: a.polygamma_(1), x.abs() + 0.5, y)     # polygamma_ (lowered directly)


def gelu_finite(x):
    # CPU's own gelu(inf) depends on the CPU: nan with its AVX-512 kernel, inf with AVX2.
    return F.gelu(x.nan_to_num(0.0, 1e4, -1e4))


STRICT_SMOKE = [(torch.exp, 1), (torch.sigmoid, 1), (torch.digamma, 1), (torch.nan_to_num, 1),
                (gelu_finite, 1), (torch.add, 2), (torch.div, 2), (torch.remainder, 2), (torch.pow, 2),
                (torch.maximum, 2), (torch.lt, 2), (torch.special.zeta, 2)]


@pytest.mark.modes("strict")
def test_strict_smoke():
    a, b = sample(torch.float32), sample(torch.float32).flip(-1)
    i, j = sample(torch.int64), _nonzero(sample(torch.int64)).flip(-1)
    for f, n in STRICT_SMOKE:
        assert check(f, *(a, b)[:n]) or check(f, *(i, j)[:n]), f
    for f in (torch.floor_divide, torch.pow):
        assert check(f, i, j)
    assert check(torch.where, a > 0, a, 2.5)
    assert check(aten.gelu_backward, a, b)


def test_float_input_to_integer_op_raises():
    with pytest.raises(RuntimeError, match="not implemented"):
        torch.bitwise_and(torch.ones(3).to("tpu"), torch.ones(3).to("tpu")).cpu()


# --------------------------------------------------------------------------------------------
# sin/cos/tan: the vectorized lowering (runtime/lowering/trig.py), as XLA's CPU routine is scalar

@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3, 1e7])
@pytest.mark.parametrize("f", [torch.sin, torch.cos, torch.tan], ids=["sin", "cos", "tan"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_sin_cos_within_one_ulp_of_cpu(f, scale):
    import jax.numpy as jnp
    from deferfuse.runtime.dtypes import x64
    from deferfuse.runtime.lowering import trig
    g = torch.Generator().manual_seed(3)
    x = torch.randn(trig.FAST_MIN_SIZE, generator=g) * scale
    x[:5] = torch.tensor([0.0, -0.0, NAN, 1e-30, -3.1415927])
    want = f(x)
    ulp = torch.nextafter(want.abs(), torch.tensor(INF)) - want.abs()
    fast = {torch.sin: trig._fast_sin, torch.cos: trig._fast_cos, torch.tan: trig._fast_tan}[f]
    with x64(True):
        direct = torch.from_numpy(np.asarray(fast(jnp.asarray(x.numpy()))).copy())
    assert torch.equal(direct.isnan(), want.isnan())
    assert torch.equal(direct.signbit(), want.signbit())
    assert ((direct.double() - want.double()).abs() / ulp.double()).nan_to_num().max().item() <= 1.0
    got = f(tpu(x))     # the polynomial on the CPU backend, the platform's own routine elsewhere
    assert_same(got, want)
    assert torch.equal(got.cpu().signbit(), want.signbit())
    assert fallbacks() == {}


@pytest.mark.parametrize("f", [torch.sin, torch.cos, torch.tan], ids=["sin", "cos", "tan"])
def test_sin_cos_of_huge_values_and_infinities_take_the_exact_routine(f):
    from deferfuse.runtime.lowering import trig
    x = torch.linspace(-4, 4, trig.FAST_MIN_SIZE)
    for special in (1e20, -3e38, INF, -INF):
        y = x.clone()
        y[7] = special
        assert_same(f(tpu(y)), f(y))
        assert f(tpu(y)).cpu()[7].isnan().item() == f(y)[7].isnan().item()


@pytest.mark.parametrize("f", [torch.atan, torch.asin, torch.acos], ids=["atan", "asin", "acos"])
def test_inverse_trig_within_one_ulp_of_cpu(f):
    import jax.numpy as jnp
    from deferfuse.runtime.dtypes import x64
    from deferfuse.runtime.lowering import trig
    g = torch.Generator().manual_seed(4)
    n = trig.FAST_MIN_SIZE
    if f is torch.atan:     # every magnitude from 1e-30 to 1e30 (normal floats: XLA flushes subnormals)
        x = torch.randn(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 60 - 30)
        x[:6] = torch.tensor([0.0, -0.0, NAN, INF, -INF, 3e38])
    else:                   # [-1.05, 1.05], and the ends
        x = torch.rand(n, generator=g) * 2.1 - 1.05
        x[:8] = torch.tensor([0.0, -0.0, NAN, 1.0, -1.0, 0.99999994, -0.99999994, 1e-30])
    want = f(x)
    fast = {torch.atan: trig._fast_atan, torch.asin: trig._fast_asin, torch.acos: trig._fast_acos}[f]
    with x64(True):
        direct = torch.from_numpy(np.asarray(fast(jnp.asarray(x.numpy()))).copy())
    assert torch.equal(direct.isnan(), want.isnan())
    num = ~want.isnan()     # (a NaN's sign bit is not specified)
    assert torch.equal(direct[num].signbit(), want[num].signbit())
    ulp = torch.nextafter(want.abs(), torch.tensor(INF)) - want.abs()
    assert ((direct.double() - want.double()).abs() / ulp.double()).nan_to_num().max().item() <= 1.0
    got = f(tpu(x))
    assert_same(got, want)
    assert torch.equal(got.cpu()[num].signbit(), want[num].signbit())
    assert fallbacks() == {}


@DEFER
@pytest.mark.parametrize("f", [torch.special.bessel_j0, torch.special.bessel_j1,
                               torch.special.bessel_y0, torch.special.bessel_y1,
                               torch.special.airy_ai], ids=lambda f: f.__name__)
def test_bessel_and_airy_on_a_dense_grid(f):
    """Every branch of CPU's rational approximations (|x| <= 5 or beyond, Ai's three regions and
    its cut-offs), the oscillating tails (where an ulp of the phase shows) and the special values,
    in float32 (CPU's tolerance) and from integers; none falls back to CPU."""
    x = torch.cat([torch.linspace(-120, 120, 4801), torch.tensor(
        [0., -0., 1e-6, -1e-6, 5., -5., 2.09, -2.09, 8.3203353, 103.892, 104., INF, -INF, NAN,
         1e30, -1e30])])
    assert check(f, x)
    assert check(f, torch.arange(-40, 41))


def test_sgn_backward_makes_a_zero_tensor():
    """The gradient of ``sgn`` of a real tensor is ``aten._efficientzerotensor``: a factory with
    device='tpu' that reaches the backend directly (it had no kernel)."""
    for x in (torch.tensor([1.5, -2.0, 0.0, 3.0]), torch.tensor([1 + 1j, -2j, 0j])):
        grads = []
        for dev in ("cpu", "tpu"):
            t = x.clone().to(dev).requires_grad_(True)
            y = torch.sgn(t)
            (y.abs() if y.is_complex() else y).sum().backward()
            grads.append(t.grad)
        assert_same(grads[1], grads[0])
    assert_same(torch.ops.aten._efficientzerotensor([2, 3], dtype=torch.bfloat16, device="tpu"),
                torch.zeros(2, 3, dtype=torch.bfloat16))


# NOTE [complex products] (runtime/lowering/pointwise.py): CPU multiplies complex numbers component
# by component, a real operand promoted to c + 0i, and add/sub scale their second operand by alpha
# with that product even when alpha is 1, so an infinite component gives NaNs XLA's folded
# arithmetic did not ((inf + 0i) * 1 is inf + nan i on CPU). Division and reciprocal are
# c10::complex's.
_CVALS = [complex(INF, 0), complex(0, INF), complex(-INF, 1), complex(INF, INF), complex(NAN, 0),
          complex(1, NAN), complex(1, 2), complex(0, 0), complex(-0.0, 0.0), complex(-3, 0.5),
          complex(2, -1), complex(0.25, 4)]


def _complex_ops(a, b):
    return (a * b, b * a, a + b, b + a, a - b, b - a, a / b, torch.add(a, b, alpha=2),
            torch.rsub(a, b), a + b * 1j)


def _zero_addends(a):
    return (a + 0, a + 0.0, 0 + a, a - (-0.0), a.add(0, alpha=2), a.sub(0.0, alpha=-1),
            torch.rsub(a, 0), -0.0 - a, a.clone().add_(0), torch._foreach_add([a], 0)[0],
            torch._foreach_sub([a], -0.0)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64],
                         ids=["f32", "bf16", "c64"])
def test_python_zero_addend_sign(dtype):
    """-0.0 + 0 is +0.0 on CPU; XLA folded the baked Python 0 away and kept -0.0
    (NOTE [signed zero addends]). Values and the sign of every zero (real and imaginary parts)."""
    x = vec([-0.0, 0.0, 1.0, -2.5, INF, -INF], torch.float32)
    x = torch.complex(x, x.flip(-1)) if dtype.is_complex else x.to(dtype)
    want, got = _zero_addends(x), _zero_addends(tpu(x))
    for i, (g, w) in enumerate(zip(got, want)):
        g = g.cpu()
        assert g.dtype == w.dtype, i
        torch.testing.assert_close(g, w, equal_nan=True, atol=0, rtol=0, msg=f"result {i}")
        for gp, wp in ((g.real, w.real), (g.imag, w.imag)) if w.is_complex() else ((g, w),):
            sign = lambda t: torch.signbit(t) & ~t.isnan()    # noqa: E731  (a NaN's sign is not CPU's contract)
            assert torch.equal(sign(gp), sign(wp)), f"result {i}: {gp.tolist()} vs {wp.tolist()}"


@DEFER
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=["c64", "c128"])
def test_complex_pow_at_zeros_and_infinities(dtype):
    """Complex pow by exponents CPU does not special-case (a Python number, a 0-d or a full tensor,
    a scalar base) is glibc's cpow, cexp(y * clog(x)) with C99's rules (NOTE [complex pow]): 0 **
    2.5 is 0 - 0i, inf ** 2.5 inf + nan i, pow(1, x) 1. Values, NaN/inf pattern and zero signs."""
    x = torch.tensor([complex(INF, 0), complex(0, INF), complex(-INF, 1), complex(INF, INF),
                      complex(NAN, 0), complex(1, NAN), complex(1, 2), complex(0, 0),
                      complex(-0.0, 0.0), complex(0.5, -3)], dtype=dtype)

    def fns(a):
        out = [a ** a.flip(0), torch.pow(1, a), torch.pow(0, a), torch.pow(2.5, a)]
        for e in (2.5, INF, NAN, -0.7, 2, 0):
            full = torch.full(a.shape, e, dtype=torch.float64, device=a.device)
            out += [a ** e, a ** full[0], a ** full]
        return out
    for i, (g, w) in enumerate(zip(fns(tpu(x)), fns(x))):
        g = torch.view_as_real(g.cpu())
        w = torch.view_as_real(w)
        torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-5, atol=1e-6, msg=f"result {i}")
        zero = w == 0
        assert torch.equal(g[zero].signbit(), w[zero].signbit()), f"result {i}: zero signs"


@DEFER
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=["c64", "c128"])
def test_complex_arithmetic_with_real_scalars(dtype):
    x = torch.tensor(_CVALS * 2, dtype=dtype).reshape(2, 12)
    scalars = (1, 0, -1, 2.5, INF, NAN)
    for s in scalars:            # a Python number (a constant XLA may fold), a 0-d tensor
        assert check(lambda a: (a * s, s * a, a + s, a - s, s - a, a / s, s / a), x)
        assert check(_complex_ops, x, torch.tensor(float(s)))
    assert check(_complex_ops, x, vec(scalars, torch.float64))
    assert check(_complex_ops, x, x.flip(-1))
    assert check(torch.reciprocal, x)
    # CPU's pow takes products and quotients for these exponents (3 and -2 arrive traced)
    assert check(lambda a: (a ** 0, a ** 1, a ** 2, a ** 3, a ** -1, a ** -2), x)
