"""What a tpu tensor is (NOTE [tensor representation] in deferfuse/plain.py): always the plain
PrivateUse1 tensor of the C++ extension. ``DEFERFUSE_TENSOR=wrapper``, which chose the removed
``TpuTensor`` subclass, stops the import with a message saying so (``plain`` is accepted); without
a loadable extension ``import deferfuse`` raises ImportError naming the fix."""
import os
import subprocess
import sys

import pytest
import torch

from deferfuse import cxxext, plain
from deferfuse.config import _removed_tensor_choice

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# prints the type of a tpu tensor and a result computed on it
_USE = ("import torch, deferfuse\n"
        "x = torch.arange(6.0).reshape(2, 3).to('tpu')\n"
        "y = (x * 2 + 1).sum(0)\n"
        "print(type(x).__name__, y.cpu().tolist())\n")
# the import's error, or what a tpu tensor is
_IMPORT = ("import torch\n"
           "try:\n"
           "    import deferfuse\n"
           "except (ImportError, ValueError) as e:\n"
           "    print(type(e).__name__ + ':', e)\n"
           "else:\n"
           "    print('imported', type(torch.ones(1, device='tpu')).__name__)\n")
# the extension made unimportable before deferfuse looks for it
_BLOCKED = "import sys\nsys.modules['deferfuse._tpu_tensor'] = None\n" + _IMPORT


def _start(code, tensor=None):
    e = {k: v for k, v in os.environ.items() if k != "DEFERFUSE_TENSOR"}
    if tensor is not None:
        e["DEFERFUSE_TENSOR"] = tensor
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=e, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _out(p):
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return out.strip().splitlines()[-1]


@pytest.mark.modes("strict")
def test_fresh_processes_get_the_plain_tensor_or_a_clear_error(tpu_mode):
    # four fresh processes side by side: the variable unset, set to plain, set to the removed
    # wrapper, and the extension blocked
    default, plain_, wrapper, blocked = (_start(_USE), _start(_USE, " Plain "),
                                         _start(_IMPORT, "wrapper"), _start(_BLOCKED))
    want = (torch.arange(6.0).reshape(2, 3) * 2 + 1).sum(0).tolist()
    assert _out(default) == f"Tensor {want}"
    assert _out(plain_) == f"Tensor {want}"
    line = _out(wrapper)
    assert line.startswith("ValueError: DEFERFUSE_TENSOR='wrapper': the setting was removed with "
                           "the TpuTensor wrapper subclass it selected"), line
    assert "Unset DEFERFUSE_TENSOR" in line and "setup.py build_ext --inplace" in line, line
    line = _out(blocked)
    assert line.startswith("ImportError: the tpu tensor needs the C++ extension: "
                           "deferfuse's C++ extension deferfuse._tpu_tensor is not built"), line
    assert "setup.py build_ext --inplace" in line and "DEFERFUSE_TENSOR" not in line, line


def test_a_tpu_tensor_is_plain():
    x = torch.ones(2, 3).to("tpu")
    assert type(x) is torch.Tensor and plain.is_tpu(x)
    torch.testing.assert_close((x + 1).cpu(), torch.ones(2, 3) + 1)


@pytest.mark.modes("strict")
def test_the_removed_setting(monkeypatch):
    for ok in (None, "", "plain", " PLAIN "):
        if ok is None:
            monkeypatch.delenv("DEFERFUSE_TENSOR", raising=False)
        else:
            monkeypatch.setenv("DEFERFUSE_TENSOR", ok)
        _removed_tensor_choice()
    for bad in ("wrapper", " Wrapper ", "subclass"):
        monkeypatch.setenv("DEFERFUSE_TENSOR", bad)
        with pytest.raises(ValueError, match=f"DEFERFUSE_TENSOR={bad!r}: the setting was removed"):
            _removed_tensor_choice()


@pytest.mark.modes("strict")
def test_require_names_the_fix(monkeypatch):
    # built for another torch: the version the library records (read from the file) is named
    monkeypatch.setattr(cxxext, "built_for", lambda path: "0.0.1")
    with pytest.raises(ImportError, match=r"built for torch 0\.0\.1, this is torch .*rebuild it"):
        cxxext.require()
    monkeypatch.undo()
    # not built
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deferfuse._tpu_tensor" else find(name, *a))
    with pytest.raises(ImportError, match=r"is not built.*setup.py build_ext --inplace") as e:
        cxxext.require()
    assert "DEFERFUSE_TENSOR" not in str(e.value)
