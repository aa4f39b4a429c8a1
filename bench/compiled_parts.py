"""Where a steady compiled training step's time goes (issue 34: compiled mode at the hand-written
``jax.jit`` step's speed), for ``mlp_train`` and ``gpt_train`` (``bench/workloads.py``) with the
whole step under ``torch.compile(backend="tpu")`` as the paired bench's ``compiled`` system runs
it (zero_grad, forward and loss, ``backward()``, AdamW's step, ``loss.item()``).

A step is a timeline of events, each stamped with ``time.perf_counter`` (``--clock thread``:
``time.thread_time``, the Python thread's CPU time, which a loaded machine moves far less) by a
wrapper around the function that starts or ends it; a part is the time between two events, its
figure the median over the steps:

- ``to forward graph``: Dynamo's frame entry and guards, ``zero_grad``, AOTAutograd's forward
  wrappers (the autograd Function's ``apply``) until our forward graph is called;
- ``forward graph (ours)``, ``backward graph (ours)``, ``optimizer graph (ours)``: deferfuse's
  call of each graph (``PlainGraph.__call__``: argument conversion, the entry lookup, the node
  recorded into the pending trace, the outputs made);
- ``forward graph -> backward()``: AOTAutograd's forward post-wrappers, Dynamo's graph break at
  ``backward()``, ``Tensor.backward`` with deferfuse's backward hook (NOTE [backward cut]);
- ``autograd engine -> backward graph`` and ``backward graph -> engine done``: the autograd
  engine and AOTAutograd's backward wrappers around the backward graph, gradient accumulation;
- ``backward() -> optimizer graph``: the resumed frame's guards, the optimizer's Python wrappers
  (``Optimizer.step``'s hooks, ``_use_grad``), the compiled update's frame and AOTAutograd's
  inference wrapper; ``optimizer graph -> step returns``: their way back;
- ``item -> flush``: ``.item()``'s dispatch to the sync; ``flush (host)``: the runner before the
  program's call (the trace taken, the structure's cache hit, buffers bound, donation);
  ``executable call``: ``execute.run_region`` (the XLA executable's call; on this CPU a call runs
  part of the program before it returns); ``wait``: reading the index-check flags, which waits
  for the program; ``sync -> step end``: the loss read back and the rest.

The system ``compiled_fb`` is the same step in docs/compiled.md's two-function form
(``workloads._two_functions``: forward and backward one compiled function under
``trace_autograd_ops``, the optimizer step compiled apart), with its own parts (``PARTS_FB``):
``to forward-backward graph`` (``zero_grad``, Dynamo's frame and guards, AOTAutograd's wrappers),
``forward-backward graph (ours)``, ``forward-backward graph -> optimizer graph`` (AOTAutograd's
post-wrappers, the frame's return, ``Optimizer.step``'s wrappers and ``_use_grad``'s frames, the
update's frame and guards), then the optimizer graph and the sync as above. Both of its graphs are
AOTAutograd inference graphs (the returned loss is detached): the first a step is the
forward-backward one.

With them: regions (programs) run a step, graph calls, ops recorded; the compiled step's program
and the hand-written ``jax.jit`` step's alone (``programs_alone``); and the hand-written
``jax.jit`` step and the defer step timed in the same process, rounds alternated, each system's
wall time, process CPU time (the host and XLA's threads) and Python thread CPU time a step.
Run: ``python bench/compiled_parts.py [--workloads mlp_train,gpt_train --steps 20 --rounds 6
--clock wall|thread]``.
The machine's load (``os.getloadavg``) is printed with the figures: it is shared and noisy.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import torch  # noqa: E402

import deferfuse  # noqa: E402
import workloads as W  # noqa: E402
from deferfuse import compiled as C  # noqa: E402
from deferfuse.engine import engine  # noqa: E402
from deferfuse.runtime import execute, flush  # noqa: E402
from deferfuse.runtime import checks as CH  # noqa: E402

# (part name, event it starts at, event it ends at)
PARTS = [
    ("to forward graph", "start", "fwd<"),
    ("forward graph (ours)", "fwd<", "fwd>"),
    ("forward graph -> backward()", "fwd>", "eng<"),
    ("autograd engine -> backward graph", "eng<", "bwd<"),
    ("backward graph (ours)", "bwd<", "bwd>"),
    ("backward graph -> engine done", "bwd>", "eng>"),
    ("backward() -> optimizer graph", "eng>", "inf<"),
    ("optimizer graph (ours)", "inf<", "inf>"),
    ("optimizer graph -> step returns", "inf>", "ret"),
    ("item -> flush", "ret", "sync<"),
    ("flush (host)", "sync<", "run<"),
    ("executable call", "run<", "run>"),
    ("flush after the call", "run>", "wait<"),
    ("wait (index-check flags)", "wait<", "wait>"),
    ("sync -> step end", "wait>", "end"),
]
SYSTEMS = ("compiled", "compiled_fb")      # the compiled forms measured
# the two-function form (system compiled_fb): "fb" is the step's first graph call, "inf" its second
PARTS_FB = [
    ("to forward-backward graph", "start", "fb<"),
    ("forward-backward graph (ours)", "fb<", "fb>"),
    ("forward-backward graph -> optimizer graph", "fb>", "inf<"),
] + PARTS[7:]


class Timeline:
    """Event stamps of the current step; the first stamp of each event in a step counts."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.on = False
        self.ev: dict = {}
        self.steps: dict = collections.defaultdict(list)     # system -> its steps' events
        self.form = None

    def mark(self, name):
        if self.on and name not in self.ev:
            self.ev[name] = self.clock()

    def stamped(self, fn, tag):
        """``fn`` with ``tag<`` stamped on entry and ``tag>`` on exit."""
        def wrapped(*a, **k):
            self.mark(tag + "<")
            try:
                return fn(*a, **k)
            finally:
                self.mark(tag + ">")
        return wrapped

    def install(self):
        tl = self
        kind_ev = {"forward": "fwd", "backward": "bwd", "inference": "inf"}
        graph_call = C.PlainGraph.__call__

        def call(self_, *args):
            k = kind_ev.get(self_.kind, "g")
            if tl.form == "fb":
                k = "fb" if "fb<" not in tl.ev else "inf"
            tl.mark(k + "<")
            try:
                return graph_call(self_, *args)
            finally:
                tl.mark(k + ">")
        C.PlainGraph.__call__ = call
        torch.autograd._engine_run_backward = tl.stamped(torch.autograd._engine_run_backward, "eng")
        sync = engine.sync

        def sync_(*a, **k):
            tl.mark("sync<")
            return sync(*a, **k)
        engine.sync = sync_
        execute.run_region = tl.stamped(execute.run_region, "run")
        check = CH.CheckList.check

        def check_(self_, rec):
            if rec.flags and not rec.done:
                tl.mark("wait<")
                try:
                    return check(self_, rec)
                finally:
                    tl.mark("wait>")
            return check(self_, rec)
        CH.CheckList.check = check_
        assert flush.execute is execute

    def step(self, fn, system="compiled"):
        self.form = "fb" if system == "compiled_fb" else None
        self.ev = {}
        self.on = True
        self.ev["start"] = self.clock()
        loss = fn()
        self.mark("ret")
        loss.item()
        self.ev["end"] = self.clock()
        self.on = False
        self.steps[system].append(self.ev)


def parts(steps, table=PARTS) -> dict:
    out = {}
    for name, a, b in table:
        d = [s[b] - s[a] for s in steps if a in s and b in s]
        out[name] = statistics.median(d) * 1e3 if d else None
    out["whole step"] = statistics.median([s["end"] - s["start"] for s in steps]) * 1e3
    return out


def counters():
    m = deferfuse.metrics()
    return {k: m.get(k, 0) for k in ("regions_run", "compiled_calls", "ops_recorded",
                                     "needed_first_splits", "graph_compiles", "compiles")}


# NOTE: every build of a workload compiles ``Optimizer.step``'s frames again for its own optimizer
# (Dynamo guards on the instance), and ``_train_built``'s step closure is one code object for
# every model: past Dynamo's ``cache_size_limit`` (8 a frame) a frame runs eagerly, unsaid. Each
# measuring function starts from ``torch._dynamo.reset()``, so the builds of an earlier workload
# or function do not count against its own.


def measure(w: str, steps: int, rounds: int, tl: Timeline) -> dict:
    tl.steps.clear()
    torch._dynamo.reset()       # (see ``fresh``)
    jb = getattr(W, w + "_jax")(True)
    with deferfuse.mode("defer"):
        cb = getattr(W, w)(W.Ctx("compiled"), True)
        with W.fb_config():
            fbb = getattr(W, w)(W.Ctx("compiled_fb"), True)
        db = getattr(W, w)(W.Ctx("defer"), True)
        fns = {"compiled": cb.train_step, "compiled_fb": fbb.train_step}
        for _ in range(4):
            cb.step()
            with W.fb_config():
                fbb.step()
            db.step()
            jb.step()
        deferfuse.sync()
        torch.tpu.synchronize()
        c0 = counters()
        whole = collections.defaultdict(list)
        cpu = collections.defaultdict(list)     # (process, thread) CPU ms a step
        loads = []
        for r in range(rounds):
            order = ("compiled", "compiled_fb", "defer", "jax")
            loads.append(os.getloadavg()[0])
            for s in (order if r % 2 == 0 else order[::-1]):
                scope = W.fb_config() if s == "compiled_fb" else contextlib.nullcontext()
                with scope:
                    t0, p0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
                    for _ in range(steps):
                        if s in fns:
                            tl.step(fns[s], s)
                        elif s == "defer":
                            db.step()
                        else:
                            jb.step()
                    deferfuse.sync()
                    torch.tpu.synchronize()
                    whole[s].append((time.perf_counter() - t0) / steps * 1e3)
                    cpu[s].append(((time.process_time() - p0) / steps * 1e3,
                                   (time.thread_time() - h0) / steps * 1e3))
        c1 = counters()
    n = rounds * steps
    per = {k: (c1[k] - c0[k]) / n for k in c0 if k in ("regions_run", "compiled_calls",
                                                       "ops_recorded", "needed_first_splits")}
    # (the defer steps' regions, ops and calls are among the counters: compiled's own come from
    # a separate count below)
    return dict(parts=parts(tl.steps["compiled"]),
                parts_fb=parts(tl.steps["compiled_fb"], PARTS_FB),
                whole={s: statistics.median(v) for s, v in whole.items()},
                cpu={s: tuple(statistics.median(c[k] for c in v) for k in (0, 1))
                     for s, v in cpu.items()},
                ratio={s: statistics.median([c / j for c, j in zip(whole[s], whole["jax"])])
                       for s in fns},
                counters=per, compiles_after_warmup=c1["compiles"] - c0["compiles"],
                graph_compiles_after_warmup=c1["graph_compiles"] - c0["graph_compiles"],
                load=(min(loads), max(loads)))


def programs_alone(w: str, calls: int) -> tuple:
    """(ours, jax's) ms: the compiled step's program (its executable called on copies of a
    step's inputs, as ``bench/wlm_step.py`` calls a region's, with the scalar packing its run
    used) and the hand-written ``jax.jit`` step (its ``train_step``, the loss waited for), each
    call timed with its wait, alternated; medians."""
    torch._dynamo.reset()       # (see ``fresh``)
    captured = []
    run_region = execute.run_region

    def capture(compiled, don, keep, scalars, device=0, debug=False, pack=execute.pack_scalars):
        captured[:] = [(compiled, [jax.numpy.copy(a) for a in don],
                        [jax.numpy.copy(a) for a in keep], list(scalars), pack)]
        return run_region(compiled, don, keep, scalars, device, debug, pack)

    def call(prog):
        compiled, don, keep, scalars, pack = prog
        don = [jax.numpy.copy(a) for a in don]     # donated: a fresh copy per call
        jax.block_until_ready(don)
        t0 = time.perf_counter()
        with execute.x64(True):
            res = compiled(don, keep, pack(scalars))
        jax.block_until_ready(res)
        return time.perf_counter() - t0
    jb = getattr(W, w + "_jax")(True)
    with deferfuse.mode("defer"):
        cb = getattr(W, w)(W.Ctx("compiled"), True)
        for _ in range(3):
            cb.step()
            jb.step()
        execute.run_region = capture
        try:
            cb.step()
        finally:
            execute.run_region = run_region
    assert len(captured) == 1, "a compiled step ran more than one program"
    ours, theirs = [], []
    for _ in range(calls):
        ours.append(call(captured[0]))
        t0 = time.perf_counter()
        jax.block_until_ready(jb.train_step())
        theirs.append(time.perf_counter() - t0)
    return statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3


def compiled_counts(w: str, steps: int, system: str = "compiled") -> dict:
    """Programs, graph calls and ops recorded a compiled step, counted alone."""
    torch._dynamo.reset()       # (see ``fresh``)
    scope = W.fb_config() if system == "compiled_fb" else contextlib.nullcontext()
    with deferfuse.mode("defer"), scope:
        cb = getattr(W, w)(W.Ctx(system), True)
        for _ in range(3):
            cb.step()
        deferfuse.sync()
        c0 = counters()
        for _ in range(steps):
            cb.step()
        deferfuse.sync()
        c1 = counters()
    return {k: (c1[k] - c0[k]) / steps for k in c0}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="mlp_train,gpt_train")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="what stamps the parts: wall time, or the Python thread's CPU time")
    a = p.parse_args()
    tl = Timeline(time.perf_counter if a.clock == "wall" else time.thread_time)
    tl.install()
    for w in a.workloads.split(","):
        counts = {s: compiled_counts(w, a.steps, s) for s in SYSTEMS}
        progs = programs_alone(w, a.steps * a.rounds)
        r = measure(w, a.steps, a.rounds, tl)
        lo, hi = r["load"]
        print(f"\n## {w} (quick sizes; load {lo:.1f}-{hi:.1f} on {os.cpu_count()} CPUs)\n")
        print(", ".join(f"{s} {r['whole'][s]:.2f} ms" for s in SYSTEMS + ("defer", "jax"))
              + f" a step (medians of {a.rounds} rounds of {a.steps} steps, alternated); / jax "
              "paired: " + ", ".join(f"{s} **{r['ratio'][s]:.2f}x**" for s in SYSTEMS))
        print("CPU ms a step, process / Python thread: " + ", ".join(
            f"{s} {r['cpu'][s][0]:.2f} / {r['cpu'][s][1]:.2f}" for s in SYSTEMS + ("defer", "jax")))
        for s in SYSTEMS:
            c = counts[s]
            print(f"a {s} step: {c['regions_run']:g} programs, {c['compiled_calls']:g} graph "
                  f"calls, {c['ops_recorded']:g} ops recorded, {c['needed_first_splits']:g} "
                  "needed-first splits")
        print(f"after warm-up (all systems): {r['compiles_after_warmup']} compiles, "
              f"{r['graph_compiles_after_warmup']} graph compiles")
        print(f"programs alone (executable and wait, alternated): the compiled step's "
              f"{progs[0]:.2f} ms, the jax.jit step's {progs[1]:.2f} ms\n")
        for s, table, key in (("compiled", PARTS, "parts"), ("compiled_fb", PARTS_FB, "parts_fb")):
            print(f"| part of a {s} step | ms (median, {a.clock} clock) |")
            print("|---|---:|")
            tot = 0.0
            for name, _, _ in table:
                v = r[key][name]
                tot += v or 0.0
                print(f"| {name} | {'–' if v is None else f'{v:.3f}'} |")
            print(f"| sum of the parts | {tot:.3f} |")
            print(f"| whole step (timed alone) | {r[key]['whole step']:.3f} |\n")

if __name__ == "__main__":
    main()
