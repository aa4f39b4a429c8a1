"""The C part of deferfuse (deferfuse/_fastpath.c: NOTE [C record path]) and the C++ device hooks
(deferfuse/_tpu_hooks.cpp: NOTE [pinned memory]); everything else is in pyproject.toml. A missing C
compiler fails the install with a message saying what to install. The hooks are optional: built
when torch is installed in the environment deferfuse goes into (found without importing it: pip
builds in an isolated environment), skipped with a message otherwise; without them deferfuse
registers PyTorch's Python hooks, and pinned memory (DDP's static_graph) is unavailable.
The plain tpu tensor (deferfuse/_tpu_tensor.cpp, docs/cxx-plan.md) is required: built with
torch.utils.cpp_extension against the torch deferfuse will run with, so torch must be installed
first. NOTE [extension build]: pip's isolated build environment has no torch; setup.py then
imports the torch of the environment being installed into (found as the hooks find it), so
`pip install .` works after torch, and `pip install --no-build-isolation .` (what the Makefile
does) builds against that torch directly. No torch, a missing compiler or a failed build stops the
install with a message saying what to do. The library is tied to torch's exact version: it records
the version it was built for (`deferfuse-built-for-torch:` in the .so), which deferfuse/cxxext.py
reads before loading it."""
import os
import re
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HOOKS = "deferfuse._tpu_hooks"


def _torch_dir():
    """The installed torch package that deferfuse will run with, or None."""
    paths = sysconfig.get_paths()
    for d in dict.fromkeys([paths["platlib"], paths["purelib"]]):
        t = os.path.join(d, "torch")
        if os.path.isfile(os.path.join(t, "include", "ATen", "detail",
                                       "PrivateUse1HooksInterface.h")):
            return t
    try:
        import torch
    except ImportError:
        return None
    return os.path.dirname(torch.__file__)


def _hooks_extension():
    t = _torch_dir()
    if t is None:
        print("deferfuse: torch is not installed here: the C++ device hooks are not built")
        return []
    with open(os.path.join(t, "version.py")) as f:
        version = re.search(r"^__version__ = '([^']+)'", f.read(), re.M).group(1)
    # optional: a failed build is reported and skipped (deferfuse falls back to Python's hooks)
    return [Extension(
        HOOKS, ["deferfuse/_tpu_hooks.cpp"], language="c++", optional=True,
        include_dirs=[os.path.join(t, "include")], library_dirs=[os.path.join(t, "lib")],
        libraries=["c10", "torch_cpu"],
        # torch/lib next to deferfuse/ in site-packages; an editable install finds them loaded.
        runtime_library_dirs=["$ORIGIN/../torch/lib"],
        extra_compile_args=["-O2", "-std=c++20", "-fvisibility=hidden",
                            f'-DDEFERFUSE_TORCH_VERSION="{version}"'])]


def _import_torch():
    """torch as deferfuse will run with it (NOTE [extension build]), or None."""
    try:
        import torch
        return torch
    except ImportError:
        pass
    t = _torch_dir()        # pip's isolated build: the target environment's torch
    if t is None:
        return None
    import sys
    sys.path.append(os.path.dirname(t))     # last: the build environment's setuptools stay first
    try:
        import torch
        return torch
    except ImportError as e:
        print(f"deferfuse: torch in {os.path.dirname(t)} does not import here: {e}")
        return None


def _tensor_extension():
    torch = _import_torch()
    if torch is None:
        raise SystemExit(
            "deferfuse: its C++ extension (deferfuse/_tpu_tensor.cpp) is built against the torch it "
            "will run with, and torch is not installed here. Install torch first (the CPU build: "
            "pip install torch --index-url https://download.pytorch.org/whl/cpu), then deferfuse "
            "(pip install --no-build-isolation .).")
    from torch.utils.cpp_extension import CppExtension
    return [CppExtension(
        "deferfuse._tpu_tensor", ["deferfuse/_tpu_tensor.cpp"],
        extra_compile_args=["-O2", "-std=c++20", "-fvisibility=hidden",
                            "-DTORCH_EXTENSION_NAME=_tpu_tensor", "-DTORCH_API_INCLUDE_EXTENSION_H",
                            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                            f'-DDEFERFUSE_TORCH_VERSION="{torch.__version__}"'])]


class BuildExt(build_ext):
    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:      # distutils' CompileError / LinkError / a missing compiler
            if getattr(ext, "optional", False):
                raise               # the hooks: reported and skipped by setuptools
            raise SystemExit(
                f"deferfuse: building {ext.name} ({', '.join(ext.sources)}) failed: {e}\n"
                "deferfuse needs a C and C++ compiler and Python's headers: on Debian/Ubuntu "
                "`apt install build-essential python3-dev`, on macOS `xcode-select --install`; "
                "CC and CXX name other compilers. The compiler's own errors are above.") from e


setup(
    ext_modules=[Extension("deferfuse._fastpath", ["deferfuse/_fastpath.c"],
                           extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"]),
                 *_hooks_extension(), *_tensor_extension()],
    cmdclass={"build_ext": BuildExt},
)
