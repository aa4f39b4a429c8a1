"""Distributed training on tpu against gloo on CPU tensors: a GPT training step on 1, 2 and 4
processes, with DDP and with FSDP2.

    python bench/dist.py [--procs 1,2,4] [--strategies ddp,fsdp] [--steps 10] [--rounds 1]

For each (processes, strategy) it launches the processes twice, one run on ``tpu`` (deferfuse,
defer mode, the ``tpu`` process group: XLA collectives, gloo underneath on CPU) and one on CPU
tensors with PyTorch's own ``gloo`` group, back to back (the order alternates between rounds), and
reports per step: the median step time, tokens per second (the global batch), the host time in
collectives during training (tpu: ``metrics()['collective_seconds']``, which includes waiting for
the collective's inputs to be computed), the bytes each process gave to collectives against the
model's size, and the collectives of one step replayed on their own (the same sizes, no compute),
timed on each system.

Honest about this machine: it has 2 cores. With 4 processes, 4 Python interpreters, 4 XLA (or
ATen) thread pools and the collectives' threads share them, so 4 processes are slower per step
than 2 here; scaling is a TPU pod's business, not this benchmark's. Results:
bench/results/dist.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
CFG = dict(vocab=1024, d=128, layers=4, heads=4, t=64, batch=4)     # batch: per process


# --------------------------------------------------------------------------- one process
def worker(system: str, strategy: str, steps: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    sys.path.insert(0, HERE)
    from workloads import _GPT
    tpu = system == "tpu"
    if tpu:
        import deferfuse
    dist.init_process_group("tpu" if tpu else "gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    if not tpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // n))
    dev = "tpu" if tpu else "cpu"
    torch.manual_seed(0)
    model = _GPT(CFG["vocab"], CFG["d"], CFG["layers"], CFG["heads"], CFG["t"]).to(dev)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + r)
    x = torch.randint(0, CFG["vocab"], (CFG["batch"], CFG["t"]), generator=g).to(dev)
    y = torch.randint(0, CFG["vocab"], (CFG["batch"], CFG["t"]), generator=g).to(dev)

    def step():
        loss = F.cross_entropy(model(x).reshape(-1, CFG["vocab"]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    times, before = [], None
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            if tpu:
                before = deferfuse.metrics()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times = times[warmup:]
    out = {"step_s": statistics.median(times), "model_bytes": model_bytes, "strategy": strategy}
    if tpu:
        after = deferfuse.metrics()
        out["coll_s"] = (after["collective_seconds"] - before["collective_seconds"]) / steps
        for k in ("check", "wait"):
            key = f"collective_{k}_seconds"
            out[f"{k}_s"] = (after[key] - before[key]) / steps
        out["coll_bytes"] = (after["collective_bytes"] - before["collective_bytes"]) / steps
        out["coll_count"] = sum(after["collectives"].values()) - sum(before["collectives"].values())
        out["coll_count"] /= steps
    out["replay_s"] = replay(strategy, model, dev, n)
    if strategy == "ddp":
        out.setdefault("coll_bytes", model_bytes)
    # A whole step's numbers are the slowest rank's: gather them on rank 0.
    res = [None] * n
    dist.all_gather_object(res, out)
    if r == 0:
        print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()


def replay(strategy: str, model, dev: str, n: int, iters: int = 5) -> float:
    """The collectives of one training step alone (same sizes, no compute): seconds per step."""
    import torch
    import torch.distributed as dist
    if strategy == "ddp":
        # DDP all-reduces every gradient once (in buckets; one flat tensor here)
        sizes = [("all_reduce", sum(p.numel() for p in model.parameters()))]
    else:
        # FSDP2: per group, all-gather before forward and before backward, reduce-scatter after
        sizes = []
        for m in list(model.blocks) + [model]:
            own = [p for name, p in m.named_parameters()
                   if m is not model or not name.startswith("blocks.")]
            numel = sum(p.to_local().numel() for p in own)
            sizes += [("all_gather", numel), ("all_gather", numel), ("reduce_scatter", numel)]
    bufs = []
    for kind, numel in sizes:
        x = torch.ones(numel, device=dev)
        out = torch.empty(numel * n if kind == "all_gather" else numel, device=dev)
        inp = torch.ones(numel * n, device=dev) if kind == "reduce_scatter" else x
        bufs.append((kind, x, inp, out))

    def once():
        for kind, x, inp, out in bufs:
            if kind == "all_reduce":
                dist.all_reduce(x)
            elif kind == "all_gather":
                dist.all_gather_into_tensor(out, inp)
            else:
                dist.reduce_scatter_tensor(out, inp)
        if dev == "tpu":
            torch.tpu.synchronize()
    once()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    return (time.perf_counter() - t0) / iters


# --------------------------------------------------------------------------- the launcher
def _port() -> int:
    """tests/util.py's ``free_port``: a port p with p + 1 free too (JAX's coordinator)."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    try:
        from util import free_port
    finally:
        sys.path.pop(0)
    return free_port()


def run_ranks(n: int, script: str, args: list, extra_env: dict, what: str) -> list:
    """Run ``script --worker *args`` as ``n`` local ranks (defer mode, JAX on CPU); rank 0's
    ``RESULT`` line, parsed. ``what`` names the run in the error of a rank that fails."""
    port = _port()
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   JAX_PLATFORMS="cpu", TORCHTPU_MODE="defer", **extra_env)
        env.pop("XLA_FLAGS", None)
        procs.append(subprocess.Popen(
            [sys.executable, script, "--worker", *map(str, args)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1800) for p in procs]
    for r, (p, (so, se)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise RuntimeError(f"{what} n={n} rank {r} failed:\n{se[-4000:]}")
    line = [ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def launch(n: int, system: str, strategy: str, steps: int, warmup: int) -> list:
    extra = {"DEFERFUSE_DIST_CHECK": "0"} if system == "tpu-nocheck" else {}
    return run_ranks(n, __file__, [system.split("-")[0], strategy, steps, warmup], extra,
                     f"{system} {strategy}")


def summarize(n, res) -> dict:
    step = max(r["step_s"] for r in res)
    tokens = n * CFG["batch"] * CFG["t"]
    out = {"step_ms": step * 1e3, "tok_s": tokens / step,
           "replay_ms": max(r["replay_s"] for r in res) * 1e3,
           "model_MB": res[0]["model_bytes"] / 2**20,
           "coll_MB": res[0].get("coll_bytes", 0) / 2**20}
    # On the wire per process, as ring algorithms move it: all-reduce 2(n-1)/n of the data,
    # all-gather and reduce-scatter (n-1)/n of the whole (FSDP2: 2 all-gathers + 1 reduce-scatter)
    out["ring_MB"] = out["model_MB"] * (n - 1) / n * (2 if res[0]["strategy"] == "ddp" else 3)
    if "coll_s" in res[0]:
        out["coll_ms"] = max(r["coll_s"] for r in res) * 1e3
        out["check_ms"] = max(r["check_s"] for r in res) * 1e3
        out["wait_ms"] = max(r["wait_s"] for r in res) * 1e3
        out["coll_per_step"] = res[0]["coll_count"]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", default="1,2,4")
    p.add_argument("--strategies", default="ddp,fsdp")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--systems", default="tpu,gloo",
                   help="tpu, gloo, and tpu-nocheck (tpu with DEFERFUSE_DIST_CHECK=0: what the "
                        "agreement before each collective costs)")
    p.add_argument("--out", default="dist", help="results file name under bench/results")
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        system, strategy, steps, warmup = a.worker
        worker(system, strategy, int(steps), int(warmup))
        return
    rows = []
    load0 = os.getloadavg()
    for rnd in range(a.rounds):
        for n in map(int, a.procs.split(",")):
            for strategy in a.strategies.split(","):
                systems = a.systems.split(",")
                order = systems if rnd % 2 == 0 else systems[::-1]
                got = {}
                for system in order:
                    t0 = time.time()
                    got[system] = summarize(n, launch(n, system, strategy, a.steps, a.warmup))
                    print(f"round {rnd} n={n} {strategy} {system}: {got[system]} "
                          f"({time.time() - t0:.0f} s)", flush=True)
                rows.append({"round": rnd, "procs": n, "strategy": strategy, **{
                    f"{s}_{k}": v for s, d in got.items() for k, v in d.items()}})
    os.makedirs(RESULTS, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta = {"date": stamp, "config": CFG, "steps": a.steps, "warmup": a.warmup,
            "cpus": os.cpu_count(), "load_before": load0, "load_after": os.getloadavg(),
            "rows": rows}
    with open(os.path.join(RESULTS, a.out + ".json"), "w") as f:
        json.dump(meta, f, indent=1)
    with open(os.path.join(RESULTS, a.out + ".md"), "w") as f:
        f.write(report(meta))
    print(report(meta))


def report(meta) -> str:
    c = meta["config"]
    la, lb = meta.get("load_before", (0, 0, 0)), meta.get("load_after", (0, 0, 0))
    nocheck = any("tpu-nocheck_step_ms" in r for r in meta["rows"])
    lines = ["# Distributed GPT training step: tpu (deferfuse, defer mode) vs gloo on CPU tensors",
             "", f"{meta['date']}, {meta['cpus']} CPU cores, load average {la[0]:.1f} before "
             f"and {lb[0]:.1f} after (the machine is shared: other work ran meanwhile). GPT vocab "
             f"{c['vocab']}, d {c['d']}, {c['layers']} layers, {c['t']} tokens x {c['batch']} "
             f"sequences per process; AdamW; median of {meta['steps']} steps after "
             f"{meta['warmup']} warm-up steps, the slowest rank's; a step ends with loss.item(). "
             "The systems of a row ran back to back. All processes share the 2 cores: 4 "
             "processes are slower per step than 2 here (see bench/dist.py's docstring).", "",
             "| round | procs | strategy | step ms: tpu | " + ("tpu, no agreement | " if nocheck
                                                              else "") +
             "gloo | tok/s: tpu | gloo | tpu ms in collectives: all (agreeing, waiting) | "
             "collectives / step | MB to collectives / step (model MB) | MB on the wire / step "
             "(ring estimate) | replayed collectives ms: tpu | gloo |",
             "|" + " --- |" * (14 if nocheck else 13)]
    for r in meta["rows"]:
        lines.append(
            f"| {r['round']} | {r['procs']} | {r['strategy']} | {r['tpu_step_ms']:.1f} | "
            + (f"{r['tpu-nocheck_step_ms']:.1f} | " if nocheck else "") +
            f"{r['gloo_step_ms']:.1f} | {r['tpu_tok_s']:.0f} | {r['gloo_tok_s']:.0f} | "
            f"{r.get('tpu_coll_ms', 0):.1f} ({r.get('tpu_check_ms', 0):.1f}, "
            f"{r.get('tpu_wait_ms', 0):.1f}) | {r.get('tpu_coll_per_step', 0):.0f} | "
            f"{r['tpu_coll_MB']:.2f} ({r['tpu_model_MB']:.2f}) | {r['tpu_ring_MB']:.2f} | "
            f"{r['tpu_replay_ms']:.1f} | {r['gloo_replay_ms']:.1f} |")
    lines += ["", "ms in collectives: host time inside tpu collectives per step; agreeing is the "
              "exchange with the other ranks before each one (docs/distributed.md, Agreement; it "
              "includes waiting for the slowest rank to arrive, which the collective itself "
              "would otherwise wait for), waiting is for its results, which includes the compute "
              "it depends on (the backward pass, for DDP's all-reduce). " + (
                  "No agreement: the same with DEFERFUSE_DIST_CHECK=0. " if nocheck else "") +
              "MB to collectives: the bytes each process handed to collectives per step (DDP: "
              "every gradient once; FSDP2: its shard, all-gathered before the forward and the "
              "backward pass, and every gradient reduce-scattered). Replayed: the same "
              "collectives with no compute, on each system.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
