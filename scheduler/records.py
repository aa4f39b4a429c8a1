"""The records passed between pipeline stages: values, trace nodes, regions and plans.

Records are small and slotted. ``Value`` is the one mutable record: it starts pending (produced by a
node of the current trace) and is bound to a device array when the region that produces it runs.
"""
from __future__ import annotations

from typing import Any

# Memory accounting hook: the runtime installs a callable taking one buffer's bytes and 1 when it
# is allocated, -1 when freed (see runtime.memory).
_account: list = [None]


class SigTable:
    """Tensor signatures, interned: a tensor's ``_sig`` is a small int (cheap to hash in every op's
    key) standing for the tuple (base shape, base dtype, view chain, shape, strides, dtype). Ids
    are never reused: past ``capacity`` signatures the table starts afresh (counted), and a
    signature seen again gets a new id, so an old id in a cached key can only miss, never match
    another signature."""

    __slots__ = ("ids", "of", "next", "capacity", "evictions")

    def __init__(self, capacity: int = 1 << 18):
        self.ids: dict = {}
        self.of: dict = {}
        self.next = 0
        self.capacity = capacity
        self.evictions = 0

    def __call__(self, sig: tuple) -> int:
        i = self.ids.get(sig)
        if i is None:
            if len(self.ids) >= self.capacity:
                self.evictions += len(self.ids)
                self.ids, self.of = {}, {}
            i = self.ids[sig] = self.next
            self.of[i] = sig
            self.next += 1
        return i

    def stats(self) -> dict:
        return {"size": len(self.ids), "capacity": self.capacity, "inserts": self.next,
                "evictions": self.evictions}


sig_id = SigTable()     # the one table: tensors of every thread share signatures


class Padded:
    """The ``array`` of a lazily cut value (NOTE [value states], NOTE [lazy cuts] in
    runtime/buckets.py): a bucket run's output still at its bucket's shape. ``array``: the padded
    device array (its padding never read); ``nbytes``: its size, what memory accounting counts;
    ``cut(array, shape)``: the runtime's cut to the exact shape. Not an array: a reader that takes
    ``Value.array`` without ``Value.exact`` gets an object no program or numpy accepts."""

    __slots__ = ("array", "nbytes", "cut")

    def __init__(self, array, nbytes: int, cut):
        self.array, self.nbytes, self.cut = array, nbytes, cut

    def __array__(self, *a, **k):
        raise TypeError("deferfuse internal error: a lazily cut value was read without "
                        "Value.exact (NOTE [lazy cuts] in runtime/buckets.py); please report this")


def counted(v, a) -> int:
    """The bytes memory accounting counts for value ``v`` holding the array ``a``: a lazily cut
    value's padded array its own size, else the value's (_fastpath.c's ``array_nbytes``)."""
    return a.nbytes if a.__class__ is Padded else v.nbytes


class Value:
    """One SSA value. NOTE [value states]: a value is

    - ready: ``array`` is its device array;
    - pending: ``node`` is the recorded op that will compute it (output ``idx``);
    - failed: ``err`` is the exception its computation raised; reading it raises that error;
    - donated: ``err`` is a ``Donated`` record: its buffer was given to a program, and reading it
      is an internal error naming that program;
    - empty: none of these (``torch.empty``): read as zeros, as uninitialised memory may be;
    - lazily cut: ready, but ``array`` is a ``Padded`` (a bucket run's output at its bucket's
      shape, NOTE [lazy cuts] in runtime/buckets.py): every reader of its data takes it through
      ``exact()``, which cuts it to ``shape`` once; a bucket run reading it pads from the padded
      array. Tests of ``array is None`` (pending, failed, donated, empty) hold as for ready.

    A pending value that the sync reading it did not compute (its op recorded, but elided as no
    output) is none of these: ``Engine.ready`` raises an internal error for it, never zeros.

    ``chk``: the index checks of the program that computed it, not yet read by the host (see NOTE
    [unchecked values] in runtime/flush.py), or None."""

    __slots__ = ("array", "node", "idx", "shape", "dtype", "nbytes", "err", "chk", "__weakref__")

    def __init__(self, shape: tuple, dtype: Any, nbytes: int, array=None, node=None, idx: int = 0):
        self.shape = shape
        self.dtype = dtype          # a numpy/jax dtype
        self.nbytes = nbytes
        self.array = array
        self.node = node
        self.idx = idx
        self.err = None
        self.chk = None
        if array is not None:
            _account[0](nbytes, 1)

    def fail(self, err: BaseException) -> None:
        """Make this value failed (or donated): its array, if any, is dropped."""
        a = self.array
        if a is not None:
            self.array = None
            _account[0](counted(self, a), -1)
        self.node = None
        self.err = err

    def exact(self):
        """Its array at its exact shape: a lazily cut value is cut now (and stays cut); any other
        value's ``array`` as it is (NOTE [lazy cuts] in runtime/buckets.py)."""
        p = self.array
        if p.__class__ is not Padded:
            return p
        a = p.cut(p.array, self.shape)
        if self.array is p:         # (another thread may have cut it meanwhile)
            self.array = a
            _account[0](self.nbytes, 1)
            _account[0](p.nbytes, -1)
        return self.array

    def bind(self, array) -> None:
        self.array = array
        self.node = None
        _account[0](self.nbytes, 1)

    @property
    def pending(self) -> bool:
        return self.array is None

    def __del__(self):      # the exact class runs _fastpath.c's copy (NOTE [value finalizer])
        a = self.array
        if a is not None:
            try:
                _account[0](counted(self, a), -1)
            except TypeError:   # interpreter shutdown
                pass


class Node:
    """One recorded op. ``key`` is its op cache entry (``dispatch._Entry``: the op's structural
    key, its hash, its lowering ``fn(arrays, scalars)`` and its name)."""

    __slots__ = ("key", "ins", "wiring", "s0", "scalars", "outs", "src", "pos", "trace")

    def __init__(self, key, ins: list, wiring: tuple, s0: int, scalars: list, outs: tuple, src,
                 pos: int, trace=None):
        self.trace = trace      # the pending trace holding it (a thread's: NOTE [threads])
        self.key = key
        self.ins = ins          # input Values (None: a mutated input overwritten without a read)
        self.wiring = wiring    # per input: int = external input index, (pos, idx) = node output
        self.s0 = s0            # this node's scalars start at trace.scalars[s0]
        self.scalars = scalars
        self.outs = outs
        self.src = src
        self.pos = pos

    # Read at compile time and in messages only: not stored per node (recording is the hot path).
    khash = property(lambda self: self.key.khash)
    fn = property(lambda self: self.key.fn)
    name = property(lambda self: self.key.name)


class Donated(RuntimeError):
    """The ``err`` of a donated value (NOTE [value states]): reading it is an internal error."""

    def __init__(self, program: str):
        super().__init__(f"deferfuse internal error: a value was read after its buffer was donated "
                         f"to {program}; please report this with DEFERFUSE_DEBUG=3 output")
