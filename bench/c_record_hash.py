"""The C record path's rolling hashes (NOTE [rolling hashes in C] in deferfuse/_fastpath.c) in
the wrapper subclass's C record path (it sets DEFERFUSE_TENSOR=wrapper for itself): µs per ``x + y`` (64x64
float32) recorded in defer mode with the hashes taken from the items' hashes (``lanes``) and from
packed tuples (``packed``, as before), side by side in one process, rounds alternated, each block
under the trace's first step-detection check (256 ops) and timed in sub-blocks of 25 ops (the
block's figure their median). Run: ``python bench/c_record_hash.py``."""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["DEFERFUSE_TENSOR"] = "wrapper"     # the wrapper's C path (before torch autoloads us)
import torch  # noqa: E402

import deferfuse  # noqa: E402
from deferfuse import _fastpath  # noqa: E402

SYSTEMS = ("lanes", "packed")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--ops", type=int, default=200)
    a = p.parse_args()
    n, sub = a.ops, 25
    ca, cb = torch.randn(64, 64), torch.randn(64, 64)
    x, y = ca.to("tpu"), cb.to("tpu")
    torch.testing.assert_close((x + y).cpu(), ca + cb)
    deferfuse.sync()

    def block(s):
        assert _fastpath.set_own_hash(s == "lanes") == (s == "lanes")
        parts = []
        try:
            for _ in range(n // sub):
                t0 = time.perf_counter()
                for _ in range(sub):
                    x + y
                parts.append(time.perf_counter() - t0)
        finally:
            _fastpath.set_own_hash(True)
        deferfuse.sync()
        return statistics.median(parts) / sub * 1e6

    for s in SYSTEMS:
        for _ in range(3):
            block(s)
    load0 = os.getloadavg()
    h0 = _fastpath.stats()["hits"]
    times = {s: [] for s in SYSTEMS}
    diff = []
    for r in range(a.rounds):
        order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
        got = {s: block(s) for s in order}
        for s in SYSTEMS:
            times[s].append(got[s])
        diff.append(got["packed"] - got["lanes"])
    hits = _fastpath.stats()["hits"] - h0
    load = os.getloadavg()
    print(f"default mode, x + y, µs per op, {a.rounds} rounds of {n} ops (median of sub-blocks of "
          f"{sub}); C record path hits {hits} of {a.rounds * n * 2}; load average before "
          f"{load0[0]:.1f}, after {load[0]:.1f}")
    print("| system | median | min | max |")
    print("|---|---:|---:|---:|")
    for s in SYSTEMS:
        v = times[s]
        print(f"| {s} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")
    print(f"| packed - lanes | {statistics.median(diff):.2f} | {min(diff):.2f} | {max(diff):.2f} |")


if __name__ == "__main__":
    main()
