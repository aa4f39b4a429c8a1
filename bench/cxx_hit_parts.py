"""Where a kernel hit's time goes, section by section (issue 34; docs/cxx-plan.md, Session 8):
``x + y`` (64x64 float32) recorded by the C++ recording kernel, with rdtsc marks between the
sections of the hit and around it (NOTE [hit timing] in deferfuse/_fastpath.c and _tpu_tensor.cpp).

The marks exist only in a debug build (``-DDEFERFUSE_HIT_TIMING``), which this script makes in a
folder of /tmp (``--build``: the two extensions, a few minutes) and loads instead of the shipped
``.so`` files (an import hook for ``deferfuse._fastpath`` and ``deferfuse._tpu_tensor``); the
shipped build compiles the marks to nothing (``DEFERFUSE_HIT_TIMING_DIR`` names another folder, so
two builds can be alternated). One row of ticks per hit; a row whose total is over
three times the median (the first hit after a sync, a preemption) is dropped; the table gives each
section's mean over the rows kept, in ns (ticks at the rate calibrated here against
``time.perf_counter``), and its share of the whole. ``wall`` is the mean time per op of the same
blocks timed from Python, for comparison with the rows' total (the marks cost a few ns each).

Run: ``python bench/cxx_hit_parts.py --build`` once, then ``python bench/cxx_hit_parts.py``."""
from __future__ import annotations

import argparse
import gc
import glob
import importlib.abc
import importlib.machinery
import os
import statistics
import subprocess
import sys
import sysconfig
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.environ.get("DEFERFUSE_HIT_TIMING_DIR", "/tmp/deferfuse-hit-timing")  # a build per worktree


def build():
    # CFLAGS/CXXFLAGS replace the interpreter's own flags: the shipped build's (NDEBUG matters to
    # c10's debug-only asserts), plus the macro
    flags = f"{sysconfig.get_config_var('CFLAGS') or ''} -DDEFERFUSE_HIT_TIMING"
    env = dict(os.environ, CFLAGS=flags, CXXFLAGS=flags)
    subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", f"{DEBUG}/lib",
                    "--build-temp", f"{DEBUG}/tmp"], cwd=ROOT, env=env, check=True)


class DebugBuild(importlib.abc.MetaPathFinder):
    """Loads the debug build's two extensions in place of the shipped ones."""

    def find_spec(self, name, path=None, target=None):
        if name not in ("deferfuse._fastpath", "deferfuse._tpu_tensor"):
            return None
        got = glob.glob(f"{DEBUG}/lib/deferfuse/{name.rsplit('.', 1)[1]}.*.so")
        if not got:
            raise SystemExit(f"no debug build of {name} in {DEBUG}: run with --build first")
        return importlib.util.spec_from_file_location(
            name, got[0], loader=importlib.machinery.ExtensionFileLoader(name, got[0]))


def table(names, raw, ns_per_tick, title, stat="mean"):
    import array
    n = len(names)
    a = array.array("I")
    a.frombytes(raw)
    rows = [a[i:i + n] for i in range(0, len(a), n)]
    totals = [sum(r) for r in rows]
    cut = 3 * statistics.median(totals)
    kept = [r for r, t in zip(rows, totals) if t <= cut]
    if stat == "median":    # robust to a loaded machine's slow rows; the sections need not add up
        means = [statistics.median(r[i] for r in kept) for i in range(n)]
    else:
        means = [sum(r[i] for r in kept) / len(kept) for i in range(n)]
    whole = sum(means)
    print(f"\n{title}: {len(kept)} hits kept of {len(rows)}; total of the {stat}s {whole * ns_per_tick:.0f} ns "
          f"a hit (median row {statistics.median(totals) * ns_per_tick:.0f} ns)")
    print("| section | ns | share |")
    print("|---|---:|---:|")
    for name, m in zip(names, means):
        print(f"| {name} | {m * ns_per_tick:.0f} | {100 * m / whole:.1f}% |")
    return whole * ns_per_tick


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", action="store_true", help="make the debug build in " + DEBUG)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--ops", type=int, default=200)
    p.add_argument("--stat", choices=("mean", "median"), default="mean",
                   help="each section's mean over the rows kept, or its median")
    a = p.parse_args()
    if a.build:
        build()
    sys.meta_path.insert(0, DebugBuild())
    import torch

    import deferfuse
    from deferfuse import _fastpath, plain
    ext = plain.PLAIN.ext
    assert ext.__file__.startswith(DEBUG) and _fastpath.__file__.startswith(DEBUG), \
        (ext.__file__, _fastpath.__file__)

    t0, c0 = time.perf_counter(), ext.ticks()
    time.sleep(0.3)
    ns_per_tick = (time.perf_counter() - t0) * 1e9 / (ext.ticks() - c0)

    ca, cb = torch.randn(64, 64), torch.randn(64, 64)
    x, y = ca.to("tpu"), cb.to("tpu")
    torch.testing.assert_close((x + y).cpu(), ca + cb)
    for _ in range(3):
        for _ in range(a.ops):
            x + y
        deferfuse.sync()
    ext.hit_timing()
    _fastpath.hit_timing()
    hits0 = ext.kernel_stats()["hits"]
    load0 = os.getloadavg()
    walls, gcs, timing = [], [], [False]

    def on_gc(phase, info):
        # garbage collections inside the timed blocks: the allocations of a hit (Value, Node,
        # Storage, lists, tuples) trigger them; their rows are over the cut, so counted here
        if timing[0]:
            gcs.append((phase, info["generation"], time.perf_counter()))

    gc.callbacks.append(on_gc)
    for _ in range(a.rounds):
        timing[0] = True
        t = time.perf_counter()
        for _ in range(a.ops):
            x + y
        walls.append((time.perf_counter() - t) / a.ops * 1e9)
        timing[0] = False
        deferfuse.sync()
    gc.callbacks.remove(on_gc)
    load = os.getloadavg()
    spent = {0: 0.0, 1: 0.0, 2: 0.0}
    count = {0: 0, 1: 0, 2: 0}
    for (p0, g0, t0), (p1, g1, t1) in zip(gcs, gcs[1:]):
        if p0 == "start" and p1 == "stop":
            spent[g0] += t1 - t0
            count[g0] += 1
    hits = ext.kernel_stats()["hits"] - hits0
    assert hits == a.rounds * a.ops, (hits, a.rounds * a.ops)
    print(f"x + y kernel hits, {a.rounds} blocks of {a.ops}; {ns_per_tick:.3f} ns a tick; "
          f"load average before {load0[0]:.1f}, after {load[0]:.1f}; wall per op (Python loop): "
          f"median of blocks {statistics.median(walls):.0f} ns, min {min(walls):.0f} ns")
    names, raw = ext.hit_timing()
    table(names, raw, ns_per_tick, "the C++ side (from the last hit's fallback exit)", a.stat)
    names, raw = _fastpath.hit_timing()
    table(names, raw, ns_per_tick, "record_c (_fastpath.record_storages_checked) by section", a.stat)
    n_ops = a.rounds * a.ops
    print("\ngarbage collections in the timed blocks, per generation: "
          + ", ".join(f"gen{g} {count[g]} ({spent[g] * 1e9 / n_ops:.0f} ns an op)" for g in spent))
    pair = ext.gil_pair_ticks(200000)
    print(f"\nGIL release + re-acquire, uncontended, this thread: {pair * ns_per_tick:.0f} ns")


if __name__ == "__main__":
    main()
