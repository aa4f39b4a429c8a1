"""The engine: the one object that owns deferfuse's state.

NOTE [threads]: the mode is per thread, as PyTorch's mode stack is, and so is the pending trace:
each thread records its own ops, so a thread's regions keep their structure (and their compiled
programs) whatever other threads do. One lock (reentrant) is held while a trace records an op or
runs: a thread that reads a value pending in another thread's trace runs that trace first, under
the lock (a tensor made in one thread and read in another). The caches are shared, bounded and
counted (``metrics()['caches']``).
"""
from __future__ import annotations

import atexit
import gc
import itertools
import sys
import threading
import weakref

from . import _fastpath, opinfo
from .config import config
from .entries import EntryStore
from .generator import Rng
from .meta import sizes as meta_sizes
from ._fastpath import ts_changed
from .record import Bodies, SourceLines, Trace
from .runtime import execute, stats
from .runtime.flush import Runner
from .runtime.runs import Settings
from .runtime.transfer import materialize_empty
from .scheduler.cache import Cache
from .scheduler.policy import Sync, is_async
from .scheduler.records import Padded, Value, sig_id


def user_error(e: BaseException) -> BaseException:
    """``e`` as the user sees it raised: NOTE [user frames]: an error leaving deferfuse (a bad
    argument, a deferred index error, a failed region) is raised from the call the user made, its
    traceback ending in their frames (deferfuse's own frames hidden), as a CPU op's error is;
    ``DEFERFUSE_DEBUG=1`` keeps every frame."""
    if config.debug or not isinstance(e, Exception):
        return e
    return e.with_traceback(None)


class ThreadState:
    """One thread's mode, pending trace, current device and errors of its backward ops."""
    __slots__ = ("mode", "trace", "device", "backward_errors", "__weakref__")


class _Local(threading.local):
    def __init__(self, engine):     # runs once per thread, at its first use
        ts = self.ts = ThreadState()
        ts.mode = engine.default_mode
        ts.trace = Trace(engine)
        ts.device = 0
        ts.backward_errors = []
        engine.traces.add(ts.trace)

    # NOTE [thread state memo] in _fastpath.c: the C record path keeps each thread's ts by its
    # thread's id; setting (or deleting) it here tells it to look it up again
    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "ts":
            ts_changed()

    def __delattr__(self, name):
        super().__delattr__(name)
        if name == "ts":
            ts_changed()


class Engine:
    """Mode and trace per thread, the lock, the caches, the runner, RNG and the GC setting."""

    def __init__(self):
        self.lock = threading.RLock()
        self.default_mode = config.initial_mode
        self.traces = weakref.WeakSet()
        self._epochs = itertools.count(1)
        # Caches (NOTE [two generations] in scheduler/cache.py): op key -> entry; view results.
        self.ops = Cache("ops", 1 << 16)
        self.entry_store = EntryStore()     # entries' metadata on disk (NOTE [entries on disk])
        self.views = Cache("views", 1 << 15)
        self.aliases = Cache("aliases", 1 << 15)
        self.routes: dict = {}      # id(OpOverload) -> route: one per op, bounded by the op set
        self.runner = Runner(config.max_regions)
        # The one thread calling programs nobody waits for (NOTE [in flight] in execute.py).
        self.dispatcher = self.runner.dispatcher = execute.Dispatcher()
        atexit.register(self.dispatcher.stop)
        self.interrupts = self.runner.interrupts     # NOTE [interrupt safety]
        self.interrupts.install()
        # Per-op programs and view reads are dropped with the regions (NOTE [JIT mappings]).
        self.runner.also_evict = (self.ops.clear, execute.view_jits.clear)
        self.runner.same_structure = _fastpath.same_structure      # NOTE [region hits]
        # NOTE [run tables in C] (_fastpath.c)
        self.runner.bind_values, self.runner.drop_values = (_fastpath.bind_values,
                                                            _fastpath.drop_values)
        self.runner.checks.unchecked_inputs = _fastpath.unchecked_inputs
        self.runner.checks.check_tables = _fastpath.check_tables
        self.runner.hit_parts = _fastpath.hit_parts     # NOTE [hit key parts] (runtime/hits.py)
        self.bodies = Bodies()
        self.sources = SourceLines()
        self.rng = Rng()
        self.settings = self.settings_of = None     # the last flush's Settings, and its values
        # NOTE [lazy storages] (_tpu_tensor.cpp): lazy_outputs(trace), the pending Values of a
        # trace that plain tensors hold without a Storage yet (set by plain.install), or None
        self.lazy_outputs = None
        self.young_gc = 0           # NOTE [gc threshold] (deferfuse/__init__.py)
        self.raised_gc = 0
        self.local = _Local(self)

    def next_epoch(self) -> int:
        return next(self._epochs)

    # --- mode ---------------------------------------------------------------------------------
    @property
    def state(self) -> ThreadState:
        return self.local.ts

    @property
    def mode(self) -> str:
        return self.local.ts.mode

    def set_mode(self, m: str) -> None:
        """The calling thread's mode (leaving defer runs what it recorded)."""
        ts = self.local.ts
        if ts.mode == "defer" and m != "defer":
            self.sync(Sync.MODE_EXIT)
        ts.mode = m
        if self.young_gc:
            t = gc.get_threshold()
            want = self.raised_gc if m == "defer" else self.young_gc
            if t[0] != want and t[0] in (self.young_gc, self.raised_gc):  # not the program's own
                gc.set_threshold(want, *t[1:])

    # --- syncs ------------------------------------------------------------------------------------
    def sync(self, reason: str, op: str | None = None, want=None, later: bool = False) -> None:
        """Run the calling thread's pending trace now (a sync point), recording why and from which
        line. ``want``: the one pending Value the caller reads (``.item()``, ``.cpu()``), when that
        is all it needs (NOTE [needed first] in runtime/flush.py); ``later``: the caller reads a
        value computed before the trace, so the host waits for none of it, and its index checks
        are read at the next sync."""
        trace = self.local.ts.trace
        self.interrupts.install()       # a handler set since the last sync (NOTE [interrupt safety])
        with self.interrupts, self.lock:
            if trace.nodes:
                src = self.sources.site(sys._getframe(1))
                stats.S["syncs"][reason] += 1
                stats.S["sync_sites"][(reason, src)] += 1
                if config.debug >= 1:
                    print(f"[deferfuse] sync: {reason}{' (' + op + ')' if op else ''} at {src}, "
                          f"{len(trace.nodes)} ops", file=sys.stderr)
                self.flush(trace, reason, src, want, later)
                if self.young_gc and gc.get_count()[0] > self.young_gc:
                    # The trace is gone: collect what Python's own threshold would have by now
                    # (cyclic garbage holding device buffers must not wait for the raised one).
                    gc.collect(0)
            if want is None and not later and not is_async(reason):
                self.runner.settle()    # a sync of everything (NOTE [in flight] in execute.py)
            if not is_async(reason):
                # Values are read now: report an index check that failed in what ran (in what the
                # read waited for, when it read one value: NOTE [unchecked values]).
                checks = self.runner.checks
                checks.check_all(later=want is None and not later)
                err = checks.take_error()
                if err is not None:
                    raise err.with_traceback(None)

    def flush(self, trace: Trace, reason: str, src: str | None = None, want=None,
              later: bool = False, raise_errors: bool = True) -> None:
        """Run ``trace`` (any thread's). NOTE [errors lose nothing]: an op that fails makes the
        values that depend on it failed (NOTE [value states]) and every other value is computed;
        the error is raised once everything ran. An interrupt (Ctrl-C) stops the flush: what did
        not run is recorded again, so the next sync runs it."""
        with self.interrupts, self.lock:
            # A region call in flight first: its outputs may be this trace's inputs, and who
            # holds them decides what is donated (NOTE [in flight] in execute.py).
            self.runner.settle()
            fl = trace.take(reason, want)
            if fl is None:
                return
            if src is None:
                src = self.sources.site(sys._getframe(1))
            now = (config.debug, config.cross_check, config.memory_planner,
                   config.shape_recompile_limit, config.memory_budget, config.step_detection,
                   config.buckets, config.setup_first, config.buckets_ahead, config.dispatch_thread,
                   config.lazy_cuts)
            cfg = self.settings
            if cfg is None or self.settings_of != now:      # the last flush's, while unchanged
                cfg = self.settings = Settings(*now)
                self.settings_of = now
            ctx = self.runner.start(fl, reason, src, cfg, config.max_regions)
            try:
                self.runner.run(ctx, later or is_async(reason))
            except Exception as e:
                ctx.errors.insert(0, e)
                for v in fl.outs:
                    if v.array is None and v.err is None and v.node.__class__ is not execute.Job:
                        v.fail(e)
            except BaseException:
                trace.requeue(fl, ctx.done)
                raise
            finally:
                # Values and nodes reference each other (Value.node, Node.outs): break the cycles
                # so buffers are released by reference counting, right away.
                for n in fl.nodes:
                    n.ins = n.outs = None
            if ctx.errors:
                if raise_errors:
                    self.runner.checks.errors[:0] = ctx.errors[1:]
                    raise ctx.errors[0]
                self.runner.checks.errors[:0] = ctx.errors

    def resolve(self, v: Value, reader=None) -> None:
        """Make ``v``, pending in another thread's trace, ready (or failed): run that trace."""
        n = v.node
        if n.__class__ is execute.Job:      # its call is in flight (NOTE [in flight])
            with self.interrupts, self.lock:
                self.runner.settle()
            return
        tr = n.trace
        if tr is None or tr is reader or tr.nodes[n.pos:n.pos + 1] != [n]:
            raise RuntimeError(f"deferfuse internal error: a value of {n.name} recorded at {n.src} "
                               "was dropped by an earlier sync but is still read")
        self.flush(tr, "another thread's read", raise_errors=False)

    def ready(self, v: Value, device: int = 0, reason: str = Sync.CPU, check: bool = True):
        """The array of ``v``, running what it waits for; raises the error of a failed value.
        ``check``: read its index checks first (NOTE [unchecked values]); a program that takes it
        as an input carries them on instead."""
        if v.array is None and v.node is not None:
            with self.lock:
                if v.node is not None:
                    if v.node.trace is self.local.ts.trace:
                        self.sync(reason, want=v)
                    else:
                        self.resolve(v)
        c = v.chk
        if c is not None and check:
            if not c.done:
                self.runner.checks.check(c)
            v.chk = None
        if v.array is None:
            if v.err is not None:
                self.raise_failed(v)
            if v.node is not None:
                # NOTE [value states]: only an empty value (no producer) reads as zeros; a value
                # whose op was recorded but that the sync did not compute was elided by mistake,
                # and reading it as zeros would be a silent wrong answer.
                n = v.node
                raise RuntimeError(f"deferfuse internal error: a value of {getattr(n, 'name', n)} "
                                   f"recorded at {getattr(n, 'src', '?')} was not computed by the "
                                   "sync that read it; please report this with DEFERFUSE_DEBUG=3 "
                                   "output")
            materialize_empty(v, device)
        a = v.array
        return a if a.__class__ is not Padded else v.exact()    # (NOTE [lazy cuts])

    def raise_failed(self, v: Value):
        self.runner.checks.forget(v.err)
        raise v.err.with_traceback(None)

    def run_node(self, entry, ins, scalars, dev):
        """Run one op now (strict and debug mode): its inputs must be ready first."""
        for v in ins:
            if v is not None and (v.array is None or v.chk is not None):
                self.ready(v, dev, Sync.MODE_EXIT)
        self.runner.relieve()
        return execute.run_op(entry, ins, scalars, self.local.ts.mode == "debug",
                              self.runner.programs,
                              self.runner.buckets if config.buckets else None)

    # --- caches -----------------------------------------------------------------------------------
    def caches(self) -> list:
        return [self.ops, self.views, self.aliases, execute.view_jits, *self.runner.caches(),
                self.bodies.found, self.bodies.ops, self.sources.codes]

    def cache_stats(self) -> dict:
        out = {c.name: c.stats() for c in self.caches()}
        out["signatures"] = sig_id.stats()
        out["loop bodies"] = self.bodies.stats()
        out["memory mappings"] = self.runner.maps.stats()
        out["meta size rules"] = meta_sizes.stats()
        out["bucket fits on disk"] = self.runner.buckets.learned.stats()
        out["op entries on disk"] = self.entry_store.stats()
        return out

    def clear_caches(self) -> None:
        with self.lock:
            for c in self.caches():
                c.clear()
            self.bodies.known.clear()
            self.bodies.outer.clear()
            self.routes.clear()
            meta_sizes.clear()
            opinfo.clear()
            self.entry_store.clear()


engine = Engine()
config.bind_mode(lambda: engine.mode, engine.set_mode)
