"""Where compiled mode's first vLLM batch spends its time, step by step.

    python bench/vllm_warmup.py [--concurrency 1] [--tokens 32] [--batches 2] [--defer]

Runs the tiny Llama of bench/vllm.py on tpu with the model compiled
(``compilation_config={"mode": 1, "backend": "tpu"}``), engine in this process, with an empty
program store (a fresh ``DEFERFUSE_CACHE_DIR``) unless ``--keep-cache``, and prints one row a
model step: the step's padded tokens, and its seconds split into

- ``dynamo``: Dynamo's own tracing of the model's frame (``torch._dynamo``'s ``_compile`` less
  the backend call);
- ``aot``: the backend call (AOTAutograd's functionalisation and decompositions, and
  ``CompiledGraph``'s set-up of the graph);
- ``shapes``: the graph traced through deferfuse's lowerings with ``jax.eval_shape`` (once a new
  combination of sizes: ``CompiledGraph._entry``);
- ``lower``: regions traced through deferfuse's lowerings and lowered to StableHLO (``jax.jit(...).lower``);
- ``xla``: XLA compiling those (``Lowered.compile``);
- ``other``: the rest of the step (running, recording, vLLM's Python).

Then the totals a batch, ``deferfuse.metrics()``'s compiles and ``report()``'s first lines.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# this folder holds bench/vllm.py, which would hide vLLM itself
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.join(ROOT, "bench")]


def save_model(path: str) -> None:
    """bench/vllm.py's tiny Llama (loaded by path: a module named vllm would hide vLLM)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_vllm", os.path.join(ROOT, "bench", "vllm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.save_model(path)


class Timers:
    """Seconds a phase, added up by wrappers installed on the functions that do each phase."""

    def __init__(self):
        self.t = collections.Counter()
        self.n = collections.Counter()
        self.depth = collections.Counter()

    def wrap(self, owner, name, phase):
        fn = getattr(owner, name)
        timers = self

        def timed(*args, **kwargs):
            if timers.depth[phase]:             # nested (recursive) calls count once
                return fn(*args, **kwargs)
            timers.depth[phase] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.depth[phase] -= 1
                timers.t[phase] += time.perf_counter() - t0
                timers.n[phase] += 1
        setattr(owner, name, timed)

    def snap(self):
        return collections.Counter(self.t), collections.Counter(self.n)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--defer", action="store_true", help="defer mode (the model not compiled)")
    ap.add_argument("--keep-cache", action="store_true", help="keep DEFERFUSE_CACHE_DIR as it is")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--profile", help="cProfile the first batch into this file")
    a = ap.parse_args()
    tmp = None
    if not a.keep_cache:
        tmp = tempfile.TemporaryDirectory()
        os.environ["DEFERFUSE_CACHE_DIR"] = tmp.name
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    model = tempfile.mkdtemp()
    save_model(model)

    import jax
    import torch._dynamo.convert_frame as cf
    import torch._dynamo.output_graph as og

    import deferfuse
    import deferfuse.compiled as dc
    from deferfuse.runtime import execute

    timers = Timers()
    timers.wrap(cf, "_compile", "dynamo_all")
    timers.wrap(og.OutputGraph, "call_user_compiler", "aot")
    user_compiler = og.OutputGraph.call_user_compiler

    def call_user_compiler(self, gm, *args, **kwargs):
        code = getattr(getattr(self, "root_tx", None), "f_code", None)
        print(f"graph: {getattr(code, 'co_filename', '?')}:{getattr(code, 'co_name', '?')}, "
              f"{sum(1 for n in gm.graph.nodes if n.op == 'call_function')} ops", flush=True)
        return user_compiler(self, gm, *args, **kwargs)
    og.OutputGraph.call_user_compiler = call_user_compiler
    timers.wrap(dc.CompiledGraph, "_shapes", "shapes")
    timers.wrap(jax.stages.Traced, "lower", "lower")
    timers.wrap(jax.stages.Lowered, "compile", "xla")
    # compile_region calls jax.jit(fn).lower(...): through Traced.lower on this jax? Count both.
    timers.wrap(execute, "compile_region", "region_compile")

    from vllm import LLM, SamplingParams
    from deferfuse.vllm import worker as vw
    steps = []
    runner_cls = vw.TpuModelRunner
    orig_exec, orig_sample = runner_cls.execute_model, runner_cls.sample_tokens
    state = {}

    def execute_model(self, scheduler_output, *args, **kwargs):
        state["t0"] = time.perf_counter()
        state["snap"] = timers.snap()
        state["c0"] = deferfuse.metrics()["compiles"]
        state["tokens"] = scheduler_output.total_num_scheduled_tokens
        state["reqs"] = len(scheduler_output.num_scheduled_tokens)
        return orig_exec(self, scheduler_output, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        out = orig_sample(self, *args, **kwargs)
        if "t0" in state:
            t, _ = timers.snap()
            t0, _ = state["snap"]
            d = {k: t[k] - t0[k] for k in t}
            row = {"tokens": state["tokens"], "reqs": state["reqs"],
                   "wall": time.perf_counter() - state["t0"],
                   "compiles": deferfuse.metrics()["compiles"] - state["c0"], **d}
            steps.append(row)
            state.clear()
        return out

    runner_cls.execute_model, runner_cls.sample_tokens = execute_model, sample_tokens
    extra = {} if a.defer else {"compilation_config": {"mode": 1, "backend": "tpu"}}
    t = time.perf_counter()
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              max_num_seqs=max(a.concurrency, 1), kv_cache_memory_bytes=1 << 26, seed=0, **extra)
    start = time.perf_counter() - t
    print(f"engine start {start:.2f} s; {timers.snap()[0]}")
    prompts = [{"prompt_token_ids": [(11 * i + 7 * j) % 500 + 1 for j in range(16)]}
               for i in range(a.concurrency)]
    sp = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    phases = ("dynamo", "aot", "shapes", "lower", "xla", "other")
    allrows = []
    for b in range(a.batches):
        deferfuse.reset_metrics()
        steps.clear()
        prof = None
        if a.profile and b == 0:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        if prof is not None:
            prof.disable()
            prof.dump_stats(a.profile)
        print(f"\nbatch {b}: {wall:.2f} s, {len(steps)} steps")
        print("step tokens reqs  wall  " + "  ".join(f"{p:>6}" for p in phases) + "  compiles")
        tot = collections.Counter()
        for i, r in enumerate(steps):
            r["dynamo"] = r.get("dynamo_all", 0) - r.get("aot", 0)
            # lowering: the region compiles' time less XLA's (Traced.lower may not be reached)
            r["lower"] = max(r.get("region_compile", 0) - r.get("xla", 0), r.get("lower", 0))
            r["other"] = r["wall"] - sum(r.get(p, 0) for p in ("dynamo_all", "shapes", "region_compile"))
            for p in ("wall",) + phases:
                tot[p] += r.get(p, 0)
            tot["compiles"] += r["compiles"]
            if r["wall"] > 0.3 or r["compiles"] or i < 2:
                print(f"{i:>4} {r['tokens']:>6} {r['reqs']:>4} {r['wall']:5.2f}  "
                      + "  ".join(f"{r.get(p, 0):6.2f}" for p in phases) + f"  {r['compiles']}")
        print(f"all  {'':>6} {'':>4} {tot['wall']:5.2f}  "
              + "  ".join(f"{tot[p]:6.2f}" for p in phases) + f"  {tot['compiles']}")
        m = deferfuse.metrics()
        print({k: m[k] for k in ("compiles", "region_compiles", "op_compiles", "disk_cache_hits",
                                 "dynamo_graphs", "graph_compiles", "compiled_calls",
                                 "bucketed_runs", "bucket_programs", "compile_seconds")})
        allrows.append({"batch": b, "wall": wall, "steps": steps[:], "metrics": {
            k: m[k] for k in ("compiles", "dynamo_graphs", "graph_compiles", "compile_seconds")}})
    print("\n" + "\n".join(deferfuse.report().splitlines()[:12]))
    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"start": start, "batches": allrows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
