"""The C part of deferfuse (deferfuse/_fastpath.c: NOTE [C record path]); everything else is in
pyproject.toml. A missing C compiler fails the install with a message saying what to install."""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


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
                           extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"])],
    cmdclass={"build_ext": BuildExt},
)
