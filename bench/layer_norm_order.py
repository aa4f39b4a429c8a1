"""What following CPU's per-thread order costs a bfloat16 layer norm's training step (NOTE [half
layer norm parameter gradients] in runtime/lowering/norms.py; issue 37, session 12).

A stack of ``Linear`` + ``LayerNorm`` + GELU blocks in bfloat16, trained with SGD in defer mode,
two ways in one process, rounds alternated: ``cpu order`` (the default: the weight and bias
gradients summed in one bfloat16 buffer per thread, a scan over each thread's rows) and
``float32 sum`` (the recorder told the platform is not XLA's CPU, so the lowering sums in float32
as on a TPU or GPU). Each way's first step (its compiles, from empty caches; run with DEFERFUSE_PERSISTENT_CACHE=0
so nothing comes from disk) is timed alone; the steady steps are
medians over rounds. CPU eager in bfloat16 runs beside them as the reference.

Run: ``python bench/layer_norm_order.py [--rows 1024 --width 256 --blocks 4 --steps 5
--rounds 5]``; the load average and torch's thread count are printed with the figures.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import deferfuse
from deferfuse import specials


def make(width: int, blocks: int):
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(torch.bfloat16)


def step(model, opt, x):
    opt.zero_grad()
    loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    return loss.item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}; torch threads {torch.get_num_threads()}; "
          f"rows {a.rows}, width {a.width}, blocks {a.blocks}")
    x = torch.randn(a.rows, a.width).to(torch.bfloat16)
    real = specials.platform_name
    ways = {"cpu order": real, "float32 sum": lambda: "not cpu"}
    setups, first, steady = {}, {}, {k: [] for k in (*ways, "cpu eager")}
    for name, plat in ways.items():
        specials.platform_name = plat
        try:
            with deferfuse.mode("defer"):
                m = make(a.width, a.blocks).to("tpu")
                opt = torch.optim.SGD(m.parameters(), lr=1e-3)
                xt = x.to("tpu")
                deferfuse.clear_caches()    # each way's first step compiles all it runs
                t0 = time.perf_counter()
                step(m, opt, xt)
                first[name] = time.perf_counter() - t0
                step(m, opt, xt)            # the optimizer's second-step program
                setups[name] = (m, opt, xt)
        finally:
            specials.platform_name = real
    for name, plat in ways.items():     # programs the other way's clear_caches dropped
        specials.platform_name = plat
        try:
            with deferfuse.mode("defer"):
                step(*setups[name][:2], setups[name][2])
        finally:
            specials.platform_name = real
    cm = make(a.width, a.blocks)
    copt = torch.optim.SGD(cm.parameters(), lr=1e-3)
    step(cm, copt, x)
    for _ in range(a.rounds):
        for name, plat in ways.items():
            m, opt, xt = setups[name]
            specials.platform_name = plat
            try:
                with deferfuse.mode("defer"):
                    t0 = time.perf_counter()
                    for _ in range(a.steps):
                        step(m, opt, xt)
                    steady[name].append((time.perf_counter() - t0) / a.steps)
            finally:
                specials.platform_name = real
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step(cm, copt, x)
        steady["cpu eager"].append((time.perf_counter() - t0) / a.steps)
    med = {k: statistics.median(v) for k, v in steady.items()}
    for k in steady:
        extra = f", first step {first[k]:.2f} s" if k in first else ""
        print(f"{k:12s} step {med[k] * 1e3:8.1f} ms (median of {a.rounds}){extra}")
    print(f"cpu order / float32 sum: {med['cpu order'] / med['float32 sum']:.2f}x a step, "
          f"{first['cpu order'] / first['float32 sum']:.2f}x the first step; "
          f"cpu order / cpu eager {med['cpu order'] / med['cpu eager']:.2f}x")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
