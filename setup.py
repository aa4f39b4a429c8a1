"""The C part of deferfuse (deferfuse/_fastpath.c: NOTE [C record path]) and the C++ device hooks
(deferfuse/_tpu_hooks.cpp: NOTE [pinned memory]); everything else is in pyproject.toml. A missing C
compiler fails the install with a message saying what to install. The hooks are optional: built
when torch is installed in the environment deferfuse goes into (found without importing it: pip
builds in an isolated environment), skipped with a message otherwise; without them deferfuse
registers PyTorch's Python hooks, and pinned memory (DDP's static_graph) is unavailable.
The plain tpu tensor (deferfuse/_tpu_tensor.cpp, docs/cxx-plan.md; used only with
DEFERFUSE_TENSOR=plain) is optional too: built with torch.utils.cpp_extension when torch imports
here, skipped when its build fails or with DEFERFUSE_BUILD_TENSOR=0."""
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


def _tensor_extension():
    if os.environ.get("DEFERFUSE_BUILD_TENSOR", "1") == "0":
        return []
    try:
        from torch.utils.cpp_extension import CppExtension
        import torch
    except ImportError:
        print("deferfuse: torch does not import here: the plain tpu tensor is not built")
        return []
    ext = CppExtension(
        "deferfuse._tpu_tensor", ["deferfuse/_tpu_tensor.cpp"],
        extra_compile_args=["-O2", "-std=c++20", "-fvisibility=hidden",
                            "-DTORCH_EXTENSION_NAME=_tpu_tensor", "-DTORCH_API_INCLUDE_EXTENSION_H",
                            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                            f'-DDEFERFUSE_TORCH_VERSION="{torch.__version__}"'])
    ext.optional = True     # a failed build is reported and skipped: deferfuse runs as without it
    return [ext]


class BuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as e:      # distutils' CompileError / a missing compiler's OSError
            raise SystemExit(
                f"deferfuse: building its C record path (deferfuse/_fastpath.c) failed: {e}\n"
                "deferfuse needs a C compiler and Python's headers: on Debian/Ubuntu "
                "`apt install build-essential python3-dev`, on macOS `xcode-select --install`."
            ) from e


setup(
    ext_modules=[Extension("deferfuse._fastpath", ["deferfuse/_fastpath.c"],
                           extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"]),
                 *_hooks_extension(), *_tensor_extension()],
    cmdclass={"build_ext": BuildExt},
)
