"""µs per op on the host, side by side in one process (issue 34; docs/cxx-plan.md):

- ``cpu``: CPU eager PyTorch;
- ``defer``: the op path's ``TpuTensor`` made directly (``from_cpu``: the removed wrapper subclass's
  path, the C record path), defer mode;
- ``wrapper_floor``: a wrapper subclass whose ``__torch_dispatch__`` only makes its output
  (``bench/workloads.FloorTensor``: PyTorch's own cost of reaching Python), ``x + y`` and
  ``y * 1.0001`` only;
- ``plain``: the plain PrivateUse1 tensor, every op through the boxed
  C++ fallback and the Python router into the same op path, defer mode;
- ``plain_kernel``: the plain tensor with the C++ recording kernel (NOTE [C++ recording kernel] in
  deferfuse/_tpu_tensor.cpp): a cache hit keyed and recorded from C++, the node made by the C
  record path, outputs built in C++; misses, in-place ops and the rest through the router;
- ``plain_floor``: the plain tensor with the C++ fallback building outputs from cached metadata and
  calling no Python (NOTE [floor cache] in deferfuse/_tpu_tensor.cpp): the floor a C++ recording
  kernel starts from (it records nothing).

Recording time only: each block of ops is timed, and the trace is synced after the timer stops.
Rounds alternate the systems' order; the ratio to ``cpu`` is taken within each round and the
median reported. Run: ``python bench/cxx_floor.py``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import deferfuse  # noqa: E402
from deferfuse import plain  # noqa: E402
from deferfuse.dispatch import from_cpu  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from workloads import FloorTensor  # noqa: E402

EXT = plain.PLAIN.ext
SYSTEMS = ("cpu", "defer", "wrapper_floor", "plain", "plain_kernel", "plain_floor")


def maker(system):
    if system == "cpu":
        return lambda t: t.clone()
    if system == "defer":
        return lambda t: from_cpu(t)
    if system == "wrapper_floor":
        return lambda t: FloorTensor(t.shape)
    return lambda t: t.to("tpu")


def add_block(x, y, n):
    for _ in range(n):
        x + y


def mul_block(x, y, n):
    for _ in range(n):
        y * 1.0001


class MLP:
    """A small MLP training step, functional: 2 linear layers, ReLU, MSE, backward, SGD."""

    def __init__(self, make):
        g = torch.Generator().manual_seed(0)
        self.ws = [make(torch.randn(32, 64, generator=g) * 0.1).requires_grad_(),
                   make(torch.zeros(64)).requires_grad_(),
                   make(torch.randn(64, 8, generator=g) * 0.1).requires_grad_(),
                   make(torch.zeros(8)).requires_grad_()]
        self.x = make(torch.randn(16, 32, generator=g))
        self.y = make(torch.randn(16, 8, generator=g))

    def step(self):
        w1, b1, w2, b2 = self.ws
        loss = F.mse_loss(torch.relu(self.x @ w1 + b1) @ w2 + b2, self.y)
        loss.backward()
        with torch.no_grad():
            for w in self.ws:
                w.sub_(w.grad * 0.01)
                w.grad = None
        return loss


def mlp_block(m, _, n):
    for _ in range(n):
        m.step()


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def mlp_ops() -> int:
    """aten ops in one MLP step on CPU (the per-op divisor)."""
    m = MLP(maker("cpu"))
    m.step()
    with Count() as c:
        m.step()
    return c.n


def run(rounds: int, n: int, mlp_steps: int):
    cases = {"x + y": (add_block, n, 1), "y * 1.0001": (mul_block, n, 1),
             "mlp step": (mlp_block, mlp_steps, mlp_ops())}
    out = {}
    for case, (block, reps, ops) in cases.items():
        systems = [s for s in SYSTEMS if not (s == "wrapper_floor" and block is mlp_block)]
        state = {}
        for s in systems:
            mk = maker(s)
            if block is mlp_block:
                state[s] = (MLP(mk), None)
            else:
                a, b = torch.randn(64, 64), torch.randn(64, 64)
                state[s] = (mk(a), mk(b))
        times = {s: [] for s in systems}
        ratios = {s: [] for s in systems}

        def one(s, reps):
            EXT.set_floor(s == "plain_floor")
            EXT.set_kernel(s == "plain_kernel")
            try:
                t0 = time.perf_counter()
                block(*state[s], reps)
                dt = time.perf_counter() - t0
            finally:
                EXT.set_floor(False)
                EXT.set_kernel(False)
            if s in ("defer", "plain", "plain_kernel"):
                deferfuse.sync()
            return dt

        for s in systems:      # warm-up: compiles (blocks as long as the timed ones), caches,
            for _ in range(3):  # the floor cache filled
                one(s, reps)
        for r in range(rounds):
            order = systems if r % 2 == 0 else systems[::-1]
            got = {s: one(s, reps) / (reps * ops) * 1e6 for s in order}
            for s in systems:
                times[s].append(got[s])
                ratios[s].append(got[s] / got["cpu"])
        out[case] = {"ops_per_unit": ops,
                     "us_per_op": {s: statistics.median(v) for s, v in times.items()},
                     "spread": {s: [min(v), max(v)] for s, v in times.items()},
                     "ratio_to_cpu": {s: statistics.median(v) for s, v in ratios.items()}}
    out["floor_cache"] = dict(zip(("hits", "misses", "entries"), EXT.floor_stats()))
    out["kernel"] = dict(EXT.kernel_stats())
    return out


def check():
    """The plain tensor's results equal CPU's, through the router and through the C++ kernel
    (the floor computes nothing)."""
    for kernel in (False, True):
        EXT.set_kernel(kernel)
        a, b = torch.randn(8, 8), torch.randn(8, 8)
        x, y = a.to("tpu"), b.to("tpu")
        for _ in range(3):
            torch.testing.assert_close((x + y).cpu(), a + b)
            torch.testing.assert_close((y * 1.0001).cpu(), b * 1.0001)
        m_cpu, m_tpu = MLP(maker("cpu")), MLP(maker("plain"))
        for _ in range(3):
            torch.testing.assert_close(m_tpu.step().detach().cpu(), m_cpu.step().detach())
    EXT.set_kernel(False)


def markdown(res, meta) -> str:
    lines = [f"# µs per op, plain PrivateUse1 tensor vs today ({meta['date']})", "",
             f"{meta['machine']}; torch {meta['torch']}; load average before the run "
             f"{meta['load_before']}, after {meta['load_after']} (the machine is shared by 5 "
             "engineers: figures drift, the within-round ratios are the steady figure). "
             f"{meta['rounds']} rounds; recording time only (each block synced after its timer). "
             "`bench/cxx_floor.py`.", "",
             "| case | " + " | ".join(SYSTEMS) + " |", "|---|" + "---:|" * len(SYSTEMS)]
    for case, r in res.items():
        if case in ("floor_cache", "kernel"):
            continue
        cells = [f"{r['us_per_op'][s]:.2f} ({r['ratio_to_cpu'][s]:.2f}x)" if s in r["us_per_op"]
                 else "—" for s in SYSTEMS]
        lines.append(f"| {case} (µs per op; x CPU) | " + " | ".join(cells) + " |")
    lines += ["", "Per op of the MLP step: its time divided by the aten ops CPU eager runs in it "
              f"({res['mlp step']['ops_per_unit']}). Spread (min, max µs per op over rounds):", ""]
    for case, r in res.items():
        if case not in ("floor_cache", "kernel"):
            lines.append(f"- {case}: " + ", ".join(f"{s} {a:.2f}-{b:.2f}"
                                                    for s, (a, b) in r["spread"].items()))
    lines += ["", f"Floor cache: {res['floor_cache']}.", f"C++ kernel: {res['kernel']}.", ""]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--ops", type=int, default=500)
    p.add_argument("--mlp-steps", type=int, default=10)
    p.add_argument("--out", default=None, help="write bench/results/<out>.{json,md}")
    a = p.parse_args()
    check()
    load_before = os.getloadavg()
    res = run(a.rounds, a.ops, a.mlp_steps)
    meta = {"date": datetime.date.today().isoformat(),
            "machine": f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})",
            "torch": torch.__version__, "rounds": a.rounds,
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()]}
    md = markdown(res, meta)
    print(md)
    if a.out:
        base = os.path.join(os.path.dirname(__file__), "results", a.out)
        with open(base + ".json", "w") as f:
            json.dump({"meta": meta, "results": res}, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
