"""Compiled tensor parallelism: a tensor-parallel MLP stack trained on 2 processes, compiled with
``torch.compile(backend="tpu")``, beside the same step in defer mode, compiled with its graphs run
op by op (``DEFERFUSE_COMPILED_COLLECTIVES=0``: how every graph with collectives ran before they
were lowered into its program) and PyTorch eager on CPU tensors with gloo.

    python bench/tp_compiled.py [--procs 2] [--steps 10] [--warmup 3] [--rounds 1]

Each system is one launch of ``--procs`` processes, back to back in one run (the order alternates
between rounds). Per system: the median step (forward, backward, SGD step, ``loss.item()``) of
the slowest rank, the warm-up steps' seconds (Dynamo, compiles), the programs compiled in the
timed steps, the graphs run op by op and the graphs run as one program over the group, the first
loss (every system trains the same model on the same data). The machine has 2 cores shared with
other work: the figures are noisy. Results: bench/results/tp_compiled.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

from dist import run_ranks     # bench/dist.py: the same local-rank launcher

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
CFG = dict(d=128, hidden=512, layers=4, tokens=128)
SYSTEMS = ("gloo", "defer", "compiled-opbyop", "compiled")


def worker(system: str, steps: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    tpu = system != "gloo"
    if tpu:
        import deferfuse
    dist.init_process_group("tpu" if tpu else "gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    dev = "tpu" if tpu else "cpu"
    if not tpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // n))
    d, h = CFG["d"], CFG["hidden"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))

        def forward(self, x):
            return x + self.mlp(self.ln(x))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, d), *[Block() for _ in range(CFG["layers"])]).to(dev)
    mesh = init_device_mesh(dev, (n,))
    for b in list(model)[1:]:
        parallelize_module(b.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    step_model = torch.compile(model, backend="tpu") if system.startswith("compiled") else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)
    x = torch.randn(CFG["tokens"], d, generator=torch.Generator().manual_seed(1)).to(dev)

    def step():
        out = step_model(x)
        loss = (out * out).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    times, losses, before = [], [], None
    t_warm = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            warm_s = time.perf_counter() - t_warm
            if tpu:
                before = deferfuse.metrics()
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    out = {"step_s": statistics.median(times[warmup:]), "warm_s": warm_s, "loss0": losses[0]}
    if tpu:
        m = deferfuse.metrics()
        out["compiles_timed"] = m["compiles"] - before["compiles"]
        out["graphs_run_eagerly"] = m["graphs_run_eagerly"]
        out["graphs_with_collectives"] = m["graphs_with_collectives"]
        out["syncs_per_step"] = (sum(m["syncs"].values()) - sum(before["syncs"].values())) / steps
    res = [None] * n
    dist.all_gather_object(res, out)
    if r == 0:
        print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()


def launch(n: int, system: str, steps: int, warmup: int) -> list:
    extra = {"DEFERFUSE_COMPILED_COLLECTIVES": "0"} if system == "compiled-opbyop" else {}
    return run_ranks(n, __file__, [system, steps, warmup], extra, system)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=3)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], int(a.worker[1]), int(a.worker[2]))
        return
    runs: dict = {s: [] for s in SYSTEMS}
    for k in range(a.rounds):
        for system in (SYSTEMS if k % 2 == 0 else tuple(reversed(SYSTEMS))):
            res = launch(a.procs, system, a.steps, a.warmup)
            runs[system].append(res)
            print(system, json.dumps(res[0]), flush=True)
    rows = []
    for system in SYSTEMS:
        step = statistics.median(max(r["step_s"] for r in res) for res in runs[system])
        first = runs[system][0][0]
        rows.append({"system": system, "step_ms": step * 1e3,
                     "warm_s": max(r["warm_s"] for r in runs[system][0]),
                     "loss0": first["loss0"],
                     **{k: first.get(k) for k in ("compiles_timed", "graphs_run_eagerly",
                                                  "graphs_with_collectives", "syncs_per_step")}})
    base = next(r["step_ms"] for r in rows if r["system"] == "compiled-opbyop")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Compiled tensor parallelism ({a.procs} processes, {stamp})", "",
             f"`python bench/tp_compiled.py --procs {a.procs} --steps {a.steps} --warmup "
             f"{a.warmup} --rounds {a.rounds}`; model {CFG}; a 2-core machine shared with other "
             "work (noisy).", "",
             "| system | step ms (median) | vs compiled op by op | warm-up s | compiles in timed "
             "steps | graphs op by op | graphs as one program | syncs a step | first loss |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        def f(k):
            v = r[k]
            return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))
        lines.append(f"| {r['system']} | {r['step_ms']:.1f} | {base / r['step_ms']:.2f}x | "
                     f"{r['warm_s']:.1f} | {f('compiles_timed')} | {f('graphs_run_eagerly')} | "
                     f"{f('graphs_with_collectives')} | {f('syncs_per_step')} | "
                     f"{r['loss0']:.6f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "tp_compiled.json"), "w") as fh:
        json.dump({"cfg": CFG, "procs": a.procs, "stamp": stamp, "rows": rows, "runs": runs},
                  fh, indent=1)
    with open(os.path.join(RESULTS, "tp_compiled.md"), "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
