"""A fixed representative subset of PyTorch's OpInfo database on the tpu device, against CPU eager.

One test per op and mode (conftest's ``tpu_mode``): float32 forward (``SUBSET``, the first
``LIMIT`` sample inputs), float32 gradients (``BACKWARD``), other dtypes (``DTYPES``) and random ops
(``RANDOM``: shape, dtype and reproducibility under the same seed). The engine is tests/opinfo_sweep.py (``check_op``): it moves each sample to
tpu, runs the op on tpu and on CPU, and compares structure, device, dtype, shape and values (and the
inputs afterwards), or that both raise the same exception type. A test passes only when every
sample matches CPU AND no aten op ran on CPU fallback. The full sweep over all of op_db is
``python tests/opinfo_sweep.py`` (results in bench/results/opinfo.json).

Ops known to fail are listed in ``KNOWN_FAIL`` with a reason and run as ``xfail(strict=True)``, so a
fix shows up as an unexpected pass (then move the op back to plain ``SUBSET``).
"""
import functools

import pytest
import torch

import opinfo_sweep as sweep  # the sweep's comparison and its tables

LIMIT = 3          # samples per op (the full sweep: python tests/opinfo_sweep.py)
TIMEOUT = 90.0     # seconds per op and mode

# op_db names (with variant), across families.
SUBSET = [
    # pointwise
    "add", "mul", "div.no_rounding_mode", "sub", "pow", "exp", "log", "sin", "tanh", "sigmoid",
    "abs", "clamp", "where", "maximum", "rsqrt",
    # reductions and scans
    "sum", "mean", "amax", "argmax", "var", "std", "softmax", "log_softmax", "cumsum", "sort",
    "topk", "linalg.vector_norm",
    # linalg
    "matmul", "mm", "bmm", "addmm", "nn.functional.linear",
    # indexing, joining
    "cat", "stack", "gather", "scatter_add", "index_select", "masked_fill", "flip", "roll", "tril",
    # nn
    "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu", "nn.functional.layer_norm",
    "nn.functional.embedding", "nn.functional.conv2d", "nn.functional.max_pool2d",
    "nn.functional.avg_pool2d", "nn.functional.cross_entropy", "nn.functional.mse_loss",
    "nn.functional.scaled_dot_product_attention",
    # views
    "transpose", "permute", "reshape", "view", "expand", "narrow", "select", "squeeze",
    "unsqueeze",
    # creation
    "full", "arange", "zeros_like",
    # spectral and special functions, distances, segment and scatter ops (each once a CPU fallback)
    "fft.fft", "fft.rfft", "fft.irfft", "fft.ifft", "fft.fft2", "special.chebyshev_polynomial_t",
    "special.hermite_polynomial_h", "special.legendre_polynomial_p", "cdist",
    "nn.functional.pdist", "nn.functional.bilinear", "histc", "_segment_reduce.lengths",
    "diagonal_scatter", "as_strided_scatter", "put", "nonzero_static", "complex", "polar",
    "special.modified_bessel_k0", "special.scaled_modified_bessel_k1", "nn.functional.embedding_bag",
    "ormqr", "linalg.householder_product",
    # once on issue 37's list: eigenvectors (compared up to sign), tensor_split's index forms, and
    # as_strided views over part of a storage (a sample where tpu must raise CPU's error)
    "linalg.eigh", "tensor_split", "as_strided.partial_views",
    # data-dependent output sizes (deferfuse/datadep.py)
    "nonzero", "masked_select", "unique", "unique_consecutive",
]

# Gradients (float32, ``BACKWARD_LIMIT`` samples): the sweep's --backward check.
BACKWARD = ["mul", "exp", "sum", "mm", "nn.functional.linear", "softmax",
            "nn.functional.layer_norm", "nn.functional.conv2d", "nn.functional.cross_entropy",
            "gather", "cumsum", "cdist", "_segment_reduce.lengths", "take"]
BACKWARD_LIMIT = 2

# Other dtypes (forward, ``DTYPE_LIMIT`` samples).
DTYPES = {
    "bfloat16": ["add", "sum", "mm", "softmax", "nn.functional.layer_norm", "sort"],
    "float16": ["exp", "mean", "mm", "argsort"],
    "int64": ["add", "sum", "cumsum", "topk", "gather"],
    "int32": ["mul", "amax", "kthvalue"],
    "bool": ["logical_and", "any", "where", "sort"],
}
DTYPE_LIMIT = 1

# Half-precision gradients (``HALF_BACKWARD_LIMIT`` samples; the sweep's --backward in bfloat16 and
# float16, tolerance ``BACKWARD_TOL``).
HALF_BACKWARD = {
    "bfloat16": ["nn.functional.layer_norm", "nn.functional.batch_norm", "softmax",
                 "nn.functional.conv2d", "nn.functional.cross_entropy"],
    "float16": ["log_softmax", "nn.functional.conv_transpose2d", "mm"],
}
HALF_BACKWARD_LIMIT = 1

# Random ops: shape and dtype against CPU, and the same values again under the same seed.
RANDOM = ["normal", "uniform", "bernoulli", "nn.functional.dropout", "randn", "randint_like",
          "multinomial"]

# op -> (reason, modes it fails in, or None for every mode). Each runs as xfail(strict=True).
KNOWN_FAIL: dict = {}


def _params():
    out = []
    for name in SUBSET:
        out.append(pytest.param(name, id=name))
    return out


@functools.lru_cache(maxsize=1)
def _ops():
    return sweep.load_ops()


def _describe(rec) -> str:
    if rec["status"] == "fallback":
        return f"every sample matches CPU, but these aten ops ran on CPU fallback: {rec.get('fallbacks')}"
    parts = [f"{rec['status']}: {rec.get('group', '')}: {rec.get('error', rec.get('reason', ''))}"]
    if rec.get("sample"):
        parts.append(f"sample {rec['sample']}")
    parts.append(f"({rec['passed']}/{rec['samples']} samples passed)")
    return " ".join(parts)


@pytest.mark.modes("strict")
def test_subset_names_exist():
    ops = _ops()
    names = SUBSET + BACKWARD + RANDOM + [n for v in DTYPES.values() for n in v] + \
        [n for v in HALF_BACKWARD.values() for n in v]
    missing = [n for n in names + list(KNOWN_FAIL) if n not in ops]
    assert not missing, f"not in op_db: {missing}"
    assert not set(SUBSET + BACKWARD) & sweep.RANDOM, "random ops: keep them in RANDOM"
    assert set(RANDOM) <= sweep.RANDOM
    assert not set(names) & set(sweep.SKIP)


@pytest.mark.parametrize("name", _params())
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_opinfo(name, tpu_mode, request):
    known = KNOWN_FAIL.get(name)
    if known is not None and (known[1] is None or tpu_mode in known[1]):
        request.applymarker(pytest.mark.xfail(reason=known[0], strict=True))
    o = _ops()[name]
    assert torch.float32 in o.supported_dtypes("cpu")
    rec = sweep.check_op(o, tpu_mode, torch.float32, "forward", limit=LIMIT, timeout=TIMEOUT)
    assert rec["samples"] > 0, f"{name}: no samples were compared ({rec})"
    assert rec["status"] == "pass", f"{name} [{tpu_mode}] {_describe(rec)}"
    assert rec["passed"] == rec["samples"]


def _check(name, mode, dtype, direction, limit):
    o = _ops()[name]
    assert dtype in o.supported_dtypes("cpu"), f"{name}: CPU kernels lack {dtype}"
    rec = sweep.check_op(o, mode, dtype, direction, limit=limit, timeout=TIMEOUT)
    assert rec["samples"] > 0, f"{name}: no samples were compared ({rec})"
    assert rec["status"] == "pass", f"{name} [{mode} {dtype} {direction}] {_describe(rec)}"
    assert rec["passed"] == rec["samples"]


@pytest.mark.parametrize("name", BACKWARD)
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_opinfo_backward(name, tpu_mode):
    _check(name, tpu_mode, torch.float32, "backward", BACKWARD_LIMIT)


@pytest.mark.parametrize("dtype,name", [pytest.param(d, n, id=f"{d}-{n}")
                                        for d, ns in DTYPES.items() for n in ns])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_opinfo_dtype(dtype, name, tpu_mode):
    _check(name, tpu_mode, sweep.DTYPES[dtype], "forward", DTYPE_LIMIT)


@pytest.mark.parametrize("dtype,name", [pytest.param(d, n, id=f"{d}-{n}")
                                        for d, ns in HALF_BACKWARD.items() for n in ns])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_opinfo_half_backward(dtype, name, tpu_mode):
    _check(name, tpu_mode, sweep.DTYPES[dtype], "backward", HALF_BACKWARD_LIMIT)


@pytest.mark.parametrize("name", RANDOM)
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_opinfo_random(name, tpu_mode):
    _check(name, tpu_mode, torch.float32, "forward", 2)
