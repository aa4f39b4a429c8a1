"""TorchTitan's llama3 debug model with varlen attention, trained on packed batches whose number
of documents changes from step to step: the programs compiled and the tokens per second, with
this checkout's deferfuse and with another's (``--before DIR``: a source tree, e.g. an export of
an earlier commit, run in the same way) side by side in one run.

    python bench/titan_varlen.py [--steps 10] [--seq 256] [--batch 2] [--modes compiled,eager]
                                 [--before DIR] [--out NAME]

Each (mode, tree) is one process (this checkout first) (``torch.distributed.run``, one rank, TorchTitan's own setup as
tests/titan_worker.py builds it: ``parallelize_llama`` with selective activation checkpointing,
``torch.compile`` of each block with backend ``tpu`` in mode ``compiled``, none in ``eager``
(defer mode), its chunked loss, clipping, AdamW and schedule), with an empty deferfuse cache
directory of its own (no program comes from disk). Every step packs documents of random lengths
(1 to 8 a row, seeded: the same batches for every run). Per run: each step's seconds, tokens/s
over all steps and over the steps after the first two, programs compiled (``compiles`` plus
disk-cache hits), graph traces, compile seconds, the boundaries padded, the losses. The machine
has 2 cores shared with other work: the figures are noisy. Results: bench/results/NAME.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


def batches(steps: int, batch: int, seq: int):
    """``steps`` batches of (tokens, labels, positions), each row packing 1 to 8 documents."""
    import torch
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        rows = []
        for _ in range(batch):
            n = int(torch.randint(1, 9, (1,), generator=g))
            cuts = sorted(torch.randperm(seq - 1, generator=g)[:n - 1].add(1).tolist())
            lens = [b - a for a, b in zip([0] + cuts, cuts + [seq])]
            rows.append(torch.cat([torch.arange(m) for m in lens]))
        toks = torch.randint(0, 2048, (batch, seq + 1), generator=g)
        out.append((toks[:, :-1], toks[:, 1:], torch.stack(rows)))
    return out


def worker(mode: str, steps: int, batch: int, seq: int) -> None:
    import time

    import torch
    import torch.distributed as dist
    import deferfuse
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import titan_worker

    cfg = llama3_debugmodel()
    cfg.model_spec = model_registry("debugmodel", attn_backend="varlen")
    cfg.parallelism.spmd_backend = "partial_dtensor"
    cfg.training.steps = steps
    cfg.training.local_batch_size = batch
    cfg.training.seq_len = seq
    cfg.debug.seed = 42
    if mode == "compiled":
        cfg.compile.enable = True
        cfg.compile.backend = "tpu"
    device, _, model, loss_fn, opt, sched = titan_worker.build(cfg)
    deferfuse.reset_metrics()
    losses, secs, docs = [], [], []
    for tokens, labels, positions in batches(steps, batch, seq):
        t0 = time.perf_counter()
        tokens, labels, positions = (t.to(device) for t in (tokens, labels, positions))
        opt.zero_grad()
        global_tokens = torch.tensor(labels.numel(), device=device)
        pred = model(tokens, positions=positions,
                     attention_masks=model.get_attention_masks(positions=positions))
        loss, _ = loss_fn(pred, labels, global_tokens, positions=positions)
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), cfg.training.max_norm, foreach=True,
                                   pp_mesh=None, ep_enabled=False)
        opt.step()
        sched.step()
        losses.append(loss.item())
        secs.append(time.perf_counter() - t0)
        docs.append(int((positions == 0).sum()))
    m = deferfuse.metrics()
    print("RESULT " + json.dumps({
        "losses": losses, "seconds": secs, "documents": docs,
        "programs": m["compiles"] + m["disk_cache_hits"], "graph_traces": m["graph_compiles"],
        "compile_seconds": round(m["compile_seconds"], 1), "dynamo_graphs": m["dynamo_graphs"],
        "packed_padded": m.get("packed_padded", 0), "fallbacks": m["cpu_fallbacks"],
        "deferfuse": os.path.dirname(deferfuse.__file__)}), flush=True)
    dist.destroy_process_group()


def launch(tree: str, mode: str, args) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               DEFERFUSE_CACHE_DIR=tempfile.mkdtemp(prefix="titan-varlen-"))
    env.pop("XLA_FLAGS", None)
    if tree != ROOT:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                        f"--master_port={port}", os.path.abspath(__file__), "--worker", mode,
                        "--steps", str(args.steps), "--batch", str(args.batch), "--seq",
                        str(args.seq)], env=env, capture_output=True, text=True, timeout=3000)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        raise RuntimeError(p.stdout[-3000:] + p.stderr[-5000:])
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--modes", default="compiled,eager")
    ap.add_argument("--before", default=None, help="another deferfuse source tree to compare")
    ap.add_argument("--out", default="titan-varlen")
    ap.add_argument("--worker", default=None)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.batch, args.seq)
        return
    trees = [("after", ROOT)] + ([("before", args.before)] if args.before else [])
    load0 = os.getloadavg()
    rows = []
    for mode in args.modes.split(","):
        for name, tree in trees:
            r = launch(tree, mode, args)
            r.update(tree=name, mode=mode)
            tok = args.batch * args.seq
            r["tokens_per_s"] = round(tok * len(r["seconds"]) / sum(r["seconds"]), 1)
            warm = r["seconds"][2:]
            r["tokens_per_s_after_2"] = round(tok * len(warm) / sum(warm), 1)
            rows.append(r)
            save(args, rows, load0)
            print(f"{mode:9s} {name:6s} programs {r['programs']:3d}  traces {r['graph_traces']:3d}  "
                  f"compile s {r['compile_seconds']:6.1f}  tokens/s {r['tokens_per_s']:7.1f} "
                  f"(after 2 steps {r['tokens_per_s_after_2']:7.1f})  documents {r['documents']}",
                  flush=True)
    print(json.dumps(save(args, rows, load0)))


def save(args, rows, load0) -> dict:
    """Write the runs so far (with the load averages at the start and now)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    os.makedirs(RESULTS, exist_ok=True)
    meta = dict(date=stamp, steps=args.steps, batch=args.batch, seq=args.seq,
                load_start=[round(x, 2) for x in load0],
                load_now=[round(x, 2) for x in os.getloadavg()])
    with open(os.path.join(RESULTS, args.out + ".json"), "w") as f:
        json.dump(dict(meta, runs=rows), f, indent=1)
    return meta


if __name__ == "__main__":
    main()
