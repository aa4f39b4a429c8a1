"""Programs that vary (issue 25): what the first call, the second identical call, a new prompt length
and a second process cost, in defer and strict mode, from cold caches.

    python bench/vary.py [--quick] [--workloads a,b] [--systems defer,strict]

For each (workload, system): a fresh process with an empty cache folder runs the workload's step
three times (the first call: compiles included; the second, identical; for the generate workloads
a third with another prompt length), then a second process with the same, now warm, folder runs it
once. Each row gives wall seconds, programs compiled and seconds spent compiling, and programs
loaded from disk. The steady speed of the same workloads is in the paired bench (paired.py).
Results: bench/results/vary.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import run as R

WORKLOADS = ["gpt_generate_grow", "nanogpt_sample", "hf_generate", "hf_generate_static",
             "bptt_lstm", "wlm_lstm", "bptt_transformer", "ragged_train"]
PROMPTS = {"gpt_generate_grow": 12, "hf_generate": 11}     # the new prompt length of the third call


def child(a) -> None:
    import torch
    import deferfuse as df
    import workloads as W
    res = {"calls": []}
    ctx = W.Ctx(a.system)
    with df.mode(a.system):
        torch.manual_seed(W.SEED)
        built = W.WORKLOADS[a.workload]["torch"](ctx, a.quick)
        calls = 1 if a.phase == "second_process" else 2
        steps = [built.step] * calls
        if a.phase == "first_process" and a.workload in PROMPTS:
            steps.append(_new_prompt(W, ctx, a.workload, a.quick, PROMPTS[a.workload]))
        for step in steps:
            df.reset_metrics()
            t0 = time.perf_counter()
            step()
            ctx.sync()
            dt = time.perf_counter() - t0
            m = df.metrics()
            res["calls"].append(dict(seconds=dt, compiles=m["compiles"],
                                     compile_s=m["compile_seconds"], disk=m["disk_cache_hits"],
                                     bucketed=m["bucketed_runs"] + m["bucketed_ops"],
                                     op_by_op=m["shape_fallbacks"]))
        res["check"] = built.check()
    print("RESULT " + json.dumps(res))


def _new_prompt(W, ctx, workload, quick, plen):
    """A step of ``workload`` from a prompt of another length (same model and weights)."""
    import torch
    if workload == "gpt_generate_grow":
        torch.manual_seed(W.SEED)
        model = W.GrowGPT().eval().to(ctx.device)
        prompt = ctx.to(torch.randint(0, 96, (1, plen), generator=W._gen(1)))
        return lambda: model.generate(prompt, 50).cpu()
    model, c = W._llama(quick)
    model = model.to(ctx.device).eval()
    ids = ctx.to(torch.randint(2, c["vocab_size"], (2, plen), generator=W._gen(1)))
    new = W._sizes(quick, 8, 32)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
              do_sample=False, pad_token_id=0, disable_compile=True)

    def step():
        with torch.no_grad():
            model.generate(ids, **kw).cpu()
    return step


def _run(args, env):
    out = subprocess.run([sys.executable, os.path.abspath(__file__)] + args, env=env,
                         capture_output=True, text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]}


def render(meta, results) -> str:
    L = ["# Programs that vary: first call, second call, new prompt, second process", "",
         f"- date: {meta['machine']['date']}; {meta['machine']['nproc']} CPUs; load average "
         f"{', '.join(f'{x:.1f}' for x in meta['machine']['loadavg_start'])} at start",
         f"- {'quick' if meta['quick'] else 'full'} sizes; each row: a fresh process with an "
         "empty cache folder (first call, second identical call, a new prompt length where it "
         "applies), then a second process on the warm folder (first call). Cells: wall seconds "
         "(programs compiled / seconds compiling / programs loaded from disk).", "",
         "| workload | system | first call | second call | new prompt | second process | "
         "check |", "|---|---|---:|---:|---:|---:|---:|"]

    def cell(c):
        return (f"{c['seconds']:.2f} s ({c['compiles']} / {c['compile_s']:.1f} s / {c['disk']})"
                if c else "–")
    for w in meta["workloads"]:
        for s in meta["systems"]:
            r = results.get(w, {}).get(s, {})
            a, b = r.get("first_process", {}), r.get("second_process", {})
            if "error" in a or "error" in b:
                L.append(f"| {w} | {s} | ERROR: {(a.get('error') or b.get('error'))[0][:90]} |")
                continue
            ca, cb = a.get("calls", []), b.get("calls", [])
            L.append(f"| {w} | {s} | {cell(ca[0] if ca else None)} | "
                     f"{cell(ca[1] if len(ca) > 1 else None)} | "
                     f"{cell(ca[2] if len(ca) > 2 else None)} | {cell(cb[0] if cb else None)} | "
                     f"{a.get('check', '–')} |")
    return "\n".join(L) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--systems", default="defer,strict")
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--phase", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.workload:
        child(a)
        return 0
    meta = dict(machine=R.machine_info(), quick=a.quick, workloads=a.workloads.split(","),
                systems=a.systems.split(","))
    results = {}
    for w in meta["workloads"]:
        for s in meta["systems"]:
            with tempfile.TemporaryDirectory(prefix="deferfuse-vary-") as tmp:
                env = dict(os.environ, DEFERFUSE_CACHE_DIR=tmp, PYTHONWARNINGS="ignore")
                r = {}
                for phase in ("first_process", "second_process"):
                    r[phase] = _run(["--workload", w, "--system", s, "--phase", phase]
                                    + (["--quick"] if a.quick else []), env)
                results.setdefault(w, {})[s] = r
                print(w, s, json.dumps(r)[:300], flush=True)
    os.makedirs(R.RESULTS, exist_ok=True)
    with open(os.path.join(R.RESULTS, "vary.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1, default=str)
    md = render(meta, results)
    with open(os.path.join(R.RESULTS, "vary.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
