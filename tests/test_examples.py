"""examples/word_language_model.py, unmodified and without `import deferfuse`, trains, saves,
reloads and tests on tpu (`--accel`) in both modes, with CPU's losses."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.modes("strict")   # the modes are the subprocesses' TORCHTPU_MODE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "word_language_model.py")
# Dropout off (tpu draws other random numbers than CPU); small enough for the default test run.
TINY = ["--dropout", "0", "--epochs", "1", "--words", "300", "--nlayers", "1", "--bptt", "6",
        "--batch_size", "6", "--emsize", "12", "--nhid", "12"]


def _losses(out):
    return [float(v) for v in re.findall(r"(?:valid|test) loss\s+([0-9.]+)", out)]


def _run_all(tmp_path, extra):
    runs = {"cpu": ([], {}), "strict": (["--accel"], {"TORCHTPU_MODE": "strict"}),
            "defer": (["--accel"], {"TORCHTPU_MODE": "defer"})}
    procs = {}
    for name, (flags, env) in runs.items():
        e = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
        e.update(env)
        procs[name] = subprocess.Popen(
            [sys.executable, SCRIPT, *extra, *flags, "--save", str(tmp_path / f"{name}.pt")],
            cwd=tmp_path, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, f"{name}: exit {p.returncode}\n{out}\n{err}"
        outs[name] = out
    return outs


def _check(outs):
    assert "Using device: cpu" in outs["cpu"]
    want = _losses(outs["cpu"])
    assert len(want) >= 2
    for mode in ("strict", "defer"):
        out = outs[mode]
        assert "Using device: tpu" in out, out
        assert "Loaded model on: tpu:0" in out, out     # torch.load put the checkpoint back on tpu
        got = _losses(out)
        assert len(got) == len(want), out
        for g, w in zip(got, want):
            assert abs(g - w) <= 1e-4 * max(1.0, abs(w)), (mode, got, want)


def test_script_never_imports_deferfuse():
    with open(SCRIPT) as f:
        assert not re.search(r"^\s*(import|from)\s+deferfuse", f.read(), re.M)


def test_word_language_model_on_tpu(tmp_path):
    _check(_run_all(tmp_path, TINY))


@pytest.mark.slow
def test_word_language_model_default_sizes(tmp_path):
    _check(_run_all(tmp_path, ["--dropout", "0"]))
