"""Where the C++ recording kernel's time goes on a cache hit (issue 34; docs/cxx-plan.md,
Session 4):
µs per ``x + y`` (64x64 float32), side by side in one process, rounds alternated:

- ``cpu``: CPU eager PyTorch;
- ``floor``: the plain tensor's C++ fallback building its output from cached metadata, calling no
  Python (NOTE [floor cache] in deferfuse/_tpu_tensor.cpp);
- ``kernel``: the C++ recording kernel (NOTE [C++ recording kernel]): key, lookup, the node
  recorded by ``_fastpath.record_storages``' body through ``_fastpath.record_capi`` (NOTE [C++
  node hand-over]: no Python call, the fake-mode check in C++), the output built;
- ``kernel_call``: the same with the kernel calling ``_fastpath.record_storages`` as a Python
  function (``ext.install_record_capi(None)``; the kernel before the hand-over);
- ``kernel_packed``: ``kernel`` with the trace's rolling hashes hashed from packed tuples
  (``_fastpath.set_own_hash(False)``; before NOTE [rolling hashes in C]);
- ``record_only``: ``_fastpath.record_storages`` alone, called from Python with the same Entry,
  input Values and device (what the kernel hands to it): the Python objects of the node (Node,
  Values, Storage), its hashes and the trace's checks;
- ``kernel - record``: the kernel's own part (key, lookup, gathering inputs, outputs), the median
  of the within-round differences.

Recording time only (each block synced after its timer). A block records fewer ops than the
trace's first step-detection check (256: ``record_storages`` says NotImplemented there, which
``record_only`` would then time at every later call) and is timed in sub-blocks of ``--sub``
ops, the block's figure their median: a block sometimes stalls 4-12 ms once (a background
thread after the previous sync; no garbage collection ran), which the mean of 200 ops turns into
20-60 µs an op. Run: ``python bench/cxx_kernel_parts.py``."""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch  # noqa: E402

import deferfuse  # noqa: E402
from deferfuse import _fastpath, plain  # noqa: E402

P = plain.PLAIN
EXT = P.ext
SYSTEMS = ("cpu", "floor", "kernel", "kernel_call", "kernel_packed", "record_only")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--ops", type=int, default=200)
    p.add_argument("--sub", type=int, default=25)
    a = p.parse_args()
    n = a.ops
    ca, cb = torch.randn(64, 64), torch.randn(64, 64)
    x, y = ca.to("tpu"), cb.to("tpu")
    torch.testing.assert_close((x + y).cpu(), ca + cb)
    got = P.learn(torch.ops.aten.add.Tensor, (x, y), {"alpha": 1}, False, x + y)
    assert got is not None, "add.Tensor's Entry not found"
    entry = got[0]
    deferfuse.sync()

    capi = _fastpath.record_capi
    sub = max(1, min(a.sub, n))

    def block(s):
        EXT.set_floor(s == "floor")
        EXT.set_kernel(s in ("kernel", "kernel_call", "kernel_packed"))
        EXT.install_record_capi(None if s == "kernel_call" else capi)
        _fastpath.set_own_hash(s != "kernel_packed")
        parts = []
        try:
            # fresh inputs each block: the flush may donate the buffers of values only this
            # bench holds (the record_only outputs are never read)
            xr, yr = ca.to("tpu"), cb.to("tpu")
            ins = [P.storage(xr).val, P.storage(yr).val]
            rec = _fastpath.record_storages
            for _ in range(n // sub):
                t0 = time.perf_counter()
                if s == "cpu":
                    for _ in range(sub):
                        ca + cb
                elif s == "record_only":
                    for _ in range(sub):
                        rec(entry, ins, [], 0)
                else:
                    for _ in range(sub):
                        x + y
                parts.append(time.perf_counter() - t0)
        finally:
            EXT.set_floor(False)
            EXT.set_kernel(True)
            EXT.install_record_capi(capi)
            _fastpath.set_own_hash(True)
        deferfuse.sync()
        return statistics.median(parts) / sub * 1e6

    load0 = os.getloadavg()
    for s in SYSTEMS:
        for _ in range(3):
            block(s)
    times = {s: [] for s in SYSTEMS}
    own, saved, hashed = [], [], []
    for r in range(a.rounds):
        order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
        got = {s: block(s) for s in order}
        for s in SYSTEMS:
            times[s].append(got[s])
        own.append(got["kernel"] - got["record_only"])
        saved.append(got["kernel_call"] - got["kernel"])
        hashed.append(got["kernel_packed"] - got["kernel"])
    load = os.getloadavg()
    print(f"x + y, µs per op, {a.rounds} rounds of {n} ops (median of sub-blocks of {sub}); "
          f"load average before {load0[0]:.1f}, after {load[0]:.1f}")
    print("| system | median | min | max |")
    print("|---|---:|---:|---:|")
    for s in SYSTEMS:
        v = times[s]
        print(f"| {s} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")
    print(f"| kernel - record | {statistics.median(own):.2f} | {min(own):.2f} | {max(own):.2f} |")
    print(f"| kernel_call - kernel | {statistics.median(saved):.2f} | {min(saved):.2f} | "
          f"{max(saved):.2f} |")
    print(f"| kernel_packed - kernel | {statistics.median(hashed):.2f} | {min(hashed):.2f} | "
          f"{max(hashed):.2f} |")


if __name__ == "__main__":
    main()
