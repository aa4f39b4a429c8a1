"""Step detection: find the loop body in a trace that never syncs, from op-structure hashes only.

Deterministic: it looks at counts and hashes, never at time, so every rank of a job cuts alike.
"""
from __future__ import annotations

import numpy as np


def find_period(khashes: list[int], min_len: int = 8) -> int | None:
    """The smallest L >= min_len such that the last half of the trace, and the L ops before it,
    repeat with period L (so the loop body shows at least one full period before the last half)."""
    n = len(khashes)
    w = n // 2
    if w < 2 * min_len:
        return None
    a = np.asarray(khashes, dtype=np.int64)
    tail = a[n - w:]
    last = a[-1]
    # Candidate periods: distances to earlier occurrences of the last op's structure.
    cands = np.nonzero(a[n - 1 - w:n - 1] == last)[0]
    for j in sorted((n - 1) - (cands + n - 1 - w)):
        L = int(j)
        if L < min_len or L > w:
            continue
        if np.array_equal(tail[L:], tail[:-L]) and np.array_equal(a[n - w - L:n - L], tail):
            return L
    return None


def loop_phase(khashes: list[int], L: int) -> tuple[int, int]:
    """(where the repetitions begin, how many more ops until the next boundary of the loop's
    iterations) (NOTE [aligned cuts] in deferfuse/record.py): the repetitions with period ``L``
    begin where the trace stops differing from itself ``L`` ops later, and iterations start every
    ``L`` ops from there."""
    a = np.asarray(khashes, dtype=np.int64)
    n = len(a)
    miss = np.nonzero(a[:-L] != a[L:])[0]
    start = int(miss[-1]) + 1 if len(miss) else 0
    return start, (start - n) % L


def rolling(h: int, khash: int) -> int:
    return hash((h, khash))


def body_signature(khashes: list[int], L: int) -> tuple[int, int]:
    """(L, op-structure hash) of the last L ops, as the recorder computes it from an empty trace."""
    h = 0
    for k in khashes[-L:]:
        h = rolling(h, k)
    return (L, h)


LOOP_SPLIT_MIN_OPS = 256     # shorter traces run whole (one step of a model is never split)
CUT_MIN_OPS = 128            # early step detection cuts every k repetitions of a shorter body
LOOP_SPLIT_MIN_REPS = 3
LOOP_SPLIT_MIN_COVER = 0.5   # the repeated ops must be at least this share of the trace


def _periodic_run(khashes: list[int], min_len: int, max_candidates: int) -> tuple | None:
    """(start, period, ops covered) of the longest periodic run through the trace's middle op that
    ``periodic_cuts`` would cut at (NOTE [loop split]), or None."""
    n = len(khashes)
    if n < LOOP_SPLIT_MIN_OPS:
        return None
    a = np.asarray(khashes, dtype=np.int64)
    p = n // 2
    occ = np.nonzero(a[:p] == a[p])[0]
    best = None
    for L in sorted(int(d) for d in p - occ)[:max_candidates]:
        if L < min_len:
            continue
        miss = np.nonzero(a[:-L] != a[L:])[0]       # a[i] != a[i + L]
        i0 = p - L
        k = np.searchsorted(miss, i0)
        if k < len(miss) and miss[k] == i0:
            continue
        s = int(miss[k - 1]) + 1 if k > 0 else 0    # the run of a[i] == a[i + L] holding i0
        e = int(miss[k]) if k < len(miss) else n - L
        reps = (e + L - s) // L
        cover = reps * L
        if reps >= LOOP_SPLIT_MIN_REPS and cover >= LOOP_SPLIT_MIN_COVER * n and \
                (best is None or cover > best[2]):
            best = (s, L, cover)
    return best


def periodic_cuts(khashes: list[int], min_len: int = 8, max_candidates: int = 64) -> tuple | None:
    """NOTE [loop split]: a trace that holds many iterations of a loop (a training loop that logs
    every 100 steps: its one sync reads the loss after 100 steps) compiled as one program, and
    XLA's compile time grows with the program: 1,900 ops of a small MLP's steps took 98 s to
    compile on the development machine. Where at least ``LOOP_SPLIT_MIN_REPS`` repetitions of a
    body of ``min_len`` or more ops cover at least half of the trace, cut it into a prefix, one
    piece per repetition, and a suffix: the repetitions share one structure, so they compile once
    (the first may differ in which inputs it can donate) and run as cached regions.

    The period is found around the trace's middle op: each earlier occurrence of its structure is
    a candidate, and the one whose periodic run covers the most ops wins (ties: the shorter).
    Returns the end index of each piece, or None."""
    best = _periodic_run(khashes, min_len, max_candidates)
    if best is None:
        return None
    n = len(khashes)
    s, L, cover = best
    cuts = ([s] if s else []) + [s + L * k for k in range(1, cover // L + 1)]
    if cuts[-1] != n:
        cuts.append(n)
    return tuple(cuts)


def split_period(khashes: list[int], min_len: int = 8, max_candidates: int = 64) -> int | None:
    """The length of the repetitions ``periodic_cuts`` would cut the trace into, or None."""
    best = _periodic_run(khashes, min_len, max_candidates)
    return None if best is None else best[1]


OUTER_MAX_OPS = 1024     # an outer loop's body up to this many ops runs as whole traces
OUTER_MAX_COVER = 0.8    # ... when the inner body's pieces are at most this share of it
OUTER_MAX_PERIOD = 64    # ... and the inner loop's iterations are shorter than this many ops


class OuterLoop:
    """NOTE [outermost body]: step detection looks at one trace at a time, so in a training step
    with a loop of its own (an LSTM's time steps, a model's identical layers) it found the inner
    body and cut there: word_language_model's step (477 ops, a sync at ``loss.item()``) ran as
    about 94 regions a batch, one per time step or few. The loop a user writes around the step is
    seen at its syncs instead: the traces from one sync to the next (an *interval*) have the same
    structure, sizes included, as an interval seen recently. Where that interval is at most
    ``OUTER_MAX_OPS`` ops and was cut or could be split by an inner loop, the outer loop is the
    body: the inner bodies that cut it are never cut at again (unless they also cut a longer
    interval: a short one may be the piece of a long loop between two syncs), and from then on an
    interval of at most ``OUTER_MAX_OPS`` ops that begins with the same op (the *head*: another
    loop of the program starts elsewhere) is neither searched for inner bodies nor split at them
    (it runs as its traces: forward, backward and step), until an interval with that head grows
    longer. Longer intervals are searched as before (a loop that syncs every hundred steps, XLA's
    compile time of a long program: NOTE [loop split]). So is an interval that is nearly all
    pieces its inner body cut (more than ``OUTER_MAX_COVER``): that is a loop over batches read
    once at its end (an evaluation loop), whose pieces run while the next is recorded; run whole,
    the paired bench's ``gpt_eval`` took 34 ms a step instead of 21.

    Only a loop of short iterations makes an outer body (its shortest iteration under
    ``OUTER_MAX_PERIOD`` ops: a time step of 10 ops, a small model's layer): cut there, a step is
    dozens of regions. A loop of long iterations is what a short *call* repeated looks like (a
    4-step denoising loop of 117 ops a step, then a VAE decode, read once per call): each piece is
    a program worth its launch, and the same pieces serve every call whatever its count of steps
    or its ending. Taken for an outer body, every call ran as one program of its own: the third
    identical call compiled the whole call again (4.8 s for 420 ops on the development machine,
    work its first call had compiled as pieces), and so did every other count of steps. An
    interval that no loop cut and none could split is no outer body either (it ran whole anyway);
    before, any interval of 256 ops or more seen twice was taken for one.

    Pure bookkeeping on counts and hashes: the recorder tells it where traces end, which body
    ended one and each body's iteration length; it answers whether a trace is within an outer body,
    and which bodies to forget."""

    def __init__(self, recent: int = 4, capacity: int = 4096):
        self.traces: list = []      # (length, structure hash) of each trace since the last sync
        self.ops = 0                # ops in those traces
        self.inner: set = set()     # bodies that cut a trace of this interval
        self.body_ops = 0           # ops in the traces of this interval a body cut ended
        self.period = None          # the shortest iteration of a loop that cut or splits this interval
        self.cutting = False        # the trace ending next was ended by a body's cut
        self.recent: list = []      # the last ``recent`` intervals' signatures
        self.nrecent = recent
        self.capacity = capacity
        self.heads: set = set()     # first op of each outer loop's body found: its intervals run whole
        self.head = None            # first op of this interval
        self.suppressed: set = set()    # inner bodies never cut at again
        self.long: set = set()      # bodies that cut an interval longer than OUTER_MAX_OPS
        self.origin: dict = {}      # a body seen from a sync partway into it -> the body
        self.periods: dict = {}     # body -> the length of one iteration of its loop
        self.found = 0              # intervals that made inner bodies suppressed

    @property
    def quiet(self) -> bool:
        return bool(self.heads)

    def within(self, n: int, head) -> bool:
        """Whether a trace of ``n`` ops whose first op has structure ``head``, ending now, is
        within an outer loop's body."""
        if not self.traces:
            self.head = head
        return self.head in self.heads and self.ops + n <= OUTER_MAX_OPS

    def learned(self, body, period: int) -> None:
        """``body`` (a cut's body: ``k`` iterations of its loop) has iterations of ``period`` ops."""
        if len(self.periods) >= self.capacity:
            self.periods.clear()
        self.periods[body] = period

    def _shortest(self, period) -> None:
        if period is not None and (self.period is None or period < self.period):
            self.period = period

    def cut_by(self, body) -> None:
        self.inner.add(body)
        self.cutting = True
        self._shortest(self.periods.get(self.origin.get(body, body)))

    def rotated(self, rot, body) -> None:
        """``rot`` is ``body`` as seen from a sync partway into it (NOTE [body phase])."""
        if len(self.origin) >= self.capacity:
            self.origin.clear()
        self.origin[rot] = self.origin.get(body, body)

    def trace_ended(self, n: int, h: int, sync: bool, head=None, period=None) -> set:
        """A trace of ``n`` ops with structure hash ``h`` ended (``sync``: at a sync that reads
        values, ending the interval); ``period``: the iterations' length where the runner will
        split it at a loop (NOTE [loop split]), else None. Returns the bodies to forget now (often
        none)."""
        if not self.traces:
            self.head = head
        self.traces.append((n, h))
        self.ops += n
        self._shortest(period)
        if self.cutting:
            self.body_ops += n
            self.cutting = False
        if not sync:
            return set()
        sig, ops, inner, body_ops, shortest = (tuple(self.traces), self.ops, self.inner,
                                               self.body_ops, self.period)
        self.traces, self.ops, self.inner, self.body_ops, self.period = [], 0, set(), 0, None
        forget = set()
        if ops > OUTER_MAX_OPS:
            self.heads.discard(self.head)   # the loop moved on to longer intervals: search them
            if len(self.long) + len(inner) > self.capacity:
                self.long.clear()
            self.long |= inner      # bodies of long loops (a short interval may be a piece of one)
        elif sig in self.recent and body_ops <= OUTER_MAX_COVER * ops and \
                shortest is not None and shortest < OUTER_MAX_PERIOD:
            origin = self.origin.get
            forget = {b for b in inner - self.suppressed - self.long if origin(b) not in self.long}
            if forget or not inner:
                if forget or self.head not in self.heads:
                    self.found += 1
                if len(self.heads) >= self.capacity:
                    self.heads.clear()
                self.heads.add(self.head)
                if len(self.suppressed) + len(forget) > self.capacity:
                    self.suppressed.clear()
                self.suppressed |= forget
        if sig not in self.recent:
            self.recent.append(sig)
            del self.recent[:-self.nrecent]
        return forget

    def clear(self) -> None:
        self.__init__(self.nrecent, self.capacity)
