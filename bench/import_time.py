"""What deferfuse's autoload adds to ``import torch``, and what the first use of the device costs.

    python bench/import_time.py [--rounds N]

Each round runs, alternating in fresh interpreters: ``import torch`` with
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (as without deferfuse installed; PyTorch still looks its entry
points up) and with autoload on; then ``import torch`` plus the first ``tpu`` tensor (which imports
JAX and deferfuse). Times are wall-clock seconds measured inside the child, medians over rounds,
and the paired difference per round. Writes bench/results/import_time.md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = {
    "import torch": "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)",
    "first tpu tensor": ("import time; t = time.perf_counter(); import torch; "
                         "x = torch.ones(2).to('tpu'); x.cpu(); print(time.perf_counter() - t)"),
}


def run(code: str, autoload: bool) -> float:
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="1" if autoload else "0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd="/", check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args()
    off, on, first, diff = [], [], [], []
    for r in range(a.rounds):
        pair = [(False, off), (True, on)] if r % 2 == 0 else [(True, on), (False, off)]
        for autoload, out in pair:
            out.append(run(CODE["import torch"], autoload))
        diff.append(on[-1] - off[-1])
        first.append(run(CODE["first tpu tensor"], True))
    load = os.getloadavg()
    md = [f"# import time ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
          f"- {a.rounds} rounds, {os.cpu_count()} CPUs, load average {load[0]:.1f} at the end; "
          f"python {sys.version.split()[0]}", "",
          "| what | median s | min s |", "|---|---:|---:|",
          f"| import torch, autoload off | {statistics.median(off):.3f} | {min(off):.3f} |",
          f"| import torch, autoload on (tpu registered, no JAX) | {statistics.median(on):.3f} | {min(on):.3f} |",
          f"| paired difference (on - off) | {statistics.median(diff):+.3f} | {min(diff):+.3f} |",
          f"| import torch + first tpu tensor (JAX, deferfuse) | {statistics.median(first):.3f} | {min(first):.3f} |",
          ""]
    text = "\n".join(md)
    print(text)
    with open(os.path.join(ROOT, "bench", "results", "import_time.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
