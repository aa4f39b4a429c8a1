"""Ops on moving windows (NOTE [C++ moving windows] in deferfuse/_tpu_tensor.cpp; docs/cxx-plan.md,
Session 4): µs per op, side by side in one process, rounds alternated, recording time only:

- ``cpu``: CPU eager PyTorch;
- ``defer``: the op path's ``TpuTensor`` made directly (``from_cpu``: the removed wrapper subclass's
  path, the C record path), defer mode;
- ``plain_router``: the plain tensor with the C++ kernel off (every op through the Python
  router: what a window's op cost before the kernel took windows, when it refused them);
- ``plain_kernel``: the plain tensor with the C++ recording kernel.

Cases: ``buf[i] = src * 0.5`` (a moving select written by ``copy_``, plus the ``mul``) and
``t[i:i + 3].sum(0)`` (a moving slice read), ``i`` cycling over 8 offsets. µs per aten op: the
block's time over the ops CPU eager runs in it. Run: ``python bench/cxx_kernel_windows.py``."""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import deferfuse  # noqa: E402
from deferfuse import plain  # noqa: E402
from deferfuse.dispatch import from_cpu  # noqa: E402

EXT = plain.PLAIN.ext
SYSTEMS = ("cpu", "defer", "plain_router", "plain_kernel")


def write_rows(buf, src, n):
    for k in range(n):
        buf[k % 8] = src * 0.5


def read_windows(t, _, n):
    for k in range(n):
        t[k % 8:k % 8 + 3].sum(0)


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def ops_of(block, a, b) -> int:
    with Count() as c:
        block(a.clone(), b.clone(), 8)
    return c.n / 8


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--ops", type=int, default=200)
    a = p.parse_args()
    load0 = os.getloadavg()
    res = {}
    for name, block in (("buf[i] = src * 0.5", write_rows), ("t[i:i + 3].sum(0)", read_windows)):
        ca, cb = torch.randn(16, 32), torch.randn(32)
        per = ops_of(block, ca, cb)
        state = {"cpu": (ca.clone(), cb), "defer": (from_cpu(ca), from_cpu(cb)),
                 "plain_router": (ca.to("tpu"), cb.to("tpu")),
                 "plain_kernel": (ca.to("tpu"), cb.to("tpu"))}

        def one(s):
            EXT.set_kernel(s == "plain_kernel")
            try:
                t0 = time.perf_counter()
                block(*state[s], a.ops)
                dt = time.perf_counter() - t0
            finally:
                EXT.set_kernel(True)
            if s != "cpu":
                deferfuse.sync()
            return dt / (a.ops * per) * 1e6

        for s in SYSTEMS:
            for _ in range(3):
                one(s)
        for s in SYSTEMS[1:]:       # the values equal CPU's
            torch.testing.assert_close(state[s][0].cpu(), state["cpu"][0])
        times = {s: [] for s in SYSTEMS}
        ratios = {s: [] for s in SYSTEMS}
        for r in range(a.rounds):
            order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
            got = {s: one(s) for s in order}
            for s in SYSTEMS:
                times[s].append(got[s])
                ratios[s].append(got[s] / got["cpu"])
        res[name] = (per, times, ratios)
    load1 = os.getloadavg()
    print(f"µs per aten op (x CPU eager, median of within-round ratios); {a.rounds} rounds of "
          f"{a.ops} iterations; load average before {load0[0]:.1f}, after {load1[0]:.1f}")
    print("| case | ops | " + " | ".join(SYSTEMS) + " |")
    print("|---|---:|" + "---:|" * len(SYSTEMS))
    for name, (per, times, ratios) in res.items():
        cells = [f"{statistics.median(times[s]):.2f} ({statistics.median(ratios[s]):.2f}x)"
                 for s in SYSTEMS]
        print(f"| `{name}` | {per:g} | " + " | ".join(cells) + " |")
    print(f"kernel: {dict(EXT.kernel_stats())}")


if __name__ == "__main__":
    main()
