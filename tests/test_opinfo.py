"""A fixed representative subset of PyTorch's OpInfo database on the tpu device, against CPU eager.

One test per op and mode (conftest's ``tpu_mode``), float32, forward, the first few sample inputs
of each op (``LIMIT``). The engine is tests/opinfo_sweep.py (``check_op``): it moves each sample to
tpu, runs the op on tpu and on CPU, and compares structure, device, dtype, shape and values (and the
inputs afterwards), or that both raise the same exception type. A test passes only when every
sample matches CPU AND no aten op ran on CPU fallback. The full sweep over all of op_db is
``python tests/opinfo_sweep.py`` (results in bench/results/opinfo.json).

Ops known to fail are listed in ``KNOWN_FAIL`` with a reason and run as ``xfail(strict=True)``, so a
fix shows up as an unexpected pass (then move the op back to plain ``SUBSET``).
"""
import functools
import importlib.util
import os
import sys

import pytest
import torch


def _load_engine():
    name = "opinfo_sweep"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "opinfo_sweep.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


sweep = _load_engine()

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
]

# op -> (reason, modes it fails in, or None for every mode). Each runs as xfail(strict=True).
KNOWN_FAIL: dict = {
    "matmul": ("1-d @ 2-d unsqueezes, multiplies, then calls the in-place view op squeeze_, which "
               "the dispatcher treats as an out= write of a different shape and rejects (core: "
               "in-place view ops squeeze_/unsqueeze_/transpose_ must change the view chain)", None),
}


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
    missing = [n for n in SUBSET + list(KNOWN_FAIL) if n not in ops]
    assert not missing, f"not in op_db: {missing}"
    assert not set(SUBSET) & sweep.RANDOM, "random ops are compared by shape only; keep them out"
    assert not set(SUBSET) & set(sweep.SKIP)


@pytest.mark.parametrize("name", _params())
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
