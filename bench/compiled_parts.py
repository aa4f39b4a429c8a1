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


class Timeline:
    """Event stamps of the current step; the first stamp of each event in a step counts."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.on = False
        self.ev: dict = {}
        self.steps: list = []

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

    def step(self, fn):
        self.ev = {}
        self.on = True
        self.ev["start"] = self.clock()
        loss = fn()
        self.mark("ret")
        loss.item()
        self.ev["end"] = self.clock()
        self.on = False
        self.steps.append(self.ev)


def parts(steps) -> dict:
    out = {}
    for name, a, b in PARTS:
        d = [s[b] - s[a] for s in steps if a in s and b in s]
        out[name] = statistics.median(d) * 1e3 if d else None
    out["whole step"] = statistics.median([s["end"] - s["start"] for s in steps]) * 1e3
    return out


def counters():
    m = deferfuse.metrics()
    return {k: m.get(k, 0) for k in ("regions_run", "compiled_calls", "ops_recorded",
                                     "needed_first_splits", "graph_compiles", "compiles")}


def measure(w: str, steps: int, rounds: int, clock=time.perf_counter) -> dict:
    tl = Timeline(clock)
    tl.install()
    jb = getattr(W, w + "_jax")(True)
    with deferfuse.mode("defer"):
        cb = getattr(W, w)(W.Ctx("compiled"), True)
        db = getattr(W, w)(W.Ctx("defer"), True)
        fn = cb.train_step
        for _ in range(4):
            cb.step()
            db.step()
            jb.step()
        deferfuse.sync()
        torch.tpu.synchronize()
        c0 = counters()
        whole = collections.defaultdict(list)
        cpu = collections.defaultdict(list)     # (process, thread) CPU ms a step
        loads = []
        for r in range(rounds):
            order = ("compiled", "defer", "jax") if r % 2 == 0 else ("jax", "defer", "compiled")
            loads.append(os.getloadavg()[0])
            for s in order:
                t0, p0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
                for _ in range(steps):
                    if s == "compiled":
                        tl.step(fn)
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
    return dict(parts=parts(tl.steps), whole={s: statistics.median(v) for s, v in whole.items()},
                cpu={s: tuple(statistics.median(c[k] for c in v) for k in (0, 1))
                     for s, v in cpu.items()},
                ratio=statistics.median([c / j for c, j in zip(whole["compiled"], whole["jax"])]),
                counters=per, compiles_after_warmup=c1["compiles"] - c0["compiles"],
                graph_compiles_after_warmup=c1["graph_compiles"] - c0["graph_compiles"],
                load=(min(loads), max(loads)))


def programs_alone(w: str, calls: int) -> tuple:
    """(ours, jax's) ms: the compiled step's program (its executable called on copies of a
    step's inputs, as ``bench/wlm_step.py`` calls a region's) and the hand-written ``jax.jit``
    step (its ``train_step``, the loss waited for), each call timed with its wait, alternated;
    medians."""
    from wlm_step import call
    captured = []
    run_region = execute.run_region

    def capture(compiled, don, keep, scalars, device=0, debug=False):
        captured[:] = [(compiled, [jax.numpy.copy(a) for a in don],
                        [jax.numpy.copy(a) for a in keep], list(scalars))]
        return run_region(compiled, don, keep, scalars, device, debug)
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


def compiled_counts(w: str, steps: int) -> dict:
    """Programs, graph calls and ops recorded a compiled step, counted alone."""
    with deferfuse.mode("defer"):
        cb = getattr(W, w)(W.Ctx("compiled"), True)
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
    clock = time.perf_counter if a.clock == "wall" else time.thread_time
    for w in a.workloads.split(","):
        counts = compiled_counts(w, a.steps)
        progs = programs_alone(w, a.steps * a.rounds)
        r = measure(w, a.steps, a.rounds, clock)
        lo, hi = r["load"]
        print(f"\n## {w} (quick sizes; load {lo:.1f}-{hi:.1f} on {os.cpu_count()} CPUs)\n")
        print(f"compiled {r['whole']['compiled']:.2f} ms, defer {r['whole']['defer']:.2f} ms, "
              f"jax.jit {r['whole']['jax']:.2f} ms a step (medians of {a.rounds} rounds of "
              f"{a.steps} steps, alternated); compiled / jax paired **{r['ratio']:.2f}x**")
        print("CPU ms a step, process / Python thread: " + ", ".join(
            f"{s} {r['cpu'][s][0]:.2f} / {r['cpu'][s][1]:.2f}" for s in ("compiled", "defer", "jax")))
        print(f"a compiled step: {counts['regions_run']:g} programs, {counts['compiled_calls']:g} "
              f"graph calls, {counts['ops_recorded']:g} ops recorded, "
              f"{counts['needed_first_splits']:g} needed-first splits; after warm-up "
              f"{r['compiles_after_warmup']} compiles, {r['graph_compiles_after_warmup']} graph "
              "compiles")
        print(f"programs alone (executable and wait, alternated): the compiled step's "
              f"{progs[0]:.2f} ms, the jax.jit step's {progs[1]:.2f} ms\n")
        print(f"| part of a compiled step | ms (median, {a.clock} clock) |")
        print("|---|---:|")
        tot = 0.0
        for name, _, _ in PARTS:
            v = r["parts"][name]
            tot += v or 0.0
            print(f"| {name} | {'–' if v is None else f'{v:.3f}'} |")
        print(f"| sum of the parts | {tot:.3f} |")
        print(f"| whole step (timed alone) | {r['parts']['whole step']:.3f} |")


if __name__ == "__main__":
    main()
