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

aten = torch.ops.aten

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
    # Session 10 (gpt2)'s overloads
    ("unary_more", lambda a: (a.erf(), a.abs().log1p(), a.expm1(), a.reciprocal()), (T(7),)),
    ("unary_more_int", lambda a: (a.erf(), a.log1p(), a.expm1(), a.reciprocal()),
     (T(5, dtype=torch.int64, lo=1, hi=5),)),
    ("reciprocal_zero_bool", lambda a, b: (a.reciprocal(), b.reciprocal()),
     (torch.tensor([0.0, -0.0, 2.0]), T(3, dtype=torch.bool))),
    ("clamp", lambda a: (a.clamp(-0.5, 0.5), a.clamp(min=0), a.clamp(max=0.3), a.clamp_min(0.1),
                         a.clamp_max(-0.1), a.clamp(0.5, -0.5)), (T(8),)),
    ("clamp_int_float_bounds", lambda a: (a.clamp(0.5, 2.5), a.clamp(-1, 2), a.clamp_min(1.5)),
     (T(6, dtype=torch.int64),)),
    ("clamp_tensor", lambda a, b: (a.clamp(b, b + 1), a.clamp(min=b), a.clamp(max=b), a.clamp_min(b),
                                   a.clamp_max(b)), (T(3, 4), T(4, seed=1))),
    ("clamp_int_tensor_float_bound", lambda a, b: a.clamp(b), (T(4, dtype=torch.int64), T(4))),
    ("activations_more", lambda a: (F.leaky_relu(a, 0.2), F.leaky_relu(a), F.elu(a, 0.7), F.elu(a),
                                    F.softplus(a, beta=2.0, threshold=0.5), F.softplus(a)), (T(8),)),
    ("activation_backwards", lambda a, g: (
        aten.leaky_relu_backward(g, a, 0.2, False), aten.leaky_relu_backward(g, a, 0.2, True),
        aten.elu_backward(g, 1.5, 1.0, 1.0, False, a), aten.elu_backward(g, 1.5, 1.0, 1.0, True, a),
        aten.softplus_backward(g, a, 2.0, 0.5)), (T(6), T(6, seed=1))),
    ("amax_amin", lambda a: (a.amax(1), a.amin(0, keepdim=True), a.amax((0, 1)), a.amin(())),
     (T(3, 4),)),
    ("amax_amin_int_bool", lambda a, b: (a.amax(0), a.amin(1), b.amax(0)),
     (T(3, 4, dtype=torch.int32), T(3, 4, dtype=torch.bool))),
    ("max_min_dim", lambda a: (*a.max(1), *a.min(0, keepdim=True), *a.max(-1, True)), (T(3, 4),)),
    ("max_min_dim_int", lambda a: (*a.max(0), *a.min(1)), (T(3, 4, dtype=torch.int64),)),
    ("topk", lambda a: (*a.topk(2), *a.topk(3, dim=0, largest=False), *a.topk(0)), (T(4, 5),)),
    ("topk_int", lambda a: a.topk(2, dim=0), (torch.tensor([[5, 1], [3, 4], [9, 0]]),)),
    ("baddbmm", lambda c, a, b: (torch.baddbmm(c, a, b), torch.baddbmm(c, a, b, beta=0.5, alpha=2.0),
                                 torch.baddbmm(c[0, 0], a, b, beta=0)),
     (T(2, 3, 2), T(2, 3, 4), T(2, 4, 2))),
    ("addcmul_addcdiv", lambda a, b, c: (torch.addcmul(a, b, c, value=0.5), torch.addcmul(a, b, c),
                                         torch.addcdiv(a, b, c.abs() + 1, value=-2.0),
                                         torch.addcdiv(a, b, c.abs() + 1)), (T(3, 4), T(4), T(3, 1))),
    ("addcmul_int", lambda a, b, c: torch.addcmul(a, b, c, value=3),
     (T(4, dtype=torch.int64), T(4, dtype=torch.int64, seed=1), T(4, dtype=torch.int64, seed=2))),
    ("lerp", lambda a, b, w: (torch.lerp(a, b, 0.3), torch.lerp(a, b, w), torch.lerp(a, b, 2.0)),
     (T(3, 4), T(3, 4, seed=1), T(4, seed=2))),
    ("pow_scalar_more", lambda a: (a ** 3, a ** -2, a.abs() ** 1.5, a ** 0, a ** 1, 2.5 ** a),
     (T(5),)),
    ("pow_scalar_int", lambda a, b: (a ** 0, a ** 5, a ** 2.5, b ** 2), (T(5, dtype=torch.int64),
                                                                         T(4, dtype=torch.bool))),
    ("vector_norm", lambda a: (torch.linalg.vector_norm(a), torch.linalg.vector_norm(a, 1, dim=1),
                               torch.linalg.vector_norm(a, float("inf")),
                               torch.linalg.vector_norm(a, 2, dim=(0, 1), keepdim=True),
                               torch.linalg.vector_norm(a, 3.5, dtype=torch.float64),
                               torch.linalg.vector_norm(a, 0)), (T(3, 4),)),
    ("clip_grad_norm", lambda a, b: _clip(a, b), (T(3, 4), T(5, seed=1))),
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
    # Session 10 (gpt2)'s overloads
    ("clamp_no_bounds", lambda a: torch.clamp(a), (T(4),)),
    ("clamp_complex", lambda a: a.clamp(0, 1), (T(3, dtype=torch.complex64),)),
    ("clamp_tensor_broadcast", lambda a, b: a.clamp(b), (T(3, 4), T(5))),
    ("amax_empty_dim", lambda a: a.amax(0), (T(0, 3),)),
    ("amax_dim_out_of_range", lambda a: a.amax(3), (T(3, 4),)),
    ("amin_repeated_dim", lambda a: a.amin((0, 0)), (T(3, 4),)),
    ("max_dim_empty", lambda a: a.max(0), (T(0, 3),)),
    ("min_dim_complex", lambda a: a.min(0), (T(3, dtype=torch.complex64),)),
    ("max_dim_complex", lambda a: a.max(0), (T(3, dtype=torch.complex64),)),
    ("clamp_min_max_tensor_complex", lambda a: (a.clamp_min(0), a.clamp_max(1), a.clamp(a.real)),
     (T(3, dtype=torch.complex64),)),
    ("topk_complex", lambda a: a.topk(1), (T(3, dtype=torch.complex64),)),
    ("topk_bool", lambda a: a.topk(1), (T(3, dtype=torch.bool),)),
    ("addcdiv_bool", torch.addcdiv, (T(3, dtype=torch.bool),) * 3),
    ("topk_k_too_big", lambda a: a.topk(6), (T(4, 5),)),
    ("topk_dim", lambda a: a.topk(1, dim=2), (T(4, 5),)),
    ("baddbmm_shapes", torch.baddbmm, (T(2, 3, 2), T(2, 3, 4), T(2, 5, 2))),
    ("baddbmm_self_shape", torch.baddbmm, (T(2, 3, 3), T(2, 3, 4), T(2, 4, 2))),
    ("baddbmm_dtypes", torch.baddbmm, (T(2, 3, 2), T(2, 3, 4), T(2, 4, 2, dtype=torch.float64))),
    ("addcdiv_int", torch.addcdiv,
     (T(4, dtype=torch.int64), T(4, dtype=torch.int64, seed=1), T(4, dtype=torch.int64, lo=1, hi=3))),
    ("addcmul_broadcast", torch.addcmul, (T(3, 4), T(5), T(3, 1))),
    ("lerp_dtypes", lambda a, b: torch.lerp(a, b, 0.5), (T(3), T(3, dtype=torch.float64))),
    ("lerp_weight_dtype", torch.lerp, (T(3), T(3, seed=1), T(3, dtype=torch.float64))),
    ("vector_norm_int", lambda a: torch.linalg.vector_norm(a), (T(4, dtype=torch.int64),)),
    ("vector_norm_inf_empty", lambda a: torch.linalg.vector_norm(a, float("inf")), (T(0, 3),)),
    ("bool_pow_negative", lambda a: a ** -2, (T(4, dtype=torch.bool),)),
    ("leaky_relu_backward_inplace_negative", lambda g, a: aten.leaky_relu_backward(g, a, -0.1, True),
     (T(4), T(4, seed=1))),
    ("elu_backward_inplace_negative", lambda g, a: aten.elu_backward(g, -1.0, 1.0, 1.0, True, a),
     (T(4), T(4, seed=1))),
]

_SAME_DEVICE = "Expected all tensors to be on the same device"


def _clip(a, b):
    """``clip_grad_norm_`` over two gradients (wlm_lstm's: ``_foreach_norm``,
    ``linalg_vector_norm``, ``clamp``, ``reciprocal``, ``_foreach_mul_``), on copies."""
    p, q = torch.nn.Parameter(a.new_zeros(a.shape)), torch.nn.Parameter(b.new_zeros(b.shape))
    p.grad, q.grad = a.clone(), b.clone()
    n = torch.nn.utils.clip_grad_norm_([p, q], 0.25)
    return n, p.grad, q.grad


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


@pytest.mark.modes(*MODES)
def test_backward_through_the_new_overloads_equals_cpu():
    """Session 10 (gpt2)'s overloads under autograd (their backwards among them: leaky_relu's,
    elu's, softplus's), gradients against CPU eager."""
    def net(x, w, b1, b2, c):
        h = F.leaky_relu(x, 0.1) + F.elu(x, 0.5) * F.softplus(x, 2.0) + x.clamp(-0.5, 0.7)
        h = h + (x ** 3) * 0.1 + x.erf() + x.abs().log1p() - (x * 0.1).expm1()
        h = h * (w.abs() + 1).reciprocal() + torch.lerp(h, x, 0.3) + torch.lerp(x, h, w.sigmoid())
        h = torch.addcmul(h, x, w, value=0.5) + torch.addcdiv(h, x, w.abs() + 1, value=-0.5)
        z = torch.baddbmm(c, b1, b2, alpha=0.5)
        return (h.amax(1).sum() + h.amin(0).sum() + h.max(1)[0].sum() + h.min(0).values.sum()
                + h.topk(2)[0].sum() + torch.linalg.vector_norm(h, 2, dim=1).sum() + z.pow(2).mean()
                + x.clamp_min(0.1).sum() * x.clamp_max(0.2).sum())

    ins = [T(4, 5), T(5, seed=1), T(2, 3, 4), T(2, 4, 2, seed=2), T(2, 3, 2, seed=3)]
    for _ in range(2):
        cp = [t.clone().requires_grad_() for t in ins]
        tp = [t.to("tpu").requires_grad_() for t in ins]
        want, got = net(*cp), net(*tp)
        want.backward()
        got.backward()
        assert_same(got, want.detach(), atol=1e-4)
        for g, c in zip(tp, cp):
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
    """NOTE [C++ value checks]: ``pow.Tensor_Scalar``'s meta function checks the exponent's
    value, which a key cannot carry (numbers are runtime inputs): the kernel checks it per call.
    After hits of one key (``** 3``, ``** 4``, ``** 5``), ``** -3`` on an integer tensor (the same
    key: -1 would be a constant, another key) raises as on CPU and is never a hit; the key's next
    call is a hit again, and a float base takes a negative exponent."""
    a = T(4, dtype=torch.int64)
    t = a.to("tpu")
    for e in (3, 4, 5):     # the router's call, the kernel's learn, a kernel hit
        assert_same(t ** e, a ** e)
    k0 = EXT.kernel_stats()
    with pytest.raises(RuntimeError, match="^Integers to negative integer powers are not allowed.$"):
        t ** -3
        deferfuse.sync()
    k1 = EXT.kernel_stats()
    assert_same(t ** 6, a ** 6)
    k2 = EXT.kernel_stats()
    if ON and plain.KERNEL and deferfuse.current_mode() != "debug":
        assert k1["value_refused"] - k0["value_refused"] == 1, (k0, k1)
        assert k1["hits"] == k0["hits"], (k0, k1)
        assert k2["hits"] - k1["hits"] == 1, (k1, k2)
    assert_same(t.float() ** -3, a.float() ** -3)
    b = T(4, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="^Integers to negative integer powers are not allowed.$"):
        b.to("tpu") ** -3
        deferfuse.sync()


@pytest.mark.modes(*MODES)
@pytest.mark.parametrize("op,msg", [
    (lambda g, x, s, r: aten.leaky_relu_backward(g, x, s, r), "In-place leakyReLu backward"),
    (lambda g, x, s, r: aten.elu_backward(g, s, 1.0, 1.0, r, x), "In-place elu backward"),
], ids=["leaky_relu_backward", "elu_backward"])
def test_a_negative_slope_checked_by_value_after_hits(op, msg):
    """NOTE [C++ value checks]: the in-place backward of leaky_relu and elu (the saved tensor is
    the result) refuses a negative slope, a runtime number: after hits with positive slopes, a
    negative one raises as on CPU; with the out-of-place flag it is a value like any other."""
    g, x = T(5), T(5, seed=1)
    gt, xt = g.to("tpu"), x.to("tpu")
    for s in (0.3, 0.4, 0.7):
        assert_same(op(gt, xt, s, True), op(g, x, s, True))
    with pytest.raises(RuntimeError) as want:
        op(g, x, -0.3, True)
    with pytest.raises(RuntimeError) as got:
        op(gt, xt, -0.3, True)
        deferfuse.sync()
    assert str(got.value) == str(want.value) and str(want.value).startswith(msg)
    for s in (0.3, -0.3, -0.5):
        assert_same(op(gt, xt, s, False), op(g, x, s, False))


@pytest.mark.modes("defer")
def test_the_new_overloads_are_kernel_hits_from_the_third_call():
    """Session 10 (gpt2)'s overloads reach the fallback as themselves and, from the third call of
    a key, are kernel hits, multi-output ones (``max.dim``, ``topk``) included; with numbers
    changing per call (runtime inputs: no new key, no compile)."""
    # shapes no other case uses: the keys are new (each op's first call may have been planned)
    x, y, w = T(5, 7).to("tpu"), T(5, 7, seed=1).to("tpu"), T(7, seed=2).to("tpu")
    b1, b2 = T(2, 5, 7).to("tpu"), T(2, 7, 7).to("tpu")
    g = T(5, 7, seed=3).to("tpu")

    def calls(i):
        v = 0.1 + 0.01 * i
        return [x ** (3 + i), x.clamp(-v, v), x.clamp_min(v), x.clamp_max(v), x.clamp(w),
                x.reciprocal(), x.erf(), x.abs().log1p(), x.expm1(), F.leaky_relu(x, v),
                F.elu(x, v), F.softplus(x, 1 + v), aten.leaky_relu_backward(g, x, v, False),
                aten.elu_backward(g, v, 1.0, 1.0, False, x), aten.softplus_backward(g, x, 1 + v, 20.0),
                x.amax(1), x.amin(0), *x.max(1), *x.min(0), *x.topk(2), torch.baddbmm(b1, b1, b2, alpha=v),
                torch.addcmul(x, y, w, value=v), torch.addcdiv(x, y, w.abs() + 1, value=v),
                torch.lerp(x, y, v), torch.lerp(x, y, w), torch.linalg.vector_norm(x, 2.0, dim=1)]
    EXT.reset_route_stats()
    n = len(calls(0)) - 3     # max, min and topk each return two tensors from one op
    m0 = deferfuse.metrics()["compiles"]
    got = []
    for i in range(1, 6):
        h, r0 = EXT.kernel_stats()["hits"], EXT.route_stats()
        got = calls(i)
        if i >= 2:
            assert EXT.route_stats() == r0         # nothing through the router
            # and the abs of log1p's input, the abs and add of addcdiv's; off, PyTorch's
            # structured path may split an op into several hits
            h = EXT.kernel_stats()["hits"] - h
            assert h == n + 3 if ON else h >= n + 3, h
        deferfuse.sync()
        if i == 2:
            m0 = deferfuse.metrics()["compiles"]
    assert deferfuse.metrics()["compiles"] == m0
    r = EXT.route_stats()       # before the reads below (_to_copy)
    xc, yc, wc, b1c, b2c, gc = (t.cpu() for t in (x, y, w, b1, b2, g))
    want = [xc ** 8, xc.clamp(-0.15, 0.15), xc.clamp_min(0.15), xc.clamp_max(0.15), xc.clamp(wc),
            xc.reciprocal(), xc.erf(), xc.abs().log1p(), xc.expm1(), F.leaky_relu(xc, 0.15),
            F.elu(xc, 0.15), F.softplus(xc, 1.15), aten.leaky_relu_backward(gc, xc, 0.15, False),
            aten.elu_backward(gc, 0.15, 1.0, 1.0, False, xc), aten.softplus_backward(gc, xc, 1.15, 20.0),
            xc.amax(1), xc.amin(0), *xc.max(1), *xc.min(0), *xc.topk(2),
            torch.baddbmm(b1c, b1c, b2c, alpha=0.15), torch.addcmul(xc, yc, wc, value=0.15),
            torch.addcdiv(xc, yc, wc.abs() + 1, value=0.15), torch.lerp(xc, yc, 0.15),
            torch.lerp(xc, yc, wc), torch.linalg.vector_norm(xc, 2.0, dim=1)]
    assert_same(got, want, atol=1e-4, rtol=1e-4)
    if ON:
        for name in ("pow.Tensor_Scalar", "clamp", "clamp_min", "clamp.Tensor", "max.dim", "topk",
                     "baddbmm", "lerp.Scalar", "linalg_vector_norm", "leaky_relu_backward"):
            assert 1 <= r.get("aten::" + name, 0) <= 2, (name, r)     # (plan,) learn
        assert not any(k.endswith("out") for k in r), r


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
