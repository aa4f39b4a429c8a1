"""The wheel installs into a clean environment and imports from an unrelated folder; `make`
installs the CPU build of torch and the project into a clean venv.

Slow (builds a wheel and a venv): out of the default run, run by CI through `make wheel-test`.
"""
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slow, pytest.mark.modes("strict")]


def test_wheel_installs_and_imports(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), ROOT],
                   check=True, capture_output=True, text=True)
    wheel = next(dist.glob("deferfuse-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in ("deferfuse/__init__.py", "deferfuse/distributed/__init__.py", "deferfuse/runtime/__init__.py",
                "deferfuse/runtime/lowering/__init__.py", "deferfuse/runtime/lowering/pointwise.py",
                "deferfuse/runtime/lowering/activations.py", "deferfuse/scheduler/__init__.py",
                "deferfuse/scheduler/records.py", "deferfuse/scheduler/cut.py",
                "deferfuse/vllm/__init__.py", "deferfuse/vllm/platform.py", "deferfuse/vllm/buckets.py"):
        assert pkg in names, f"{pkg} missing from the wheel"
    assert not any(n.startswith(("runtime/", "scheduler/", "tests/")) for n in names)
    # the C++ extension (the plain tpu tensor, NOTE [extension build] in setup.py) and the C
    # record path, both built into the wheel
    for ext in ("deferfuse/_tpu_tensor", "deferfuse/_fastpath"):
        assert any(n.startswith(ext) and n.endswith((".so", ".pyd")) for n in names), (ext, names)
    # the autoload module and its torch.backends entry point (import torch registers tpu)
    assert "deferfuse_autoload.py" in names
    ep = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "[torch.backends]\ndeferfuse = deferfuse_autoload:autoload" in zipfile.ZipFile(wheel).read(ep).decode()
    # vLLM's platform plugin (docs/serving.md)
    assert "[vllm.platform_plugins]\ndeferfuse = deferfuse.vllm:register" in zipfile.ZipFile(wheel).read(ep).decode()
    # and its general hook, run in vLLM's engine process (tensor parallelism)
    assert "[vllm.general_plugins]\ndeferfuse = deferfuse.vllm:general" in zipfile.ZipFile(wheel).read(ep).decode()
    # A clean venv that sees this environment's torch/jax (so nothing is downloaded), but not the
    # repository: the wheel alone must provide deferfuse.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([sys.executable, "-c", "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages" / "deps.pth").write_text(site + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], check=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # a tpu tensor is the plain torch.Tensor of the wheel's C++ extension (NOTE [tensor
    # representation] in plain.py), and the op path's entry is the wheel's C record path
    code = ("import deferfuse, torch, sys\n"
            "assert 'site-packages' in deferfuse.__file__ or 'dist-packages' in deferfuse.__file__, deferfuse.__file__\n"
            "import deferfuse.runtime, deferfuse.scheduler\n"
            "c = torch.arange(6.).reshape(2, 3)\n"
            "x = c.to('tpu')\n"
            "y, want = (x * 2).t().sum(0), (c * 2).t().sum(0)\n"
            "assert y.device.type == 'tpu' and y.is_tpu, y.device\n"
            "assert y.dtype == want.dtype and y.shape == want.shape, (y.dtype, y.shape)\n"
            "assert torch.equal(y.cpu(), want), (y.cpu(), want)\n"
            "from deferfuse import cxxext, _fastpath\n"
            "ext, why = cxxext.load()\n"
            "assert ext is not None, why\n"
            "assert ext.__file__.startswith(deferfuse.__path__[0]), (ext.__file__, deferfuse.__path__)\n"
            "assert _fastpath.__file__.startswith(deferfuse.__path__[0]), _fastpath.__file__\n"
            "assert type(x) is torch.Tensor and type(y) is torch.Tensor, (type(x), type(y))\n"
            "assert ext.is_plain(x) and ext.is_plain(y)\n"
            "print('plain', type(y).__name__, y.sum().item())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DEFERFUSE_TENSOR")}
    out = subprocess.run([str(py), "-c", code], cwd=elsewhere, env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == ["plain", "Tensor", "30.0"], out.stdout


def test_make_installs_cpu_torch_into_a_clean_venv(tmp_path):
    # The README's path from nothing: make creates the venv, installs the CPU build of torch
    # (here: the local wheel pip is configured with; elsewhere: PyTorch's CPU index) and the project.
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    r = subprocess.run(["make", "-C", ROOT, f"VENV={venv}", f"{venv}/.installed"], env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    code = ("import torch, sys, importlib.metadata as md\n"
            "assert torch.version.cuda is None, torch.version.cuda\n"
            "print(torch.__version__, torch.accelerator.current_accelerator(), 'jax' in sys.modules,\n"
            "      md.version('accelerate') != '', md.version('transformers') != '')\n")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    version, acc, jax_loaded, *extras = out.stdout.split()
    assert version.startswith("2.13.0") and acc == "tpu" and jax_loaded == "False"
    assert extras == ["True", "True"]
    # the install built the C++ extension against this venv's torch: a tpu tensor is plain
    code = ("import torch, deferfuse\n"
            "from deferfuse import cxxext\n"
            "ext, why = cxxext.load()\n"
            "assert ext is not None, why\n"
            "x = torch.ones(3, device='tpu')\n"
            "assert type(x) is torch.Tensor and x.is_tpu and ext.is_plain(x), type(x)\n"
            "print(cxxext.built_for(ext.__file__) == torch.__version__, (x + 1).sum().item())\n")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "6.0"], out.stdout


def test_a_missing_compiler_stops_the_build_with_the_fix(tmp_path):
    # NOTE [extension build] in setup.py: the C++ extension is required, so a missing C++ compiler
    # stops the install (pip and make exit non-zero) with what to install, not a silent skip.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["CXX"] = str(tmp_path / "nonexistent")
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                        "--build-temp", str(tmp_path / "temp")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode != 0, r.stdout[-2000:]
    assert "deferfuse: building deferfuse._tpu_tensor (deferfuse/_tpu_tensor.cpp) failed" in r.stderr, r.stderr[-3000:]
    assert "apt install build-essential python3-dev" in r.stderr and "nonexistent" in r.stderr
    assert not list((tmp_path / "lib").rglob("_tpu_tensor*"))
