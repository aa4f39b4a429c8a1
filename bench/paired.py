"""defer against strict eager and CPU eager, step for step in one process.

    python bench/paired.py [--quick] [--workloads a,b] [--systems eager,strict,defer] [--rounds N]
                           [--block K]

``run.py`` runs each (workload, system) in its own process, minutes apart. This machine's speed
drifts by 2-3x over minutes, so a ratio of two medians from different processes is good to about
±30%. Here one process per workload builds the workload once for each system, warms each up, and
then runs rounds. In a round every system runs ``--block`` steps, timed together with a wait for
all the work it queued (a step's ``.item()`` waits for the loss only; the backward pass and the
optimizer step may still be running, and must not run on into the next system's steps); the order
is reversed every other round, so both sides of each ratio see the same machine within
milliseconds. For each round it takes (other system's time per step) / (defer's) and reports the
median of these paired ratios and their quartiles.

A block is 10 steps: the wait at its end is not part of a training loop (whose steps overlap the
device's work on the step before), and it costs defer more than strict (defer's last region is
the backward pass and optimizer step of a whole step; strict's last op is one op). Measured in one
process, alternating (2026-12-04, quick sizes), strict / defer with blocks of 3, 10 and 30 steps:
convnet 1.40, 1.58, 1.47x; GPT 1.66, 1.85, 1.65x; MLP 1.75, 2.13, 2.07x.
Results: bench/results/paired.{json,md}.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback

import run as R

# floor: a wrapper subclass that only makes its output (overhead only); jax: the hand-written
# jax.jit program of the same step, where a workload has one.
SYSTEMS = ["eager", "compile", "strict", "debug", "defer", "compiled", "compiled_fb", "floor", "jax"] + \
    list(R.DEFER_VARIANTS)
GOAL = 1.5          # issue 3: defer at least 1.5x faster than strict eager on every workload


# =========================================================================== child: one workload
def child(a) -> None:
    import faulthandler
    faulthandler.enable()
    res = dict(workload=a.cell, status="error")
    try:
        res.update(_measure(a.cell, a.systems.split(","), a.quick, a.warmup, a.rounds, a.block))
        res["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - a failing workload records why
        res.update(error=R._first_line(e), traceback=traceback.format_exc()[-4000:])
    with open(a.cell_out, "w") as f:
        json.dump(res, f)


def _measure(w: str, systems: list[str], quick: bool, warmup: int, rounds: int, block: int) -> dict:
    import contextlib

    import torch
    import workloads as W
    df = None
    if set(systems) & set(R.DEFERFUSE):
        import deferfuse as df
    built, scopes, out = {}, {}, {"na": {}, "failed": {}, "warmup_compiles": {}}
    for s in systems:
        torch.manual_seed(W.SEED)
        if df is not None:
            df.reset_metrics()
        scopes[s] = _scope(df, s) if s in R.DEFERFUSE else contextlib.nullcontext
        try:
            if s == "jax":
                if W.WORKLOADS[w]["jax"] is None:
                    raise W.NotApplicable("no hand-written JAX program for this workload")
                make = lambda: W.WORKLOADS[w]["jax"](quick)  # noqa: E731
            elif s == "floor" and w != "overhead":
                raise W.NotApplicable("the floor is measured on the overhead workload only")
            else:
                ctx = W.Ctx(s)
                make = lambda: W.WORKLOADS[w]["torch"](ctx, quick)  # noqa: E731
            with scopes[s]():
                t0 = time.perf_counter()
                built[s] = make()
                built[s].step()
                out.setdefault("first_step_s", {})[s] = time.perf_counter() - t0    # compiles
                for _ in range(warmup - 1):
                    built[s].step()
            if df is not None and s in R.DEFERFUSE:
                # What building and warming this system up compiled (compile seconds are the
                # cost of a program that varies: issue 25).
                m = df.metrics()
                out["warmup_compiles"][s] = dict(compiles=m["compiles"],
                                                 compile_s=m["compile_seconds"],
                                                 disk=m["disk_cache_hits"])
        except W.NotApplicable as e:
            out["na"][s] = str(e)
        except Exception as e:
            if s in ("eager", "defer"):
                raise               # the reference systems: the workload itself is broken
            # One system that cannot run this workload: reported, the others still measured.
            built.pop(s, None)
            out["failed"][s] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}" \
                if str(e).strip() else type(e).__name__
    live = [s for s in systems if s in built]
    if df is not None:
        df.reset_metrics()
    times = {s: [] for s in live}
    extras = {s: [] for s in live}
    timed_compiles = {s: 0 for s in live if s in R.DEFERFUSE}
    drains = {s: (_jax_drain if s == "jax" else W.Ctx(s).sync) for s in live}
    for r in range(rounds):
        for s in (live if r % 2 == 0 else live[::-1]):
            c0 = df.metrics()["compiles"] if s in timed_compiles else 0
            with scopes[s]():
                t0 = time.perf_counter()
                for _ in range(block):
                    x = built[s].step()
                    if isinstance(x, dict) and "us_per_op" in x:
                        extras[s].append(x["us_per_op"])
                # A step's .item() waits for the loss, not for the backward pass and optimizer
                # step queued after it: wait for those too, inside the timing, so that no
                # system's work runs on into the next system's steps.
                drains[s]()
                times[s].append((time.perf_counter() - t0) / block)
            if s in timed_compiles:
                timed_compiles[s] += df.metrics()["compiles"] - c0
    if df is not None:
        m = df.metrics()
        out["deferfuse_compiles_after_warmup"] = m["compiles"]
        out["compiles_after_warmup"] = timed_compiles
        out["cpu_fallbacks"] = dict(m["cpu_fallbacks"])
    out["times_s"] = times
    out["us_per_op"] = {s: statistics.median(v) for s, v in extras.items() if v}
    out["check"] = {s: built[s].check() for s in live if s != "floor"}    # floor computes nothing
    out["info"] = built[live[0]].info if live else {}
    return out


def _jax_drain():
    """A hand-written JAX step reads its loss (float()), which waits for the whole program."""


def _scope(df, s: str):
    """The block a deferfuse system's steps run in: its mode, and for a variant of defer
    (run.DEFER_VARIANTS, given as environment variables) the same settings as overrides."""
    if s == "compiled":
        return lambda: df.mode("defer")     # what a compiled step does not capture runs in defer
    if s == "compiled_fb":
        import workloads as W

        @contextlib.contextmanager
        def fb_scope():
            with df.mode("defer"), W.fb_config():
                yield
        return fb_scope
    if s not in R.DEFER_VARIANTS:
        return lambda: df.mode(s)
    from deferfuse.config import SETTINGS
    by_env = {st.env: st for st in SETTINGS.values()}
    kw = {by_env[k].name: by_env[k].parse(v) for k, v in R.DEFER_VARIANTS[s].items()}

    @contextlib.contextmanager
    def scope():
        with df.mode("defer"), df.override(**kw):
            yield
    return scope


# =========================================================================== parent
def summarize(res: dict) -> dict:
    """Per system: median ms; per other system: the paired ratios other/defer."""
    t = res["times_s"]
    c = {"median_ms": {s: statistics.median(v) * 1e3 for s, v in t.items()}, "paired": {}}
    if "defer" in t:
        for s, v in t.items():
            if s == "defer":
                continue
            r = [a / b for a, b in zip(v, t["defer"])]
            c["paired"][s] = dict(median=statistics.median(r), p25=R._pct(r, .25), p75=R._pct(r, .75),
                                  rounds=len(r), at_goal=sum(x >= GOAL for x in r) / len(r))
    ref = res["check"].get("eager")
    if ref is not None:
        # Relative, except near zero: after 48 steps a small model's loss is ~1e-5, where rounding
        # of a few ulps in any system is a large relative difference.
        c["check_diff"] = {s: abs(v - ref) / max(abs(ref), 1e-3)
                           for s, v in res["check"].items() if s != "eager"}
    return c


def render_md(meta: dict, results: dict) -> str:
    m = meta["machine"]
    others = [s for s in meta["systems"] if s != "defer"]
    L = ["# deferfuse paired benchmark: every system step for step in one process", "",
         f"- date: {m['date']}; {m['nproc']} CPUs ({m['cpu']}); load average "
         f"{', '.join(f'{x:.1f}' for x in m['loadavg_start'])} at start, "
         f"{', '.join(f'{x:.1f}' for x in m.get('loadavg_end', ()))} at end",
         "- versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v),
         f"- protocol: {'quick' if meta['quick'] else 'full'} sizes; one process per workload holds "
         f"every system; {meta['warmup']} warm-up steps each, then {meta['rounds']} rounds; in a "
         f"round each system runs {meta['block']} steps, timed together with a wait for all its "
         "queued work at the end (so none of it runs into another system's steps), order reversed "
         "every other round. Times are per step.",
         "- paired ratio: (other system's time per step) / (defer's, in the same round); median "
         f"[25th-75th percentile] over the rounds; > 1: defer is faster. 'at {GOAL}x': the share of "
         "rounds where defer was at least that much faster. check: the largest difference of a "
         "system's final number (loss, sum) from eager's, relative (absolute below 1e-3).", "",
         "| workload | " + " | ".join(f"{s} ms" for s in meta["systems"]) + " | "
         + " | ".join(f"{s} / defer (paired)" for s in others) + f" | rounds at {GOAL}x vs strict |"
         + " compile s in warm-up (defer, strict) | compiles after warm-up (defer, strict, compiled,"
         " compiled_fb) |"
         " check |",
         "|---|" + "---:|" * (len(meta["systems"]) + len(others) + 3) + "---|"]
    ratios = []
    for w in meta["workloads"]:
        r = results.get(w)
        if r is None or r["status"] != "ok":
            L.append(f"| {w} | ERROR: {(r or {}).get('error', 'not run')[:100]} |")
            continue
        c = summarize(r)
        cells = [R._ms(c["median_ms"].get(s)) if s in c["median_ms"] else
                 ("n/a" if s in r["na"] else "failed" if s in r.get("failed", {}) else "–")
                 for s in meta["systems"]]
        pr = []
        for s in others:
            p = c["paired"].get(s)
            pr.append(f"{p['median']:.2f}x [{p['p25']:.2f}-{p['p75']:.2f}]" if p else "–")
        st = c["paired"].get("strict")
        if st:
            ratios.append(st["median"])
        diffs = c.get("check_diff", {})
        worst = max(diffs.values()) if diffs else None
        chk = "–" if worst is None else (f"{worst:.0e}" if worst < 1e-3 else f"**{worst:.2g} DIFFERS**")
        share = "–" if not st else f"{st['at_goal'] * 100:.0f}%"
        wc = r.get("warmup_compiles", {})
        csec = ", ".join(f"{wc[x]['compile_s']:.1f}" if x in wc else "–" for x in ("defer", "strict"))
        ca = r.get("compiles_after_warmup")
        after = (", ".join(str(ca.get(x, "–")) for x in ("defer", "strict", "compiled", "compiled_fb"))
                 if ca is not None
                 else str(r.get("deferfuse_compiles_after_warmup", "–")))
        L.append(f"| {w} | " + " | ".join(cells + pr) + f" | {share} | {csec} | {after} | {chk} |")
    if ratios:
        g = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        L += ["", f"Geometric mean of the paired strict/defer medians: **{g:.2f}x**; "
              f"{sum(x >= GOAL for x in ratios)} of {len(ratios)} workloads at {GOAL}x or more."]
    for w in meta["workloads"]:
        r = results.get(w)
        p = summarize(r)["paired"].get("jax") if r and r["status"] == "ok" else None
        if p:
            L.append(f"- {w}: defer / hand-written jax.jit program, paired: **{1 / p['median']:.2f}x** "
                     f"[{1 / p['p75']:.2f}-{1 / p['p25']:.2f}] (1.0 would be the JAX ceiling)")
    for w in meta["workloads"]:
        r = results.get(w)
        p = summarize(r)["paired"] if r and r["status"] == "ok" else {}
        for s in ("compiled", "compiled_fb"):
            if p.get("jax") and p.get(s):
                L.append(f"- {w}: {s} / hand-written jax.jit program, paired: "
                         f"**{p[s]['median'] / p['jax']['median']:.2f}x**; {s} / defer "
                         f"{p[s]['median']:.2f}x")
    for w in meta["workloads"]:
        r = results.get(w)
        for s, why in ((r or {}).get("failed") or {}).items():
            L.append(f"- {w}: {s} failed: {why}")
    for w in meta["workloads"]:
        r = results.get(w)
        if r and r["status"] == "ok" and r.get("first_step_s"):
            L.append(f"- {w}: first step (compiles included): "
                     + ", ".join(f"{s} {v:.2f} s" for s, v in r["first_step_s"].items()))
    ops = {w: results[w].get("us_per_op") for w in results if results[w].get("us_per_op")}
    for w, u in ops.items():
        L.append(f"- {w}: recording / dispatch cost per op (loop only): "
                 + ", ".join(f"{s} {v:.1f} µs" for s, v in u.items()))
    return "\n".join(L) + "\n"


def _write_md(meta: dict, results: dict) -> None:
    md = render_md(meta, results)
    with open(os.path.join(R.RESULTS, "paired.md"), "w") as f:
        f.write(md)
    print()
    print(md)


def parent(a) -> int:
    import workloads as W
    workloads = a.workloads.split(",") if a.workloads else list(W.WORKLOADS)
    systems = a.systems.split(",")
    for s in systems:
        if s not in SYSTEMS:
            sys.exit(f"unknown system {s!r}; paired runs take {', '.join(SYSTEMS)}")
    for w in workloads:
        if w not in W.WORKLOADS:
            sys.exit(f"unknown workload {w!r}; known: {', '.join(W.WORKLOADS)}")
    rounds = a.rounds or 10
    warmup = a.warmup or 3
    os.makedirs(R.RESULTS, exist_ok=True)
    machine = R.machine_info()
    t_start = time.time()
    print(f"paired bench: {machine['date']}, load {machine['loadavg_start'][0]:.1f}; systems "
          f"{', '.join(systems)}; {rounds} rounds", flush=True)
    results = {}
    tmp = tempfile.mkdtemp(prefix="deferfuse-paired-")
    try:
        for w in workloads:
            t0 = time.time()
            env = {"DEFERFUSE_CACHE_DIR": os.path.join(tmp, w, "deferfuse"),
                   "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, w, "inductor"),
                   "PYTHONWARNINGS": "ignore"}
            args = ["--cell", w, "--systems", ",".join(systems), "--rounds", str(rounds),
                    "--warmup", str(warmup), "--block", str(a.block)] + (["--quick"] if a.quick else [])
            res, why = R._spawn(args, a.timeout or (600 if a.quick else 1800), env, tmp,
                                script=os.path.abspath(__file__))
            if res is None:
                res = dict(workload=w, status="error", error=why.partition("\n")[0])
            results[w] = res
            line = f"{w:<20}"
            if res["status"] == "ok":
                c = summarize(res)
                line += "  ".join(f"{s} {v:.2f} ms" for s, v in c["median_ms"].items())
                if "strict" in c["paired"]:
                    line += f"  strict/defer {c['paired']['strict']['median']:.2f}x"
            else:
                line += f"ERROR: {res.get('error', '')[:120]}"
            print(line + f"  ({time.time() - t0:.0f} s)", flush=True)
    finally:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    machine["loadavg_end"] = os.getloadavg()
    meta = dict(machine=machine, quick=a.quick, rounds=rounds, block=a.block, warmup=warmup, systems=systems,
                workloads=workloads, wall_s=time.time() - t_start, argv=sys.argv[1:])
    with open(os.path.join(R.RESULTS, "paired.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1, default=str)
    _write_md(meta, results)
    print(f"wrote {os.path.relpath(R.RESULTS)}/paired.json, paired.md in {time.time() - t_start:.0f} s")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes (as run.py --quick)")
    p.add_argument("--workloads", help="comma-separated subset of workloads")
    p.add_argument("--systems", default="eager,strict,defer",
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default eager,strict,defer)")
    p.add_argument("--rounds", type=int, help="timed rounds (default 10)")
    p.add_argument("--warmup", type=int, help="warm-up steps per system (default 3)")
    p.add_argument("--block", type=int, default=10,
                   help="steps per system per round, timed together with a full wait at the end "
                        "(default 10)")
    p.add_argument("--timeout", type=float, help="seconds per workload (default 1800, quick 600)")
    p.add_argument("--results", default=R.RESULTS, help="folder for paired.json / paired.md")
    p.add_argument("--rerender", action="store_true", help="only rewrite paired.md from paired.json")
    p.add_argument("--cell", help=argparse.SUPPRESS)
    p.add_argument("--cell-out", help=argparse.SUPPRESS)
    a = p.parse_args()
    R.RESULTS = os.path.abspath(a.results)
    if a.cell:
        child(a)
        return 0
    if a.rerender:
        with open(os.path.join(R.RESULTS, "paired.json")) as f:
            d = json.load(f)
        _write_md(d["meta"], d["results"])
        return 0
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())
