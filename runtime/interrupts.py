"""Signals that raise (Ctrl-C's KeyboardInterrupt, a timer's handler) wait until deferfuse's state
is whole, then raise in the user's frame.

NOTE [interrupt safety]: Python runs a signal's handler between two bytecodes of the main thread,
wherever it is: in the middle of recording an op, between handing a program its donated buffers
and binding its results, inside a backward op that the autograd engine called, or inside a
garbage-collector callback (JAX's ``_xla_gc_callback``), where Python prints "Exception ignored"
and the KeyboardInterrupt is lost. A timer raising KeyboardInterrupt 40 times into training
bursts broke 6 of 8 defer runs (later values off by ~1e-3, "Array has been deleted", an abort)
and every strict run (8 of 8: the abort "terminate called without an active exception", exit 134,
or a backward pass that failed). So:

- ``Interrupts`` wraps the Python handlers of the signals that may raise (``install``, at import
  and at every sync and ``backward()``: a handler set since is wrapped then). While the main
  thread is inside deferfuse (``depth``: an op's ``__torch_dispatch__``, the kernels PyTorch calls
  outside it (``around``), a sync, ``backward()``), the wrapper only notes the signal; the
  outermost exit calls the user's handler, so its exception leaves the op the user called with
  every value recorded or computed, as a CPU op completes before Python sees Ctrl-C. An XLA
  compile inside a sync is held too: Ctrl-C waits for it to end (stopping one, and recording
  again what did not run, left later training values off in 5 of 6 runs).
- A KeyboardInterrupt that Python would drop (raised in a GC callback or a finalizer outside
  deferfuse) is sent again as SIGINT from another thread (``sys.unraisablehook``), to be raised
  at a bytecode outside such a callback.
- The device guard PyTorch calls from noexcept C++ (``deferfuse_autoload``) runs no bytecode.

With these, 8 of 8 defer runs and 6 of 8 strict runs were clean. The strict runs left still
aborted: a handler that runs in Python code PyTorch itself calls from C++ in the middle of an op
(``find_torch_dispatch_rule``, ``Tensor.backward``'s return) leaves a Python error pending when
C++ next calls the device guard; only PyTorch can make that guard safe.
"""
from __future__ import annotations

import _thread
import signal
import sys
import threading

_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGALRM", "SIGTERM", "SIGHUP", "SIGUSR1",
                                              "SIGUSR2", "SIGVTALRM") if hasattr(signal, n))


class Interrupts:
    """The main thread's depth inside deferfuse, the signals held meanwhile, and the wrapped
    handlers. ``with interrupts:`` is one level (a no-op on other threads)."""

    __slots__ = ("main", "depth", "held", "_prev_hook")

    def __init__(self):
        self.main = threading.main_thread().ident
        self.depth = 0
        self.held: list = []
        self._prev_hook = None

    def __enter__(self):
        if _thread.get_ident() == self.main:
            self.depth += 1
        return self

    def __exit__(self, *exc):
        if _thread.get_ident() == self.main:
            self.depth -= 1
            if not self.depth and self.held:
                self.deliver()
        return False

    def around(self, fn):
        """``fn`` (a kernel PyTorch calls, from C++, outside ``__torch_dispatch__``), held."""
        def held(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        held.__name__ = held.__qualname__ = fn.__name__
        held.__doc__ = fn.__doc__
        held.__wrapped__ = fn
        return held

    def deliver(self) -> None:
        """Call the handlers of the signals held, in the caller's frame (the first that raises
        ends it: the others were the same interrupt, arriving while it waited)."""
        held, self.held = self.held, []
        frame = sys._getframe(1)
        for handler, signum in held:
            handler(signum, frame)

    def install(self) -> None:
        """Wrap the Python handler of each signal that may raise (main thread only)."""
        if _thread.get_ident() != self.main:
            return
        for s in _SIGNALS:
            h = signal.getsignal(s)
            if callable(h) and getattr(h, "__deferfuse_held__", None) is not self:
                try:
                    signal.signal(s, self._wrap(h))
                except (ValueError, OSError):   # not the main interpreter
                    return
        if sys.unraisablehook is not self._unraisable:
            self._prev_hook = sys.unraisablehook
            sys.unraisablehook = self._unraisable

    def _wrap(self, handler):
        def held(signum, frame):
            if self.depth:
                self.held.append((handler, signum))
                return None
            return handler(signum, frame)
        held.__deferfuse_held__ = self
        held.__wrapped__ = handler
        held.__name__ = getattr(handler, "__name__", "handler")
        return held

    def _unraisable(self, u) -> None:
        if isinstance(u.exc_value, KeyboardInterrupt) and _thread.get_ident() == self.main:
            if callable(signal.getsignal(signal.SIGINT)):
                # Raised in a GC callback or a finalizer: Python would print it and go on. Sent
                # again from another thread, so that it is not handled inside this hook.
                _thread.start_new_thread(_resend, (self.main, (signal.SIGINT,)))
                return
        (self._prev_hook or sys.__unraisablehook__)(u)


def _resend(main: int, sigs) -> None:
    for s in sigs:
        signal.pthread_kill(main, s)
