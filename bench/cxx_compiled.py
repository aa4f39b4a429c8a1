"""Host cost of a compiled-mode call, the wrapper tensor against the plain tensor (issue 34;
docs/cxx-plan.md, NOTE [compiled plain tensors] in deferfuse/compiled.py).

``torch.compile(backend="tpu")`` records each call of a graph as one node of the pending trace
(NOTE [graphs are ops]); what a call costs the host is reading its inputs' values and making its
outputs. The flag that picks the representation is read at import, so the two run in separate
processes; rounds alternate them, and each round reports µs per call (recording only: the trace
is synced outside the timed block) for:

- ``few``: ``f(a, b) = gelu(a @ b.T).sum(-1)``, 2 inputs, 1 output;
- ``many``: an in-place update of 64 tensors (``p.add_(g, alpha=-0.1)`` over lists, as a
  compiled SGD step), 128 inputs, 64 written.

Run: ``python bench/cxx_compiled.py [--rounds N]``; results are printed as a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(calls: int) -> dict:
    import torch
    import deferfuse

    def few(a, b):
        return torch.nn.functional.gelu(a @ b.t()).sum(-1)

    def many(ps, gs):
        for p, g in zip(ps, gs):
            p.add_(g, alpha=-0.1)

    a, b = torch.randn(8, 16, device="tpu"), torch.randn(4, 16, device="tpu")
    ps = [torch.randn(32, device="tpu") for _ in range(64)]
    gs = [torch.randn(32, device="tpu") for _ in range(64)]
    out = {}
    for name, f, args in (("few", few, (a, b)), ("many", many, (ps, gs))):
        cf = torch.compile(f, backend="tpu", fullgraph=True)
        for _ in range(3):
            cf(*args)
        deferfuse.sync()
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                cf(*args)
            best.append((time.perf_counter() - t0) / calls * 1e6)
            deferfuse.sync()
        out[name] = statistics.median(best)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.calls)))
        return
    res = {"wrapper": [], "plain": []}
    for r in range(args.rounds):
        order = ("wrapper", "plain") if r % 2 == 0 else ("plain", "wrapper")
        for kind in order:
            env = dict(os.environ, DEFERFUSE_TENSOR=kind)
            p = subprocess.run([sys.executable, __file__, "--child", kind, "--calls",
                                str(args.calls)], env=env, capture_output=True, text=True)
            if p.returncode:
                sys.exit(p.stderr[-3000:])
            res[kind].append(json.loads(p.stdout.strip().splitlines()[-1]))
    print(f"{args.rounds} rounds, {args.calls} calls x 5 blocks each, median µs per call "
          "(ratio plain / wrapper, median of the rounds' ratios)\n")
    print("| graph | wrapper | plain | plain / wrapper |")
    print("|---|---:|---:|---:|")
    for case in ("few", "many"):
        w = [x[case] for x in res["wrapper"]]
        p = [x[case] for x in res["plain"]]
        ratio = statistics.median(b / a for a, b in zip(w, p))
        print(f"| {case} | {statistics.median(w):.1f} | {statistics.median(p):.1f} | "
              f"{ratio:.2f}x |")


if __name__ == "__main__":
    main()
