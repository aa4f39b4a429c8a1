"""Which torch the Makefile installs (tools/install_torch.py), decided without any network. The
install itself, into a clean venv, is the slow tests/test_packaging.py (CI: make wheel-test)."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.modes("strict")
def _install_torch_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("install_torch", os.path.join(ROOT, "tools", "install_torch.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("case", ["installed", "local wheel", "linux", "darwin"])
def test_torch_install_plan(case):
    # Which torch the Makefile installs (tools/install_torch.py), decided without any network.
    m = _install_torch_module()
    assert m.pinned_version(os.path.join(ROOT, "constraints.txt")) == "2.13.0"
    have = {"installed": "2.13.0+cpu"}.get(case)
    local = {"local wheel": "2.13.0+cpu"}.get(case)
    plat = "darwin" if case == "darwin" else "linux"
    args = m.plan("2.13.0", have, local, plat, m.CPU_INDEX)
    want = {"installed": None,
            "local wheel": ["install", "torch==2.13.0+cpu"],
            "linux": ["install", "--timeout", "20", "--retries", "1", "--extra-index-url",
                      "https://download.pytorch.org/whl/cpu", "torch==2.13.0+cpu"],
            "darwin": ["install", "torch==2.13.0"]}[case]
    assert args == want
    # an installed torch of another version is replaced
    assert m.plan("2.13.0", "2.12.1", None, "linux", m.CPU_INDEX)[-1] == "torch==2.13.0+cpu"

