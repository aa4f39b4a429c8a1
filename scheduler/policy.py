"""Where defer mode cuts a trace, and how a flushed trace runs: the decisions in one place (issue 33).

Pure (no torch, no jax): counts, hashes and reasons in, decisions out. The recorder
(deferfuse/record.py) and the runner (runtime/flush.py) ask ``CutPolicy`` and carry its answers
out; what they do with them (flush, compile, run) stays theirs.

A cut's reason is a ``Cut`` when the recorder cut on its own (the host does not wait: the pieces
run while the next is recorded); any other reason is a sync that reads values (the op or the read
that needed them: ``item``, ``cpu`` ...). ``Cut`` members are strings equal to (and hashing as)
their values, so counters and reports keyed by reason read alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from . import cut, steps


class Cut(str, Enum):
    """Why the recorder cut a trace without a read (an asynchronous cut)."""
    LOOP_BOUNDARY = "loop boundary"     # a loop body found by step detection ended here
    TRACE_LIMIT = "trace limit"         # DEFERFUSE_TRACE_LIMIT ops recorded
    BACKWARD = "backward"               # backward() dispatched the forward pass
    DEVICE_SWITCH = "device switch"     # an op on another device: a region runs on one
    FENCE = "fence"                     # the caller ended a region here (deferfuse.vllm: a step's model)
    PACKED = "packed boundaries"        # a packed batch's boundaries computed before they are padded

    __hash__ = str.__hash__             # (as the plain string: counters keyed by reason)

    def __str__(self) -> str:
        return self.value


ASYNC_CUTS = frozenset(c.value for c in Cut)


class Sync(str, Enum):
    """Why a trace ran because values were read (a sync: the host waits). Members are strings
    equal to (and hashing as) their values, as ``Cut``'s."""
    CPU = "cpu"                             # a tensor copied to the host (.cpu(), .numpy(), ...)
    ITEM = "item"                           # .item()
    TOLIST = "tolist"
    PRINT = "print"
    SYNC = "sync"                           # deferfuse.sync()
    SYNCHRONIZE = "synchronize"             # torch.tpu.synchronize(), a stream's or event's
    MODE_EXIT = "mode exit"                 # leaving defer mode
    COMPILED_GRAPH = "compiled graph"       # a torch.compile graph reads the pending values
    COLLECTIVE = "collective"               # a collective: cut at the same op on every rank
    DATA_DEPENDENT = "data-dependent shape"     # an op whose output size depends on values
    UNLOWERED = "unlowered op"              # an op with no lowering runs on the CPU
    LINALG_CHECK = "linalg error check"     # a linalg op's error flag read to raise as CPU does

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


def is_async(reason) -> bool:
    """Whether ``reason`` is a cut the host does not wait for (else a sync that reads values)."""
    return reason in ASYNC_CUTS


@dataclass(frozen=True, slots=True)
class SyncPlan:
    """What the recorder does with a trace it hands over: ``whole`` (within an outer loop's body:
    never split at an inner loop), ``search`` ("body": look for a loop body in it; "rephase": learn
    the body it began in as seen from its start; None), ``split_period`` (find the iterations the
    runner will split it into: an outer body needs short ones)."""
    whole: bool
    search: str | None
    split_period: bool


class Shapes(str, Enum):
    """How a region structure that came back with new shapes no bucket takes runs (NOTE [shape
    churn] in runtime/flush.py)."""
    WHOLE = "whole"             # compiled whole for these shapes
    SPLIT = "split"             # as pieces: the ops whose keys changed apart from those that never did
    OP_BY_OP = "op by op"       # every op changed: op by op (the same version again compiles whole)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class ShapePlan:
    """``how`` a version of a churning structure runs, and the ``cuts`` of its pieces (SPLIT)."""
    how: Shapes
    cuts: tuple | None = None


WHOLE = ShapePlan(Shapes.WHOLE)


class Split(str, Enum):
    """How the runner splits a flushed trace before compiling it (each computed by
    scheduler/cut.py or steps.py from the trace's structure, cached with it)."""
    SETUP_FIRST = "setup first"     # leading factories run first (NOTE [setup first])
    LOOP = "loop"                   # at every repetition of a loop body (NOTE [loop split])
    NEEDED_FIRST = "needed first"   # what the sync reads, then the rest (NOTE [needed first])

    def __str__(self) -> str:
        return self.value


# A pending trace this short that holds a compiled forward graph is not cut at backward() (NOTE
# [no backward cut for graphs] in deferfuse/compiled.py).
GRAPH_STEP_OPS = 8


class CutPolicy:
    """The decisions, with what they learn from (the outer loop's bookkeeping: NOTE [outermost
    body] in steps.py). One per engine."""

    def __init__(self):
        self.outer = steps.OuterLoop()

    # --- while recording ------------------------------------------------------------------
    def search_while_recording(self, n: int, head, detect: bool = True) -> bool:
        """At a check point of a trace that never syncs (NOTE [early step detection]): whether to
        look for a loop body in its ``n`` ops (never within an outer loop's body). ``detect``:
        step detection is on (DEFERFUSE_STEP_DETECTION), here and below."""
        return detect and not self.outer.within(n, head)

    @staticmethod
    def search_at_cut(reason, detect: bool = True) -> bool:
        """A trace cut for ``reason`` before a body was found: look for one (the trace limit)."""
        return detect and reason == Cut.TRACE_LIMIT

    # --- at a sync or cut -----------------------------------------------------------------
    def at_sync(self, reason, n: int, head, after, detect: bool = True) -> SyncPlan:
        """The plan for a trace of ``n`` ops (first op ``head``) ending for ``reason``; ``after``:
        the body whose cut began it (or None)."""
        whole = self.outer.within(n, head)
        search = None
        if detect and not is_async(reason) and not whole:
            if n >= steps.LOOP_SPLIT_MIN_OPS:
                # A sync after many repetitions of a loop body (a loop that logs every N steps):
                # the loop goes on after the sync, so cut it at every repetition from here on.
                search = "body"
            elif after is not None:
                search = "rephase"
        return SyncPlan(whole, search, detect and not whole and n >= steps.LOOP_SPLIT_MIN_OPS)

    def trace_ended(self, reason, n: int, h: int, head, period, detect: bool = True) -> set:
        """Bookkeeping once the trace is handed over; the loop bodies to forget."""
        if not detect:
            return set()
        return self.outer.trace_ended(n, h, not is_async(reason), head, period)

    # --- in the runner --------------------------------------------------------------------
    @staticmethod
    def loop_split(n: int, whole: bool, enabled: bool = True, cross_check: bool = False) -> bool:
        """Whether the runner looks for a loop to split a flushed trace of ``n`` ops at (NOTE
        [loop split]): not within an outer loop's body, not when every region is also run op by
        op to compare."""
        return enabled and not whole and n >= steps.LOOP_SPLIT_MIN_OPS and not cross_check

    @staticmethod
    def new_shapes(versions: int, limit: int, decided, first_keys, keys, vary: set,
                   new_base: bool = False):
        """A structure compiled for ``versions`` sets of shapes is here with new ones (and no
        bucket takes them): (its ``ShapePlan``, what to remember for this version or None).
        ``limit``: versions compiled whole before splitting (DEFERFUSE_SHAPE_RECOMPILE_LIMIT);
        ``decided``: what was remembered for this version (None: nothing); ``first_keys``,
        ``keys``: the op keys of the first version and of this one; ``vary``: the positions seen
        to change (updated). A version that comes back runs as it did, except one that ran op by
        op: that one recurs, and compiles whole. ``new_base``: the version is the first at a new
        base of a structure that runs in buckets (NOTE [new bases] in runtime/buckets.py): it
        compiles whole, to be fitted against by the versions that follow it."""
        if versions < limit or new_base:
            return WHOLE, None
        if decided is None:
            cuts = cut.churn_cuts(first_keys, keys, vary)
            if cuts is not None:
                return ShapePlan(Shapes.SPLIT, cuts), cuts
            return ShapePlan(Shapes.OP_BY_OP), Shapes.WHOLE.value
        if decided.__class__ is tuple:
            return ShapePlan(Shapes.SPLIT, decided), None
        return WHOLE, None

    @staticmethod
    def cut_at_backward(n: int, graphs=(), enabled: bool = True) -> bool:
        """Whether ``backward()`` cuts the pending trace of ``n`` ops (NOTE [backward cut] in
        deferfuse/device.py: the forward pass computes while the backward pass is recorded).
        ``graphs``: the kinds ("forward", "backward") of the compiled graphs the trace holds,
        asked only of a trace of at most ``GRAPH_STEP_OPS`` ops: one that holds a compiled
        forward graph and no backward graph is a compiled step's forward pass and its loss,
        whose backward pass is one graph too, and is not cut (NOTE [no backward cut for
        graphs] in deferfuse/compiled.py)."""
        if not enabled or n == 0:
            return False
        if n > GRAPH_STEP_OPS:
            return True
        return "backward" in graphs or "forward" not in graphs

    @staticmethod
    def setup_split(n: int, first_is_setup: bool, setup_first: bool = True) -> bool:
        """Whether the runner looks for leading setup ops to run first in a flushed trace of
        ``n`` ops whose first op is a factory (``first_is_setup``: NOTE [setup first])."""
        return setup_first and n > 1 and first_is_setup

    @staticmethod
    def trace_splits(n: int, whole: bool, wants: bool, loop_split: bool = True,
                     cross_check: bool = False) -> tuple:
        """The splits the runner tries on a flushed trace (or what setup first left of it), in
        order; the first that finds cuts is carried out, else the trace is one region. ``whole``:
        within an outer loop's body; ``wants``: the sync reads values (needed first)."""
        out = ()
        if CutPolicy.loop_split(n, whole, loop_split, cross_check):
            out = (Split.LOOP,)
        if wants and not cross_check:
            out += (Split.NEEDED_FIRST,)
        return out

    @staticmethod
    def in_buckets(enabled: bool = True, cross_check: bool = False) -> bool:
        """Whether a region with new sizes is tried in a bucket (NOTE [buckets] in
        runtime/buckets.py): not when every region is also run op by op to compare."""
        return enabled and not cross_check

    @staticmethod
    def plan_ahead(enabled: bool = True, ahead: bool = True, cross_check: bool = False) -> bool:
        """Whether a loop's first repetitions at hand plan their bucket before the first runs
        (NOTE [buckets ahead] in runtime/flush.py)."""
        return ahead and CutPolicy.in_buckets(enabled, cross_check)

    @staticmethod
    def over_budget(n: int, need: int, budget: int) -> bool:
        """Whether a region of ``n`` ops that needs ``need`` bytes (inputs, outputs and XLA's
        temporaries) is split for the memory budget (DEFERFUSE_MEMORY_BUDGET; 0: none)."""
        return bool(budget) and n > 1 and need > budget

    def clear(self) -> None:
        self.outer.clear()
