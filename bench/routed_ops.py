"""What a steady defer step routes, and where its host time goes, for ``bench/workloads.py``'s
quick workloads (issue 34; docs/cxx-plan.md, Session 10):

- per step, exact: C++ kernel hits (``kernel_stats``) and the ops the C++ fallback handed to the
  Python router (``route_stats``; the lowered factories reach it too, NOTE [C++ factories]);
- ``--kernel-off``: every op reaching the C++ fallback by name (``DEFERFUSE_CXX_KERNEL=0`` routes
  them all): a ``.out`` name is a structured op that still runs PyTorch's C++ meta function and an
  ``empty`` before its kernel hit (NOTE [functional direct] in deferfuse/plain.py);
- host time per step in phases, defer and CPU eager alternated: ``backward()`` (autograd engine
  and the backward ops' recording), the optimizer's ``step()``, ``.item()``/``.cpu()`` (the
  sync: flush, region run, read back), and the rest (the forward pass's recording, zero_grad).

Run: ``python bench/routed_ops.py [--workloads gpt_train,small_ops] [--steps 5 --rounds 4]
[--kernel-off]``. Times are medians over rounds, per step; the load is printed with them.
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
import torch.optim.optimizer as optimizer  # noqa: E402

import deferfuse  # noqa: E402
import workloads as W  # noqa: E402
from deferfuse import plain  # noqa: E402

PHASES = ("backward", "optimizer", "sync", "rest")


class Phases:
    """Host time spent in ``backward()``, optimizer steps and reads to the host, while ``on``."""

    def __init__(self):
        self.t = collections.defaultdict(float)
        self.depth = 0
        self.hits = collections.defaultdict(int)
        ext = plain.PLAIN.ext
        opt = optimizer

        def timed(name, fn):
            def wrapper(*a, **k):
                if self.depth:
                    return fn(*a, **k)
                self.depth += 1
                h0 = ext.kernel_stats()["hits"]
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.t[name] += time.perf_counter() - t0
                    self.hits[name] += ext.kernel_stats()["hits"] - h0
                    self.depth -= 1
            return wrapper
        torch.Tensor.backward = timed("backward", torch.Tensor.backward)
        torch.Tensor.item = timed("sync", torch.Tensor.item)
        torch.Tensor.cpu = timed("sync", torch.Tensor.cpu)
        t0 = [0.0, 0]

        def pre(o, a, k):
            t0[0] = time.perf_counter()
            t0[1] = ext.kernel_stats()["hits"]

        def post(o, a, k):
            self.t["optimizer"] += time.perf_counter() - t0[0]
            self.hits["optimizer"] += ext.kernel_stats()["hits"] - t0[1]
        opt.register_optimizer_step_pre_hook(pre)
        opt.register_optimizer_step_post_hook(post)


def delta(a, b):
    return {k: v - a.get(k, 0) for k, v in b.items() if v != a.get(k, 0)}


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--workloads", default="gpt_train,small_ops,bptt_lstm,wlm_lstm,hf_generate")
    a.add_argument("--steps", type=int, default=5, help="steps a round and system")
    a.add_argument("--rounds", type=int, default=4)
    a.add_argument("--kernel-off", action="store_true",
                   help="list every op reaching the fallback (run with DEFERFUSE_CXX_KERNEL=0)")
    args = a.parse_args()
    ext = plain.PLAIN.ext
    if args.kernel_off and plain.KERNEL:
        sys.exit("--kernel-off: run with DEFERFUSE_CXX_KERNEL=0")
    print(f"load average at start: {os.getloadavg()}; torch threads {torch.get_num_threads()}")
    ph = Phases()
    for name in args.workloads.split(","):
        fn = W.WORKLOADS[name]["torch"]
        with deferfuse.mode("defer"):
            d = fn(W.Ctx("defer"), True)
            for _ in range(4):
                d.step()
            deferfuse.sync()
        n = 2
        k0, r0, m0 = ext.kernel_stats(), ext.route_stats(), deferfuse.metrics()
        with deferfuse.mode("defer"):
            for _ in range(n):
                d.step()
            deferfuse.sync()
        k1, r1, m1 = ext.kernel_stats(), ext.route_stats(), deferfuse.metrics()
        per = lambda dd: {k: v / n for k, v in sorted(dd.items(), key=lambda kv: -kv[1])}  # noqa: E731
        print(f"\n== {name} (per step, {n} steps)")
        print("kernel:", per(delta(k0, k1)))
        print("route_stats:", per(delta(r0, r1)))
        print("regions", (m1["regions_run"] - m0["regions_run"]) / n,
              "compiles", m1["compiles"] - m0["compiles"])
        if args.kernel_off:
            continue
        e = fn(W.Ctx("eager"), True)
        for _ in range(4):
            e.step()
        tim = {"eager": collections.defaultdict(list), "defer": collections.defaultdict(list)}
        hits = collections.defaultdict(int)
        for r in range(args.rounds):
            for s in ("eager", "defer") if r % 2 == 0 else ("defer", "eager"):
                ph.t.clear()
                ph.hits.clear()
                h0 = ext.kernel_stats()["hits"]
                t0 = time.perf_counter()
                if s == "eager":
                    for _ in range(args.steps):
                        e.step()
                else:
                    with deferfuse.mode("defer"):
                        for _ in range(args.steps):
                            d.step()
                        deferfuse.sync()
                        torch.tpu.synchronize()
                    hits["all"] += ext.kernel_stats()["hits"] - h0
                    for k, v in ph.hits.items():
                        hits[k] += v
                total = time.perf_counter() - t0
                known = sum(ph.t.values())
                for k in PHASES[:3]:
                    tim[s][k].append(ph.t[k] / args.steps)
                tim[s]["rest"].append((total - known) / args.steps)
                tim[s]["total"].append(total / args.steps)
        ms = lambda v: round(statistics.median(v) * 1e3, 3)  # noqa: E731
        for s in ("eager", "defer"):
            print(f"{s} ms/step:", {k: ms(v) for k, v in tim[s].items()},
                  "rounds", [round(x * 1e3, 2) for x in tim[s]["total"]])
        steps = args.steps * args.rounds
        print("defer kernel hits a step:", {k: round(v / steps, 1) for k, v in hits.items()})
        print(f"load average now: {os.getloadavg()}")


if __name__ == "__main__":
    main()
