"""Whether forward, backward and the AdamW step can be one Dynamo graph a step (issue 34), for the
quick ``mlp_train`` / ``gpt_train`` models of ``bench/workloads.py``, under ``trace_autograd_ops``.

Forms (``--form``):

- ``raw``: ``loss.backward()`` and AdamW's own update (``AdamW.step`` without ``_use_grad``'s two
  ``graph_break()``s and the profiling wrapper) in one compiled function, under ``no_grad``.
- ``functional``: ``loss.backward()`` and ``torch.optim.adamw.adamw`` over the parameters'
  ``.grad`` (the functional update: no ``Optimizer`` object for Dynamo to check) and states made
  as AdamW makes them, with
  ``capturable=True`` (the step counts on the device: with CPU step counts the compiled update
  fails in Dynamo's fake run of ``_foreach_addcdiv_``).

Printed: Dynamo's graph breaks, the values after 12 steps against CPU eager AdamW (losses,
parameters, dtypes and shapes, step counts), a step's graph calls, programs and ops recorded, and
the Python thread's CPU time and wall time a step against the two-function form (the paired
bench's ``compiled_fb``: ``workloads._two_functions``), rounds alternated in one process.
Run: ``python bench/compiled_one_graph.py [--workloads mlp_train,gpt_train] [--form functional]
[--steps 15 --rounds 4]``. The machine is shared: the load is printed with the figures.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# deferfuse before torch._dynamo: imported the other way round, the traced backward broke the
# graph at deferfuse's torch.autograd.grad wrapper (device.py), which Dynamo skips
import deferfuse  # noqa: E402,I001
import workloads as W  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.optim.adamw import adamw  # noqa: E402

RAW_STEP = torch.optim.AdamW.step.__wrapped__      # AdamW's update, without _use_grad


def build(w, dev):
    if w == "mlp_train":
        model, x, y, _ = W._mlp_make(W._mlp_cfg(True))

        def lf(m, x, y):
            return F.cross_entropy(m(x), y)
    else:
        model, x, y, _ = W._gpt_make(W._gpt_cfg(True))

        def lf(m, x, y):
            out = m(x)
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    model = model.to(dev)
    x, y = x.to(dev), y.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, (lambda: lf(model, x, y))


def raw(w, dev):
    """(model, {param: step count}, step) of the ``raw`` form; on CPU, eager (the reference)."""
    model, opt, loss_fn = build(w, dev)

    def whole():
        loss = loss_fn()
        loss.backward()
        with torch.no_grad():
            RAW_STEP(opt)
        return loss.detach()
    f = torch.compile(whole, backend="tpu") if dev != "cpu" else whole

    def step():
        opt.zero_grad(set_to_none=True)
        return f()
    return model, (lambda: [opt.state[p]["step"] for p in model.parameters()]), step


def functional(w, dev):
    model, _, loss_fn = build(w, dev)
    params = list(model.parameters())
    avgs = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
    sqs = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
    counts = [torch.tensor(0.0, device=dev) for _ in params]

    def whole():
        loss = loss_fn()
        loss.backward()
        with torch.no_grad():
            adamw(params, [p.grad for p in params], avgs, sqs, [], counts, foreach=True,
                  capturable=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3,
                  weight_decay=1e-2, eps=1e-8, maximize=False)
        return loss.detach()
    f = torch.compile(whole, backend="tpu")

    def step():
        for p in params:
            p.grad = None       # (zero_grad(set_to_none=True), outside the graph)
        return f()
    return model, (lambda: counts), step


def two(w, dev):
    _, opt, loss_fn = build(w, dev)
    return W._two_functions(loss_fn, opt)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="mlp_train,gpt_train")
    p.add_argument("--form", choices=("raw", "functional"), default="functional")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    form = raw if a.form == "raw" else functional
    with torch._dynamo.config.patch(trace_autograd_ops=True), deferfuse.mode("defer"):
        for w in a.workloads.split(","):
            torch._dynamo.reset()
            mc, cc, sc = raw(w, "cpu")
            mt, ct, st = form(w, "tpu")
            counters.clear()
            lc = [sc().item() for _ in range(12)]
            lt = [st().item() for _ in range(12)]
            print(f"\n## {w}, form {a.form}\n")
            print("graph breaks:", ", ".join(k.split("\n")[0] for k in counters["graph_break"])
                  or "none")
            dl = max(abs(x - y) for x, y in zip(lc, lt))
            dp = max((x.detach() - y.detach().cpu()).abs().max().item()
                     for x, y in zip(mc.parameters(), mt.parameters()))
            same = all(x.dtype == y.dtype and x.shape == y.shape
                       for x, y in zip(mc.parameters(), mt.parameters()))
            counts = [x.item() for x in cc()] == [y.item() for y in ct()]
            print(f"against CPU eager AdamW after 12 steps: max |loss| difference {dl:.2e}, "
                  f"parameters {dp:.2e}; dtypes and shapes equal: {same}; step counts equal: "
                  f"{counts} (on {sorted({y.device.type for y in ct()})})")
            m0 = deferfuse.metrics()
            st().item()
            m1 = deferfuse.metrics()
            print("a step: " + ", ".join(f"{k} {m1[k] - m0[k]}" for k in (
                "compiled_calls", "regions_run", "ops_recorded", "compiles")))
            one_step, two_step = form(w, "tpu")[2], two(w, "tpu")
            for _ in range(4):
                one_step().item()
                two_step().item()
            res = {"one": [], "two": []}
            c0, loads = deferfuse.metrics()["compiles"], []
            for r in range(a.rounds):
                loads.append(os.getloadavg()[0])
                order = (("one", one_step), ("two", two_step))
                for k, s in (order if r % 2 == 0 else order[::-1]):
                    t0, w0 = time.thread_time(), time.perf_counter()
                    for _ in range(a.steps):
                        s().item()
                    res[k].append(((time.thread_time() - t0) / a.steps * 1e3,
                                   (time.perf_counter() - w0) / a.steps * 1e3))
            c1 = deferfuse.metrics()["compiles"]
            print(f"load {min(loads):.1f}-{max(loads):.1f}; compiles after warm-up {c1 - c0}")
            for k, name in (("one", a.form), ("two", "two-function form")):
                print(f"  {name}: thread CPU {statistics.median(x[0] for x in res[k]):.3f} ms, "
                      f"wall {statistics.median(x[1] for x in res[k]):.3f} ms a step")
            print(f"  {a.form} / two-function form, thread CPU (median of the rounds' ratios): "
                  f"{statistics.median(x[0] / y[0] for x, y in zip(res['one'], res['two'])):.3f}")


if __name__ == "__main__":
    main()
