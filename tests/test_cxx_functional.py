"""Structured ops' functional overloads straight to the C++ fallback (NOTE [functional direct] in
deferfuse/plain.py; docs/cxx-plan.md, Session 9 (cxx19)): ``add.Tensor``, ``mm``,
``sum.dim_IntList`` ... reach the fallback whole, without PyTorch's meta function running first,
so the op path must give what CPU eager gives: values, dtypes, shapes, and for bad input the
exception type and message (broadcasting, promotion, alpha, devices, integer division,
out-of-range Python ints). Every case runs in strict, defer and debug mode; the module runs again
in a child process with ``DEFERFUSE_FUNCTIONAL_DIRECT=0`` (the structured path), where every case
must hold as well."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import deferfuse
from deferfuse import plain
from util import assert_same

EXT = plain.PLAIN.ext
ON = deferfuse.config.functional_direct
MODES = ("strict", "defer", "debug")


def T(*shape, dtype=torch.float32, seed=0, lo=-3, hi=4):
    g = torch.Generator().manual_seed(seed + 17 * len(shape))
    if dtype.is_floating_point:
        return torch.randn(*shape, generator=g).to(dtype)
    if dtype.is_complex:
        return torch.randn(*shape, generator=g, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


class Cpu:
    """An argument that stays a CPU tensor in the tpu call (a mixed-device case)."""

    def __init__(self, t):
        self.t = t


def _tpu(a):
    if isinstance(a, Cpu):
        return a.t
    if isinstance(a, torch.Tensor):
        return a.to("tpu")
    if isinstance(a, (list, tuple)):
        return type(a)(_tpu(x) for x in a)
    return a


def _cpu(a):
    if isinstance(a, Cpu):
        return a.t
    if isinstance(a, (list, tuple)):
        return type(a)(_cpu(x) for x in a)
    return a


# (id, fn, args): values, dtypes and shapes as CPU eager gives them
VALUES = [
    ("add_broadcast", lambda a, b: a + b, (T(3, 1), T(1, 4))),
    ("add_int_float", lambda a, b: a + b, (T(3, 4, dtype=torch.int64), T(3, 4))),
    ("add_bool_bool", lambda a, b: a + b, (T(5, dtype=torch.bool), T(5, dtype=torch.bool, seed=1))),
    ("add_int32_int64", lambda a, b: a + b, (T(4, dtype=torch.int32), T(4, dtype=torch.int64))),
    ("add_alpha", lambda a, b: torch.add(a, b, alpha=2.5), (T(3, 4), T(4))),
    ("add_int_alpha", lambda a, b: torch.add(a, b, alpha=3), (T(4, dtype=torch.int64), T(4, dtype=torch.int64))),
    ("add_bool_alpha", lambda a, b: torch.add(a, b, alpha=True), (T(4, dtype=torch.bool), T(4, dtype=torch.bool))),
    ("add_bool_int_alpha", lambda a, b: torch.add(a, b, alpha=2), (T(4, dtype=torch.bool), T(4, dtype=torch.bool))),
    ("add_zero_dim_f64", lambda a, b: a + b, (T(3), torch.tensor(2.5, dtype=torch.float64))),
    ("add_int_zero_dim_float", lambda a, b: a + b, (T(3, dtype=torch.int64), torch.tensor(2.5))),
    ("add_f16_zero_dim_f32", lambda a, b: a + b, (T(3, dtype=torch.float16), torch.tensor(1.5))),
    ("add_zero_dims", lambda a, b: a + b, (torch.tensor(3), torch.tensor(1.5, dtype=torch.float64))),
    ("add_complex_float", lambda a, b: a + b, (T(3, dtype=torch.complex64), T(3))),
    ("mul_float_complex_scalar", lambda a: a * 1j, (T(3),)),
    ("mul_int_float_scalar", lambda a: a * 2.5, (T(4, dtype=torch.int64),)),
    ("mul_int_int_scalar", lambda a: a * 3, (T(4, dtype=torch.int32),)),
    ("mul_f16_f32", lambda a, b: a * b, (T(4, dtype=torch.float16), T(4))),
    ("mul_bool_float_scalar", lambda a: a * 1.5, (T(4, dtype=torch.bool),)),
    ("mul_uint8_wraps", lambda a: a * 200, (T(4, dtype=torch.uint8, lo=0, hi=10),)),
    ("add_int32_big_python_int", lambda a: a + 2 ** 40, (T(4, dtype=torch.int32),)),
    ("add_int8_wraps", lambda a: a + 300, (T(4, dtype=torch.int8),)),
    ("sub_alpha", lambda a, b: torch.sub(a, b, alpha=0.5), (T(2, 3), T(2, 3, seed=1))),
    ("rsub_scalar", lambda a: 2 - a, (T(3),)),
    ("div_int_int", lambda a, b: a / b, (T(4, dtype=torch.int64), torch.tensor([2, -3, 4, 5]))),
    ("div_floor_int", lambda a, b: torch.div(a, b, rounding_mode="floor"),
     (torch.tensor([7, -7, 7, -7]), torch.tensor([2, 2, -2, -2]))),
    ("div_trunc_int", lambda a, b: torch.div(a, b, rounding_mode="trunc"),
     (torch.tensor([7, -7, 7, -7]), torch.tensor([2, 2, -2, -2]))),
    ("floordiv_float", lambda a, b: a // b, (T(5), T(5, seed=3))),
    ("div_float_by_zero", lambda a, b: a / b, (torch.tensor([1.0, -1.0, 0.0]), torch.zeros(3))),
    ("mm", torch.mm, (T(2, 3), T(3, 5))),
    ("addmm", lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0), (T(5), T(2, 3), T(3, 5))),
    ("bmm", torch.bmm, (T(2, 3, 4), T(2, 4, 2))),
    ("sum_dim", lambda a: a.sum(1), (T(3, 4),)),
    ("sum_dim_int_keepdim", lambda a: a.sum((0, 1), keepdim=True), (T(3, 4, dtype=torch.int32),)),
    ("sum_dim_bool", lambda a: a.sum(0), (T(3, 4, dtype=torch.bool),)),
    ("mean_dim", lambda a: a.mean(-1), (T(3, 4),)),
    ("mean_dim_dtype", lambda a: a.mean(0, dtype=torch.float64), (T(3, 4, dtype=torch.int64),)),
    ("cat_promotes", lambda a, b: torch.cat([a, b], 1), (T(2, 3, dtype=torch.int64), T(2, 2))),
    ("cat_legacy_empty", lambda a, b: torch.cat([a, b]), (torch.empty(0), T(2, 3))),
    ("cumsum_int", lambda a: a.cumsum(0), (T(5, dtype=torch.int32),)),
    ("argmax", lambda a: a.argmax(), (T(3, 4),)),
    ("argmax_dim", lambda a: a.argmax(1, keepdim=True), (T(3, 4),)),
    ("all_any", lambda a: (a.all(), a.any()), (T(3, 4, dtype=torch.int64, lo=0, hi=2),)),
    ("compare_scalars", lambda a: (a == 1, a < 0.5, a != 2, a <= 0, a > -1, a >= 3),
     (T(6, dtype=torch.int64),)),
    ("compare_tensors", lambda a, b: (a == b, a < b, a != b, a <= b, a > b, a >= b),
     (T(6, dtype=torch.int64), T(6, seed=2))),
    ("bitwise", lambda a, b: (a & b, a | b, ~a), (T(5, dtype=torch.int64), T(5, dtype=torch.int32, seed=1))),
    ("bitwise_bool", lambda a, b: (a & b, a | b, ~a), (T(5, dtype=torch.bool), T(5, dtype=torch.bool, seed=1))),
    ("unary", lambda a: (a.neg(), a.sin(), a.cos(), a.tanh(), a.sigmoid(), a.exp(), a.abs().sqrt(),
                         a.abs().log(), a.abs().rsqrt()), (T(7),)),
    ("unary_int", lambda a: (a.neg(), a.sin(), a.exp(), a.sigmoid()), (T(5, dtype=torch.int64),)),
    ("pow", lambda a, b: (a ** 2, a.abs() ** b, a ** 0.5), (T(4), T(4, seed=1))),
    ("pow_int", lambda a: a ** 3, (T(4, dtype=torch.int64),)),
    ("pow_int_tensor_negative", lambda a, b: a ** b, (torch.tensor([2, 3, 1]), torch.tensor([-1, 2, -2]))),
    ("max_min", lambda a, b: (torch.maximum(a, b), torch.minimum(a, b)), (T(4, dtype=torch.int64), T(4))),
    ("activations", lambda a: (F.gelu(a), F.gelu(a, approximate="tanh"), F.silu(a)), (T(6),)),
    ("softmaxes", lambda a: (a.softmax(-1), a.log_softmax(0), a.softmax(1, dtype=torch.float64)), (T(3, 4),)),
    ("cross_entropy", lambda a, y: F.cross_entropy(a, y), (T(4, 5), torch.tensor([0, 4, 2, 1]))),
    ("nll_loss_weights", lambda a, y, w: F.nll_loss(a, y, weight=w, ignore_index=2),
     (T(4, 5), torch.tensor([0, 4, 2, 1]), T(5).abs())),
    ("tpu_plus_cpu_scalar_tensor", lambda a, b: (a + b, a * b, a / b), (T(3), Cpu(torch.tensor(2.0)))),
    ("tpu_int_plus_cpu_scalar_float", lambda a, b: a + b, (T(3, dtype=torch.int64), Cpu(torch.tensor(2.5)))),
    ("cpu_scalar_tensor_plus_tpu", lambda a, b: b - a, (T(3), Cpu(torch.tensor(1.5, dtype=torch.float64)))),
    ("empty", lambda a, b: (a + b, a.sum(0), torch.mm(a.t(), a)), (T(0, 3), T(3))),
]

# (id, fn, args): PyTorch raises; the tpu call raises the same type with the same message
ERRORS = [
    ("add_broadcast_mismatch", lambda a, b: a + b, (T(3, 4), T(5, 4))),
    ("mul_broadcast_mismatch", lambda a, b: a * b, (T(2, 3), T(3, 2))),
    ("div_broadcast_mismatch", lambda a, b: a / b, (T(3), T(4))),
    ("compare_broadcast_mismatch", lambda a, b: a < b, (T(3), T(4))),
    ("add_int_float_alpha", lambda a, b: torch.add(a, b, alpha=2.5),
     (T(4, dtype=torch.int64), T(4, dtype=torch.int64))),
    ("add_bool_alpha_float", lambda a, b: torch.add(a, b, alpha=True), (T(4), T(4))),
    ("add_complex_alpha_float", lambda a, b: torch.add(a, b, alpha=1j), (T(4), T(4))),
    ("neg_bool", lambda a: -a, (T(4, dtype=torch.bool),)),
    ("div_bad_rounding_mode", lambda a, b: torch.div(a, b, rounding_mode="round"), (T(4), T(4))),
    ("sub_bool_alpha_float", lambda a, b: torch.sub(a, b, alpha=False), (T(4), T(4, dtype=torch.int64))),
    ("nll_loss_weight_size", lambda a, y, w: F.nll_loss(a, y, weight=w), (T(4, 5), torch.tensor([0, 4, 2, 1]), T(3))),
    ("bitwise_and_float", lambda a, b: a & b, (T(4), T(4))),
    # structured still: PyTorch's Python reference lacks the check (NOTE [functional direct])
    ("maximum_complex", torch.maximum, (T(4, dtype=torch.complex64), T(4, dtype=torch.complex64))),
    ("sub_bools", lambda a, b: a - b, (T(4, dtype=torch.bool), T(4, dtype=torch.bool))),
    ("sub_bool_scalar", lambda a: a - True, (T(4, dtype=torch.bool),)),
    ("int64_plus_2_pow_64", lambda a: a + 2 ** 64, (T(4, dtype=torch.int64),)),
    ("float_plus_2_pow_70", lambda a: a + 2 ** 70, (T(4),)),
    ("int_pow_negative", lambda a: a ** -1, (T(4, dtype=torch.int64),)),
    ("mm_shapes", torch.mm, (T(2, 3), T(4, 5))),
    ("mm_dtypes", torch.mm, (T(2, 3), T(3, 5, dtype=torch.float64))),
    ("mm_not_2d", torch.mm, (T(2, 3, 4), T(4, 5))),
    ("bmm_batch", torch.bmm, (T(2, 3, 4), T(3, 4, 2))),
    ("addmm_shapes", torch.addmm, (T(5), T(2, 3), T(4, 5))),
    ("sum_dim_out_of_range", lambda a: a.sum(2), (T(3, 4),)),
    ("mean_int", lambda a: a.mean(0), (T(3, 4, dtype=torch.int64),)),
    ("cat_dims", lambda a, b: torch.cat([a, b]), (T(2, 3), T(2, 4))),
    ("cat_dim_out_of_range", lambda a, b: torch.cat([a, b], 2), (T(2, 3), T(2, 3))),
    ("argmax_empty", lambda a: a.argmax(), (T(0, 3),)),
    ("log_softmax_dim", lambda a: a.log_softmax(3), (T(3, 4),)),
    ("cross_entropy_batch", lambda a, y: F.cross_entropy(a, y), (T(4, 5), torch.tensor([0, 1, 2]))),
    ("tpu_plus_cpu_tensor", lambda a, b: a + b, (T(3), Cpu(T(3)))),
    ("cpu_tensor_times_tpu", lambda a, b: b * a, (T(3), Cpu(T(3)))),
    ("mm_tpu_cpu", torch.mm, (T(2, 3), Cpu(T(3, 5)))),
]

_SAME_DEVICE = "Expected all tensors to be on the same device"


def _check(fn, args):
    want = fn(*_cpu(args))
    got = fn(*_tpu(args))
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    assert_same(list(got), list(want), atol=1e-4, rtol=1e-4)


@pytest.mark.slow_params("debug", "strict")     # defer mode only in the default run
@pytest.mark.modes(*MODES)
@pytest.mark.parametrize("fn,args", [c[1:] for c in VALUES], ids=[c[0] for c in VALUES])
def test_values_dtypes_shapes_equal_cpu(fn, args):
    for _ in range(3):      # the router's call, the kernel's learn, a kernel hit
        _check(fn, args)


@pytest.mark.slow_params("debug", "strict")     # defer mode only in the default run
@pytest.mark.modes(*MODES)
@pytest.mark.parametrize("fn,args", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_errors_equal_cpu(fn, args):
    mixed = any(isinstance(a, Cpu) for a in args)
    if mixed:
        # CPU eager has one device: PyTorch's own check of a CUDA tensor against a CPU one is the
        # reference (its TensorIterator and its matmul's message); the exception type is checked
        want_type, want_msg = RuntimeError, None
    else:
        with pytest.raises(Exception) as want:
            fn(*_cpu(args))
        want_type, want_msg = type(want.value), str(want.value)
    for _ in range(2):
        with pytest.raises(Exception) as got:
            fn(*_tpu(args))
            deferfuse.sync()
        assert type(got.value) is want_type, (type(got.value), got.value)
        if want_msg is not None:
            assert str(got.value) == want_msg
        else:
            assert "device" in str(got.value) and "cpu" in str(got.value), str(got.value)
    # nothing failed is left behind: the next op on the same inputs is right
    good = [a for a in args if isinstance(a, torch.Tensor) and a.dtype.is_floating_point]
    if good:
        _check(lambda a: a * 2 + 1, (good[0],))


@pytest.mark.modes("defer")
def test_errors_raise_at_the_call_in_defer_mode():
    """The meta function no longer runs before the router: a broadcasting error in defer mode is
    still raised by the call itself, before any sync, as PyTorch raises it."""
    a, b = torch.randn(3, 4, device="tpu"), torch.randn(5, 4, device="tpu")
    with pytest.raises(RuntimeError, match="must match the size of tensor b"):
        a + b
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.mm(a, b)


@pytest.mark.modes(*MODES)
@pytest.mark.slow_params("strict")
def test_backward_through_the_functional_overloads_equals_cpu():
    """Autograd records these overloads: a small network's gradients through add, sub, mul, div,
    mm, addmm, bmm, sum, mean, activations, softmaxes and a loss, against CPU eager."""
    def net(x, w1, b1, w2, y):
        h = torch.addmm(b1, x, w1)
        h = F.gelu(h) * torch.sigmoid(h) + torch.tanh(h) - F.silu(h) / 2
        h = torch.bmm(h.unsqueeze(0), w2.unsqueeze(0)).squeeze(0)
        h = torch.mm(h, w2.t()) @ w2
        z = (h - h.mean(1, keepdim=True)).exp().log() + h.sum(0) * 0.01
        return F.cross_entropy(z, y) + z.softmax(-1).pow(2).mean()

    ins = [T(4, 3), T(3, 5), T(5), T(5, 5, seed=4), torch.tensor([0, 1, 4, 2])]
    for _ in range(2):
        cp = [t.clone().requires_grad_(t.dtype.is_floating_point) for t in ins]
        tp = [t.to("tpu").requires_grad_(t.dtype.is_floating_point) for t in ins]
        want, got = net(*cp), net(*tp)
        want.backward()
        got.backward()
        assert_same(got, want.detach(), atol=1e-4)
        for g, c in zip(tp[:4], cp[:4]):
            assert_same(g.grad, c.grad, atol=1e-4)


@pytest.mark.modes("defer")
def test_functional_overloads_reach_the_fallback_whole_and_are_kernel_hits():
    """On: ``x + y``, ``mm``, ``sum`` reach the fallback as themselves (route_stats names
    ``add.Tensor``, never ``add.out``), and from their third call on are kernel hits. Off: PyTorch's
    structured path, ``add.out``."""
    x, y, w = T(4, 3).to("tpu"), T(4, 3, seed=1).to("tpu"), T(3, 2).to("tpu")
    EXT.reset_route_stats()
    for i in range(4):
        h = EXT.kernel_stats()["hits"]
        z = x + y
        m = torch.mm(z, w)
        s = m.sum(1)
        if i >= 2:
            assert EXT.kernel_stats()["hits"] - h == 3
    assert_same(s, ((x.cpu() + y.cpu()) @ w.cpu()).sum(1))
    r = EXT.route_stats()
    assert plain.KERNEL
    if ON:
        assert {"aten::add.Tensor", "aten::mm", "aten::sum.dim_IntList"} <= set(r), r
        assert not {"aten::add.out", "aten::mm.out", "aten::sum.IntList_out"} & set(r), r
        q = torch._C._dispatch_has_kernel_for_dispatch_key
        assert all(q("aten::" + n, "PrivateUse1") for n in plain.FUNCTIONAL_DIRECT)
    else:
        assert {"aten::add.out", "aten::mm.out", "aten::sum.IntList_out"} <= set(r), r
        assert "aten::add.Tensor" not in r


@pytest.mark.modes("defer")
def test_inplace_and_out_overloads_stay_structured():
    x, y = T(4).to("tpu"), T(4, seed=1).to("tpu")
    out = torch.empty(4, device="tpu")
    xc, yc, oc = x.cpu(), y.cpu(), torch.empty(4)
    EXT.reset_route_stats()
    torch.add(x, y, out=out)
    torch.add(xc, yc, out=oc)
    x.mul_(y)
    xc.mul_(yc)
    assert_same(out, oc)
    assert_same(x, xc)
    r = EXT.route_stats()
    # PyTorch's structured in-place kernel reaches the fallback as the .out op into self
    assert "aten::add.out" in r and "aten::mul.out" in r, r
    assert "aten::add.Tensor" not in r and "aten::mul.Tensor" not in r, r


@pytest.mark.modes(*MODES)
def test_a_python_number_checked_by_value_still_raises_after_hits():
    """``pow.Tensor_Scalar`` stays structured (NOTE [functional direct]): its meta function checks
    the exponent's value, which a kernel hit would not (numbers are runtime inputs): after hits
    with ``** 2``, ``** -1`` on an integer tensor still raises as on CPU."""
    a = T(4, dtype=torch.int64)
    t = a.to("tpu")
    for _ in range(3):
        assert_same(t ** 2, a ** 2)
    with pytest.raises(RuntimeError, match="^Integers to negative integer powers are not allowed.$"):
        t ** -1
    assert_same(t.float() ** -1, a.float() ** -1)


@pytest.mark.skipif(not ON, reason="the child process of the switch-on run")
@pytest.mark.modes("strict")
@pytest.mark.slow     # a child process over the cases with the switch off: make test-full
@pytest.mark.parametrize("which", ["strict", "all"])
def test_switch_off_every_case_holds_on_the_structured_path(which):
    """``DEFERFUSE_FUNCTIONAL_DIRECT=0``: this module again in a child process (the setting is
    read when the device registers), where each case runs on PyTorch's structured path: the
    error cases in strict mode and the routing in the default run, every case in the slow one."""
    env = dict(os.environ, DEFERFUSE_FUNCTIONAL_DIRECT="0")
    env.pop("PYTEST_XDIST_WORKER", None)
    here = os.path.dirname(os.path.abspath(__file__))
    k = ("(errors_equal_cpu and strict) or reach_the_fallback" if which == "strict"
         else "not switch_off")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "-p", "no:xdist", os.path.abspath(__file__), "-k", k,
                        "-m", "not slow" if which == "strict" else "slow or not slow"],
                       cwd=os.path.dirname(here), env=env, capture_output=True, text=True,
                       timeout=900)
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout and "skipped" not in r.stdout, tail
