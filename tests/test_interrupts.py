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
    # More targets than the model can fit: the loss stays far from zero, where Adam's steps
    # would follow rounding noise and CPU's and tpu's parameters part for no fault of either.
    x, y = torch.randn(256, 16), torch.randn(256, 4)
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
        perr = max((p.detach().cpu() - r.detach()).abs().max().item()
                   for p, r in zip(model.parameters(), ref.parameters()))
    print("RESULT", fired, caught, perr, got, want)
""")


_ABORT = "terminate called without an active exception"


def _run(mode, bursts, seed):
    env = dict(os.environ, TORCHTPU_MODE=mode)
    p = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(bursts), str(seed)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stderr[-3000:]}"
    assert _ABORT not in p.stderr and "Exception ignored" not in p.stderr, p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT"))
    fired, caught, perr, got, want = _parse(line)
    assert fired >= bursts // 2, (fired, bursts)       # the interrupts did land in the steps
    assert caught == fired, (fired, caught)            # each raised in the user's frame
    assert min(want) > 0.1, want                       # a loss far from zero: a real comparison
    assert got == pytest.approx(want, rel=1e-5)
    assert perr <= 1e-5, perr                          # the parameters after 5 steps, vs CPU's


def _parse(line):
    """``RESULT fired caught param_error [losses] [CPU's losses]``."""
    parts = line.split(" ", 4)
    fired, caught, perr = int(parts[1]), int(parts[2]), float(parts[3])
    got, want = ast.literal_eval("(" + parts[4].replace("] [", "], [") + ")")
    return fired, caught, perr, got, want


@pytest.mark.modes("defer")
@pytest.mark.parametrize("mode,seed", [("defer", 1),
                                       pytest.param("strict", 1, marks=pytest.mark.slow)])
def test_timed_keyboard_interrupts_in_training_lose_nothing(mode, seed):
    _run(mode, 25, seed)


# NOTE [interrupt safety]: before handlers ran from a pending call, about 1 run in 6 of these
# aborted ("terminate called without an active exception").
@pytest.mark.slow
@pytest.mark.modes("defer")
@pytest.mark.parametrize("mode,seed", [("defer", 2), ("defer", 3), ("strict", 4), ("strict", 5)])
def test_a_hundred_timed_keyboard_interrupts_in_training_lose_nothing(mode, seed):
    _run(mode, 100, seed)


def test_getsignal_returns_the_users_handler_and_the_handler_is_still_held():
    """``signal.getsignal`` and ``signal.signal`` return the handler the user installed (or
    Python's default), not deferfuse's wrapper, so ``getsignal(SIGINT) is default_int_handler``
    holds as on CPU (asyncio.run then installs its own SIGINT handler); a handler set through
    ``signal.signal`` is held at once while deferfuse works (NOTE [interrupt safety])."""
    import asyncio
    import signal
    import torch
    import deferfuse  # noqa: F401
    from deferfuse.engine import engine
    held = engine.interrupts
    calls = []

    def handler(signum, frame):
        calls.append(signum)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, handler)
    try:
        assert getattr(old, "__deferfuse_held__", None) is None
        assert signal.getsignal(signal.SIGALRM) is handler
        assert signal.signal(signal.SIGALRM, handler) is handler
        (torch.ones(3, device="tpu") * 2).cpu()     # a sync installs again: nothing changes
        assert signal.getsignal(signal.SIGALRM) is handler
        # What Python runs is the wrapper: inside deferfuse the signal waits for the exit.
        with pytest.raises(KeyboardInterrupt):
            with held:
                signal.raise_signal(signal.SIGALRM)
                assert calls == []
        assert calls == [signal.SIGALRM]
    finally:
        signal.signal(signal.SIGALRM, old)
    assert signal.getsignal(signal.SIGALRM) is old

    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

        async def inside():
            return signal.getsignal(signal.SIGINT)
        h = asyncio.run(inside())
        assert h is not signal.default_int_handler and "_on_sigint" in repr(h)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, prev)


@pytest.mark.modes("defer")
def test_a_handler_set_behind_signal_signal_is_held_from_the_next_sync():
    """A handler set without ``signal.signal``'s wrapper (the C ``_signal.signal``, as a module
    that bound ``signal.signal`` before deferfuse was imported calls it) is held from the next
    sync on, and so is another one set after it: the sync's install looks again whenever the
    handlers changed since it last wrapped them (NOTE [interrupt safety])."""
    import _signal
    import signal
    import torch
    from deferfuse.engine import engine
    held = engine.interrupts
    x = torch.arange(6.0)
    xt = x.to("tpu")

    def first(signum, frame):
        raise KeyboardInterrupt

    def second(signum, frame):
        raise KeyboardInterrupt

    old = _signal.getsignal(signal.SIGALRM)
    try:
        for k, handler in enumerate((first, second, first)):
            _signal.signal(signal.SIGALRM, handler)
            assert _signal.getsignal(signal.SIGALRM) is handler
            assert (xt * (k + 2.0)).sum().item() == (x * (k + 2.0)).sum().item()   # a sync
            now = _signal.getsignal(signal.SIGALRM)
            assert getattr(now, "__deferfuse_held__", None) is held, k
            assert now.__wrapped__ is handler
            assert signal.getsignal(signal.SIGALRM) is handler
            assert (xt * 3.0).sum().item() == (x * 3.0).sum().item()     # nothing changed
            assert _signal.getsignal(signal.SIGALRM) is now
    finally:
        signal.signal(signal.SIGALRM, old)


@pytest.mark.modes("defer")
def test_an_exception_in_a_finalizer_reaches_the_previous_hook_once():
    """deferfuse's ``sys.unraisablehook`` (NOTE [interrupt safety]) hands anything but a
    KeyboardInterrupt to the hook it replaced, once, however many syncs installed it again (each
    sync used to take its own hook for the previous one: a RecursionError replaced the message)."""
    import torch
    seen = []
    old = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        x = torch.arange(4.0)
        xt = x.to("tpu")
        for k in range(3):      # each sync installs
            assert (xt * (k + 1.5)).sum().item() == (x * (k + 1.5)).sum().item()

        class Finalized:
            def __del__(self):
                raise ValueError("raised in __del__")
        Finalized()
        assert [(type(u.exc_value), str(u.exc_value)) for u in seen] == \
            [(ValueError, "raised in __del__")]
    finally:
        sys.unraisablehook = old


@pytest.mark.modes("defer")
@pytest.mark.parametrize("wait", ["sleep", "loop", "event"])
def test_a_signal_outside_deferfuse_is_raised_promptly(wait):
    """Outside deferfuse a handler runs from a pending call (NOTE [interrupt safety]), which a
    blocking call (``time.sleep``, a lock wait) does not run: the signal is sent again after
    ``_Later.WAIT`` so that the call ends, as it ends on CPU. A pure Python loop is interrupted
    at its next bytecode."""
    import signal
    import threading
    import time
    import deferfuse  # noqa: F401

    def handler(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, handler)
    t0 = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            if wait == "sleep":
                time.sleep(10)
            elif wait == "event":
                threading.Event().wait(10)
            else:
                while time.monotonic() - t0 < 10:
                    pass
        took = time.monotonic() - t0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert took < 3, took       # 0.1 s and WAIT (0.05 s) on an idle machine
