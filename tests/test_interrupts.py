"""A KeyboardInterrupt raised by a signal handler at a random point of training leaves every tensor
with a value training can go on from as on CPU, is raised in the user's frame (never dropped by
Python as "Exception ignored"), and never aborts the process (NOTE [interrupt safety] in
runtime/interrupts.py). Each run is a process of its own: signal handlers are process state,
and pytest's own hooks would see what the test checks."""
import ast
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import copy, random, signal, sys
    import torch, torch.nn as nn
    import deferfuse

    mode, bursts, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    fired = 0

    def on_alarm(signum, frame):
        global fired
        fired += 1
        raise KeyboardInterrupt

    signal.signal(signal.SIGALRM, on_alarm)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model = copy.deepcopy(ref).to("tpu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    xt, yt = x.to("tpu"), y.to("tpu")
    caught = 0
    with deferfuse.mode(mode):
        def step(m, o, a, b):
            loss = (m(a) - b).square().mean()
            loss.backward()
            o.step()
            o.zero_grad()
            return loss.item()
        step(model, opt, xt, yt)    # the optimizer's state exists (PyTorch makes it in Python)
        for _ in range(bursts):
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0005, 0.02))
                for _ in range(20):
                    step(model, opt, xt, yt)
                signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                caught += 1
                # torch.optim restores grad mode in a finally that an interrupt can skip (as on
                # CPU): not what this test is about.
                torch.set_grad_enabled(True)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        opt.zero_grad()
        # Go on from the state the interrupts left, on tpu and on CPU.
        ref.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        sd = opt.state_dict()
        ref_opt.load_state_dict({"state": {k: {n: t.cpu().clone() for n, t in s.items()}
                                           for k, s in sd["state"].items()},
                                 "param_groups": sd["param_groups"]})
        got = [step(model, opt, xt, yt) for _ in range(5)]
        want = [step(ref, ref_opt, x, y) for _ in range(5)]
    print("RESULT", fired, caught, got, want)
""")


_ABORT = "terminate called without an active exception"


def _run(mode, bursts, seed, abort_retries=0):
    env = dict(os.environ, TORCHTPU_MODE=mode)
    p = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(bursts), str(seed)],
                       capture_output=True, text=True, timeout=600, env=env)
    if p.returncode in (-6, 134) and _ABORT in p.stderr and abort_retries:
        # The abort NOTE [interrupt safety] leaves to PyTorch (about one run in twenty of this
        # size): a run of another seed must then be clean. Anything else fails at once.
        return _run(mode, bursts, seed + 1000, abort_retries - 1)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stderr[-3000:]}"
    assert "Exception ignored" not in p.stderr, p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT"))
    fired, caught, got, want = _parse(line)
    assert fired >= bursts // 2, (fired, bursts)       # the interrupts did land in the steps
    assert caught == fired, (fired, caught)            # each raised in the user's frame
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)


def _parse(line):
    """``RESULT fired caught [losses] [CPU's losses]``."""
    parts = line.split(" ", 3)
    fired, caught = int(parts[1]), int(parts[2])
    got, want = ast.literal_eval("(" + parts[3].replace("] [", "], [") + ")")
    return fired, caught, got, want


@pytest.mark.modes("defer")
def test_timed_keyboard_interrupts_in_training_lose_nothing():
    _run("defer", 25, 1, abort_retries=1)


# NOTE [interrupt safety]: a handler that runs in Python code PyTorch calls from C++ in the middle
# of an op still aborts now and then (measured: 1 run in 6 of 100 interrupts in defer mode, 2 in 8
# of 40 in strict mode).
_ABORTS = pytest.mark.xfail(reason="an interrupt in Python code PyTorch calls from C++ mid-op can "
                                   "leave an error pending for its noexcept device guard (NOTE "
                                   "[interrupt safety])", strict=False)


@pytest.mark.slow
@_ABORTS
@pytest.mark.modes("defer")
@pytest.mark.parametrize("mode,seed", [("defer", 2), ("defer", 3), ("strict", 4)])
def test_a_hundred_timed_keyboard_interrupts_in_training_lose_nothing(mode, seed):
    _run(mode, 100, seed)
