"""Buckets (NOTE [buckets] in buckets.py): the ints of a region's structure, how they follow one
length (``Fit``), the bucket a length is padded to, and shape forms (``a * s + b``)."""
from __future__ import annotations

import math

from ..scheduler.records import sig_id
from .dtypes import to_np_dtype
from .lowering import LOWERINGS
from .lowering.padding import MoveDims, Reshape
from .node import SS, TS
from .viewchain import DSLICE


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
        s_b = _scan(bshape, True, ints, mask)
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
    ``a * s + b`` (``s`` is 0 at the first version seen)."""
    __slots__ = ("pos0", "forms", "skels", "n")

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
                return None
        return s

    def bucket(self, s: int) -> int:
        """The ``s`` a version of length ``s`` is padded to: where the first size that changes
        reaches the next power of two (``bucket_of``)."""
        a0, b0 = self.forms[self.pos0]
        return -(-(bucket_of(a0 * s + b0) - b0) // a0)


def fit(versions, mask) -> Fit | None:
    """The forms of versions' ints (lists of equal length, the first two different; an int may
    change only where ``mask`` says so), or None: every int is constant or grows (or shrinks)
    with one length, as the first two versions say and every other one confirms."""
    i1, i2 = versions[0], versions[1]
    if not all(len(v) == len(mask) for v in versions):
        return None
    ds = [y - x for x, y in zip(i1, i2)]
    nz = [d for d in ds if d]
    if not nz:
        return None
    g = 0
    for d in nz:
        g = math.gcd(g, abs(d))
    if nz[0] < 0:
        g = -g
    forms = []
    for x, d, may in zip(i1, ds, mask):
        if not d:
            forms.append((0, x))
        elif not may or d * g < 0:
            return None
        else:
            forms.append((d // g, x))
    f = Fit()
    f.pos0 = next(k for k, (a, _) in enumerate(forms) if a)
    f.forms, f.n = forms, len(forms)
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
