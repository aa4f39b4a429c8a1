"""Install the CPU build of torch into the running Python's environment, before the project.

deferfuse runs the ``tpu`` device on JAX; torch itself never needs CUDA, and PyPI's default torch
for Linux is the CUDA build (several GB). In order:

1. torch at the pinned version (``constraints.txt``) is already installed: nothing to do.
2. pip is configured with a local wheel of that version (``find-links``, as on the development
   machine): install it. Found with ``--no-index``, so no index is contacted to decide.
3. Otherwise the CPU build from PyTorch's CPU wheel index (``--index`` /
   ``TORCH_CPU_INDEX``; macOS: PyPI, whose macOS wheels are the CPU build), with a short timeout
   so that an unreachable index fails in seconds with what to do, instead of hanging.

``python tools/install_torch.py --dry-run`` prints the pip command it would run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pinned_version(constraints: str) -> str:
    with open(constraints) as f:
        for line in f:
            m = re.match(r"\s*torch\s*==\s*([0-9][^\s#;]*)", line)
            if m:
                return m.group(1)
    raise SystemExit(f"{constraints} pins no torch version (expected a line torch==X.Y.Z)")


def installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def local_wheel_version(want: str) -> str | None:
    """The version (e.g. ``2.13.0+cpu``) of a torch wheel pip finds without any index, or None."""
    with tempfile.TemporaryDirectory() as d:
        report = os.path.join(d, "report.json")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                            "--no-deps", "--ignore-installed", "--quiet", "--report", report,
                            f"torch=={want}"], capture_output=True, text=True)
        if r.returncode != 0 or not os.path.exists(report):
            return None
        with open(report) as f:
            items = json.load(f).get("install", [])
    return items[0]["metadata"]["version"] if items else None


def plan(want: str, have: str | None, local: str | None, platform: str, index: str) -> list | None:
    """The pip arguments that install torch ``want`` as its CPU build, or None (nothing to do)."""
    if have is not None and have.split("+")[0] == want:
        return None
    if local is not None:
        return ["install", f"torch=={local}"]
    if platform == "darwin":
        return ["install", f"torch=={want}"]
    return ["install", "--timeout", "20", "--retries", "1", "--extra-index-url", index,
            f"torch=={want}+cpu"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--constraints", default=os.path.join(ROOT, "constraints.txt"))
    ap.add_argument("--index", default=os.environ.get("TORCH_CPU_INDEX") or CPU_INDEX)
    ap.add_argument("--dry-run", action="store_true", help="print the pip command, run nothing")
    a = ap.parse_args(argv)
    want = pinned_version(a.constraints)
    have = installed_version()
    local = None if have and have.split("+")[0] == want else local_wheel_version(want)
    args = plan(want, have, local, sys.platform, a.index)
    if args is None:
        print(f"torch {have} is installed")
        return 0
    cmd = [sys.executable, "-m", "pip", *args, "--quiet", "-c", a.constraints]
    print(("would run: " if a.dry_run else "") + " ".join(cmd[2:]), flush=True)
    if a.dry_run:
        return 0
    if subprocess.run(cmd).returncode != 0:
        print(f"\nCould not install torch {want} (CPU build). Where {a.index} cannot be reached, "
              f"install it yourself into {sys.prefix}, e.g. from a wheel file: pip install "
              f"torch-{want}+cpu-....whl, or point TORCH_CPU_INDEX at a mirror of the index.",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
