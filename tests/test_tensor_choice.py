"""What a tpu tensor is (NOTE [tensor representation] in deferfuse/plain.py): the plain PrivateUse1
tensor by default, the ``TpuTensor`` wrapper subclass with ``DEFERFUSE_TENSOR=wrapper`` (a
transition switch); without a loadable C++ extension ``import deferfuse`` raises ImportError naming
the fix, never a silent change of representation."""
import os
import subprocess
import sys

import pytest
import torch

import deferfuse
from deferfuse.config import _tensor
from deferfuse import plain
from deferfuse.tensor import TpuTensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# prints the type of a tpu tensor and a result computed on it
_USE = ("import torch, deferfuse\n"
        "x = torch.arange(6.0).reshape(2, 3).to('tpu')\n"
        "y = (x * 2 + 1).sum(0)\n"
        "print(type(x).__name__, deferfuse.config.tensor, y.cpu().tolist())\n")
# the extension made unimportable before deferfuse looks for it
_BLOCKED = ("import sys\n"
            "sys.modules['deferfuse._tpu_tensor'] = None\n"
            "import torch\n"
            "try:\n"
            "    import deferfuse\n"
            "except ImportError as e:\n"
            "    print('ImportError:', e)\n"
            "else:\n"
            "    print('imported', type(torch.ones(1, device='tpu')).__name__)\n")


def _start(code, **env):
    e = {k: v for k, v in os.environ.items() if k != "DEFERFUSE_TENSOR"}
    e.update(env)
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=e, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _out(p):
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return out.strip().splitlines()[-1]


@pytest.mark.modes("strict")
def test_the_default_is_plain_and_a_missing_extension_is_an_import_error(tpu_mode):
    # two fresh processes side by side: the variable unset (the default), the extension blocked
    default, blocked = _start(_USE), _start(_BLOCKED)
    want = (torch.arange(6.0).reshape(2, 3) * 2 + 1).sum(0).tolist()
    assert _out(default) == f"Tensor plain {want}"
    line = _out(blocked)
    assert line.startswith("ImportError: the tpu tensor needs the C++ extension: "
                           "deferfuse's C++ extension deferfuse._tpu_tensor is not built"), line
    assert "setup.py build_ext --inplace" in line and "DEFERFUSE_TENSOR=wrapper" in line


def test_this_process_has_the_configured_representation():
    x = torch.ones(2, 3).to("tpu")
    assert plain.ENABLED == (deferfuse.config.tensor == "plain")
    assert (type(x) is TpuTensor) == (not plain.ENABLED)
    assert (type(x) is torch.Tensor) == plain.ENABLED
    torch.testing.assert_close((x + 1).cpu(), torch.ones(2, 3) + 1)


@pytest.mark.modes("strict")
def test_require_names_the_fix(monkeypatch):
    # built for another torch: the version the library records (read from the file) is named
    monkeypatch.setattr(plain, "built_for", lambda path: "0.0.1")
    with pytest.raises(ImportError, match=r"built for torch 0\.0\.1, this is torch .*rebuild it.*"
                                          r"DEFERFUSE_TENSOR=wrapper"):
        plain.require()
    monkeypatch.undo()
    # not built
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deferfuse._tpu_tensor" else find(name, *a))
    with pytest.raises(ImportError, match=r"is not built.*setup.py build_ext --inplace.*"
                                          r"DEFERFUSE_TENSOR=wrapper"):
        plain.require()


@pytest.mark.modes("strict")
def test_an_unknown_representation_is_refused():
    with pytest.raises(ValueError, match="DEFERFUSE_TENSOR='subclass' is not a tensor "
                                         "representation; expected one of plain, wrapper"):
        _tensor("subclass")
    assert _tensor(" Wrapper ") == "wrapper"
