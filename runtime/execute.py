"""Run work: one op at a time (strict/debug), or a fused region of a trace (defer).

Every call into JAX happens inside ``x64(True)`` so 64-bit dtypes are PyTorch's (see dtypes.py).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings

import jax
import numpy as np

from ..scheduler.cache import Cache
from ..scheduler.records import Padded, Value
from . import stats
from .diskcache import fresh_compiles, op_key
from .dtypes import x64
from .lowering import flag_message, take_flags
from .transfer import devices
from .viewchain import apply_chain

S = stats.S


_last: dict = {}   # device -> the latest outputs handed to JAX there, for wait_all


def wait_all() -> None:
    """Block until the work already handed to JAX has finished, on every device."""
    for dev in list(_last):
        res = _last.pop(dev, None)
        if res is not None:
            jax.block_until_ready(res)


def _values(res, avals):
    return [None if r is None else Value(a[0], a[1], a[2], array=r) for r, a in zip(res, avals)]


def with_flags(fn, msgs: list):
    """``fn`` returning (outputs, index-check flags); ``msgs`` gets each flag's (type, message) when
    it traces (see NOTE [index checks])."""
    def f(arrays, scalars):
        take_flags()
        outs = fn(arrays, scalars)
        flags = take_flags()
        msgs[:] = [(e, m) for _, e, m in flags]
        return outs, [fl for fl, _, _ in flags]
    return f


def raise_flags(flags, msgs, where: str = "") -> None:
    for fl, (exc, msg) in zip(flags, msgs):
        fl = np.asarray(fl)
        if bool(fl):
            raise exc(flag_message(msg, fl) + where)


def sharding(device: int):
    """The placement of a program's outputs on device ``device`` (its inputs are there too)."""
    s = _shardings.get(device)
    if s is None:
        from jax.sharding import SingleDeviceSharding
        s = _shardings[device] = SingleDeviceSharding(devices()[device])
    return s


_shardings: dict = {}


def arrays_of(values, padded: bool = True) -> list:
    """The arrays of ready ``values`` as a program takes them: a lazily cut value (NOTE [lazy
    cuts] in buckets.py) is cut to its exact shape here. ``padded``: whether any may be lazily
    cut (``Buckets.padded``: never, in a process that made none, and then no input is looked at)."""
    if not padded:
        return [v.array for v in values]
    return [a if (a := v.array).__class__ is not Padded else v.exact() for v in values]


def split_donated(values, donate, padded: bool = True) -> tuple:
    """The arrays of ready ``values`` as a program takes them (``arrays_of``), as (the ones the
    flags ``donate`` give to the program, the rest); ``donate`` None: none is given."""
    arrays = arrays_of(values, padded)
    if donate is None:
        return [], arrays
    return [a for a, d in zip(arrays, donate) if d], [a for a, d in zip(arrays, donate) if not d]


def run_op(entry, ins, scalars, debug: bool, store=None, buckets=None):
    """Run one op now as its own cached program on ``entry.dev``; returns output Values.
    ``buckets``: run an op whose sizes keep changing padded in a bucket (NOTE [buckets])."""
    arrays = [None if v is None else v.exact() for v in ins]
    with x64(True):
        if entry.jit is None and buckets is not None:
            entry.jit = buckets.op_program(entry, ins, scalars, store, 0, S)
        res, flags = call_op(entry, arrays, scalars, store, buckets)
        if flags:
            raise_flags(flags, entry.msgs)
        if debug:
            jax.block_until_ready(res)
    _last[entry.dev] = res
    S["ops_eager"] += 1
    return _values(res, entry.res_avals)


def call_op(entry, arrays, scalars, store=None, buckets=None):
    """(outputs, index-check flags) of one op's own program (strict and debug mode, op-by-op
    replays): compiled ahead of time for these inputs, or loaded from the program store (NOTE
    [program store] in diskcache.py), on first use. The caller holds ``x64(True)``."""
    j = entry.jit
    if j is None:
        j = entry.jit = _op_program(entry, arrays, scalars, store)
        if buckets is not None:
            buckets.note_op(entry)
    try:
        return j(arrays, scalars)
    except TypeError:
        if type(j) is not jax.stages.Compiled:
            raise
    # Inputs of other types than the program's (a weakly typed array): a jit over any inputs.
    entry.msgs = []
    j = entry.jit = jax.jit(with_flags(entry.fn, entry.msgs), out_shardings=sharding(entry.dev))
    return j(arrays, scalars)


def _op_program(entry, arrays, scalars, store):
    key = op_key(entry, arrays, scalars, entry.dev) if store is not None and store.on else None
    got = store.load(key, entry.dev) if key is not None else None
    if got is not None:
        entry.msgs = got[1]["msgs"]
        return got[0]
    t0 = time.perf_counter()
    entry.msgs = []
    hits = S["jax_disk_hits"]
    with fresh_compiles() if key is not None else _nothing:
        compiled = jax.jit(with_flags(entry.fn, entry.msgs),
                           out_shardings=sharding(entry.dev)).lower(arrays, scalars).compile()
    dt = time.perf_counter() - t0
    fresh = S["jax_disk_hits"] == hits      # JAX's own persistent cache did not answer it
    if fresh:
        S["compiles"] += 1
        S["op_compiles"] += 1
        S["compile_seconds"] += dt
        if key is not None:
            store.save(key, compiled, {"msgs": entry.msgs})
    return compiled


_nothing = contextlib.nullcontext()


@contextlib.contextmanager
def compiling():
    """``x64(True)`` for a compile, with JAX's warning about a donated buffer that no output can
    reuse silenced: such a buffer is still freed early, which is all its donation was for."""
    with x64(True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        yield


view_jits = Cache("view reads", 4096)    # view chain -> its jitted read


def read_view(array, chain, dyn=()):
    """The view ``chain`` of ``array``, at the dynamic offsets ``dyn`` (program inputs)."""
    j = view_jits.get(chain)
    if j is None:
        j = view_jits[chain] = jax.jit(lambda a, d: apply_chain(a, chain, d))
    with x64(True):
        return j(array, tuple(dyn))


# NOTE [packed scalars]: a region's Python scalars (learning rates, step counts, the constants of
# a chain of ops) reach it as two arrays, the floats as float64 and the ints as int64, so a call
# costs two host-to-device transfers, not one per scalar (~3 µs each on CPU). Inside, each element
# becomes a weakly typed scalar again, exactly what JAX makes of a Python scalar argument, so
# dtype promotion and the compiled code are unchanged. Which scalar is a float is a function of
# the region's key (each op's key has its scalars' types).
try:
    from jax._src.lax.lax import _convert_element_type as _weak_cast   # private: guarded
except ImportError:     # pragma: no cover (a JAX without it: scalars are passed one by one)
    _weak_cast = None


_F64, _I64 = np.dtype(np.float64), np.dtype(np.int64)


def pack_scalars(scalars: list):
    """The scalars of a region call: (floats as float64, ints as int64) (see NOTE [packed scalars])."""
    if _weak_cast is None or not scalars:
        return scalars
    return (np.array([s for s in scalars if type(s) is float], np.float64),
            np.array([s for s in scalars if type(s) is not float], np.int64))


_NO_INTS = np.empty(0, np.int64)
_NO_INTS.flags.writeable = False


def pack_floats(scalars: list):
    """``pack_scalars`` of scalars known to be all floats, none missing (a region hit knows it
    from its key: NOTE [packed scalars]): one array made, the empty int64 array shared."""
    if _weak_cast is None:      # pragma: no cover (scalars passed one by one)
        return scalars
    return (np.array(scalars, np.float64), _NO_INTS)


def _unpack_scalars(packed, is_float: tuple) -> list:
    if _weak_cast is None or not is_float:
        return packed
    fl, it = packed
    out, a, b = [], 0, 0
    for f in is_float:
        if f:
            out.append(_weak_cast(fl[a], _F64, weak_type=True))
            a += 1
        else:
            out.append(_weak_cast(it[b], _I64, weak_type=True))
            b += 1
    return out


def region_function(plan, out_sig, donate, is_float=()):
    """A pure function (donated inputs, kept inputs, scalars) -> outputs running ``plan`` in order.

    ``plan`` is [(fn, wiring, s0, n_scalars)]; ``out_sig`` lists (node pos, output idx) to return;
    ``donate[i]`` says whether external input i arrives in the donated list; ``is_float[i]`` whether
    scalar i is a float (the scalars arrive packed, see NOTE [packed scalars]).
    """
    order = []
    nd = nk = 0
    for d in donate:
        order.append((0, nd) if d else (1, nk))
        nd, nk = nd + d, nk + (not d)

    def region(don, keep, packed):
        scalars = _unpack_scalars(packed, is_float)
        ext = [(don if src == 0 else keep)[i] for src, i in order]
        return run_nodes(((fn, wiring, scalars[s0:s0 + ns]) for fn, wiring, s0, ns in plan), ext,
                         out_sig, msgs)
    msgs: list = []     # (node pos, exception type, message) per flag, filled when it traces
    region.msgs = msgs
    return region


def run_nodes(steps, ext, out_sig, msgs):
    """Trace a region's nodes in order: ``steps`` gives each node's ``fn(arrays, scalars)``, its
    wiring (an int: external input ``ext[w]``; a pair: output of an earlier node) and its
    scalars. Returns (the outputs ``out_sig`` names, the index-check flags); ``msgs`` is refilled
    with (node pos, exception type, message) per flag."""
    env, flags = {}, []
    msgs.clear()
    take_flags()
    for pos, (fn, wiring, sc) in enumerate(steps):
        arrays = [None if w is None else (ext[w] if type(w) is int else env[w]) for w in wiring]
        for i, o in enumerate(fn(arrays, sc)):
            env[(pos, i)] = o
        for fl, exc, m in take_flags():
            flags.append(fl)
            msgs.append((pos, exc, m))
    return [env[k] for k in out_sig], flags


def compile_region(plan, out_sig, donate, don, keep, scalars, device: int = 0, store=None,
                   key=None):
    """jit and compile a region for these inputs on ``device`` (or load it from ``store`` by its
    stable ``key``: NOTE [program store] in diskcache.py); returns (compiled, lowered or None
    when loaded, seconds, index-check messages, whether it compiled)."""
    t0 = time.perf_counter()
    if key is not None:
        got = store.load(key, device)
        if got is not None:
            return got[0], None, time.perf_counter() - t0, got[1]["msgs"], False
    fn = region_function(plan, out_sig, donate, tuple(type(s) is float for s in scalars))
    msgs = fn.msgs
    scalars = pack_scalars(scalars)
    hits = S["jax_disk_hits"]
    with compiling(), fresh_compiles() if key is not None else _nothing:
        lowered = jax.jit(fn, donate_argnums=(0,) if any(donate) else (),
                          out_shardings=sharding(device)).lower(don, keep, scalars)
        compiled = lowered.compile()
    dt = time.perf_counter() - t0
    fresh = S["jax_disk_hits"] == hits     # not answered by JAX's own persistent cache
    if fresh:
        S["compiles"] += 1
        S["region_compiles"] += 1
        S["compile_seconds"] += dt
        if key is not None:
            store.save(key, compiled, {"msgs": list(msgs)})
    return compiled, lowered, dt, msgs, fresh


def run_region(compiled, don, keep, scalars, device: int = 0, debug: bool = False,
               pack=pack_scalars):
    """Call a region's executable; ``pack``: how its scalars are packed (``pack_floats`` when they
    are known to be all floats)."""
    t0 = time.perf_counter()
    with x64(True):
        res = compiled(don, keep, pack(scalars))
        _last[device] = res[0]
        if debug:
            jax.block_until_ready(res)
    S["execute_seconds"] += time.perf_counter() - t0
    S["regions_run"] += 1
    return res


# NOTE [in flight]: XLA's CPU client decides per call whether a program runs inline, on the calling
# thread, before the call returns: a program whose cost analysis counts under 1000 flops
# ("cheap"), or any program when asynchronous dispatch is off, runs inline when its inputs are
# ready; any other is enqueued on the client's thread pool (``ExecuteOptions.execution_mode``
# overrides the choice, but jaxlib's Python API does not expose it). Even enqueued, the call
# costs the host its argument handling and, on a machine whose cores the program's threads fill,
# the wait for a core back. With ``config.dispatch_thread``, a region nobody waits for (the
# second piece of a needed-first split, a cut the host does not wait for) is called on the
# engine's one dispatch thread instead: the host hands it over and records the next ops while
# the call (and the program) runs. Its outputs are "in flight": ``Value.node`` is the ``Job``
# (``pos`` -1, a ``trace`` that is no trace), so the recorder takes them as external inputs
# without waiting, and every reader of an array (the next region's input binding, ``.item()``,
# ``.cpu()``, strict mode's ops, another thread, ``synchronize``) settles the job first:
# ``Runner.settle`` waits for the call's return and binds its outputs, exactly as the call on
# the host would have (donated inputs, index checks, an error replayed op by op). One job is in
# flight at a time, so programs still run in the order they were recorded.


class _NoTrace:
    """The ``trace`` of an in-flight job's ``node``: no trace holds it (NOTE [in flight])."""
    __slots__ = ()
    nodes = ()

    def track(self, storage):
        pass

    def track_mut(self, storage, v):
        pass


NO_TRACE = _NoTrace()


class Job:
    """One region call handed to the dispatch thread; its outputs' ``node`` while in flight."""
    __slots__ = ("compiled", "don", "keep", "packed", "device", "res", "exc", "done", "started",
                 "finish", "__weakref__")
    pos = -1
    idx = 0
    trace = NO_TRACE
    name = "a region in flight"
    src = None

    def __init__(self, compiled, don, keep, packed, device, finish):
        self.compiled, self.don, self.keep, self.packed = compiled, don, keep, packed
        self.device = device
        self.finish = finish        # called on the host with this job once its call returned
        self.res = self.exc = None
        self.done = threading.Event()
        self.started = threading.Event()


class Dispatcher:
    """The engine's one dispatch thread (NOTE [in flight]): calls region executables handed over
    by ``submit``; ``take`` returns the job in flight once its call returned."""

    def __init__(self):
        self.job = None
        self._thread = None
        self._pid = 0
        self._cv = threading.Condition(threading.Lock())
        self._queue: list = []
        self.calls = 0

    def _ensure(self) -> None:
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            # (a forked child inherits the object, not the thread)
            self._cv = threading.Condition(threading.Lock())
            self._queue = []
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._loop, args=(self._cv, self._queue),
                                             name="deferfuse-dispatch", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> None:
        """Hand ``job`` over; return once the thread holds it (so the call starts now, not when
        Python's switch interval hands the thread the GIL). The caller settled the last job."""
        assert self.job is None
        self._ensure()
        self.job = job
        self.calls += 1
        with self._cv:
            self._queue.append(job)
            self._cv.notify()
        job.started.wait()

    @staticmethod
    def _loop(cv, queue) -> None:
        while True:
            with cv:
                while not queue:
                    cv.wait()
                job = queue.pop(0)
            if job is None:
                return
            job.started.set()
            try:
                with x64(True):
                    job.res = job.compiled(job.don, job.keep, job.packed)
            except BaseException as e:     # raised on the host when the job is settled
                job.exc = e
            job.don = job.keep = job.packed = None
            job.done.set()
            job = None      # hold nothing while idle: who holds a value decides its donation

    def take(self):
        """The job in flight once its call returned (waiting for it), or None."""
        job = self.job
        if job is None:
            return None
        if not job.done.is_set():
            t0 = time.perf_counter()
            job.done.wait()
            S["dispatch_wait_seconds"] += time.perf_counter() - t0
        self.job = None
        if job.exc is None:
            _last[job.device] = job.res[0]
        return job

    def stop(self) -> None:
        """End the thread (at exit), after the job in flight."""
        t = self._thread
        if t is not None and t.is_alive() and self._pid == os.getpid():
            with self._cv:
                self._queue.append(None)
                self._cv.notify()
            t.join(timeout=60)
        self._thread = None


def dispatch(dispatcher: Dispatcher, compiled, don, keep, scalars, device: int, finish) -> Job:
    """``run_region`` on the dispatch thread: the call is handed over; ``finish(job)`` binds its
    results when the host settles it (NOTE [in flight])."""
    t0 = time.perf_counter()
    job = Job(compiled, don, keep, pack_scalars(scalars), device, finish)
    dispatcher.submit(job)
    S["execute_seconds"] += time.perf_counter() - t0
    S["regions_run"] += 1
    S["regions_dispatched"] += 1
    return job
