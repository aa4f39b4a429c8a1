"""The OpInfo sweep: PyTorch's ``op_db`` on the ``tpu`` device against CPU eager PyTorch.

For every OpInfo, mode (``strict``, ``defer``) and dtype its CPU kernels support, each sample input
is moved to tpu (tensors only, recursively, aliasing kept), the op runs on tpu and on CPU, and the
results are compared: type/structure, then device, dtype and shape, then values (per-op
tolerances, ``TOL``); inputs are compared afterwards too (in-place writes). If the CPU call raises,
the tpu call must raise the same exception: its type, and its message with device names made one
word (``error_message``); an error in the sweep's own view of CPU's result (``ties_view``, a gauge
view) is the harness's, a failure. A sample that passes by raising, or whose result is empty,
compared nothing: an op all of whose samples are such is ``hollow``, counted apart. Random ops (``RANDOM``) are compared by shape and
dtype, and must give the same values again under the same ``torch.manual_seed``; indices that may
pick any of several equal values (``TIES``: sort, topk...) are compared through the values they
select, and sort/argsort's must be a permutation, topk's distinct (``ties_indices_error``).
With ``--backward``, floating-point samples of autograd ops (``BACKWARD_DTYPES``: float32,
float64, bfloat16, float16) also compare the gradients of a fixed random-weighted sum of the float
outputs with respect to the float inputs (for ``TIES`` ops, summed over tied inputs). Where an
OpInfo declares a looser half-precision tolerance for comparing a device with CPU (TestConsistency's
``toleranceOverride``), a sample that passes only with it counts as passing and is listed apart;
``CPU_BROKEN`` ops are compared with CPU's float32 result, rounded.

The half-precision sweep: ``--dtypes bfloat16,float16 --backward`` (about 20 min forward and
25 min backward, both modes, on two busy cores with a cold compile cache).

Each (op, mode, dtype, direction) is classified:
  pass      every sample matches CPU and nothing ran on CPU fallback
  fallback  every sample matches, but some aten op ran on CPU (``deferfuse.metrics()['cpu_fallbacks']``)
  fail      some sample failed; the first failure's cause is its group (``GROUPS``)
  skip      named in ``SKIP`` (one reason each) or no sample inputs for the dtype
  hollow    every sample compared nothing (both sides raised the same exception, or an empty result)
Ops whose CPU dtypes lack the dtype are not counted for it.

Run from the repository root::

    .venv/bin/python tests/opinfo_sweep.py [--modes strict,defer] [--dtypes float32,...]
        [--backward | --backward-only] [--ops a,b] [--limit-samples N] [--timeout S]
        [--out bench/results/opinfo.json] [--md bench/results/opinfo.md]
    .venv/bin/python tests/opinfo_sweep.py --merge fwd.json,bwd.json,dtypes.json \
        --out bench/results/opinfo.json --md bench/results/opinfo.md

Forward, backward and other dtypes are separate runs (each its own JSON); ``--merge`` combines
them (a later file's cells replace an earlier one's, so a targeted rerun with ``--ops`` can be
merged last) and writes the markdown table.

The full float32 forward sweep in both modes takes ~25 min on two busy cores with
``--limit-samples 3`` and a warm compile cache (~70 min cold). The JSON is rewritten every 25 ops
(``meta.partial``) so an interrupted sweep leaves its results.

This file is the whole engine (tests/ is not a package); tests/test_opinfo.py loads it by path.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import platform
import re
import signal
import sys
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import deferfuse  # noqa: E402
from deferfuse.errors import LoweringError, RegionError  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "opinfo.json")
# Dtypes whose gradients ``--backward`` compares (half precision included: a bf16 model trains).
BACKWARD_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
          "float64": torch.float64}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# Failure groups, in the order the report lists them.
GROUPS = ("dtype mismatch", "shape mismatch", "value mismatch", "structure mismatch",
          "wrong device", "error not raised", "wrong exception type", "wrong exception message",
          "not reproducible",
          "lowering error",
          "timeout", "crash", "other")

# ---------------------------------------------------------------------------------------------
# The named sets

# Ops whose results are random (or undefined memory): compared by shape and dtype only.
RANDOM = {
    "cauchy", "exponential", "geometric", "log_normal", "normal.in_place", "uniform",
    "normal", "normal.number_mean", "bernoulli", "multinomial",
    "randn", "randn_like", "rand_like", "randint", "randint_like",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout.with_train",
    "nn.functional.rrelu", "nn.functional.fractional_max_pool2d",
    "nn.functional.fractional_max_pool3d", "svd_lowrank", "pca_lowrank",
    # uninitialized memory: the values are undefined
    "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted",
}
RANDOM_REASON = ("random or uninitialized result: shape and dtype only, and (random ops) the same "
                 "values again under the same torch.manual_seed")
UNINITIALIZED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                 "empty_permuted"}

# Ops random only for some samples (dropout > 0 while training): those samples shape and dtype only.
RANDOM_SAMPLES = {
    "nn.functional.scaled_dot_product_attention": lambda s: s.kwargs.get("dropout_p", 0.0) > 0,
    "nn.functional.multi_head_attention_forward":
        lambda s: len(s.args) > 9 and s.args[9] > 0 and s.kwargs.get("training", True),
}

# Ops whose tensor args (not the input) PyTorch requires on CPU, whatever the input's device.
CPU_ARGS = {"tensor_split": "the indices_or_sections tensor must be a CPU tensor"}

# Ops whose outputs are unique only up to a sign or phase (eigenvectors, singular vectors): both
# results go through the sample's own ``output_process_fn_grad`` (OpInfo's gauge-invariant view:
# abs() of the vectors, or the singular values) before comparing.
GAUGE = {"svd", "linalg.svd", "linalg.eig", "linalg.eigh"}


def gauge_view(name: str, s, out):
    """A GAUGE op's result as compared. svd's samples each pick one view (|U|, S, S and |Vh|, or
    U @ Vh and S, in turn), so a sample compared only part of the result: every view is taken
    here, as OpInfo's ``uniformize`` makes them (the first k = len(S) singular vectors)."""
    if name not in ("svd", "linalg.svd"):
        return s.output_process_fn_grad(out)
    S = out[1]
    k = S.shape[-1]
    U = out[0][..., :k]
    Vh = (out[2] if name == "linalg.svd" else out[2].mH)[..., :k, :]
    return U.abs(), S, Vh.abs(), U @ Vh

# Ops whose indices output is unspecified among equal values (CPU's unstable sort, topk and
# kthvalue pick any of the tied elements): the indices are compared through the input values they
# select (``ties_view``), so a different choice among ties is no mismatch. {op: (index of the
# indices output, position of ``dim`` in args)}.
TIES = {"sort": (1, 0), "argsort": (None, 0), "topk": (1, 1), "kthvalue": (1, 1), "mode": (1, 0)}


# Ops returning no indices whose gradient still goes to whichever tied element was picked
# (msort: an unstable sort along dim 0): gradients compared as for TIES. {op: dim}
TIES_GRAD = {"msort": 0}


def _ties_dim(name: str, s, inp):
    """The dim of a ``TIES`` op's sample, or None when its tie order is defined (stable=True)."""
    if s.kwargs.get("stable") or not isinstance(inp, torch.Tensor) or inp.dim() == 0:
        return None
    if name in TIES_GRAD:
        return TIES_GRAD[name]
    pos = TIES[name][1]
    return s.args[pos] if len(s.args) > pos else s.kwargs.get("dim", -1)


def ties_grad(name: str, s, inp, g):
    """A gradient ``g`` with respect to the input of a ``TIES`` op, summed over each group of equal
    input values along ``dim``: which of several tied elements receives a gradient is as
    unspecified as which index the forward returns, but the group's total is not."""
    dim = _ties_dim(name, s, inp)
    if dim is None or g is None:
        return g
    x = inp.detach().movedim(dim, -1)
    gm = g.movedim(dim, -1).float()
    eq = x.unsqueeze(-1) == x.unsqueeze(-2)
    return (eq * gm.unsqueeze(-2)).sum(-1).movedim(-1, dim).to(g.dtype)


def ties_view(name: str, s, inp, out):
    """``out`` with its indices replaced by the input values they select (see ``TIES``)."""
    k = TIES[name][0]
    dim = _ties_dim(name, s, inp)
    idx = out if k is None else out[k]
    if dim is None or not isinstance(idx, torch.Tensor):
        return out
    keep = idx.dim() == inp.dim()
    sel = torch.take_along_dim(inp, idx if keep else idx.unsqueeze(dim), dim)
    sel = sel if keep else sel.squeeze(dim)
    if k is None:
        return sel
    # (a structseq such as torch.return_types.sort takes one sequence, not its fields as arguments)
    return type(out)([sel if i == k else o for i, o in enumerate(out)])


# Why the known failures fail, {op: (group, cause)} (for the table; the sweep does not use it).
CAUSES = {
    "logcumsumexp": (
        "value mismatch", "backward of a 1e4-valued sample: CPU and tpu both ~5e-3 from float64 "
        "(tpu closer)"),
    "complex": ("other", "float16 input makes complex32, which JAX lacks (see SKIP chalf)"),
    "view_as_complex": ("lowering error", "float16 input makes complex32, which JAX lacks"),
    "nn.functional.linear_cross_entropy.chunked_none": (
        "value mismatch", "half precision: PyTorch's own composite kernel runs on tpu op for op; "
        "a loss near a rounding boundary lands a few ulps off (float32 products summed in another "
        "order)"),
    "grid_sampler_2d": (
        "value mismatch", "half-precision backward: CPU adds the input gradient into a "
        "half-precision buffer output pixel by output pixel; tpu accumulates in float32 and rounds "
        "once (following CPU would take a sequential scan; see docs/dtypes.md)"),
    "grid_sampler_3d": ("value mismatch", "as grid_sampler_2d"),
    "nn.functional.grid_sample": ("value mismatch", "as grid_sampler_2d"),
    "nn.functional.conv_transpose3d": (
        "value mismatch", "half-precision backward with an output padding as large as the stride "
        "(CPU's slow path): the weight gradient, accumulated in float32 on tpu"),
    "nn.functional.layer_norm": (
        "value mismatch", "float32 backward over one element: the exact gradient is 0 (x is its "
        "own mean); CPU's is the rounding residue of its fused formula scaled by 1/sqrt(eps) "
        "(2.4e-4; float64 gives 6e-14), tpu's is 0"),
    "special.i0e": (
        "value mismatch", "bfloat16 backward: i1e(x) - sgn(x) * i0e(x) cancels; one ulp of "
        "difference in i0e or i1e (computed in float32 on tpu) survives it"),
}

# Ops whose CPU kernel is wrong in a dtype: the reference is the CPU op in float32 on float32
# copies of the inputs, rounded to the dtype. {op: {dtype: reason}}
_MEXP = ("CPU's half-precision matrix_exp returns NaN or values off by 1e30 for ordinary "
         "inputs (exp of 0.1 * randn(5, 5) in bfloat16 has a -1.3e30 entry); tpu computes in "
         "float32 and rounds once")
CPU_BROKEN = {"matrix_exp": {torch.bfloat16: _MEXP, torch.float16: _MEXP}}
# That reference is float32 arithmetic too (CPU's MKL products where tpu's are XLA's past 10x10):
# rounded to float16, the two may differ by up to two ulps.
TOL_HALF_EXPM = {torch.float16: (1e-5, 2e-3)}

# Half-precision contractions: CPU eager's own half-precision convolution and matmul kernels give
# different results on different CPUs (oneDNN rounds partial sums to the dtype where the CPU has
# native bfloat16/float16 arithmetic, AVX512-BF16 or AMX, and sums in float32 elsewhere), so a
# gradient can be several ulps from the exact result on one machine and not on another. Where the
# comparison with CPU fails, tpu's result still counts as matching when, element by element, it is
# no farther from the float64 result (the op on float64 copies of the same inputs) than CPU's own
# result is, within the dtype's tolerance: tpu no less accurate than CPU (counted apart).
EXACT_REFERENCE = {"addbmm", "baddbmm", "addmm", "addmm.decomposed", "addmv", "addr", "bmm", "mm",
                   "mv", "matmul", "__rmatmul__", "dot", "vdot", "inner", "tensordot", "einsum",
                   "nn.functional.linear", "nn.functional.bilinear", "nn.functional.conv1d",
                   "nn.functional.conv2d", "nn.functional.conv3d", "nn.functional.conv_transpose1d",
                   "nn.functional.conv_transpose2d", "nn.functional.conv_transpose3d"}
# Ill-conditioned float32 results, by the same rule: matrix_exp of a norm-9 matrix (values ~1e4:
# CPU's own float32 result is 3.5e-4 relative from float64; tpu follows CPU's algorithm, with
# XLA's products past 10x10), logcumsumexp's gradient
# of a 1e4-valued input (both ~5e-3 from float64), and multi-head attention (a softmax of sums of
# products: XLA's dot sums in another order, a few ulps of the sum).
EXACT_REFERENCE |= {"matrix_exp", "logcumsumexp", "nn.functional.multi_head_attention_forward"}


def no_less_accurate(got: list, want: list, ref: list, tol_of) -> bool:
    """Each tpu tensor in ``got`` (Snaps) is, element by element, within the tolerance of being
    no farther from the float64 ``ref`` than CPU's ``want`` is."""
    if len(got) != len(want) or len(want) != len(ref):
        return False
    for g, w, r in zip(got, want, ref):
        if g is None and w is None:
            continue
        if g is None or w is None or r is None:
            return False
        g, r = g.t.double(), r.detach().double()
        if g.shape != r.shape:
            return False
        atol, rtol = tol_of(w.dtype)
        slack = (w.detach().double() - r).abs() + atol + rtol * r.abs()
        both_nan = g.isnan() & r.isnan()
        if not bool(((g - r).abs() <= slack).logical_or(both_nan).all()):
            return False
    return True


def float64_copy(x, memo: dict):
    """A CPU copy of the sample with its half-precision tensors in float64 (leaves kept)."""
    def f(t):
        if not isinstance(t, torch.Tensor):
            return t
        c = memo.get(id(t))
        if c is None:
            c = t.detach().clone()
            if c.dtype in (torch.bfloat16, torch.float16):
                c = c.double()
            if t.requires_grad:
                c.requires_grad_(True)
            memo[id(t)] = c
        return c
    return _map(x, f)


# Ops not swept, one reason each.
SKIP = {
    "to_sparse": "sparse layouts are not supported on the tpu device",
    "sparse.sampled_addmm": "sparse layouts are not supported on the tpu device",
    "sparse.mm.reduce": "sparse layouts are not supported on the tpu device",
    "jiterator_unary": "jiterator: CUDA-only runtime-compiled kernels",
    "jiterator_binary": "jiterator: CUDA-only runtime-compiled kernels",
    "jiterator_4inputs_with_extra_args": "jiterator: CUDA-only runtime-compiled kernels",
    "jiterator_binary_return_by_ref": "jiterator: CUDA-only runtime-compiled kernels",
    "jiterator_2inputs_2outputs": "jiterator: CUDA-only runtime-compiled kernels",
    "bmm.triton_optimized": "CUDA-only: exercises a Triton bmm kernel",
    "torch._scaled_mm": "CUDA-only: float8 scaled matmul",
    "torch._scaled_mm_v2": "CUDA-only: float8 scaled matmul",
    "torch.ops.aten._flash_attention_forward": "CUDA-only: flash attention kernel",
    "torch.ops.aten._efficient_attention_forward": "CUDA-only: memory-efficient attention kernel",
    "nn.functional.batch_norm.without_cudnn": "CUDA-only: cudnn-disabled variant",
    "hash_tensor": "hash of the bit pattern: a CPU-kernel-specific reduction, not numerics",
    "chalf": "complex32 (chalf) has no JAX dtype: not a tpu dtype",
}

# Per-op tolerances {op: {dtype: (atol, rtol)}} over DEFAULT_TOL, forward and backward.
# float32 defaults are PyTorch's own (assert_close); loosened per op where XLA's transcendental
# approximations or a different summation order differ from PyTorch's CPU kernels.
DEFAULT_TOL = {torch.float32: (1e-5, 1.3e-6), torch.float64: (1e-7, 1e-7),
               torch.bfloat16: (1e-5, 1.6e-2), torch.float16: (1e-5, 1e-3),
               torch.complex64: (1e-5, 1.3e-6), torch.complex128: (1e-7, 1e-7)}
# Half-precision gradients go through several rounded ops (the autograd formula's, each rounding
# to the dtype on CPU, where a fused XLA region may round once): atol is that of PyTorch's own
# CPU-vs-device test (test_compare_cpu, 1e-3), rtol two units in the last place of the dtype
# (bfloat16's is assert_close's default).
BACKWARD_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-3, 1.6e-2),
                torch.float16: (1e-3, 2e-3)}
TOL: dict = {}
BACKWARD_TOL_OP: dict = {}

# Contractions (matmul, convolutions): XLA's dot/conv emitters sum in a different order than
# MKL/oneDNN, so float32 results differ by a few times the rounding of the sum.
for _n in ("addbmm", "baddbmm", "addmm", "addmm.decomposed", "addmv", "addr", "bmm", "mm", "mv",
           "matmul", "__rmatmul__", "dot", "vdot", "inner", "tensordot", "einsum",
           "linalg.multi_dot", "linalg.vecdot", "nn.functional.linear", "nn.functional.bilinear",
           "nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.conv3d",
           "nn.functional.conv_transpose1d", "nn.functional.conv_transpose2d",
           "nn.functional.conv_transpose3d", "cdist", "nn.functional.pdist"):
    TOL[_n] = {torch.float32: (1e-4, 1e-5)}
# polygamma: XLA evaluates it through a zeta series; results differ from PyTorch's by ~2e-5
# relative for large values (about 150 ulp), not a lowering bug.
for _n in ("polygamma.polygamma_n_0", "polygamma.polygamma_n_1", "polygamma.polygamma_n_2",
           "polygamma.polygamma_n_3", "polygamma.polygamma_n_4",
           "special.polygamma.special_polygamma_n_0"):
    TOL[_n] = {torch.float32: (1e-5, 1e-4)}


TOL["matrix_exp"] = {**TOL.get("matrix_exp", {}), **TOL_HALF_EXPM}


def tolerance(name: str, dtype, backward: bool = False, own: bool = True):
    table = BACKWARD_TOL_OP if backward else TOL
    t = table.get(name, {}).get(dtype)
    if t is None and backward:
        t = TOL.get(name, {}).get(dtype)
    if t is None:
        t = (BACKWARD_TOL if backward else {}).get(dtype) or DEFAULT_TOL.get(dtype, (0.0, 0.0))
    o = opinfo_tolerances().get((name, dtype, backward)) if own else None
    if o is not None:       # the OpInfo's own device-vs-CPU tolerance, where looser
        t = (max(t[0], o[0]), max(t[1], o[1]))
    return t


_OWN_TESTS = {False: "test_output_match", True: "test_output_grad_match"}
_OWN: dict = {}


def opinfo_tolerances() -> dict:
    """{(op, dtype, backward): (atol, rtol)}: the half-precision tolerances op_db's OpInfos
    declare themselves for comparing a device with CPU (``toleranceOverride`` decorators of
    TestConsistency's ``test_output_match`` / ``test_output_grad_match``, MPS against CPU)."""
    if _OWN:
        return _OWN
    _OWN[None] = None
    try:
        from torch.testing._internal.common_device_type import toleranceOverride
    except ImportError:
        return _OWN
    for name, o in load_ops().items():
        for d in o.decorators:
            if getattr(d, "cls_name", None) != "TestConsistency":
                continue
            for dec in getattr(d, "decorators", ()):
                if not isinstance(dec, toleranceOverride):
                    continue
                for bwd, test in _OWN_TESTS.items():
                    if d.test_name not in (None, test):
                        continue
                    for dt, tl in dec.d.items():
                        if dt in (torch.bfloat16, torch.float16):
                            _OWN[(name, dt, bwd)] = (tl.atol, tl.rtol)
    return _OWN


# ---------------------------------------------------------------------------------------------
# op_db

def op_name(o) -> str:
    return o.name + ("." + o.variant_test_name if o.variant_test_name else "")


def load_ops() -> dict:
    """{name: OpInfo} of op_db, in op_db order (names are unique with their variant)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return {op_name(o): o for o in op_db}


def supported(o, dtype) -> bool:
    try:
        return dtype in o.supported_dtypes("cpu")
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------
# moving samples, snapshots

def _map(x, f):
    """Apply f to every leaf of nested lists/tuples/dicts (namedtuples and torch.Size kept)."""
    if isinstance(x, torch.Tensor):
        return f(x)
    if isinstance(x, torch.Size):
        return x
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*[_map(y, f) for y in x])
    if isinstance(x, (list, tuple)):
        return type(x)(_map(y, f) for y in x)
    if isinstance(x, dict):
        return {k: _map(v, f) for k, v in x.items()}
    return f(x)


def clone_cpu(x, memo: dict):
    """A fresh CPU copy of the sample (leaf tensors, requires_grad kept, aliasing kept)."""
    def f(t):
        if not isinstance(t, torch.Tensor):
            return t
        c = memo.get(id(t))
        if c is None:
            c = t.detach().clone()
            if t.requires_grad:
                c.requires_grad_(True)
            memo[id(t)] = c
        return c
    return _map(x, f)


def to_tpu(x, memo: dict):
    """The sample on tpu: tensors copied over (requires_grad kept), CPU devices become tpu."""
    def f(t):
        if isinstance(t, torch.Tensor):
            c = memo.get(id(t))
            if c is None:
                c = t.detach().resolve_conj().resolve_neg().to("tpu")
                if t.requires_grad:
                    c.requires_grad_(True)
                memo[id(t)] = c
            return c
        if isinstance(t, torch.device) and t.type == "cpu":
            return torch.device("tpu")
        if isinstance(t, str) and t == "cpu":
            return "tpu"
        return t
    return _map(x, f)


def place(name: str, s, memo: dict):
    """(input, args, kwargs) of sample ``s`` for the tpu run."""
    if name in CPU_ARGS:
        return to_tpu(s.input, memo), clone_cpu(s.args, {}), to_tpu(s.kwargs, memo)
    return to_tpu((s.input, s.args, s.kwargs), memo)


class Snap:
    """A tensor result seen from CPU: its device, and a CPU copy (taken inside the tpu try)."""
    __slots__ = ("device", "t")

    def __init__(self, t: torch.Tensor):
        self.device = t.device.type
        d = t.detach()
        if d.layout == torch.strided:
            d = d.resolve_conj().resolve_neg()
        self.t = d.cpu() if self.device != "cpu" else d.clone()

    @classmethod
    def of(cls, t: torch.Tensor, device: str = "tpu") -> "Snap":
        """A snapshot holding the CPU tensor ``t`` as if read from ``device``."""
        snap = cls.__new__(cls)
        snap.device, snap.t = device, t
        return snap


def snapshot(x):
    return _map(x, lambda t: Snap(t) if isinstance(t, torch.Tensor) else t)


# ---------------------------------------------------------------------------------------------
# comparison

class Mismatch(Exception):
    def __init__(self, group: str, msg: str):
        super().__init__(msg)
        self.group = group


def _fmt(x) -> str:
    if isinstance(x, Snap):
        return f"tensor[{x.device}]"
    if isinstance(x, torch.Tensor):
        return "tensor"
    return type(x).__name__


def compare(got, want, tol_of, path: str = "out", values: bool = True, device: bool = True):
    """``got`` (snapshot of the tpu result) against ``want`` (the CPU result)."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, Snap):
            raise Mismatch("structure mismatch", f"{path}: expected a tensor, got {_fmt(got)}")
        if device and got.device != "tpu" and want.device.type == "cpu":
            raise Mismatch("wrong device", f"{path}: result on {got.device}, expected tpu")
        g = got.t
        if g.dtype != want.dtype:
            raise Mismatch("dtype mismatch", f"{path}: dtype {g.dtype} != {want.dtype}")
        if tuple(g.shape) != tuple(want.shape):
            raise Mismatch("shape mismatch", f"{path}: shape {tuple(g.shape)} != {tuple(want.shape)}")
        if not values or want.layout != torch.strided:
            return
        w = want.detach().resolve_conj().resolve_neg()
        atol, rtol = tol_of(want.dtype)
        try:
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol, equal_nan=True,
                                       check_device=False, check_stride=False, check_dtype=False,
                                       check_layout=False)
        except AssertionError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            raise Mismatch("value mismatch", f"{path}: " + "; ".join(lines[:4])) from None
        return
    if isinstance(want, torch.Size):
        if not isinstance(got, torch.Size) or tuple(got) != tuple(want):
            raise Mismatch("structure mismatch", f"{path}: {got!r} != {want!r}")
        return
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or type(got) is not type(want):
            raise Mismatch("structure mismatch",
                           f"{path}: expected {type(want).__name__}, got {type(got).__name__}")
        if len(got) != len(want):
            raise Mismatch("structure mismatch", f"{path}: {len(got)} items, expected {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            compare(g, w, tol_of, f"{path}[{i}]", values, device)
        return
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            raise Mismatch("structure mismatch", f"{path}: dict keys differ")
        for k in want:
            compare(got[k], want[k], tol_of, f"{path}[{k!r}]", values, device)
        return
    if isinstance(got, Snap):
        raise Mismatch("structure mismatch", f"{path}: expected {type(want).__name__}, got a tensor")
    if isinstance(want, bool) or want is None or not isinstance(want, (int, float, complex)):
        if type(got) is not type(want) or got != want:
            raise Mismatch("value mismatch" if type(got) is type(want) else "structure mismatch",
                           f"{path}: {got!r} != {want!r}")
        return
    if not isinstance(got, (int, float, complex)) or isinstance(got, bool):
        raise Mismatch("structure mismatch", f"{path}: expected {type(want).__name__}, got {_fmt(got)}")
    if not values:
        return
    if isinstance(want, int) and isinstance(got, int):
        if got != want:
            raise Mismatch("value mismatch", f"{path}: {got} != {want}")
        return
    if (got != got and want != want) or got == want:
        return
    atol, rtol = tol_of(torch.float32)
    if not (abs(got - want) <= atol + rtol * abs(want)):
        raise Mismatch("value mismatch", f"{path}: {got!r} != {want!r}")


def _tensors(x, out: list):
    """Tensor leaves of a nested structure, in order."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensors(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _tensors(y, out)
    return out


# ---------------------------------------------------------------------------------------------
# timeouts

class SweepTimeout(BaseException):
    """Raised by the alarm: a BaseException so that no ``except Exception`` swallows it."""


def _on_alarm(signum, frame):
    raise SweepTimeout()


class alarm:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        self.old = None
        if self.seconds and self.seconds > 0 and hasattr(signal, "setitimer"):
            self.old = signal.signal(signal.SIGALRM, _on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)
        return False


# ---------------------------------------------------------------------------------------------
# running one sample

def _err_text(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:300] if s else ''}"


def _classify_error(e: BaseException) -> str:
    """'lowering error' for failures inside a lowering / JAX, else 'other'."""
    if isinstance(e, (LoweringError, RegionError)):
        return "lowering error"
    tb = traceback.extract_tb(e.__traceback__)
    for fr in tb:
        fn = fr.filename.replace("\\", "/")
        if "/runtime/lowering/" in fn or "/site-packages/jax/" in fn or "/jax/_src/" in fn:
            return "lowering error"
    mod = type(e).__module__ or ""
    if mod.startswith("jax") or mod.startswith("jaxlib"):
        return "lowering error"
    return "other"


def _same_error_type(t: BaseException, c: BaseException) -> bool:
    if type(t) is type(c):
        return True
    # A fused region re-raises a kernel's RuntimeError as a RegionError (a RuntimeError).
    return isinstance(t, RegionError) and type(c) is RuntimeError


_DEVICE_WORDS = re.compile(r"\b(tpu|cpu|privateuseone|meta)(:\d+)?\b", re.IGNORECASE)


# A check that a fused program reports through an error flag (an index out of range, read at the
# next sync: FINDINGS' "Out-of-range indices") raises CPU's exception with CPU's message followed
# by where the op was recorded, " (aten.embedding.default recorded at file.py:12)", which the
# design asks for (the op and the user's line); that suffix is not part of the comparison.
_RECORDED_AT = re.compile(r" \(\S+ recorded at [^()]*\)$")


def error_message(e: BaseException) -> str:
    """An exception's message as compared with CPU's: a fused region's RegionError by the kernel
    error it wraps, a deferred check's " (op recorded at line)" dropped, device names (tpu, cpu,
    privateuseone, with an index) made one word."""
    if isinstance(e, RegionError) and e.__cause__ is not None:
        e = e.__cause__
    return _DEVICE_WORDS.sub("<device>", _RECORDED_AT.sub("", str(e).strip()))


def _same_error(t: BaseException, c: BaseException):
    """None when tpu's exception ``t`` is CPU's ``c`` (type, and message modulo device names),
    else (group, message)."""
    if not _same_error_type(t, c):
        return "wrong exception type", f"CPU raised {_err_text(c)}; tpu raised {_err_text(t)}"
    if error_message(t) != error_message(c):
        return "wrong exception message", f"CPU raised {_err_text(c)}; tpu raised {_err_text(t)}"
    return None


def ties_indices_error(name: str, s, inp, out):
    """Why a ``TIES`` op's indices (on tpu) are no valid answer, or None: ``ties_view`` compares
    them only through the values they select, which would let a repeated index pass where the
    input has equal values; sort and argsort must give a permutation along ``dim``, topk ``k``
    distinct indices."""
    k = TIES[name][0]
    dim = _ties_dim(name, s, inp)
    idx = out if k is None else out[k]
    if dim is None or not isinstance(idx, torch.Tensor) or name not in ("sort", "argsort", "topk"):
        return None
    idx = idx.detach().cpu()
    if idx.numel() == 0:
        return None
    st = idx.sort(dim).values
    if name == "topk":
        if st.size(dim) > 1 and bool((st.narrow(dim, 1, st.size(dim) - 1) ==
                                      st.narrow(dim, 0, st.size(dim) - 1)).any()):
            return f"{name}: indices repeat along dim {dim}"
        return None
    n = st.size(dim)
    shape = [1] * st.dim()
    shape[dim] = n
    if not bool((st == torch.arange(n).view(shape)).all()):
        return f"{name}: indices are not a permutation along dim {dim}"
    return None


def _empty(x) -> bool:
    """True when a result has nothing to compare: only tensors, every one of them empty."""
    leaves = []
    _map(x, lambda t: leaves.append(t))
    return bool(leaves) and all(isinstance(t, torch.Tensor) and t.numel() == 0 for t in leaves)


def describe_sample(s) -> str:
    def d(x):
        if isinstance(x, torch.Tensor):
            return f"T{list(x.shape)}:{str(x.dtype).replace('torch.', '')}"
        if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
            inner = ", ".join(d(y) for y in list(x)[:6]) + (", ..." if len(x) > 6 else "")
            return f"[{inner}]" if isinstance(x, list) else f"({inner})"
        r = repr(x)
        return r if len(r) <= 40 else r[:37] + "..."
    parts = [d(s.input)] + [d(a) for a in s.args] + [f"{k}={d(v)}" for k, v in s.kwargs.items()]
    r = ", ".join(parts)
    return r if len(r) <= 200 else r[:197] + "..."


def _call(o, s, inp, args, kwargs):
    return o.op(inp, *args, **kwargs)


def _cpu_call(name, o, s, inp, args, kwargs):
    """The CPU reference: the op itself, or (``CPU_BROKEN``) the op in float32 on float32 copies
    of the half-precision inputs, its floating outputs rounded back to the input's dtype."""
    dt = inp.dtype if isinstance(inp, torch.Tensor) else None
    if dt not in CPU_BROKEN.get(name, {}):
        return _call(o, s, inp, args, kwargs)
    up = _map((inp, args, kwargs), lambda t: t.float() if isinstance(t, torch.Tensor)
              and t.dtype == dt else t)
    out = _call(o, s, *up)
    return _map(out, lambda t: t.to(dt) if isinstance(t, torch.Tensor)
                and t.dtype == torch.float32 else t)


def run_forward_sample(o, name: str, s, mode: str, random: bool):
    """None when the sample passes, else (group, message)."""
    gauge = name in GAUGE
    cmemo, tmemo = {}, {}
    c_in, c_args, c_kw = clone_cpu((s.input, s.args, s.kwargs), cmemo)
    t_in, t_args, t_kw = place(name, s, tmemo)
    # tpu first (on copies), then CPU on the clones: in-place ops mutate their inputs.
    t_err = t_out = t_after = ties_err = None
    reseed = random and name not in UNINITIALIZED
    try:
        with deferfuse.mode(mode):
            if reseed:
                torch.manual_seed(1234)
            out = _call(o, s, t_in, t_args, t_kw)
            if gauge:
                out = gauge_view(name, s, out)
            if name in TIES:
                ties_err = ties_indices_error(name, s, t_in, out)
                out = ties_view(name, s, t_in, out)
            t_out = snapshot(out)          # .cpu(): in defer mode this runs the trace
            t_after = [Snap(t) for t in _tensors((t_in, t_args, t_kw), [])]
            del out
    except SweepTimeout:
        raise
    except Exception as e:
        t_err = e
    c_err = c_out = None
    stage = "op"
    try:
        with torch.random.fork_rng(devices=[]):
            c_out = _cpu_call(name, o, s, c_in, c_args, c_kw)
            stage = "the sweep's view of the result"
            if gauge:
                c_out = gauge_view(name, s, c_out)
            if name in TIES:
                c_out = ties_view(name, s, c_in, c_out)
    except SweepTimeout:
        raise
    except Exception as e:
        c_err = e
    if c_err is not None:
        if stage != "op":
            # Not the op's error: a harness bug (ties_view once raised on both sides, a "pass").
            return "other", f"sweep: {stage} raised on CPU: {_err_text(c_err)}"
        if t_err is None:
            return "error not raised", f"CPU raised {_err_text(c_err)}; tpu did not"
        return _same_error(t_err, c_err) or "raised"
    if t_err is not None:
        return _classify_error(t_err), _err_text(t_err)
    if ties_err is not None:
        return "value mismatch", ties_err
    if reseed:
        # Reproducibility: the same seed gives the same values (on fresh copies of the inputs).
        try:
            with deferfuse.mode(mode):
                torch.manual_seed(1234)
                again = snapshot(_call(o, s, *place(name, s, {})))
            compare(again, _map(t_out, lambda x: x.t if isinstance(x, Snap) else x),
                    lambda dt: (0.0, 0.0), "out (same seed again)")
        except Mismatch as m:
            return "not reproducible", str(m)
        except Exception as e:
            return _classify_error(e), "second run: " + _err_text(e)
    def check(tol_of):
        compare(t_out, c_out, tol_of, "out", values=not random)
        # (inputs stay where they were placed: CPU_ARGS keeps some on CPU)
        compare(t_after, _tensors((c_in, c_args, c_kw), []), tol_of, "input after the op",
                values=not random, device=False)

    def exact(tol_of):
        with torch.random.fork_rng(devices=[]):
            r_out = _call(o, s, *float64_copy((s.input, s.args, s.kwargs), {}))
        got, want, ref = [], _tensors(c_out, []), _tensors(r_out, [])
        _map(t_out, lambda x: got.append(x) if isinstance(x, Snap) else None)
        return no_less_accurate(got, want, ref, tol_of)
    r = _checked(name, False, check, None if random else exact)
    return "empty" if r is None and _empty(c_out) else r


def _diff_outputs(out):
    """Float tensors of a result that autograd can differentiate."""
    return [t for t in _tensors(out, []) if t.is_floating_point() and t.requires_grad]


def _weights(outs, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(t.shape, generator=g, dtype=torch.float32).to(t.dtype) + 0.5 for t in outs]


def run_backward_sample(o, name: str, s, mode: str, seed: int):
    """None when the gradients match, "n/a" when nothing is differentiable, else (group, msg)."""
    cmemo, tmemo = {}, {}
    c_in, c_args, c_kw = clone_cpu((s.input, s.args, s.kwargs), cmemo)
    leaves = [t for t in _tensors((c_in, c_args, c_kw), []) if t.requires_grad and t.is_leaf]
    leaves = list({id(t): t for t in leaves}.values())
    if not leaves:
        return "n/a"
    # CPU first: only samples CPU can differentiate are compared.
    try:
        with torch.random.fork_rng(devices=[]):
            c_out = _cpu_call(name, o, s, c_in, c_args, c_kw)
        c_out = s.output_process_fn_grad(c_out)
        c_outs = _diff_outputs(c_out)
        if not c_outs:
            return "n/a"
        ws = _weights(c_outs, seed)
        loss = sum((t * w).sum() for t, w in zip(c_outs, ws))
        c_grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    except SweepTimeout:
        raise
    except Exception:
        return "n/a"
    # The tpu copies of the same leaves (the CPU clones map back to the sample's tensors).
    orig_of = {id(v): k for k, v in cmemo.items()}
    t_in, t_args, t_kw = place(name, s, tmemo)
    t_leaves = [tmemo[orig_of[id(t)]] for t in leaves]
    try:
        with deferfuse.mode(mode):
            out = _call(o, s, t_in, t_args, t_kw)
            out = s.output_process_fn_grad(out)
            t_outs = _diff_outputs(out)
            if len(t_outs) != len(c_outs):
                return ("structure mismatch",
                        f"{len(t_outs)} differentiable outputs on tpu, {len(c_outs)} on CPU")
            loss = sum((t * w.to("tpu")).sum() for t, w in zip(t_outs, ws))
            t_grads = torch.autograd.grad(loss, t_leaves, allow_unused=True)
            got = [None if g is None else Snap(g) for g in t_grads]
    except SweepTimeout:
        raise
    except Exception as e:
        return _classify_error(e), _err_text(e)
    if name in TIES or name in TIES_GRAD:
        got = [Snap.of(ties_grad(name, s, c_in, g.t)) if g is not None and t is c_in else g
               for g, t in zip(got, leaves)]
        c_grads = [ties_grad(name, s, c_in, w) if t is c_in else w
                   for w, t in zip(c_grads, leaves)]
    def check(tol_of):
        for i, (g, w) in enumerate(zip(got, c_grads)):
            if w is None and g is None:
                continue
            if w is None or g is None:
                raise Mismatch("structure mismatch", f"grad[{i}]: {'None' if g is None else 'a tensor'}"
                               f" on tpu, {'None' if w is None else 'a tensor'} on CPU")
            compare(g, w, tol_of, f"grad[{i}]")

    def exact(tol_of):
        dmemo = {}
        d_in, d_args, d_kw = float64_copy((s.input, s.args, s.kwargs), dmemo)
        d_leaves = [dmemo[orig_of[id(t)]] for t in leaves]
        with torch.random.fork_rng(devices=[]):
            d_outs = _diff_outputs(s.output_process_fn_grad(_call(o, s, d_in, d_args, d_kw)))
        loss = sum((t * w.to(t.dtype)).sum() for t, w in zip(d_outs, ws))
        ref = torch.autograd.grad(loss, d_leaves, allow_unused=True)
        return no_less_accurate(got, list(c_grads), list(ref), tol_of)
    return _checked(name, True, check, exact)


def _checked(name: str, backward: bool, check, exact=None):
    """None when ``check(tol_of)`` passes with the sweep's tolerances; "exact" when, for a
    half-precision contraction (``EXACT_REFERENCE``), tpu is no less accurate than CPU
    (``exact(tol_of)``); "own" when it passes only with the OpInfo's own, looser half-precision
    tolerance (``opinfo_tolerances``); both counted apart; else (group, message) of the first
    mismatch."""
    try:
        check(lambda dt: tolerance(name, dt, backward, own=False))
        return None
    except Mismatch as m:
        first = m
    if exact is not None and name in EXACT_REFERENCE and first.group == "value mismatch":
        try:
            if exact(lambda dt: tolerance(name, dt, backward, own=False)):
                return "exact"
        except Exception:
            pass
    if not any((name, dt, backward) in opinfo_tolerances() for dt in (torch.bfloat16, torch.float16)):
        return first.group, str(first)
    try:
        check(lambda dt: tolerance(name, dt, backward))
        return "own"
    except Mismatch:
        return first.group, str(first)


# ---------------------------------------------------------------------------------------------
# running one op

# Further samples tried, past ``--limit-samples``, for an op whose first ones compared nothing.
HOLLOW_MORE = 100


def gen_samples(o, dtype, requires_grad: bool, limit):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        it = o.sample_inputs("cpu", dtype, requires_grad=requires_grad)
        return list(itertools.islice(it, limit) if limit else it)


def _reset_defer():
    """After a timeout: drop whatever a half-run op left pending."""
    try:
        with deferfuse.mode("strict"):
            pass
    except BaseException:
        pass


def check_op(o, mode: str, dtype, direction: str = "forward", samples=None, limit=None,
             timeout: float = 120.0) -> dict:
    """Run every sample of one op in one mode and dtype; returns its result record."""
    name = op_name(o)
    rec = {"status": None, "samples": 0, "passed": 0}
    if name in SKIP:
        rec.update(status="skip", reason=SKIP[name])
        return rec
    if not supported(o, dtype):
        rec.update(status="n/a", reason=f"CPU kernels do not support {dtype}")
        return rec
    if direction == "backward" and not o.supports_autograd:
        rec.update(status="n/a", reason="no autograd support")
        return rec
    random = name in RANDOM
    failures = []
    t0 = time.perf_counter()
    deferfuse.reset_metrics()
    try:
        with alarm(timeout):
            if samples is None:
                samples = gen_samples(o, dtype, direction == "backward", limit)
            n_counted = 0

            def run(i, s):
                """One sample: True when it compared something (passed or failed)."""
                nonlocal n_counted
                rnd = random or (name in RANDOM_SAMPLES and RANDOM_SAMPLES[name](s))
                if direction == "forward":
                    r = run_forward_sample(o, name, s, mode, rnd)
                else:
                    if rnd:
                        r = "n/a"
                    else:
                        r = run_backward_sample(o, name, s, mode, seed=i)
                if r == "n/a":
                    return False
                n_counted += 1
                hollow = r in ("raised", "empty")
                if hollow:
                    rec[r] = rec.get(r, 0) + 1
                    r = None
                elif r == "own":
                    rec["own_tolerance"] = rec.get("own_tolerance", 0) + 1
                    r = None
                elif r == "exact":
                    rec["no_less_accurate"] = rec.get("no_less_accurate", 0) + 1
                    r = None
                if r is None:
                    rec["passed"] += 1
                else:
                    failures.append((i, r[0], r[1], s))
                return not hollow

            compared = 0
            for i, s in enumerate(samples):
                compared += run(i, s)
            if limit and compared < limit and not failures and len(samples) >= limit:
                # Some of the first ``limit`` samples compared nothing (errors, empty results): go
                # on through up to HOLLOW_MORE further samples until ``limit`` compared something.
                more = gen_samples(o, dtype, direction == "backward", limit + HOLLOW_MORE)
                for i, s in enumerate(more[len(samples):], len(samples)):
                    rec["extra_samples"] = rec.get("extra_samples", 0) + 1
                    compared += run(i, s)
                    if compared >= limit or failures:
                        break
    except SweepTimeout:
        _reset_defer()
        failures.append((None, "timeout", f"no result within {timeout:g}s "
                         f"({rec['passed']} samples passed first)", None))
        n_counted = rec["passed"] + 1
    except Exception as e:   # the engine itself, or sample generation
        failures.append((None, "other", "sweep: " + _err_text(e), None))
        n_counted = rec["passed"] + 1
    rec["samples"] = n_counted
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    fb = deferfuse.metrics()["cpu_fallbacks"]
    if fb:
        rec["fallbacks"] = dict(fb)
    if random and direction == "forward":
        rec["note"] = RANDOM_REASON
    if failures:
        i, group, msg, s = failures[0]
        rec.update(status="fail", group=group, error=msg)
        if s is not None:
            rec["sample"] = f"#{i}: {describe_sample(s)}"
        groups = sorted({f[1] for f in failures}, key=GROUPS.index)
        if len(groups) > 1:
            rec["groups"] = groups
    elif n_counted == 0:
        rec.update(status="skip" if direction == "forward" else "n/a",
                   reason="no sample inputs" if direction == "forward" else
                   "no differentiable float sample")
    elif rec.get("raised", 0) + rec.get("empty", 0) == n_counted:
        # Every sample "passed" with nothing compared: CPU and tpu raised the same error, or the
        # result had no elements. Counted apart from pass (HOLLOW).
        rec.update(status="hollow", reason=f"{rec.get('raised', 0)} samples raised the same "
                   f"error on both sides, {rec.get('empty', 0)} gave only empty results")
    elif fb:
        rec["status"] = "fallback"
    else:
        rec["status"] = "pass"
    return rec


# ---------------------------------------------------------------------------------------------
# the sweep

STATUSES = ("pass", "fail", "fallback", "skip", "hollow")
_DIR = {"forward": "fwd", "backward": "bwd"}
_ABBR = {"pass": "ok", "fail": "FAIL", "fallback": "fb", "skip": "skip", "n/a": "-",
         "hollow": "hollow"}


def sweep(ops: dict, modes, dtypes, directions=("forward",), limit=None, timeout: float = 120.0,
          progress=print, emit=None, skip_cells=frozenset(), index0: int = 0, total=None,
          elapsed0: float = 0.0):
    """Every op in ``ops`` per dtype, mode and direction ('forward', 'backward'), in this process;
    returns {op: {mode: {dtype: {direction: record}}}} (records: ``check_op``).

    ``emit(kind, payload)``, if given, hears 'start' before each (op, mode, dtype, direction) cell
    runs, 'cell' with its record, and 'op' when an op is done; cells in ``skip_cells`` are not run.
    """
    results: dict = {}
    n = total or len(ops)
    t_start = time.perf_counter() - elapsed0
    emit = emit or (lambda kind, payload: None)
    for k, (name, o) in enumerate(ops.items()):
        t0 = time.perf_counter()
        r = results[name] = {}
        cells = []

        def done(m, dname, d, rec):
            r.setdefault(m, {}).setdefault(dname, {})[d] = rec
            emit("cell", {"op": name, "mode": m, "dtype": dname, "direction": d, "rec": rec})
            if rec["status"] != "n/a" or d == "forward":
                cells.append(f"{m[0]}{dname}{'.bwd' if d == 'backward' else ''}:{_ABBR[rec['status']]}")

        for dt in dtypes:
            dname = DTYPE_NAMES[dt]
            fwd = [m for m in modes if "forward" in directions
                   and (name, m, dname, "forward") not in skip_cells]
            samples = None
            if fwd and name not in SKIP and supported(o, dt):
                emit("start", [name, fwd[0], dname, "forward"])
                try:
                    with alarm(timeout):
                        samples = gen_samples(o, dt, False, limit)
                except BaseException as e:   # noqa: B036 (the alarm)
                    if isinstance(e, KeyboardInterrupt):
                        raise
                    samples = e
            for m in fwd:
                emit("start", [name, m, dname, "forward"])
                if isinstance(samples, BaseException):
                    grp = "timeout" if isinstance(samples, SweepTimeout) else "other"
                    rec = {"status": "fail", "samples": 0, "passed": 0, "group": grp,
                           "error": "sample generation: " + _err_text(samples)}
                else:
                    rec = check_op(o, m, dt, "forward", samples=samples, limit=limit,
                                   timeout=timeout)
                done(m, dname, "forward", rec)
            if "backward" in directions and dt in BACKWARD_DTYPES:
                for m in modes:
                    if (name, m, dname, "backward") in skip_cells:
                        continue
                    emit("start", [name, m, dname, "backward"])
                    done(m, dname, "backward",
                         check_op(o, m, dt, "backward", limit=limit, timeout=timeout))
        emit("op", name)
        if progress:
            el = time.perf_counter() - t_start
            progress(f"[{index0 + k + 1:4d}/{n}] {name[:44]:44s} {' '.join(cells)}  "
                     f"{time.perf_counter() - t0:5.1f}s  (total {el / 60:.1f} min)", flush=True)
    return results


# ---------------------------------------------------------------------------------------------
# crash isolation: the sweep runs in a worker process; a worker that dies (a C++ abort, a
# segfault) or hangs where the alarm cannot reach (inside native code) costs one cell, recorded
# as 'crash' or 'timeout', and a new worker resumes after it.

def run_worker(jobfile: str, load, sweep_fn) -> int:
    """A worker process of ``sweep_isolated``: the job file's items (from ``load()``, a dict by
    name) through ``sweep_fn`` (this file's ``sweep`` or the ModuleInfo sweep's), each cell
    reported on stdout as an ``@@kind json`` line."""
    with open(jobfile) as f:
        job = json.load(f)
    warnings.simplefilter("ignore")
    every = load()
    items = {n: every[n] for n in job["ops"]}

    def emit(kind, payload):
        print(f"@@{kind} {json.dumps(payload, default=str)}", flush=True)

    skip = {tuple(c) for c in job["skip_cells"]}
    sweep_fn(items, job["modes"], [DTYPES[d] for d in job["dtypes"]], tuple(job["directions"]),
             job["limit"], job["timeout"], progress=print, emit=emit, skip_cells=skip,
             index0=job["index0"], total=job["total"], elapsed0=job["elapsed"])
    print("@@end null", flush=True)
    return 0


def select_ops(ops: dict, want: list) -> list:
    """Names in {name: OpInfo} matching ``want`` (a name with its variant, or a base name: every
    variant of it)."""
    return [n for n, o in ops.items() if n in want or o.name in want]


def sweep_isolated(names: list, modes, dtypes, directions, limit, timeout: float,
                   progress=print, checkpoint=None, every: int = 25, script: str = None) -> dict:
    """``sweep`` over op_db ``names`` in worker processes (restarted after a crash or a hang);
    ``script``: the sweep whose ``--worker`` runs them (this file; the ModuleInfo sweep's too)."""
    import queue
    import subprocess
    import tempfile
    import threading

    results = {n: {} for n in names}
    done_ops: set = set()
    skip_cells: set = set()
    dnames = [DTYPE_NAMES[d] for d in dtypes]
    n_since = 0
    t_start = time.perf_counter()
    while True:
        todo = [n for n in names if n not in done_ops]
        if not todo:
            break
        job = {"ops": todo, "modes": list(modes), "dtypes": dnames, "directions": list(directions),
               "limit": limit, "timeout": timeout, "index0": len(done_ops), "total": len(names),
               "elapsed": time.perf_counter() - t_start,
               "skip_cells": [list(c) for c in skip_cells if c[0] in set(todo)]}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as jf:
            json.dump(job, jf)
        errf = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen([sys.executable, script or os.path.abspath(__file__), "--worker",
                                 jf.name],
                                stdout=subprocess.PIPE, stderr=errf, text=True, cwd=ROOT)
        lines: queue.Queue = queue.Queue()

        def pump(stream=proc.stdout, q=lines):
            for ln in stream:
                q.put(ln)
            q.put(None)
        threading.Thread(target=pump, daemon=True).start()
        current, hung, progressed, ended = None, False, False, False
        while True:
            # Startup (op_db import) is slow on busy machines; a cell has its alarm plus slack.
            wait = 1800.0 if current is None else timeout * 2 + 120.0
            try:
                ln = lines.get(timeout=wait)
            except queue.Empty:
                hung = True
                proc.kill()
                break
            if ln is None:
                break
            if ln.startswith("@@start "):
                current = tuple(json.loads(ln[8:]))
            elif ln.startswith("@@cell "):
                c = json.loads(ln[7:])
                results[c["op"]].setdefault(c["mode"], {}).setdefault(c["dtype"], {})[
                    c["direction"]] = c["rec"]
                skip_cells.add((c["op"], c["mode"], c["dtype"], c["direction"]))
                current, progressed = None, True
            elif ln.startswith("@@op "):
                done_ops.add(json.loads(ln[5:]))
                current, progressed = None, True
                n_since += 1
                if checkpoint is not None and n_since >= every:
                    n_since = 0
                    checkpoint({k: v for k, v in results.items() if k in done_ops})
            elif ln.startswith("@@end"):
                ended = True
            elif progress:
                progress(ln.rstrip("\n"), flush=True)
        rc = proc.wait()
        os.unlink(jf.name)
        errf.seek(0)
        tail = [x.strip() for x in errf.read().splitlines() if x.strip()][-3:]
        errf.close()
        if ended and rc == 0:
            continue
        why = (f"worker hung (no output for {wait:g}s)" if hung else
               f"worker died (exit {rc}{', ' + signal.Signals(-rc).name if rc < 0 else ''})")
        if current is None:
            if not progressed:
                raise RuntimeError(f"opinfo sweep: {why} before running any op: {' | '.join(tail)}")
            continue
        name, m, dname, d = current
        rec = {"status": "fail", "samples": 0, "passed": 0,
               "group": "timeout" if hung else "crash",
               "error": f"{why}: {' | '.join(tail)[:400]}"}
        results[name].setdefault(m, {}).setdefault(dname, {})[d] = rec
        skip_cells.add(tuple(current))
        if progress:
            progress(f"       {name} [{m} {dname} {d}]: {why}; restarting the worker", flush=True)
    return results


def summarize(results: dict, modes, dtypes, directions=("forward",)) -> dict:
    """Counts, failure groups and CPU fallbacks per (mode, dtype, direction)."""
    summary, groups = {}, {}
    fallback_ops: dict = collections.defaultdict(set)
    dirs = directions
    for m in modes:
        for dt in dtypes:
            dname = DTYPE_NAMES[dt]
            for d in dirs:
                c = dict.fromkeys(("ops", "tested") + STATUSES, 0)
                g: dict = collections.defaultdict(list)
                for name, r in results.items():
                    rec = r.get(m, {}).get(dname, {}).get(d)
                    if rec is None or rec["status"] == "n/a":
                        continue
                    st = rec["status"]
                    c["ops"] += 1
                    c[st] += 1
                    if st not in ("skip", "hollow"):
                        c["tested"] += 1
                    if st == "fail":
                        g[rec["group"]].append(name)
                    for aten in rec.get("fallbacks", {}):
                        fallback_ops[aten].add(name)
                if c["ops"]:
                    summary.setdefault(m, {}).setdefault(dname, {})[d] = c
                    groups.setdefault(m, {}).setdefault(dname, {})[d] = {
                        k: g[k] for k in GROUPS if g.get(k)}
    fb = {k: sorted(v) for k, v in sorted(fallback_ops.items(), key=lambda kv: (-len(kv[1]), kv[0]))}
    return {"summary": summary, "groups": groups, "fallback_aten_ops": fb}


def render(results: dict, summ: dict, modes, dtypes, directions=("forward",),
           top_fallbacks: int = 30) -> str:
    lines = []
    hdr = f"{'mode':7s} {'dtype':9s} {'dir':4s} {'ops':>5s} {'tested':>6s} {'pass':>5s} {'fail':>5s} " \
          f"{'fallback':>8s} {'skip':>5s} {'hollow':>6s}"
    lines += ["", hdr, "-" * len(hdr)]
    for m, per in summ["summary"].items():
        for dname, perd in per.items():
            for d, c in perd.items():
                lines.append(f"{m:7s} {dname:9s} {_DIR[d]:4s} {c['ops']:5d} {c['tested']:6d} "
                             f"{c['pass']:5d} {c['fail']:5d} {c['fallback']:8d} {c['skip']:5d} "
                             f"{c.get('hollow', 0):6d}")
    # Failure groups, merged over modes: an op failing in only some modes says which.
    for dt in dtypes:
        dname = DTYPE_NAMES[dt]
        for d in directions:
            by_group: dict = collections.defaultdict(dict)
            for m in modes:
                for grp, names in summ["groups"].get(m, {}).get(dname, {}).get(d, {}).items():
                    for nm in names:
                        by_group[grp].setdefault(nm, []).append(m)
            if not by_group:
                continue
            lines += ["", f"failures, {dname} {d} (op[mode] when not in every mode):"]
            for grp in GROUPS:
                if grp not in by_group:
                    continue
                ops = by_group[grp]
                shown = [nm if len(ms) == len(modes) else f"{nm}[{','.join(ms)}]"
                         for nm, ms in ops.items()]
                lines.append(f"  {grp} ({len(ops)}): " + ", ".join(shown))
    fb = summ["fallback_aten_ops"]
    if fb:
        lines += ["", f"CPU fallbacks: aten op -> OpInfo ops that used it (top {top_fallbacks}):"]
        for aten, names in list(fb.items())[:top_fallbacks]:
            more = f", ... (+{len(names) - 8})" if len(names) > 8 else ""
            lines.append(f"  {aten} ({len(names)}): {', '.join(names[:8])}{more}")
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# merging runs (forward, backward, other dtypes are separate runs) and the markdown table

def merge_results(docs: list) -> tuple:
    """(results, modes, dtype names, directions) of several sweep JSON documents; a later
    document's cell replaces an earlier one's."""
    results: dict = {}
    modes, dnames, dirs = [], [], []
    for doc in docs:
        for name, r in doc["ops"].items():
            for m, per in r.items():
                for dname, perd in per.items():
                    for d, rec in perd.items():
                        results.setdefault(name, {}).setdefault(m, {}).setdefault(dname, {})[d] = rec
                        modes += [m] if m not in modes else []
                        dnames += [dname] if dname not in dnames else []
                        dirs += [d] if d not in dirs else []
    order = list(DTYPES)
    return (results, [m for m in ("strict", "defer") if m in modes] + [m for m in modes if m not in
            ("strict", "defer")], sorted(dnames, key=order.index),
            [d for d in ("forward", "backward") if d in dirs])


def _rate(a: int, b: int) -> str:
    return f"{100.0 * a / b:.1f}%" if b else "-"


def render_md(results: dict, summ: dict, runs: list) -> str:
    """The human-readable table: counts per mode, dtype and direction, the non-random pass rate,
    failures by cause and the CPU fallbacks."""
    L = ["# OpInfo sweep: deferfuse `tpu` vs CPU eager PyTorch", "",
         "Generated by `tests/opinfo_sweep.py` (see its docstring); data in `opinfo.json`. "
         "`pass`: every sample matches CPU (dtype, shape, values) and nothing ran on CPU; "
         "`fallback`: matches, but some aten op ran on CPU; `fail`: a sample differs or raises; "
         "`skip`: a named skip (one reason each) or no samples; `hollow`: every sample compared "
         "nothing (CPU and tpu raised the same exception, type and message modulo device names, "
         "or the result was empty), so the op is untested by these samples: not in `tested` nor "
         "in the rates. Random ops (shape and dtype only) "
         "are excluded from the `non-random pass` rate; `correct` counts pass + fallback.", "",
         "Runs:", ""]
    L += [f"- `{r['command']}` ({r['date']}, {r['seconds'] / 60:.0f} min, limit "
          f"{r.get('limit_samples') or 'all'} samples/op)" for r in runs]
    L += ["", "| mode | dtype | dir | ops | tested | pass | fail | fallback | skip | hollow | "
          "non-random pass | correct |", "|" + "---|" * 12]
    for m, per in summ["summary"].items():
        for dname, perd in per.items():
            for d, c in perd.items():
                nr = [r.get(m, {}).get(dname, {}).get(d) for n, r in results.items()
                      if n not in RANDOM]
                nr = [x for x in nr if x and x["status"] not in ("n/a", "skip", "hollow")]
                npass = sum(x["status"] == "pass" for x in nr)
                L.append(f"| {m} | {dname} | {_DIR[d]} | {c['ops']} | {c['tested']} | {c['pass']} | "
                         f"{c['fail']} | {c['fallback']} | {c['skip']} | {c.get('hollow', 0)} | "
                         f"{_rate(npass, len(nr))} ({npass}/{len(nr)}) | "
                         f"{_rate(c['pass'] + c['fallback'], c['tested'])} |")
    L += ["", "## Failures by cause", "",
          "`op[mode]`: fails only in that mode. First failing sample's error, per op, in "
          "`opinfo.json`.", ""]
    for (dname, d) in sorted({(dn, d) for per in summ["groups"].values() for dn, perd in per.items()
                              for d in perd}, key=lambda k: (list(DTYPES).index(k[0]), k[1] != "forward")):
        by_group: dict = collections.defaultdict(dict)
        ms = [m for m in summ["groups"] if d in summ["groups"][m].get(dname, {})]
        for m in ms:
            for grp, names in summ["groups"][m][dname][d].items():
                for nm in names:
                    by_group[grp].setdefault(nm, []).append(m)
        if not by_group:
            continue
        L += [f"**{dname} {d}**", ""]
        for grp in GROUPS:
            if grp in by_group:
                shown = [nm if len(v) == len(ms) else f"{nm}[{','.join(v)}]"
                         for nm, v in by_group[grp].items()]
                L.append(f"- {grp} ({len(shown)}): " + ", ".join(shown))
                L += [f"  - {nm}: {CAUSES[nm][1]}" for nm in by_group[grp]
                      if nm in CAUSES and CAUSES[nm][0] == grp]
        L.append("")
    own = sorted({f"{n} [{dn} {_DIR[d]}]" for n, r in results.items() for per in r.values()
                  for dn, perd in per.items() for d, rec in perd.items()
                  if rec.get("own_tolerance")})
    if own:
        L += ["Passing only with the OpInfo's own half-precision tolerance (its TestConsistency "
              "toleranceOverride for comparing a device with CPU, looser than assert_close's "
              "default; `tolerances.opinfo_own` in the JSON): " + ", ".join(own) + ".", ""]
    cells = [(n, dn, d, rec) for n, r in results.items() for per in r.values()
             for dn, perd in per.items() for d, rec in perd.items()]
    hollow = sorted({f"{n} [{dn} {_DIR[d]}]" for n, dn, d, rec in cells
                     if rec["status"] == "hollow"})
    if hollow:
        L += ["Hollow (every sample raised the same exception on both sides or gave an empty "
              "result; not counted as tested): " + ", ".join(hollow) + ".", ""]
    raised = collections.Counter()
    for n, dn, d, rec in cells:
        if rec.get("raised") and rec["status"] != "hollow":
            raised[n] = max(raised[n], rec["raised"])
    if raised:
        L += ["Passing ops with samples that pass by raising CPU's exception (type and message), "
              "most samples per cell: " + ", ".join(f"{n} ({k})" for n, k in sorted(
                  raised.items())) + ".", ""]
    broken = [f"{n} ({', '.join(DTYPE_NAMES[d] for d in t)}): {next(iter(t.values()))}"
              for n, t in CPU_BROKEN.items()]
    L += ["Compared against CPU in float32, rounded (`CPU_BROKEN`): " + "; ".join(broken) + ".",
          ""]
    L += ["Tolerances: forward, assert_close's defaults for the dtype (bfloat16 atol 1e-5 rtol "
          "1.6e-2, float16 atol 1e-5 rtol 1e-3; contractions and a few named ops looser in "
          "float32, `tolerances` in the JSON); half-precision gradients atol 1e-3 (PyTorch's "
          "test_compare_cpu) and two ulps of rtol (bfloat16 1.6e-2, float16 2e-3). Half "
          "precision computes in float32 and rounds where CPU's kernels round "
          "(docs/dtypes.md).", ""]
    fb = summ["fallback_aten_ops"]
    if fb:
        L += ["## CPU fallbacks (aten op: OpInfo ops that used it, all runs)", ""]
        L += [f"- `{aten}` ({len(names)}): {', '.join(names)}" for aten, names in fb.items()]
        L.append("")
    return "\n".join(L)


STATUS_TEXT = {"pass": "every sample matches CPU, no CPU fallback",
               "fallback": "every sample matches CPU, some aten op ran on CPU",
               "fail": "a sample failed (group: the first failure's cause)",
               "skip": "named skip set or no sample inputs",
               "hollow": "every sample raised CPU's exception on both sides or had an empty "
                         "result: nothing compared (not counted as tested)",
               "n/a": "the dtype/direction does not apply (not counted)"}


def make_doc(results: dict, summ: dict, meta: dict) -> dict:
    return {
        "meta": {**meta, "statuses": STATUS_TEXT},
        **summ,
        "skip": SKIP,
        "random": sorted(RANDOM),
        "gauge": sorted(GAUGE),
        "tolerances": {"default": {DTYPE_NAMES[k]: v for k, v in DEFAULT_TOL.items()
                                   if k in DTYPE_NAMES},
                       "backward_default": {DTYPE_NAMES[k]: v for k, v in BACKWARD_TOL.items()},
                       "per_op": {n: {DTYPE_NAMES[k]: v for k, v in t.items()}
                                  for n, t in sorted(TOL.items())},
                       "per_op_backward": {n: {DTYPE_NAMES[k]: v for k, v in t.items()}
                                           for n, t in sorted(BACKWARD_TOL_OP.items())},
                       "opinfo_own": {f"{n} {DTYPE_NAMES[d]} {'bwd' if b else 'fwd'}": v
                                      for (n, d, b), v in sorted(
                                          ((k, v) for k, v in opinfo_tolerances().items()
                                           if k is not None), key=str)}},
        "cpu_broken": {n: {DTYPE_NAMES[k]: v for k, v in t.items()}
                       for n, t in CPU_BROKEN.items()},
        "ops": results,
    }


def _write(text: str, path: str):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(doc: dict, path: str):
    _write(json.dumps(doc, indent=1, default=str) + "\n", path)


def write_md(results: dict, summ: dict, runs: list, path: str):
    _write(render_md(results, summ, runs) + "\n", path)


def merge_main(paths: list, out: str, md) -> int:
    """``--merge``: one document (and table) from several runs' JSON."""
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    results, modes, dnames, dirs = merge_results(docs)
    summ = summarize(results, modes, [DTYPES[d] for d in dnames], dirs)
    runs = [r for d in docs for r in (d["meta"].get("runs") or [d["meta"]])]
    for r in runs:
        r.pop("statuses", None)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "merged": True, "runs": runs,
            "modes": modes, "dtypes": dnames, "directions": dirs}
    print(render(results, summ, modes, [DTYPES[d] for d in dnames], dirs))
    write_json(make_doc(results, summ, meta), out)
    print(f"wrote {out}")
    if md:
        write_md(results, summ, runs, md)
        print(f"wrote {md}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="strict,defer")
    ap.add_argument("--dtypes", default="float32",
                    help=f"comma-separated, of {', '.join(DTYPES)}")
    ap.add_argument("--backward", action="store_true", help="also compare gradients (floating dtypes)")
    ap.add_argument("--backward-only", action="store_true", help="gradients only, no forward")
    ap.add_argument("--ops", default="", help="comma-separated op names (with or without "
                    "variant: 'max' selects every max variant)")
    ap.add_argument("--limit-samples", type=int, default=0, help="first N samples per op (0: all)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds per op, mode, dtype and direction before it counts as 'timeout'")
    ap.add_argument("--out", default=None, help=f"JSON results (default {DEFAULT_OUT} for a full "
                    "sweep; a sweep restricted with --ops writes only when --out is given)")
    ap.add_argument("--quiet", action="store_true", help="no per-op progress lines")
    ap.add_argument("--in-process", action="store_true",
                    help="no worker process: faster to start, but a crash ends the sweep")
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    ap.add_argument("--merge", default="", metavar="A.json,B.json",
                    help="run nothing: merge the results of earlier runs (forward, backward, "
                    "other dtypes) into --out (default %s) and --md" % DEFAULT_OUT)
    ap.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return run_worker(a.worker, load_ops, sweep)
    if a.merge:
        return merge_main([p for p in a.merge.split(",") if p], a.out or DEFAULT_OUT, a.md)
    directions = (("backward",) if a.backward_only else
                  ("forward", "backward") if a.backward else ("forward",))
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in deferfuse.MODES:
            ap.error(f"unknown mode {m!r}")
    try:
        dtypes = [DTYPES[d] for d in a.dtypes.split(",") if d]
    except KeyError as e:
        ap.error(f"unknown dtype {e}")
    warnings.simplefilter("ignore")
    t0 = time.time()
    all_ops = load_ops()
    if a.ops:
        want = [x.strip() for x in a.ops.split(",") if x.strip()]
        ops = {n: all_ops[n] for n in select_ops(all_ops, want)}
        missing = [w for w in want if not select_ops(ops, [w])]
        if missing:
            print(f"unknown ops: {', '.join(missing)}", file=sys.stderr)
            return 2
    else:
        ops = all_ops
    out = a.out if a.out is not None else (None if a.ops else DEFAULT_OUT)
    print(f"OpInfo sweep: {len(ops)} ops, modes {','.join(modes)}, dtypes "
          f"{','.join(DTYPE_NAMES[d] for d in dtypes)}{', ' + '+'.join(directions)}, "
          f"limit {a.limit_samples or 'all'} samples, timeout {a.timeout:g}s "
          f"(deferfuse on JAX '{deferfuse.platform()}')", flush=True)
    def write(results, partial: bool):
        import jax
        summ = summarize(results, modes, dtypes, directions)
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.time() - t0, 1),
                "partial": partial, "command": " ".join(["tests/opinfo_sweep.py"] + list(
                    argv if argv is not None else sys.argv[1:])),
                "torch": torch.__version__, "jax": jax.__version__,
                "python": platform.python_version(), "jax_platform": deferfuse.platform(),
                "modes": modes, "dtypes": [DTYPE_NAMES[d] for d in dtypes],
                "directions": list(directions), "limit_samples": a.limit_samples or None,
                "timeout_s": a.timeout, "ops": len(ops), "ops_done": len(results)}
        write_json(make_doc(results, summ, meta), out)
        if a.md:
            write_md(results, summ, [meta], a.md)
        return summ

    progress = None if a.quiet else print
    if a.in_process:
        results = sweep(ops, modes, dtypes, directions, a.limit_samples or None, a.timeout,
                        progress=progress)
    else:
        results = sweep_isolated(list(ops), modes, dtypes, directions, a.limit_samples or None,
                                 a.timeout, progress=progress,
                                 checkpoint=(lambda r: write(r, True)) if out else None)
    summ = summarize(results, modes, dtypes, directions)
    print(render(results, summ, modes, dtypes, directions))
    print(f"done in {(time.time() - t0) / 60:.1f} min")
    if out:
        write(results, False)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
