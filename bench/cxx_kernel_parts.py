"""Where the C++ recording kernel's time goes on a cache hit (issue 34; docs/cxx-plan.md,
Session 4):
µs per ``x + y`` (64x64 float32), side by side in one process, rounds alternated:

- ``cpu``: CPU eager PyTorch;
- ``floor``: the plain tensor's C++ fallback building its output from cached metadata, calling no
  Python (NOTE [floor cache] in deferfuse/_tpu_tensor.cpp);
- ``kernel``: the C++ recording kernel (NOTE [C++ recording kernel]): key, lookup, the node
  recorded by ``_fastpath.record_storages``, the output built;
- ``record_only``: ``_fastpath.record_storages`` alone, called from Python with the same Entry,
  input Values and device (what the kernel hands to it): the Python objects of the node (Node,
  Values, Storage), its hashes and the trace's checks;
- ``kernel - record``: the kernel's own part (key, lookup, gathering inputs, outputs), the median
  of the within-round differences.

Recording time only (each block synced after its timer). Run: ``python bench/cxx_kernel_parts.py``
(it sets DEFERFUSE_TENSOR=plain for itself)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if os.environ.get("DEFERFUSE_TENSOR") != "plain":
    os.environ["DEFERFUSE_TENSOR"] = "plain"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402

import deferfuse  # noqa: E402
from deferfuse import _fastpath, plain  # noqa: E402

P = plain.PLAIN
EXT = P.ext
SYSTEMS = ("cpu", "floor", "kernel", "record_only")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--ops", type=int, default=500)
    a = p.parse_args()
    n = a.ops
    ca, cb = torch.randn(64, 64), torch.randn(64, 64)
    x, y = ca.to("tpu"), cb.to("tpu")
    torch.testing.assert_close((x + y).cpu(), ca + cb)
    got = P.learn(torch.ops.aten.add.Tensor, (x, y), {"alpha": 1}, False, x + y)
    assert got is not None, "add.Tensor's Entry not found"
    entry = got[0]
    deferfuse.sync()

    def block(s):
        EXT.set_floor(s == "floor")
        EXT.set_kernel(s == "kernel")
        try:
            # fresh inputs each block: the flush may donate the buffers of values only this
            # bench holds (the record_only outputs are never read)
            xr, yr = ca.to("tpu"), cb.to("tpu")
            ins = [P.storage(xr).val, P.storage(yr).val]
            t0 = time.perf_counter()
            if s == "cpu":
                for _ in range(n):
                    ca + cb
            elif s == "record_only":
                rec = _fastpath.record_storages
                for _ in range(n):
                    rec(entry, ins, [], 0)
            else:
                for _ in range(n):
                    x + y
            dt = time.perf_counter() - t0
        finally:
            EXT.set_floor(False)
            EXT.set_kernel(True)
        deferfuse.sync()
        return dt / n * 1e6

    for s in SYSTEMS:
        for _ in range(3):
            block(s)
    times = {s: [] for s in SYSTEMS}
    own = []
    for r in range(a.rounds):
        order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
        got = {s: block(s) for s in order}
        for s in SYSTEMS:
            times[s].append(got[s])
        own.append(got["kernel"] - got["record_only"])
    load = os.getloadavg()
    print(f"x + y, µs per op, {a.rounds} rounds of {n} ops; load average after {load[0]:.1f}")
    print("| system | median | min | max |")
    print("|---|---:|---:|---:|")
    for s in SYSTEMS:
        v = times[s]
        print(f"| {s} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")
    print(f"| kernel - record | {statistics.median(own):.2f} | {min(own):.2f} | {max(own):.2f} |")


if __name__ == "__main__":
    main()
