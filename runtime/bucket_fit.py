"""Buckets (NOTE [buckets] in buckets.py): the ints of a region's structure, how they follow one
length (``Fit``), the bucket a length is padded to, and shape forms (``a * s + b``)."""
from __future__ import annotations

import math

from ..scheduler.records import sig_id
from .dtypes import to_np_dtype
from .lowering import LOWERINGS
from .lowering.padding import MoveDims, Reshape
from .node import SS, TS
from .viewchain import DSELECT, DSLICE


# NOTE [window bases]: a region follows one length (``Fit``), but data batchified from one corpus
# at batch B has N // B rows: the base that ``get_batch``'s windows ``source[i:i + bptt]`` read
# changes with the batch the other way (word_language_model evaluated at batch 7 after 10: 37 rows
# after 26), two sizes that no one line takes, so the region compiled again per batch (and its
# second chunk ran as shape churn). A base's dim along which its first view is a window (a
# ``DSLICE`` of step 1, or a ``DSELECT``: ``x[i]``) is read only inside its exact extent, whatever
# the base's length: the window's start is data and the window's own sizes are structure. Such an
# int is marked ``FREE`` in the mask; where versions fit no line with it, it leaves the line and
# follows a size of its own: its form is ``(0, Q)``, the base padded to ``Q`` rows (the next power
# of two of the longest base seen, at least ``MIN_BUCKET``), and every version whose base is at
# most ``Q`` long runs in the plan. A longer base makes a copy of the plan at its own bucket
# (``Buckets._wider``): one program per power of two the base's length crosses, none per batch.
# Anything else reading the same base whole, or a region that makes the base itself, sees its
# exact length as structure and refuses (``an input read with two different sizes``, or a fit
# that fails), so padding never reaches a valid position. Another cut (the window sliced off the
# base before the region, as its own small program) would free the region of the base's length
# too, but it is a region boundary inside every step and a program per window size; and two
# lengths in every form (``a * s + c * u + b``) would give each op's rule two padded masks to
# keep, where only a window's base needs none. The batch ``B`` then follows its own powers of two:
# ``Fit.bucket`` pads the length's own size (the changing int with the smallest step), not the
# first int that changes (the ``T * B`` rows of a loss's gradient followed their own powers of
# two, so batches 10 and 7 fell in different buckets).
FREE = 2
_WINDOWS = (DSLICE, DSELECT)


class Refused(Exception):
    """This region cannot run padded (the message names the op and why)."""


# --------------------------------------------------------------------------- ints of a structure
def _skeleton(x):
    t = type(x)
    if t is int:
        return None
    if t is tuple or t is list:
        return tuple(_skeleton(y) for y in x)
    return x


def _put(x, it):
    """``x`` with its ints replaced, in order, by the items of ``it``."""
    t = type(x)
    if t is int:
        return next(it)
    if t is tuple:
        return tuple(_put(y, it) for y in x)
    if t is list:
        return [_put(y, it) for y in x]
    return x


def parts(entry):
    """What builds an op's program (its static arguments, its inputs' base shapes, view chains and
    view sizes, its outputs' shapes), ints included: (targs, tkw, inputs, outputs)."""
    if len(entry.out) < 4:      # a compiled graph (deferfuse/compiled.py), not an op
        raise Refused(f"{entry.name} cannot run padded")
    info, targs, tkw, sigs, dev = entry.key
    ins = []
    for i in sigs:
        sig = sig_id.of.get(i)
        if sig is None:
            raise Refused("a signature was dropped from the table")
        base_shape, base_dtype, chain, size, stride, dtype = sig
        ins.append((tuple(base_shape), to_np_dtype(base_dtype), chain, tuple(size), dtype))
    outs = tuple(None if a is None else (tuple(a[0]), a[1]) for a in entry.out[3])
    return (targs, tkw, tuple(ins), outs)


def _chain_sizes(op) -> bool:
    """Whether every int of a view step's arguments is a size (a reshape's, an expand's: NOTE
    [padding rules] in lowering/padding.py)."""
    low = LOWERINGS.get(op)
    r = None if low is None else low.pad
    return type(r) is Reshape or (type(r) is MoveDims and bool(r.sizes))


def _scan(x, may: bool, ints: list, mask: list):
    """``x``'s skeleton (``_skeleton``), its ints appended to ``ints`` in ``_put`` order, each with
    whether it may change with the length (``mask``); slot markers' indices never may (a tensor or
    scalar input's place is structure). One walk for both: a second process flattens every op
    entry of every length it sees."""
    t = type(x)
    if t is int:
        ints.append(x)
        mask.append(may)
        return None
    if t is tuple or t is list:
        if x and (x[0] is TS or x[0] is SS):
            may = False
        return tuple([_scan(y, may, ints, mask) for y in x])
    return x


def flatten(entry):
    """(ints, may-change mask, skeleton) of an op's ``parts``."""
    info = entry.key[0]
    targs, tkw, ins, outs = parts(entry)
    # The static arguments that are sizes, the only ints of an op's arguments that may change
    # with the length (its padding rule's ``sizes``: NOTE [padding rules] in lowering/padding.py).
    rule = getattr(info.low, "pad", None)
    size_args = rule.sizes if rule is not None else ()
    ints, mask = [], []
    s_targs = tuple([_scan(a, i in size_args, ints, mask) for i, a in enumerate(targs)])
    s_tkw = tuple([(_skeleton(k), _scan(v, k in size_args, ints, mask)) for k, v in tkw])
    s_ins = []
    for bshape, bdt, chain, size, dt in ins:
        k0 = len(ints)
        s_b = _scan(bshape, True, ints, mask)
        if chain and chain[0][0] in _WINDOWS and type(bshape) is tuple:
            # NOTE [window bases]: the dim a window or index starts along may follow a size of
            # its own (2 in the mask, truthy: it may change)
            st = chain[0]
            if st[0] is DSELECT or (len(st[1]) == 3 and st[1][2] == 1):
                d = st[1][0]
                if type(d) is int and -len(bshape) <= d < len(bshape):
                    mask[k0 + d % len(bshape)] = FREE
        s_chain = []
        for op, args, kw in chain:
            if _chain_sizes(op):
                s_a = _scan(args, True, ints, mask)
            elif op is DSLICE:
                dim, length, stp = args
                s_a = (_scan(dim, False, ints, mask), _scan(length, True, ints, mask),
                       _scan(stp, False, ints, mask))
            else:
                s_a = _scan(args, False, ints, mask)
            s_chain.append((_skeleton(op), s_a, _scan(kw, False, ints, mask)))
        s_ins.append((s_b, _skeleton(bdt), tuple(s_chain), _scan(size, True, ints, mask),
                      _skeleton(dt)))
    return ints, mask, (s_targs, s_tkw, tuple(s_ins), _scan(outs, True, ints, mask))


class Fit:
    """How a region's sizes follow one length ``s``: each int's form ``(a, b)``, its value
    ``a * s + b`` (``s`` is 0 at the first version seen); ``free``: the positions of ints that
    follow a size of their own (NOTE [window bases]), whose form ``(0, Q)`` takes any value up
    to ``Q``, the bucket they are padded to."""
    __slots__ = ("pos0", "forms", "skels", "n", "free")

    def value(self, ints) -> int | None:
        """``s`` of a version with these ints, or None if it does not fit."""
        if len(ints) != self.n:
            return None
        a0, b0 = self.forms[self.pos0]
        s, r = divmod(ints[self.pos0] - b0, a0)
        if r:
            return None
        for v, (a, b) in zip(ints, self.forms):
            if v != a * s + b:
                return s if self.free and _free_at(self, ints, s) else None
        return s

    def over(self, ints):
        """Where this fit takes ``ints`` but for free ints past their buckets: {position: the
        bucket the int needs}, else None (NOTE [window bases])."""
        if not self.free or len(ints) != self.n:
            return None
        a0, b0 = self.forms[self.pos0]
        s, r = divmod(ints[self.pos0] - b0, a0)
        if r:
            return None
        out = {}
        for k, (v, (a, b)) in enumerate(zip(ints, self.forms)):
            if v == a * s + b or (k in self.free and 0 <= v <= b):
                continue
            if k not in self.free or v < 0:
                return None
            out[k] = bucket_of(v)
        return out or None

    def bucket(self, s: int) -> int:
        """The ``s`` a version of length ``s`` is padded to: where the length's own size (the
        changing size with the smallest step, ``pos0``: the batch, not the ``T * B`` rows it is a
        factor of) reaches the next power of two (``bucket_of``)."""
        a0, b0 = self.forms[self.pos0]
        return -(-(bucket_of(a0 * s + b0) - b0) // a0)


def _free_at(f, ints, s) -> bool:
    """Whether every int of ``ints`` is on ``f``'s forms at ``s``, free ints up to their
    buckets."""
    free = f.free
    for k, (v, (a, b)) in enumerate(zip(ints, f.forms)):
        if v != a * s + b and not (k in free and 0 <= v <= b):
            return False
    return True


def fit(versions, mask) -> Fit | None:
    """The forms of versions' ints (lists of equal length, the first two different; an int may
    change only where ``mask`` says so), or None: every int is constant or grows (or shrinks)
    with one length, as the first two versions say and every other one confirms. Where they do
    not, and the ints that break the line are window bases (``FREE`` in the mask), those follow
    sizes of their own (NOTE [window bases])."""
    if not all(len(v) == len(mask) for v in versions):
        return None
    f = _fit(versions, mask, frozenset())
    if f is not None or FREE not in mask:
        return f
    free = frozenset(k for k, m in enumerate(mask)
                     if m == FREE and len({v[k] for v in versions}) > 1)
    return _fit(versions, mask, free) if free else None


def _fit(versions, mask, free) -> Fit | None:
    i1, i2 = versions[0], versions[1]
    ds = [0 if k in free else y - x for k, (x, y) in enumerate(zip(i1, i2))]
    nz = [d for d in ds if d]
    if not nz:
        return None
    g = 0
    for d in nz:
        g = math.gcd(g, abs(d))
    if nz[0] < 0:
        g = -g
    forms = []
    for k, (x, d, may) in enumerate(zip(i1, ds, mask)):
        if k in free:
            forms.append((0, bucket_of(max(v[k] for v in versions))))
        elif not d:
            forms.append((0, x))
        elif not may or d * g < 0:
            return None
        else:
            forms.append((d // g, x))
    f = Fit()
    # the length's own size: the changing int with the smallest step (a batch ``B``, not the
    # ``T * B`` rows of a merged dim, whose bucket would follow ``T * B``'s powers of two)
    f.pos0 = min((k for k, (a, _) in enumerate(forms) if a), key=lambda k: forms[k][0])
    f.forms, f.n, f.free = forms, len(forms), free
    for v in versions[2:]:
        if f.value(v) is None:
            return None
    return f


# The smallest bucket. Every bucket a growing loop passes through is one program to compile, and
# XLA's compile time depends on the program's ops, not its sizes (0.5-1 s for nanoGPT's 35-op token
# on the development machine, quiet), while padding a short length to 32 costs little next to a
# program's launch: nanoGPT's sampling from one token compiled buckets 8, 16, 32 and 64, now 32
# and 64.
MIN_BUCKET = 32


def bucket_of(t: int) -> int:
    """The bucket of length ``t``: the next power of two (at least ``MIN_BUCKET``)."""
    return max(MIN_BUCKET, 1 << max(t - 1, 0).bit_length())


# --------------------------------------------------------------------------- shape forms
# Forms are pairs (a, b) standing for a * s + b; a structure holding forms is made concrete at a
# length with ``at``. (Every int of a structure becomes a form, so a pair of ints is always one.)
_PROBES = (101, 211, 307)


def _is_form(x) -> bool:
    return type(x) is tuple and len(x) == 2 and type(x[0]) is int and type(x[1]) is int


def at(x, t: int):
    """``x`` with each form made its value at length ``t``."""
    if _is_form(x):
        return x[0] * t + x[1]
    tx = type(x)
    if tx is tuple:
        return tuple(at(y, t) for y in x)
    if tx is list:
        return [at(y, t) for y in x]
    return x


def _padded(form_shape) -> bool:
    return any(a for a, _ in form_shape)
