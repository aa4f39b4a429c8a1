"""Where a steady defer step of ``wlm_lstm`` (word_language_model's LSTM training loop, issue 33's
sizes: 1 layer, 64 wide, bptt 35, batch 20, vocabulary 1000) spends its time, with CPU eager's
step beside it, in one process:

- the step in phases (host time: recording the forward pass, ``backward()``, ``clip_grad_norm_``,
  the manual ``p.data.add_`` and ``loss.item()``, which waits for the forward program), defer
  and CPU eager alternated round by round;
- ops recorded a step (``kernel_stats``: C++ kernel hits; ``route_stats``: ops through the Python
  router), regions run and syncs;
- the runner's share: ``Runner.run`` (plan, cache lookup, dispatch) and ``execute.run_region``
  (the dispatch of a compiled program alone);
- the compiled programs alone: each region's executable called on copies of its step's inputs
  and waited for, and its dispatch alone;
- ``--trace``: a JAX profile of the programs alone, summed per XLA operation (the thunk times of
  XLA's CPU runtime; concurrent thunks overlap, so the sums are a ranking, not a partition).

Run: ``python bench/wlm_step.py [--steps 10 --rounds 6 --trace]``. Times are medians over rounds
(per step); the machine's load is printed with them.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import glob
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import torch  # noqa: E402

import deferfuse  # noqa: E402
import workloads as W  # noqa: E402
from deferfuse import plain  # noqa: E402
from deferfuse.runtime import execute, flush as rflush  # noqa: E402

VOCAB, D, T, BATCH = 1000, 64, 35, 20
PHASES = ("forward", "backward()", "clip_grad_norm_", "p.data.add_", "item")


def build(device):
    """``bench/workloads.py``'s ``wlm_lstm`` step, timed in phases."""
    torch.manual_seed(W.SEED)
    model = W.LSTMLM(VOCAB, D).to(device)
    data = torch.randint(0, VOCAB, (T * 40 + 1, BATCH), generator=W._gen(1)).to(device)
    st = {"i": 0, "h": None, "loss": float("nan")}
    phases = collections.defaultdict(float)

    def step():
        last = time.perf_counter()

        def mark(phase):
            nonlocal last
            now = time.perf_counter()
            phases[phase] += now - last
            last = now
        W.wlm_batch(model, data, st, T, VOCAB, mark)
        return st["loss"]
    return step, phases


class Probe:
    """Times ``Runner.run`` and ``execute.run_region``; captures a step's programs and inputs."""

    def __init__(self):
        self.s = collections.defaultdict(float)
        self.capture = None
        self._run, self._rr = rflush.Runner.run, execute.run_region
        probe = self

        def run(runner, ctx, later):
            t0 = time.perf_counter()
            try:
                return probe._run(runner, ctx, later)
            finally:
                probe.s["Runner.run"] += time.perf_counter() - t0

        def run_region(compiled, don, keep, scalars, device=0, debug=False):
            if probe.capture is not None:
                probe.capture.append((compiled, [jax.numpy.copy(a) for a in don],
                                      [jax.numpy.copy(a) for a in keep], list(scalars)))
            t0 = time.perf_counter()
            try:
                return probe._rr(compiled, don, keep, scalars, device, debug)
            finally:
                probe.s["run_region"] += time.perf_counter() - t0

        rflush.Runner.run = run
        rflush.execute.run_region = run_region


def call(prog, wait=True):
    compiled, don, keep, scalars = prog
    don = [jax.numpy.copy(a) for a in don]     # donated: a fresh copy per call
    jax.block_until_ready(don)
    t0 = time.perf_counter()
    with execute.x64(True):
        res = compiled(don, keep, execute.pack_scalars(scalars))
    t1 = time.perf_counter()
    jax.block_until_ready(res)
    return (time.perf_counter() if wait else t1) - t0


def trace(progs, n, where):
    from jax import profiler
    with profiler.trace(where, create_perfetto_trace=True):
        for p in progs:
            for _ in range(n):
                call(p)
    ev = json.load(gzip.open(glob.glob(f"{where}/plugins/profile/*/perfetto_trace.json.gz")[0]))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    per = collections.defaultdict(list)
    for e in ev:
        name = e.get("name", "")
        if e.get("ph") == "X" and not name.startswith("$") and "Thunk" not in name \
                and "Pjit" not in name and "PjRt" not in name:
            per[name].append(e["dur"])
    return sorted(per.items(), key=lambda kv: -sum(kv[1]))


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--steps", type=int, default=10, help="steps a round and system")
    a.add_argument("--rounds", type=int, default=6)
    a.add_argument("--calls", type=int, default=50, help="calls of each program alone")
    a.add_argument("--trace", action="store_true", help="profile the programs alone")
    args = a.parse_args()
    ext = plain.PLAIN.ext
    print(f"load average at start: {os.getloadavg()}; torch threads {torch.get_num_threads()}")
    probe = Probe()
    e_step, e_ph = build("cpu")
    with deferfuse.mode("defer"):
        d_step, d_ph = build("tpu")
        for _ in range(4):
            d_step()
        deferfuse.sync()
        torch.tpu.synchronize()
    for _ in range(4):
        e_step()
    k0, r0, m0 = ext.kernel_stats(), ext.route_stats(), deferfuse.metrics()
    with deferfuse.mode("defer"):
        d_step()
        deferfuse.sync()
        torch.tpu.synchronize()
    k1, r1, m1 = ext.kernel_stats(), ext.route_stats(), deferfuse.metrics()
    print("a step: kernel", {k: v - k0.get(k, 0) for k, v in k1.items() if v != k0.get(k, 0)},
          "routed", {k: v - r0.get(k, 0) for k, v in r1.items() if v != r0.get(k, 0)},
          "regions", m1["regions_run"] - m0["regions_run"],
          "compiles", m1["compiles"] - m0["compiles"])
    te, td = [], []
    for d in (e_ph, d_ph, probe.s):
        d.clear()
    for r in range(args.rounds):
        for s in ("eager", "defer") if r % 2 == 0 else ("defer", "eager"):
            t0 = time.perf_counter()
            if s == "eager":
                for _ in range(args.steps):
                    e_step()
                te.append((time.perf_counter() - t0) / args.steps)
            else:
                with deferfuse.mode("defer"):
                    for _ in range(args.steps):
                        d_step()
                    deferfuse.sync()
                    torch.tpu.synchronize()
                td.append((time.perf_counter() - t0) / args.steps)
    n = args.steps * args.rounds
    ms = lambda v: round(v / n * 1e3, 3)  # noqa: E731
    print(f"CPU eager ms/step: median {statistics.median(te) * 1e3:.2f}, rounds "
          f"{[round(x * 1e3, 2) for x in te]}")
    print(f"defer ms/step: median {statistics.median(td) * 1e3:.2f}, rounds "
          f"{[round(x * 1e3, 2) for x in td]}")
    print("CPU eager phases, ms/step:", {k: ms(e_ph[k]) for k in PHASES})
    print("defer phases, ms/step:", {k: ms(d_ph[k]) for k in PHASES})
    print("defer runner, ms/step:", {k: ms(v) for k, v in probe.s.items()})
    probe.capture = []
    with deferfuse.mode("defer"):
        d_step()
        deferfuse.sync()
        torch.tpu.synchronize()
    progs, probe.capture = probe.capture, None
    total = 0.0
    for j, p in enumerate(progs):
        run = sorted(call(p) for _ in range(args.calls))
        disp = sorted(call(p, wait=False) for _ in range(args.calls))
        total += statistics.median(run)
        print(f"program {j} ({len(p[1])} donated, {len(p[2])} kept inputs): run median "
              f"{statistics.median(run) * 1e3:.3f} ms, p10 {run[len(run) // 10] * 1e3:.3f}, "
              f"min {run[0] * 1e3:.3f}; dispatch alone median "
              f"{statistics.median(disp) * 1e3:.3f}, min {disp[0] * 1e3:.3f}")
    print(f"programs alone, sum of medians: {total * 1e3:.3f} ms/step")
    if args.trace:
        with tempfile.TemporaryDirectory() as where:
            rows = trace(progs, args.calls // 2, where)
        print("XLA operations of the programs alone (per step; median per call):")
        for name, v in rows[:20]:
            print(f"  {name[:40]:40s} {sum(v) / (args.calls // 2) / 1e3:7.3f} ms, "
                  f"{len(v) // (args.calls // 2):4d} calls, median {statistics.median(v):8.1f} µs")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
