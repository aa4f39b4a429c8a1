"""Python's own time in a sync, per phase, with the XLA call taken out (issue 34's region hits).

For each workload (quick sizes, defer mode, one process): warm up, then time ``steps`` steps with
``Engine.sync``, ``Engine.flush``, ``Trace.take`` and ``Runner.run`` wrapped by ``perf_counter``;
from each sync's phases the time spent inside ``execute.run_region`` (the executable's call, with
its scalar packing) is subtracted, so what is left is the host's own work, which a loaded machine
disturbs far less than the call (JAX's asynchronous dispatch wakes a worker thread). Medians per
call. Compare two trees by running this script under each, alternated, in separate processes.
``--clock cpu`` times the calling thread's CPU time (``time.thread_time``), which a loaded machine
disturbs less again (a step's CPU time is printed beside its wall time).

    .venv/bin/python bench/sync_parts.py --workloads small_ops,bptt_lstm,wlm_lstm --steps 300
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import deferfuse as df  # noqa: E402
import workloads as W  # noqa: E402
from deferfuse import engine as E, record as R  # noqa: E402
from deferfuse.runtime import execute as X, flush as F  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="small_ops,bptt_lstm,wlm_lstm")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: perf_counter; cpu: the calling thread's time.thread_time")
    args = ap.parse_args()
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    inside = [0.0]      # seconds inside run_region so far
    acc = collections.defaultdict(list)
    run_region = X.run_region

    def timed_run_region(*a, **k):
        t0 = clock()
        try:
            return run_region(*a, **k)
        finally:
            inside[0] += clock() - t0
    X.run_region = timed_run_region

    def wrap(owner, name, label, less_call):
        f = getattr(owner, name)

        def g(*a, **k):
            c0, t0 = inside[0], clock()
            try:
                return f(*a, **k)
            finally:
                dt = clock() - t0
                acc[label].append(dt - (inside[0] - c0) if less_call else dt)
        setattr(owner, name, g)
    wrap(E.Engine, "sync", "sync", True)
    wrap(E.Engine, "flush", "flush", True)
    wrap(R.Trace, "take", "take", False)
    wrap(F.Runner, "run", "runner.run", True)
    print(f"deferfuse {df.__file__}; load {os.getloadavg()[0]:.1f}; clock {args.clock}; "
          "median us a call, the XLA call (run_region) taken out")
    for w in args.workloads.split(","):
        ctx = W.Ctx("defer")
        torch.manual_seed(W.SEED)
        with df.mode("defer"):
            b = W.WORKLOADS[w]["torch"](ctx, True)
            for _ in range(5):
                b.step()
            acc.clear()
            df.reset_metrics()
            inside[0] = 0.0
            ts, cs = [], []
            for _ in range(args.steps):
                t0, c0 = time.perf_counter(), time.thread_time()
                b.step()
                ts.append(time.perf_counter() - t0)
                cs.append(time.thread_time() - c0)
            m = df.metrics()
            path = m.get("region_hit_path", {})
            hits = f"{path.get('hits', 0)}+{path.get('piece hits', 0)}" if path else "-"
        print(f"{w}: step {statistics.median(ts) * 1e3:.3f} ms (CPU "
              f"{statistics.median(cs) * 1e3:.3f}); syncs a step "
              f"{len(acc['sync']) / args.steps:.0f}; region+piece hits {hits}; "
              + "; ".join(f"{k} {statistics.median(v) * 1e6:.1f}" for k, v in acc.items()))


if __name__ == "__main__":
    main()
