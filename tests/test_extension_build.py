"""deferfuse's C++ extension (deferfuse/_tpu_tensor.cpp) records the torch it was built for, and
one built for another torch is refused with the fix before it is loaded (NOTE [extension build] in
setup.py). In-process and instant; the build itself (a missing compiler, the wheel) is in
tests/test_packaging.py (slow, `make wheel-test`)."""
import importlib.util
import sys

import pytest
import torch

from deferfuse import cxxext

pytestmark = pytest.mark.modes("strict")


def _origin():
    spec = importlib.util.find_spec("deferfuse._tpu_tensor")
    assert spec is not None and spec.origin, "deferfuse._tpu_tensor is not built (make builds it)"
    return spec.origin


def test_an_extension_built_for_another_torch_is_refused_unloaded(monkeypatch):
    built = torch.__version__
    loaded = "deferfuse._tpu_tensor" in sys.modules
    monkeypatch.setattr(torch, "__version__", "2.15.0+cpu")
    ext, why = cxxext.load()
    assert ext is None
    assert f"was built for torch {built}, this is torch 2.15.0+cpu" in why, why
    assert "rebuild it against this torch" in why and "make" in why and "--no-build-isolation" in why
    assert _origin() in why
    if not loaded:      # the flag off: refused without dlopen (its C++ ABI may not match)
        assert "deferfuse._tpu_tensor" not in sys.modules


def test_the_extension_is_built_for_this_torch():
    assert cxxext.built_for(_origin()) == torch.__version__
    ext, why = cxxext.load()
    assert why is None and ext is not None
    assert ext.TORCH_VERSION == torch.__version__      # the module's own record agrees with the file


def test_the_mark_is_read_from_the_file(tmp_path):
    lib = tmp_path / "_tpu_tensor.so"
    lib.write_bytes(b"\x7fELF" + b"\0" * 4096 + b"deferfuse-built-for-torch:2.11.0+cpu\0" + b"x" * 100)
    assert cxxext.built_for(str(lib)) == "2.11.0+cpu"
    lib.write_bytes(b"\x7fELF" + b"\0" * 4096)     # built before the mark: no version
    assert cxxext.built_for(str(lib)) is None
