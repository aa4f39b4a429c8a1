"""deferfuse benchmarks against its peers and against the machine's limit, in one command.

    python bench/run.py [--quick] [--workloads a,b] [--systems a,b] [--repeats N]

Every (workload, system) cell runs in its own subprocess (compile caches, memory peaks and imports
never leak between systems), systems interleaved A B C, C B A, A B C ... across repeats. A cell
times ``--warmup`` steps (the first one is reported as "first step", compile included) and then
``--steps`` steady steps; medians and spreads are over the steady steps of all repeats. Each step
ends with a real sync. Results: bench/results/latest.{json,md,png}.

Systems: eager (PyTorch CPU), compile (torch.compile, Inductor, CPU), strict / debug / defer
(deferfuse on device "tpu"; defer_noplan: defer with DEFERFUSE_NO_MEMORY_PLANNER=1; defer_onepiece: defer
with DEFERFUSE_NEEDED_FIRST=0, every trace one region), torchax (op by op) and torchax_jit (jax_jit, where written), jax (a
hand-written JAX program of the same workload under jax.jit: the XLA ceiling).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
SYSTEMS = ["eager", "compile", "strict", "debug", "defer", "compiled", "compiled_fb", "defer_noplan",
           "defer_onepiece", "defer_nocut", "torchax", "torchax_jit", "jax"]
# defer with one setting changed, for side-by-side comparisons: system -> environment
DEFER_VARIANTS = {"defer_noplan": {"DEFERFUSE_NO_MEMORY_PLANNER": "1"},      # memory planner off
                  "defer_onepiece": {"DEFERFUSE_NEEDED_FIRST": "0"},         # no needed-first split
                  "defer_nocut": {"DEFERFUSE_BACKWARD_CUT": "0"},            # no backward cut
                  "defer_py": {"DEFERFUSE_C_RECORD": "0"},                   # Python record path only
                  "defer_dispatch": {"DEFERFUSE_DISPATCH_THREAD": "1"}}      # regions off the host's path
# compiled: torch.compile(step, backend="tpu") (deferfuse's compiled mode), the rest in defer;
# compiled_fb: a training step as forward+backward and the optimizer step compiled apart
# (workloads._two_functions), under trace_autograd_ops (workloads.fb_config)
DEFERFUSE = ("strict", "debug", "defer", "compiled", "compiled_fb") + tuple(DEFER_VARIANTS)
RATIO_TO = ["strict", "eager", "compile", "torchax", "torchax_jit", "jax"]


# =========================================================================== measurement helpers
def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS (Linux: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


# =========================================================================== child: one cell
def child_cell(a) -> None:
    import faulthandler
    faulthandler.enable()          # a crash in native code prints the Python stack to the log
    res = dict(workload=a.cell[0], system=a.cell[1], repeat=a.repeat, status="error")
    try:
        res.update(_measure(a.cell[0], a.cell[1], a.quick, a.warmup, a.steps))
        res["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - a failing cell records why, never crashes the run
        from workloads import NotApplicable
        if isinstance(e, NotApplicable):
            res.update(status="n/a", error=str(e))
        else:
            res.update(error=_first_line(e), traceback=traceback.format_exc()[-4000:])
    with open(a.cell_out, "w") as f:
        json.dump(res, f)


def _measure(w: str, s: str, quick: bool, warmup: int, steps: int) -> dict:
    import contextlib

    import torch
    import workloads as W

    spec = W.WORKLOADS[w]
    torch.manual_seed(W.SEED)
    out: dict = {"torch_threads": torch.get_num_threads()}
    df = None
    if s == "jax":
        if spec["jax"] is None:
            raise W.NotApplicable("no hand-written JAX program for this workload")
        import jax
        build, scope = (lambda: spec["jax"](quick)), contextlib.nullcontext()
        out["jax_backend"] = jax.default_backend()
    else:
        ctx = W.Ctx(s)
        build = lambda: spec["torch"](ctx, quick)  # noqa: E731
        if s in DEFERFUSE:
            import deferfuse as df
            df.reset_metrics()
            scope = df.mode("defer" if s in DEFER_VARIANTS or s.startswith("compiled") else s)
            if s == "compiled_fb":
                stack = contextlib.ExitStack()
                stack.enter_context(scope)
                stack.enter_context(W.fb_config())
                scope = stack
            out["deferfuse_platform"] = df.platform()
        elif ctx.tx is not None:
            scope = ctx.env
        else:
            scope = contextlib.nullcontext()

    dyn = None
    if s == "compile":
        from torch._dynamo.utils import counters as dyn

    with scope:
        t0 = time.perf_counter()
        built = build()
        out["build_s"] = time.perf_counter() - t0
        out["info"] = built.info
        warm = []
        for _ in range(warmup):
            t0 = time.perf_counter()
            built.step()
            warm.append(time.perf_counter() - t0)
        out["warmup_s"] = warm

        # ---- steady state: counters and peaks start here
        fallbacks = {}
        if df is not None:
            m = df.metrics()
            out["compiles_warmup"] = m["compiles"]
            out["compile_seconds_warmup"] = m["compile_seconds"]
            fallbacks = dict(m["cpu_fallbacks"])
            df.reset_metrics()
            torch.tpu.reset_peak_memory_stats()
        c0 = built.compiles() if built.compiles else None
        g0 = dyn["stats"]["unique_graphs"] if dyn is not None else None
        out["hwm_reset"] = _reset_hwm()
        out["rss_before_mb"] = (_status_kb("VmRSS") or 0) / 1024
        times, extras = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            x = built.step()
            times.append(time.perf_counter() - t0)
            if isinstance(x, dict):
                extras.append(x)
        hwm = _status_kb("VmHWM")
        out["peak_rss_mb"] = hwm / 1024 if hwm is not None else None
        out["times_s"] = times
        out["extras"] = {k: statistics.median(e[k] for e in extras) for k in (extras[0] if extras else {})}
        if df is not None:
            m = df.metrics()
            out["compiles_after_warmup"] = m["compiles"]
            out["region_compiles_after_warmup"] = m["region_compiles"]
            out["cache_hits"] = m["cache_hits"]
            out["compile_seconds_after_warmup"] = m["compile_seconds"]
            out["syncs_per_step"] = sum(m["syncs"].values()) / max(steps, 1)
            out["runtime_peak_mb"] = torch.tpu.max_memory_allocated() / 2**20
            for k, v in m["cpu_fallbacks"].items():
                fallbacks[k] = fallbacks.get(k, 0) + v
        elif c0 is not None:
            out["compiles_after_warmup"] = built.compiles() - c0
        elif g0 is not None:
            out["compiles_after_warmup"] = dyn["stats"]["unique_graphs"] - g0
        if s == "jax":
            out["runtime_peak_mb"] = _jax_peak_mb()
        out["cpu_fallbacks"] = fallbacks
        out["check"] = built.check()
        out["flops"], out["bytes"], out["items"] = built.flops, built.bytes, built.items
    return out


def _jax_peak_mb():
    try:
        import jax
        st = jax.devices()[0].memory_stats()
        return st["peak_bytes_in_use"] / 2**20 if st and "peak_bytes_in_use" in st else None
    except Exception:  # noqa: BLE001
        return None


# =========================================================================== child: machine limit
def child_limits(a) -> None:
    """STREAM-style copy bandwidth (numpy, all cores) and large float32 matmul FLOP/s."""
    import threading

    import numpy as np
    res = {}
    n = (64 if a.quick else 256) * 2**20 // 8            # float64 elements per array
    src = np.ones(n)
    dst = np.zeros(n)
    threads = os.cpu_count() or 1

    def copy_par():
        chunks = np.array_split(np.arange(n), threads)
        bounds = [(c[0], c[-1] + 1) for c in chunks if len(c)]
        ts = [threading.Thread(target=lambda lo, hi: np.copyto(dst[lo:hi], src[lo:hi]), args=b)
              for b in bounds]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    best1 = bestp = float("inf")
    for _ in range(5 if a.quick else 10):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best1 = min(best1, time.perf_counter() - t0)
        t0 = time.perf_counter()
        copy_par()
        bestp = min(bestp, time.perf_counter() - t0)
    nbytes = 2 * src.nbytes                              # read + write, as STREAM counts copy
    res["copy_bw_1thread_GBs"] = nbytes / best1 / 1e9
    res["copy_bw_GBs"] = max(nbytes / best1, nbytes / bestp) / 1e9
    res["copy_array_mb"] = src.nbytes / 2**20
    m = 1024 if a.quick else 2048
    x = np.random.default_rng(0).standard_normal((m, m), dtype=np.float32)
    y = np.random.default_rng(1).standard_normal((m, m), dtype=np.float32)
    x @ y
    best = float("inf")
    for _ in range(3 if a.quick else 5):
        t0 = time.perf_counter()
        x @ y
        best = min(best, time.perf_counter() - t0)
    res["matmul_n"] = m
    res["matmul_GFLOPs"] = 2 * m ** 3 / best / 1e9
    with open(a.cell_out, "w") as f:
        json.dump(res, f)


# =========================================================================== parent
def _version(pkg):
    from importlib import metadata
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) / 2**20
    except OSError:
        mem = None
    return dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                nproc=os.cpu_count(), cpu=cpu or platform.processor(), mem_gb=mem,
                python=platform.python_version(), platform=platform.platform(),
                loadavg_start=os.getloadavg(),
                versions={p: _version(p) for p in ("torch", "jax", "jaxlib", "numpy", "deferfuse",
                                                    "transformers", "torchax", "matplotlib")})


def _spawn(args: list[str], timeout: float, env_extra: dict, tmp: str,
           script: str = __file__) -> tuple[dict | None, str]:
    """Run ``script`` (this one by default) in a child; returns (its JSON or None, why not)."""
    out = os.path.join(tmp, "cell.json")
    if os.path.exists(out):
        os.remove(out)
    env = dict(os.environ, **env_extra)
    log = os.path.join(tmp, "cell.log")
    with open(log, "w") as lf:
        p = subprocess.Popen([sys.executable, os.path.abspath(script), *args, "--cell-out", out],
                             stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)          # the child's own process group only
            p.wait()
            with open(log, errors="replace") as f:
                tail = "\n".join([ln.rstrip() for ln in f if ln.strip()][-15:])
            return None, f"timeout: cell did not finish in {timeout:.0f} s" + ("\n" + tail if tail else "")
    if os.path.exists(out):
        with open(out) as f:
            return json.load(f), ""
    with open(log, errors="replace") as f:
        lines = [ln.rstrip() for ln in f if ln.strip()]
    tail = "\n".join(lines[-15:])
    code = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
    fatal = [ln.strip() for ln in lines if ln.startswith(("terminate called", "Fatal Python error"))]
    msg = fatal[0] if fatal else (lines[-1].strip() if lines else "no output")
    return None, f"child died ({code}): {msg[:300]}" + ("\n" + tail if tail else "")


def _probe_torchax(tmp: str) -> str | None:
    """None if torchax imports here, else why not (probed once, in a subprocess)."""
    if _version("torchax") is None:
        return "torchax is not installed (pip install -c constraints.txt torchax)"
    r = subprocess.run([sys.executable, "-c", "import workloads; workloads.import_torchax()"],
                       capture_output=True, text=True, timeout=300, cwd=tmp,
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(__file__))))
    if r.returncode == 0:
        return None
    last = [ln for ln in r.stderr.splitlines() if ln.strip()]
    return f"torchax {_version('torchax')} does not import on torch {_version('torch')}: " + \
        (last[-1].strip()[:250] if last else f"exit code {r.returncode}")


def _pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(runs: list[dict], limits: dict) -> dict:
    import workloads as W
    summary: dict = {}
    for r in runs:
        summary.setdefault(r["workload"], {}).setdefault(r["system"], []).append(r)
    out: dict = {}
    for w, by_sys in summary.items():
        out[w] = {}
        for s, rs in by_sys.items():
            ok = [r for r in rs if r["status"] == "ok"]
            c = dict(status="ok" if ok else rs[0]["status"], repeats=len(rs), ok_repeats=len(ok))
            bad = [r for r in rs if r["status"] != "ok"]
            if bad:
                c["error"] = bad[0].get("error")
            if ok:
                times = [t for r in ok for t in r["times_s"]]
                med = statistics.median(times)
                c.update(median_ms=med * 1e3, p25_ms=_pct(times, .25) * 1e3,
                         p75_ms=_pct(times, .75) * 1e3, min_ms=min(times) * 1e3,
                         max_ms=max(times) * 1e3, steps=len(times),
                         first_step_s=statistics.median(r["warmup_s"][0] for r in ok if r["warmup_s"]),
                         build_s=statistics.median(r["build_s"] for r in ok),
                         check=ok[0].get("check"), info=ok[0].get("info"))
                for k in ("compiles_after_warmup", "runtime_peak_mb", "peak_rss_mb",
                          "syncs_per_step", "compiles_warmup", "compile_seconds_warmup"):
                    vals = [r[k] for r in ok if r.get(k) is not None]
                    c[k] = max(vals) if vals else None
                fb: dict = {}
                for r in ok:
                    for k, v in r.get("cpu_fallbacks", {}).items():
                        fb[k] = max(fb.get(k, 0), v)
                c["cpu_fallbacks"] = fb
                d = [r["peak_rss_mb"] - r["rss_before_mb"] for r in ok
                     if r.get("peak_rss_mb") is not None and r.get("rss_before_mb")]
                c["rss_step_growth_mb"] = max(0.0, max(d)) if d else None
                ex = {}
                for k in (ok[0].get("extras") or {}):
                    ex[k] = statistics.median(r["extras"][k] for r in ok if k in r.get("extras", {}))
                c["extras"] = ex
                r0 = ok[0]
                if r0.get("items"):
                    unit, n = r0["items"]
                    c["throughput"] = (f"{unit}/s", n / med)
                bound = W.WORKLOADS[w]["bound"]
                if bound == "memory" and r0.get("bytes") and limits.get("copy_bw_GBs"):
                    c["achieved"] = r0["bytes"] / med / 1e9
                    c["limit_frac"] = c["achieved"] / limits["copy_bw_GBs"]
                    c["limit_kind"] = "BW"
                elif bound == "compute" and r0.get("flops") and limits.get("matmul_GFLOPs"):
                    c["achieved"] = r0["flops"] / med / 1e9
                    c["limit_frac"] = c["achieved"] / limits["matmul_GFLOPs"]
                    c["limit_kind"] = "FLOP/s"
            out[w][s] = c
        ref = out[w].get("eager", {}).get("check")
        for s, c in out[w].items():
            if c.get("check") is not None and ref is not None and s != "eager":
                c["check_rel_diff"] = abs(c["check"] - ref) / max(abs(ref), 1e-6)
    for w, by in out.items():
        d = by.get("defer", {}).get("median_ms")
        ratios = {}
        for o in RATIO_TO:
            t = by.get(o, {}).get("median_ms")
            ratios[o] = (t / d) if (d and t) else None
        out[w]["_defer_speedup_over"] = ratios
    return out


# --------------------------------------------------------------------------- rendering
def _f(x, fmt="{:.2f}", none="–"):
    return none if x is None else fmt.format(x)


def _ms(x):
    if x is None:
        return "–"
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def render_md(meta: dict, summ: dict, workloads: list[str], systems: list[str]) -> str:
    import workloads as W
    m, lim = meta["machine"], meta["limits"]
    v = m["versions"]
    L = [f"# deferfuse benchmarks ({'quick' if meta['quick'] else 'full'} run)", "",
         f"- date: {m['date']}",
         f"- machine: {m['nproc']} CPUs ({m['cpu']}), {_f(m['mem_gb'], '{:.0f}')} GB RAM, "
         f"{m['platform']}; load average at start {', '.join(f'{x:.1f}' for x in m['loadavg_start'])}"
         f", at end {', '.join(f'{x:.1f}' for x in m.get('loadavg_end', ()))}",
         "- versions: " + ", ".join(f"{k} {v[k]}" for k in v if v[k]) + f", python {m['python']}",
         f"- machine limit (measured in this run): copy bandwidth {_f(lim.get('copy_bw_GBs'))} GB/s "
         f"(numpy, STREAM-style copy of {_f(lim.get('copy_array_mb'), '{:.0f}')} MB, read+write; one "
         f"thread {_f(lim.get('copy_bw_1thread_GBs'))} GB/s), float32 matmul "
         f"{_f(lim.get('matmul_GFLOPs'), '{:.1f}')} GFLOP/s (numpy {lim.get('matmul_n')}²)"
         + (f" — limit probe failed: {lim['error']}" if lim.get("error") else ""),
         f"- protocol: each cell in its own process, cold caches (fresh DEFERFUSE_CACHE_DIR and "
         f"TORCHINDUCTOR_CACHE_DIR), {meta['warmup']} warm-up step(s) excluded, {meta['steps']} timed "
         f"steps × {meta['repeats']} repeat(s), systems interleaved (order reversed every other "
         f"repeat); every step ends with a real sync; same seeds and inputs for every system.",
         "", "## Results", "",
         "median / IQR: steady step time (ms). first step: the first warm-up step (s), compile "
         "included. compiles: compile-cache misses after warm-up (deferfuse metrics; jit cache size "
         "for jax; new dynamo graphs for compile) — 0 in a steady loop. runtime peak: the runtime's "
         "own count (torch.tpu.max_memory_allocated for deferfuse). peak RSS: VmHWM after "
         "clear_refs, steady steps (in brackets: how far it rose above the RSS before them). % limit: minimum bytes moved (memory-bound) or model FLOPs "
         "(matmul-bound) per step over the measured machine limit. check: relative difference of "
         "the workload's final number (loss, sum) from eager.", "",
         "| workload | system | median ms | IQR ms | first step s | compiles | runtime peak MB "
         "| peak RSS MB | % limit | throughput | CPU fallbacks | check | notes |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    errors: dict = {}
    for w in workloads:
        for s in systems:
            c = summ.get(w, {}).get(s)
            if c is None:
                continue
            if c["status"] != "ok":
                txt = c.get("error") or c["status"]
                tag = "n/a" if c["status"] == "n/a" else "ERROR"
                if tag == "ERROR":
                    errors.setdefault(txt, []).append((w, s))
                L.append(f"| {w} | {s} | {tag} | | | | | | | | | | {txt[:90]} |")
                continue
            fb = c.get("cpu_fallbacks") or {}
            fbt = (f"{sum(fb.values())} ({', '.join(sorted(fb))})" if fb else
                   ("0" if s in DEFERFUSE else "–"))
            lim = (f"{c['limit_frac'] * 100:.1f}% {c['limit_kind']}" if c.get("limit_frac") is not None
                   else "–")
            thr = c.get("throughput")
            thr = f"{thr[1]:.3g} {thr[0]}" if thr else "–"
            notes = []
            if c.get("extras", {}).get("us_per_op") is not None:
                notes.append(f"{c['extras']['us_per_op']:.1f} µs/op (loop only)")
            if c.get("compile_seconds_warmup"):
                notes.append(f"warm-up compiles {c.get('compiles_warmup')} in "
                             f"{c['compile_seconds_warmup']:.1f} s")
            if (s == "defer" or s in DEFER_VARIANTS) and c.get("syncs_per_step") is not None:
                notes.append(f"{c['syncs_per_step']:.3g} syncs/step")
            if c.get("error"):
                notes.append(f"{c['repeats'] - c['ok_repeats']} repeat(s) failed: {c['error'][:60]}")
            chk = c.get("check_rel_diff")
            chk = "–" if chk is None else (f"{chk:.0e}" if chk < 1e-3 else f"**{chk:.2g} DIFFERS**")
            L.append(f"| {w} | {s} | {_ms(c['median_ms'])} | {_ms(c['p75_ms'] - c['p25_ms'])} | "
                     f"{_f(c['first_step_s'])} | {_f(c.get('compiles_after_warmup'), '{}')} | "
                     f"{_f(c.get('runtime_peak_mb'), '{:.3g}')} | {_f(c.get('peak_rss_mb'), '{:.0f}')}{_f(c.get('rss_step_growth_mb'), ' (+{:.0f})', '')} | "
                     f"{lim} | {thr} | {fbt} | {chk} | {'; '.join(notes)} |")
    L += ["", "## defer's speedup (other system's median / defer's median; > 1: defer is faster)", "",
          "| workload | " + " | ".join(f"vs {o}" for o in RATIO_TO) + " |",
          "|---|" + "---:|" * len(RATIO_TO)]
    for w in workloads:
        r = summ.get(w, {}).get("_defer_speedup_over", {})
        L.append(f"| {w} | " + " | ".join(_f(r.get(o), "{:.3g}×", "n/a") for o in RATIO_TO) + " |")
    L += ["", "## Workloads", ""]
    for w in workloads:
        info = next((c.get("info") for s, c in summ.get(w, {}).items()
                     if isinstance(c, dict) and c.get("info")), None)
        L.append(f"- **{w}**: {W.WORKLOADS[w]['desc']}" + (f" — {json.dumps(info)}" if info else ""))
    if errors:
        L += ["", "## Errors (first line; a dead child's log tail is in latest.json)", ""]
        for txt, cells in errors.items():
            sy = sorted({c[1] for c in cells}, key=SYSTEMS.index)
            if len(cells) > 1 and set(cells) == {(w, s) for w in workloads for s in sy}:
                where = f"{', '.join(sy)} (every workload)"
            else:
                where = ", ".join(f"{w} / {s}" for w, s in cells)
            L.append(f"- {where}: {txt}")
    if meta.get("merged"):
        L += ["", f"_Merged run: {meta['merged']}_"]
    return "\n".join(L) + "\n"


def draw_png(path: str, summ: dict, workloads: list[str], systems: list[str],
             merged=()) -> str | None:
    """Speedups only for cells timed in the same run as strict (``--merge`` cells were not)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"no plot: {_first_line(e)}"

    def strict_ms(w):
        return summ.get(w, {}).get("strict", {}).get("median_ms")

    panels = [("speedup over strict eager (strict median / system median; ×, log)",
               lambda w, c: strict_ms(w) / c["median_ms"] if strict_ms(w) and c["_ws"] not in merged
               else None),
              ("peak RSS of the process, steady steps (MB, log)", lambda w, c: c.get("peak_rss_mb")),
              ("peak memory as the runtime counts it (MB, log; deferfuse: "
               "torch.tpu.max_memory_allocated)", lambda w, c: c.get("runtime_peak_mb"))]
    ok = lambda w, s: (summ.get(w, {}).get(s) or {}).get("status") == "ok"  # noqa: E731
    shown = [s for s in systems if any(ok(w, s) for w in workloads)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(10, 1.4 * len(workloads)), 13))
    width = 0.8 / max(len(shown), 1)
    for ax, (title, get) in zip(axes, panels):
        for j, s in enumerate(shown):
            xs, ys = [], []
            for i, w in enumerate(workloads):
                if ok(w, s):
                    y = get(w, dict(summ[w][s], _ws=(w, s)))
                    if y:
                        xs.append(i + (j - (len(shown) - 1) / 2) * width)
                        ys.append(y)
            if xs:
                ax.bar(xs, ys, width, label=s, color=f"C{SYSTEMS.index(s)}")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(workloads)))
        ax.set_xticklabels(workloads, rotation=20, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=.3)
        ax.legend(ncol=len(shown), fontsize=7, loc="upper right")
    axes[0].axhline(1, color="k", lw=.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_outputs(meta: dict, summ: dict, runs: list) -> tuple[str, str | None]:
    md = render_md(meta, summ, meta["workloads"], meta["systems"])
    with open(os.path.join(RESULTS, "latest.json"), "w") as f:
        json.dump(dict(meta=meta, summary=summ, runs=runs), f, indent=1, default=str)
    with open(os.path.join(RESULTS, "latest.md"), "w") as f:
        f.write(md)
    why = draw_png(os.path.join(RESULTS, "latest.png"), summ, meta["workloads"], meta["systems"],
                   {tuple(c) for c in meta.get("merged_cells", [])})
    return md, why


def rerender() -> int:
    """Redraw latest.md and latest.png from latest.json (no benchmark runs)."""
    with open(os.path.join(RESULTS, "latest.json")) as f:
        d = json.load(f)
    summ = summarize(d["runs"], d["meta"]["limits"])
    md, why = write_outputs(d["meta"], summ, d["runs"])
    print(md)
    print(why or "wrote latest.md, latest.png")
    return 0


def _merge(runs: list, meta: dict) -> tuple[list, dict]:
    """Keep latest.json's cells that this run did not redo (``--merge``)."""
    path = os.path.join(RESULTS, "latest.json")
    if not os.path.exists(path):
        return runs, meta
    with open(path) as f:
        old = json.load(f)
    redone = {(r["workload"], r["system"]) for r in runs}
    kept = [r for r in old["runs"] if (r["workload"], r["system"]) not in redone]
    om = old["meta"]
    meta = dict(om, merged=f"cells {', '.join(f'{w}/{s}' for w, s in sorted(redone))} rerun on "
                f"{meta['machine']['date']} (load {meta['machine']['loadavg_start'][0]:.1f}) into the "
                f"run of {om['machine']['date']}" + (f"; {om['merged']}" if om.get("merged") else ""))
    meta["merged_cells"] = sorted({tuple(c) for c in om.get("merged_cells", [])} | redone)
    meta["workloads"] = om["workloads"] + [w for w in {r["workload"] for r in runs}
                                           if w not in om["workloads"]]
    meta["systems"] = [s for s in SYSTEMS if s in set(om["systems"]) | {r["system"] for r in runs}]
    return kept + runs, meta


def parent(a) -> int:
    import workloads as W
    workloads = list(W.WORKLOADS) if not a.workloads else a.workloads.split(",")
    systems = SYSTEMS if not a.systems else a.systems.split(",")
    for w in workloads:
        if w not in W.WORKLOADS:
            sys.exit(f"unknown workload {w!r}; known: {', '.join(W.WORKLOADS)}")
    for s in systems:
        if s not in SYSTEMS:
            sys.exit(f"unknown system {s!r}; known: {', '.join(SYSTEMS)}")
    repeats = a.repeats or (1 if a.quick else 3)
    warmup = a.warmup or (2 if a.quick else 3)
    steps = a.steps or (3 if a.quick else 10)
    timeout = a.timeout or (300 if a.quick else 900)
    os.makedirs(RESULTS, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="deferfuse-bench-")
    t_start = time.time()
    try:
        machine = machine_info()
        print(f"deferfuse bench: {machine['date']}, {machine['nproc']} CPUs ({machine['cpu']}), "
              f"load {machine['loadavg_start'][0]:.1f}; torch {machine['versions']['torch']}, "
              f"jax {machine['versions']['jax']}", flush=True)
        limits, why = _spawn(["--limits"] + (["--quick"] if a.quick else []), 300, {}, tmp)
        limits = limits or {"error": why}
        print(f"machine limit: copy {_f(limits.get('copy_bw_GBs'))} GB/s, matmul "
              f"{_f(limits.get('matmul_GFLOPs'), '{:.1f}')} GFLOP/s", flush=True)
        tx_err = _probe_torchax(tmp) if {"torchax", "torchax_jit"} & set(systems) else None
        if tx_err:
            print(f"torchax: {tx_err}", flush=True)
        plan = []
        for r in range(repeats):
            order = systems if r % 2 == 0 else systems[::-1]
            plan += [(r, w, s) for w in workloads for s in order]
        runs = []
        for i, (r, w, s) in enumerate(plan, 1):
            t0 = time.time()
            base = dict(workload=w, system=s, repeat=r)
            if s in ("torchax", "torchax_jit") and tx_err:
                res = dict(base, status="error", error=tx_err)
            elif s == "jax" and W.WORKLOADS[w]["jax"] is None:
                res = dict(base, status="n/a", error="no hand-written JAX program for this workload")
            else:
                cache = os.path.join(tmp, f"cache-{i}")
                env = {"DEFERFUSE_CACHE_DIR": os.path.join(cache, "deferfuse"),
                       "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
                       "PYTHONWARNINGS": "ignore"}
                env.update(DEFER_VARIANTS.get(s, {}))
                args = ["--cell", w, s, "--repeat", str(r), "--warmup", str(warmup),
                        "--steps", str(steps)] + (["--quick"] if a.quick else [])
                res, why = _spawn(args, timeout, env, tmp)
                shutil.rmtree(cache, ignore_errors=True)
                if res is None:
                    why, _, tail = why.partition("\n")
                    res = dict(base, status="error", error=why, log_tail=tail)
            runs.append(res)
            line = f"[{i:>3}/{len(plan)}] r{r} {w:<19} {s:<12}"
            if res["status"] == "ok":
                t = sorted(res["times_s"])
                fb = res.get("cpu_fallbacks") or {}
                line += (f"median {statistics.median(t) * 1e3:9.2f} ms  first "
                         f"{res['warmup_s'][0] if res['warmup_s'] else float('nan'):7.2f} s  "
                         f"compiles {res.get('compiles_after_warmup', '–')}"
                         + (f"  fallbacks {sum(fb.values())}" if fb else ""))
            else:
                line += f"{res['status'].upper()}: {res.get('error', '')[:110]}"
            print(line + f"  ({time.time() - t0:.0f} s)", flush=True)
        machine["loadavg_end"] = os.getloadavg()
        meta = dict(machine=machine, limits=limits, quick=a.quick, repeats=repeats, warmup=warmup,
                    steps=steps, timeout_s=timeout, workloads=workloads, systems=systems,
                    wall_s=time.time() - t_start, argv=sys.argv[1:])
        if a.merge:
            runs, meta = _merge(runs, meta)
        summ = summarize(runs, meta["limits"])
        md, why = write_outputs(meta, summ, runs)
        print()
        print(md)
        print(f"wrote {os.path.relpath(RESULTS)}/latest.json, latest.md"
              + (", latest.png" if why is None else f" ({why})")
              + f" in {time.time() - t_start:.0f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def main() -> int:
    global RESULTS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes and few steps (smoke run)")
    p.add_argument("--workloads", help="comma-separated subset of workloads")
    p.add_argument("--systems", help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--repeats", type=int, help="processes per cell (default 3, quick 1)")
    p.add_argument("--warmup", type=int, help="warm-up steps per process (default 3, quick 2)")
    p.add_argument("--steps", type=int, help="timed steps per process (default 10, quick 3)")
    p.add_argument("--timeout", type=float, help="seconds per cell (default 900, quick 300)")
    p.add_argument("--results", default=RESULTS,
                   help="folder for latest.json / latest.md / latest.png (default bench/results)")
    p.add_argument("--merge", action="store_true",
                   help="keep latest.json's other cells; replace only the cells run now")
    p.add_argument("--rerender", action="store_true",
                   help="only redraw latest.md / latest.png from latest.json")
    p.add_argument("--cell", nargs=2, metavar=("WORKLOAD", "SYSTEM"), help=argparse.SUPPRESS)
    p.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--limits", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cell-out", help=argparse.SUPPRESS)
    a = p.parse_args()
    RESULTS = os.path.abspath(a.results)
    if a.cell:
        child_cell(a)
        return 0
    if a.limits:
        child_limits(a)
        return 0
    if a.rerender:
        return rerender()
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())
