"""NOTE [meta without dynamo] (deferfuse/metaplain.py): elementwise and decomposed ops answer their
output metadata without the Python meta kernels' Dynamo wrapper, exactly as those kernels and CPU
answer; a process running a GPT's ops never imports ``torch._dynamo``."""
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from deferfuse import meta, metaplain
from deferfuse.tensor import as_tpu

aten = torch.ops.aten
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _kernel(func, args, kwargs=None):
    """The meta kernel's answer, through the dispatcher (as before the change)."""
    kwargs = kwargs or {}
    out = func(*[meta._to_meta(a) for a in args], **{k: meta._to_meta(v) for k, v in kwargs.items()})
    if isinstance(out, torch.Tensor):
        return "one", (meta._desc(out),)
    return "tuple", tuple(meta._desc(o) for o in out)


def _cpu(func, args, kwargs=None):
    out = func(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], **(kwargs or {}))
    outs = (out,) if isinstance(out, torch.Tensor) else out
    return tuple(meta._desc(o) for o in outs)


def _tpu(shape, dtype=torch.float32, t=False):
    """A tpu tensor as the op path hands it to the meta inference (``as_tpu``: the op path's
    form with either representation, NOTE [mixed arguments] in plain.py)."""
    x = torch.randn(shape, dtype=torch.float32).to(dtype)
    if t:                           # a transposed (non-contiguous) view: the kernel answers
        x = x.transpose(-1, -2)
    return as_tpu(x.to("tpu") if not t
                  else x.contiguous().transpose(-1, -2).to("tpu").transpose(-1, -2))


def _cases():
    cases = []
    for dt in _DTYPES:
        for shape in ((5,), (3, 5), (2, 3, 5), (1, 4, 2, 5), (0, 5)):
            x = _tpu(shape, dt)
            cases.append((aten.linear.default, (x, _tpu((7, 5), dt)), {}))
            cases.append((aten.linear.default, (x, _tpu((7, 5), dt), _tpu((7,), dt)), {}))
            cases.append((aten.native_layer_norm.default, (x, [5], _tpu((5,), dt),
                                                           _tpu((5,), dt), 1e-5), {}))
            cases.append((aten.native_layer_norm.default, (x, [5], None, None, 1e-5), {}))
            if len(shape) > 1:
                cases.append((aten.native_layer_norm.default,
                              (x, list(shape[-2:]), None, None, 1e-5), {}))
            cases.append((aten.gelu.default, (x,), {}))
            for dim, keep in ((-1, True), (-1, False), ([0], True), ([0, -1], False),
                              ([-1, -1], False), (len(shape), True)):
                cases.append((aten.mean.dim, (x, dim, keep), {}))
            cases.append((aten.gelu.default, (x,), {"approximate": "tanh"}))
            for other in (2, 0.5, True, _tpu(shape[-1:], dt), _tpu((1,) * len(shape), dt),
                          _tpu(shape, dt), _tpu((3, 1, 1), dt)):
                cases.append((aten.div.Tensor, (x, other), {}))
        cases.append((aten.div.Tensor, (_tpu((3, 1), dt), _tpu((1, 4), dt)), {}))
        cases.append((aten.div.Tensor, (_tpu((4, 1, 3), dt), _tpu((2, 1), dt)), {}))
        cases.append((aten.div.Tensor, (_tpu((), dt), _tpu((2, 3), dt)), {}))
        cases.append((aten.div.Tensor, (_tpu((), dt), 2.0), {}))
    # cases the rules leave to the kernel: other layouts, dtypes, mixed dtypes
    cases += [(aten.linear.default, (_tpu((3, 5), t=True), _tpu((7, 5))), {}),
              (aten.linear.default, (_tpu((3, 5)), _tpu((7, 5), torch.float64)), {}),
              (aten.native_layer_norm.default, (_tpu((3, 5), t=True), [5], None, None, 1e-5), {}),
              (aten.gelu.default, (_tpu((4, 5), t=True),), {}),
              (aten.mean.dim, (_tpu((4, 5)), [-1], True), {"dtype": torch.float64}),
              (aten.mean.dim, (_tpu((4, 5), t=True), [-1], True), {}),
              (aten.div.Tensor, (_tpu((4, 5), t=True), 2.0), {}),
              (aten.div.Tensor, (_tpu((4, 5)), _tpu((4, 5), torch.float64)), {}),
              (aten.div.Tensor, (as_tpu(torch.arange(6).to("tpu")), 4), {}),
              (aten.div.Tensor, (_tpu((4, 5)), torch.tensor(2.0, dtype=torch.float64)), {})]
    return cases


@pytest.mark.modes("defer")
def test_plain_answers_equal_the_meta_kernel_and_cpu():
    answered = 0
    for func, args, kwargs in _cases():
        got = metaplain.answer(func, args, kwargs)
        try:
            want = _kernel(func, args, kwargs)
        except (RuntimeError, IndexError) as e:     # the kernel's error (shapes, dims)
            assert got is None, (func, got)
            with pytest.raises(type(e), match=re.escape(str(e)[:30])):
                meta._run_meta(func, args, kwargs)
            continue
        if got is not None:
            answered += 1
            assert got == want, (func, [getattr(a, "shape", a) for a in args], got, want)
            if func is not aten.native_layer_norm.default:  # (its statistics are float32 on
                # meta for half inputs and half on CPU: the kernel's answer is the one kept)
                assert got[1] == _cpu(func, args, kwargs), func
        # what _run_meta answers (the rule or the unwrapped kernel) is the kernel's answer
        assert meta._run_meta(func, args, kwargs) == want, func
    assert answered >= 150, answered


def test_unwrapped_kernels_answer_as_the_dispatcher():
    """Elementwise references called from below their Dynamo wrapper: broadcasts, type promotion
    with Python scalars, 0-dim and integer tensors, non-contiguous inputs."""
    x = torch.randn(3, 4, device="meta")
    cases = [(aten.add.Tensor, (x, torch.randn(4, device="meta"))),
             (aten.add.Tensor, (x.t(), torch.randn(3, device="meta"))),
             (aten.mul.Tensor, (torch.ones(3, 1, dtype=torch.int64, device="meta"), x)),
             (aten.mul.Scalar, (torch.ones(2, 3, dtype=torch.int32, device="meta"), 2.5)),
             (aten.lt.Tensor, (x, torch.randn(3, 1, device="meta"))),
             (aten.where.self, (torch.ones(3, 4, dtype=torch.bool, device="meta"), x,
                                torch.tensor(0.0))),
             (aten.sub.Tensor, (torch.ones((), dtype=torch.float64, device="meta"), x)),
             (aten.cat.default, ([x, x[:1]],)),
             (aten.cat.default, ([x.t(), x.t()], 1)),
             (aten.exp.default, (x.t(),))]
    for func, args in cases:
        want = func(*args)
        got = metaplain.kernel(func)(*args)
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype), func
    with pytest.raises(RuntimeError) as want:
        aten.add.Tensor(x, torch.randn(5, device="meta"))
    with pytest.raises(RuntimeError) as got:
        metaplain.kernel(aten.add.Tensor)(x, torch.randn(5, device="meta"))
    assert str(got.value) == str(want.value)


_SCRIPT = r"""
import sys, torch, torch.nn.functional as F
import deferfuse
x = torch.randn(2, 6, 16).to("tpu")
w, b = torch.randn(32, 16).to("tpu"), torch.randn(32).to("tpu")
h = F.layer_norm(x, (16,))
h = F.gelu(F.linear(h, w, b)) / 2.0
m = h < h.mean(-1, keepdim=True)
h = torch.where(m, h * 3, h + 1).softmax(-1)
h = torch.cat([h, h], dim=1)
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo", tuple(h.shape), h.stride())
"""


@pytest.mark.modes("strict")     # the child process runs in defer mode (TORCHTPU_MODE)
def test_a_gpts_ops_never_import_dynamo(tmp_path):
    env = dict(os.environ, DEFERFUSE_CACHE_DIR=str(tmp_path), TORCHTPU_MODE="defer")
    env.pop("DEFERFUSE_CROSS_CHECK", None)  # cross-checking runs every kernel (and imports Dynamo)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no dynamo (2, 12, 32) (384, 32, 1)" in out.stdout, out.stdout + out.stderr[-2000:]
