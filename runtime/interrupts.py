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
- Outside deferfuse a handler runs from a pending call (``_Later``), never where Python checks
  signals from C code. Python also runs handlers inside C functions that call
  ``PyErr_CheckSignals``: ``PyObject_Str`` and ``PyObject_Repr`` do, and pybind11's lookup of a
  Python override calls ``str()`` on the caller's code name, so every call of PyTorch's Python
  device guard (``PythonDeviceGuard::getStream``, noexcept, called by autograd's
  ``set_history`` after an op returns) could run the handler; its exception there ended in
  ``std::terminate`` ("terminate called without an active exception", exit 134). A pending call
  runs only at a bytecode boundary of the main thread (and in an interrupted lock wait), so the
  handler's exception leaves the torch call that was under way after it completes, or the
  Python code that was running, a few milliseconds later than Python would raise it; a call that
  waits (``time.sleep``, a socket) is interrupted by the signal sent again (``_Later``).
- ``signal.getsignal`` and ``signal.signal`` return the user's handler, not the wrapper
  (``Interrupts._hide``).
"""
from __future__ import annotations

import _signal
import _thread
import signal
import sys
import threading
import time

_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGALRM", "SIGTERM", "SIGHUP", "SIGUSR1",
                                              "SIGUSR2", "SIGVTALRM") if hasattr(signal, n))


class Interrupts:
    """The main thread's depth inside deferfuse, the signals held meanwhile, and the wrapped
    handlers. ``with interrupts:`` is one level (a no-op on other threads)."""

    __slots__ = ("main", "depth", "held", "_prev_hook", "_getsignal", "_setsignal", "_later",
                 "_seen", "_hook")

    def __init__(self):
        self.main = threading.main_thread().ident
        self.depth = 0
        self.held: list = []
        self._prev_hook = None
        self._getsignal, self._setsignal = signal.getsignal, signal.signal
        self._later = _Later(self)
        self._seen = None       # the raw handlers when install last wrapped every one it could
        # sys.unraisablehook's value while ours: one bound method, made once (each read of
        # ``self._unraisable`` makes a new one, which ``is`` never matches: each install took the
        # last one for the previous hook, and the chain called itself until RecursionError)
        self._hook = self._unraisable

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

    def deliver(self, frame=None) -> None:
        """Call the handlers of the signals held, in the caller's frame (the first that raises
        ends it: the others were the same interrupt, arriving while it waited)."""
        held, self.held = self.held, []
        frame = frame or sys._getframe(1)
        for handler, signum in held:
            handler(signum, frame)

    def install(self) -> None:
        """Wrap the Python handler of each signal that may raise (main thread only)."""
        if _thread.get_ident() != self.main:
            return
        self._hide()
        raw = _signal.getsignal
        # Every sync calls this: handlers the same objects as when every one was last wrapped (or
        # left as it was: not callable) have nothing to wrap.
        seen = tuple(map(raw, _SIGNALS))
        if seen == self._seen and sys.unraisablehook is self._hook:
            return
        for s in _SIGNALS:
            # Every sync calls this: the raw handler first (C, no enum conversion; signal.getsignal
            # costs ~2 µs a signal), the full lookup only for a callable handler not ours.
            h = raw(s)
            if not callable(h) or getattr(h, "__deferfuse_held__", None) is self:
                continue
            h = self._getsignal(s)
            if callable(h) and getattr(h, "__deferfuse_held__", None) is not self:
                try:
                    self._setsignal(s, self._wrap(h))
                except (ValueError, OSError):   # not the main interpreter
                    return
        if sys.unraisablehook is not self._hook:
            self._prev_hook = sys.unraisablehook
            sys.unraisablehook = self._hook
        self._seen = tuple(map(raw, _SIGNALS))

    def unwrap(self, handler):
        """The handler the user installed, for one of ours (anything else as it is)."""
        if getattr(handler, "__deferfuse_held__", None) is self:
            return handler.__wrapped__
        return handler

    def _hide(self) -> None:
        """``signal.getsignal`` and ``signal.signal`` as they were, less the wrappers: they return
        the user's handler (or Python's default), so ``getsignal(SIGINT) is default_int_handler``
        holds as on CPU (asyncio.run asks it before it installs its own); and a handler set
        through ``signal.signal`` is wrapped at once (NOTE [interrupt safety])."""
        if getattr(signal.getsignal, "__deferfuse_held__", None) is self:
            return
        get, put = signal.getsignal, signal.signal
        self._getsignal, self._setsignal = get, put

        def getsignal(signalnum, /):
            return self.unwrap(get(signalnum))

        def set_signal(signalnum, handler, /):
            if callable(handler) and signalnum in _SIGNALS and _thread.get_ident() == self.main \
                    and getattr(handler, "__deferfuse_held__", None) is not self:
                handler = self._wrap(handler)
            return self.unwrap(put(signalnum, handler))

        for fn, orig in ((getsignal, get), (set_signal, put)):
            fn.__name__, fn.__qualname__, fn.__doc__ = orig.__name__, orig.__name__, orig.__doc__
            fn.__module__ = "signal"
            fn.__wrapped__ = orig
            fn.__deferfuse_held__ = self
        signal.getsignal, signal.signal = getsignal, set_signal

    def _wrap(self, handler):
        later = self._later

        def held(signum, frame):
            later.inside += 1
            try:
                if later.forced:    # sent again: the main thread waits in a system call
                    later.forced = False
                    if self.depth or not self.held:     # held, or delivered since: this is all
                        return None
                    later.pending = False
                    now = True
                else:
                    self.held.append((handler, signum))
                    if self.depth or later.request():
                        return None
                    self.held.pop()
                    now = False
            finally:
                later.inside -= 1
            if now:
                self.deliver(frame)
                return None
            return handler(signum, frame)       # no pending call to be had: as Python would
        held.__deferfuse_held__ = self
        held.__wrapped__ = handler
        held.__name__ = getattr(handler, "__name__", "handler")
        return held

    def _unraisable(self, u) -> None:
        if isinstance(u.exc_value, KeyboardInterrupt) and _thread.get_ident() == self.main:
            if callable(self._getsignal(signal.SIGINT)):
                # Raised in a GC callback or a finalizer: Python would print it and go on. Sent
                # again from another thread, so that it is not handled inside this hook.
                _thread.start_new_thread(_resend, (self.main, (signal.SIGINT,)))
                return
        (self._prev_hook or sys.__unraisablehook__)(u)


class _Later:
    """Delivers the held signals at the main thread's next bytecode boundary (NOTE [interrupt
    safety]: never inside C code that checks signals).

    ``Py_AddPendingCall(PyObject_IsTrue, later)``: the interpreter calls ``bool(later)`` at a
    bytecode boundary of the main thread (or in an interrupted lock wait); ``__bool__`` calls the
    handlers, and an exception it raises is raised there, as a handler's is. The call is added
    from a thread of its own (``_ask``), which runs once the main thread lets go of the GIL: added
    from the handler itself, it ran at the handler's own next bytecode, inside the C code that
    ran the handler. A pending call the interpreter meets inside one of our handlers (``inside``)
    asks again. If it has not run after ``WAIT`` seconds, the main thread is waiting in a system
    call (``time.sleep``, a socket), which a signal ends: the signal is sent again, and its
    handler (``forced``) calls the held handlers at once, where Python checks signals for that
    call, as Python would."""

    __slots__ = ("owner", "pending", "inside", "forced", "_add", "_is_true")
    WAIT = 0.05

    def __init__(self, owner: Interrupts):
        self.owner = owner
        self.pending = False        # a pending call asked for and not run yet
        self.inside = 0             # our signal handlers running now
        self.forced = False         # the next signal is the one sent again: deliver now
        try:
            import ctypes
            api = ctypes.pythonapi
            self._add = api.Py_AddPendingCall
            self._add.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
            self._add.restype = ctypes.c_int
            self._is_true = ctypes.cast(api.PyObject_IsTrue, ctypes.c_void_p).value
        except (ImportError, AttributeError):       # not CPython: deliver as Python does
            self._add = None

    def request(self) -> bool:
        """True when the held signals will be delivered later (a pending call, one is enough)."""
        if self._add is None:
            return False
        if not self.pending:
            self.pending = True
            _thread.start_new_thread(self._ask, (True,))
        return True

    def _ask(self, watch: bool) -> None:
        if self._add(self._is_true, id(self)) == 0 and watch:
            time.sleep(self.WAIT)
        elif not watch:
            return
        held = self.owner.held
        if self.pending and held:   # not run yet (or the queue was full): send it again
            self.forced = True
            signal.pthread_kill(self.owner.main, held[-1][1])

    def __bool__(self) -> bool:
        if self.inside or sys._getframe(1).f_code is _HELD_CODE:
            # Run at a bytecode of our own handler (its first: before ``inside`` counts it),
            # which may be inside C code: not here.
            _thread.start_new_thread(self._ask, (False,))
            return False
        self.pending = False
        o = self.owner
        if o.held and not o.depth:          # inside deferfuse, its outermost exit delivers
            o.deliver(sys._getframe(1))
        return False


# The code of every wrapper ``Interrupts._wrap`` makes (``_Later.__bool__`` knows its frames).
_HELD_CODE = next(c for c in Interrupts._wrap.__code__.co_consts
                  if getattr(c, "co_name", None) == "held")


def _resend(main: int, sigs) -> None:
    for s in sigs:
        signal.pthread_kill(main, s)
