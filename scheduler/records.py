"""The records passed between pipeline stages: values, trace nodes, regions and plans.

Records are small and slotted. ``Value`` is the one mutable record: it starts pending (produced by a
node of the current trace) and is bound to a device array when the region that produces it runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Memory accounting hook: the runtime installs a callable taking a byte delta (see runtime.memory).
_account: list = [None]


# Tensor signatures, interned: a tensor's ``_sig`` is a small int (cheap to hash in every op's
# key); ``SIG_OF[i]`` is the tuple (base shape, base dtype, view chain, shape, strides, dtype).
SIGS: dict = {}
SIG_OF: list = []


def sig_id(sig: tuple) -> int:
    i = SIGS.get(sig)
    if i is None:
        i = SIGS[sig] = len(SIG_OF)
        SIG_OF.append(sig)
    return i


class Value:
    """One SSA value: a device array (``array``) or pending, as output ``idx`` of ``node``."""

    __slots__ = ("array", "node", "idx", "shape", "dtype", "nbytes", "__weakref__")

    def __init__(self, shape: tuple, dtype: Any, nbytes: int, array=None, node=None, idx: int = 0):
        self.shape = shape
        self.dtype = dtype          # a numpy/jax dtype
        self.nbytes = nbytes
        self.array = array
        self.node = node
        self.idx = idx
        if array is not None:
            _account[0](nbytes)

    def bind(self, array) -> None:
        self.array = array
        self.node = None
        _account[0](self.nbytes)

    @property
    def pending(self) -> bool:
        return self.array is None

    def __del__(self):
        if self.array is not None:
            try:
                _account[0](-self.nbytes)
            except TypeError:   # interpreter shutdown
                pass


class Node:
    """One recorded op. ``key`` is its op cache entry (``dispatch._Entry``: the op's structural
    key, its hash, its lowering ``fn(arrays, scalars)`` and its name)."""

    __slots__ = ("key", "ins", "wiring", "s0", "scalars", "outs", "src", "pos")

    def __init__(self, key, ins: list, wiring: tuple, s0: int, scalars: list, outs: tuple, src,
                 pos: int):
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


@dataclass(frozen=True, slots=True)
class SyncEvent:
    reason: str
    src: str
    ops: int


@dataclass(frozen=True, slots=True)
class Region:
    """A contiguous run of trace nodes compiled as one program (``fused``) or run alone."""
    start: int
    stop: int
    fused: bool = True


@dataclass(frozen=True, slots=True)
class Cut:
    """Where the pending trace is cut: ``stop`` nodes run now, the rest stay pending."""
    stop: int
    reason: str
    body: tuple | None = None   # (length, op-structure hash) of a detected loop body
