"""Buckets: one program for every length of a region whose sizes keep changing.

NOTE [buckets]: a loop that grows a sequence (generate() appending a token with ``torch.cat``, a KV
cache growing by one position per step) records the same region again and again with one size
changed, and each version was a compile (a 1,800-op region compiled again per length, or the
changing ops run one by one). Here such a region runs as a program compiled for a *bucket* of
lengths: every size that depends on the length is padded to what it is where the first of them
reaches the next power of two, the inputs are padded with zeros (on the host: a new length costs no
compile), the program runs, and each output is cut back to its exact size. The exact length is a
program input, so masks and offsets inside use it.

Finding the length. Two versions of a structure (same ops and wiring) that differ in sizes are
compared int by int: every int in the ops' structure (the sizes of their inputs, views and outputs,
and static arguments that are sizes; nothing else may change) must be constant or ``a * s + b``,
with integers ``a`` (all of one sign) and ``b``, one length ``s`` for the whole region (0 at the
first version). Every later version is checked before it runs; one that does not fit compiles
exactly (counted in ``metrics()['bucket_misfits']``). The second version already runs padded: it
fits by construction, and the rules below make any version that fits exact.

Padding is exact where it is used. Data that the padding adds is never read into a valid position:
each op is admitted only by a rule below, from what it does along its padded dims (dims whose size
depends on the length; valid data is the prefix of exact size ``a * s + b``), and anything else
refuses the whole region (it then runs as before; ``metrics()['bucket_refusals']`` says which op):

- elementwise ops (PyTorch's ``pointwise`` tag) and dtype conversions; factories and ``tril``/
  ``triu``, whose values depend on the index alone (``arange(T)`` padded is ``arange(P)``, whose
  first T values are ``arange(T)``'s), ``cumsum`` (a prefix depends on the prefix);
- views that move dims (transpose, permute, squeeze, unsqueeze, expand); reshapes that keep each
  padded dim the first dim of its group of merged or split dims (``(T, C) -> (T * C)``, never
  ``(B, T) -> (B * T)``, which would interleave padding with data); windows at dynamic offsets
  along a padded dim (``x[:, -1]``, ``x[:, i:i+k]``: the offset is the exact one, data);
- reductions, softmax and log-softmax over padded dims with the padding masked by the reduction's
  identity (0 for sums, -inf for maxima and softmax; a mean divides by the exact count);
  reductions and layer norms over other dims;
- matrix products with padded dims contracted: both operands masked to 0 there;
- fused attention with padded keys: a key mask added (and the values masked to 0);
- embeddings, ``gather`` and ``index_select`` with padded indices: the indices masked to 0 (so a
  padded index never trips the index check); ``gather``/``index_select`` along a padded dim: the
  indices checked against the dim's exact length (CPU's error and message; negative indices are
  out of range for them, as on CPU);
- ``topk`` over other dims (elementwise in the padded ones) and along a padded dim: the padding
  filled with what is never selected (-inf, or the least integer, for the largest; NaN, which
  sorts last after any valid NaN, or the greatest integer, for the smallest) and ``k`` checked
  against the exact length;
- advanced indexing (``x[:, [-1]]``, ``x[i, j]``) with integer index tensors: padded index
  entries masked to 0, and an index into a padded dim checked against the exact length and
  wrapped by it (``-1`` is the last valid position; an out-of-range index raises CPU's error
  naming the exact size);
- ``cat`` along a padded dim: each input written at its exact offset into the padded output;
- in-place writes that are elementwise, to a whole tensor (not a view of one): in-place pointwise
  ops (``masked_fill_``, ``add_``) and ``x[mask] = v`` (``index_put_`` with one boolean mask over
  leading dims and one value: nanoGPT's ``logits[logits < v[:, [-1]]] = -inf``); what they write
  into the padding stays padding;
- ``multinomial`` over the last dim with other dims padded: padded rows are given ones (a valid
  distribution, so CPU's checks see only valid rows), their samples are cut off.

Other in-place writes (to a view, ``index_copy_``, a mask's count of values), other random ops
touching padded dims and everything not listed refuse the region. Where a region is refused, its
shapes go on compiling as before (shape churn: runtime/flush.py). Programs are kept per
(structure, bucket); a bucket's program is stored on disk like any other (NOTE [program store] in
diskcache.py).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..scheduler.records import sig_id
from .dtypes import to_np_dtype, x64
from .learned import LearnedStore
from .lowering import aten, check, check_index_sized
from .node import CS, SS, TS, _fill, _rounded
from .viewchain import DSELECT, DSLICE, DSTRIDED, DYNAMIC, apply_chain, apply_step

_DIM_MOVERS = {getattr(getattr(aten, p), o) for p, o in (
    ("transpose", "int"), ("t", "default"), ("permute", "default"), ("unsqueeze", "default"),
    ("squeeze", "default"), ("squeeze", "dim"), ("squeeze", "dims"), ("alias", "default"),
    ("detach", "default"), ("lift_fresh", "default"), ("expand", "default"), ("_conj", "default"))
    if hasattr(getattr(aten, p, None), o)}
_RESHAPES = {getattr(getattr(aten, p), o) for p, o in (
    ("view", "default"), ("_unsafe_view", "default"), ("reshape", "default"),
    ("_reshape_alias", "default"), ("view_copy", "default"), ("flatten", "using_ints"))
    if hasattr(getattr(aten, p, None), o)}
_FACTORIES = {getattr(getattr(aten, p), o) for p, o in (
    ("arange", "default"), ("arange", "start"), ("arange", "start_step"), ("full", "default"),
    ("zeros", "default"), ("ones", "default"), ("new_full", "default"), ("new_zeros", "default"),
    ("new_ones", "default"), ("zeros_like", "default"), ("ones_like", "default"),
    ("full_like", "default"), ("scalar_tensor", "default"), ("tril", "default"),
    ("triu", "default"), ("_to_copy", "default"), ("clone", "default"), ("stack", "default"))
    if hasattr(getattr(aten, p, None), o)}
# reductions: op -> (position of the dims argument, or None: all dims; identity of the padding)
_REDUCTIONS = {
    aten.sum.dim_IntList: (1, 0), aten.sum.default: (None, 0),
    aten.mean.dim: (1, "mean"), aten.mean.default: (None, "mean"),
    aten.amax.default: (1, "-inf"), aten.amin.default: (1, "+inf"),
    aten.max.dim: (1, "-inf"), aten.min.dim: (1, "+inf"),
    aten.argmax.default: (1, "-inf"), aten.argmin.default: (1, "+inf"),
    aten.max.default: (None, "-inf"), aten.min.default: (None, "+inf"),
    aten._softmax.default: (1, "-inf"), aten._log_softmax.default: (1, "-inf"),
    aten.logsumexp.default: (1, "-inf"),
    aten.any.dim: (1, False), aten.any.default: (None, False),
    aten.all.dim: (1, True), aten.all.default: (None, True),
}
if hasattr(aten, "_safe_softmax"):
    _REDUCTIONS[aten._safe_softmax.default] = (1, "-inf")
_SCANS = {aten.cumsum.default, aten.cumprod.default}
# products: op -> ((input, contracted dim), ...)
_PRODUCTS = {aten.mm.default: ((0, 1), (1, 0)), aten.addmm.default: ((1, 1), (2, 0)),
             aten.bmm.default: ((0, 2), (1, 1)), aten.baddbmm.default: ((1, 2), (2, 1)),
             aten.linear.default: ((0, -1), (1, 1)), aten.mv.default: ((0, 1), (1, 0)),
             aten.dot.default: ((0, 0), (1, 0))}
_SDPA = getattr(getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None), "default",
                None)
# index ops: op -> (input holding indices, input indexed, the dim it is indexed along or None)
_INDEXED = {aten.embedding.default: (1, 0, 0)}
# ops taking indices along a dim (input 0 indexed by input 1 along the dim, argument 1)
_ALONG = {aten.gather.default, aten.index_select.default}
_TOPK = aten.topk.default
_MULTINOMIAL = aten.multinomial.default
_INDEX = aten.index.Tensor
_LAYER_NORM = aten.native_layer_norm.default
_CAT = aten.cat.default


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


# Static arguments that are sizes, the only ints of an op's arguments that may change with the
# length (a baked number, a dim, an offset of an op that is not a window must stay the same):
# op -> positions (or keyword names).
_SIZE_ARGS = {}
for _n, _pos in (("full.default", (0, "size")), ("zeros.default", (0, "size")),
                 ("ones.default", (0, "size")), ("new_full.default", (1, "size")),
                 ("new_zeros.default", (1, "size")), ("new_ones.default", (1, "size")),
                 ("arange.default", (0, "end")), ("arange.start", (1, "end")),
                 ("arange.start_step", (1, "end")), ("view_copy.default", (1, "size")),
                 ("_unsafe_view.default", (1, "size")), ("view.default", (1, "size")),
                 ("reshape.default", (1, "shape")), ("expand.default", (1, "size")),
                 ("expand_copy.default", (1, "size"))):
    _p, _, _o = _n.partition(".")
    _f = getattr(getattr(aten, _p, None), _o, None)
    if _f is not None:
        _SIZE_ARGS[_f] = _pos


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
    size_args = _SIZE_ARGS.get(info.func, ())
    ints, mask = [], []
    s_targs = tuple([_scan(a, i in size_args, ints, mask) for i, a in enumerate(targs)])
    s_tkw = tuple([(_skeleton(k), _scan(v, k in size_args, ints, mask)) for k, v in tkw])
    s_ins = []
    for bshape, bdt, chain, size, dt in ins:
        s_b = _scan(bshape, True, ints, mask)
        s_chain = []
        for op, args, kw in chain:
            if op in _RESHAPES or op is _EXPAND:
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


def _step_forms(fstep, fin, dtype, learned=None) -> tuple:
    """The forms of a view step's output shape, from its shape at two lengths (kept in
    ``learned``, a LearnedStore, for the next process: NOTE [learned on disk] in learned.py)."""
    key = shapes = None
    if learned is not None and learned.on:
        from .diskcache import Unstable, describe
        try:
            key = describe(("step", fstep, fin, str(dtype), _PROBES[:2]))
        except Unstable:
            key = None
        shapes = learned.step(key) if key is not None else None
    if shapes is None:
        shapes = []
        for t in _PROBES[:2]:
            st = at(fstep, t)
            x = jax.ShapeDtypeStruct(at(fin, t), dtype)
            shapes.append(tuple(jax.eval_shape(lambda v: apply_step(v, st, 0), x).shape))
        if key is not None:
            learned.put("steps", key, tuple(shapes))
    (s1, s2), (t1, t2) = shapes, _PROBES[:2]
    out = []
    for x, y in zip(s1, s2):
        a, r = divmod(y - x, t2 - t1)
        if r:
            raise Refused("a view whose size is not linear in the length")
        out.append((a, x - a * t1))
    return tuple(out)


def _check_reshape(fin, fout, name) -> None:
    """NOTE [buckets]: a reshape keeps each padded dim the first of its group of dims."""
    fin = [f for f in fin if f != (0, 1)]
    fout = [f for f in fout if f != (0, 1)]

    def prod(g):
        out = []
        for t in _PROBES:
            p = 1
            for a, b in g:
                p *= a * t + b
            out.append(p)
        return out
    i = j = 0
    while i < len(fin) or j < len(fout):
        if i >= len(fin) or j >= len(fout):
            raise Refused(f"{name}: a reshape whose sizes do not match")
        gi, gj = [fin[i]], [fout[j]]
        i, j = i + 1, j + 1
        while prod(gi) != prod(gj):
            if prod(gi)[0] < prod(gj)[0]:
                if i >= len(fin):
                    raise Refused(f"{name}: a reshape whose sizes do not match")
                gi.append(fin[i])
                i += 1
            else:
                if j >= len(fout):
                    raise Refused(f"{name}: a reshape whose sizes do not match")
                gj.append(fout[j])
                j += 1
        for g in (gi, gj):
            if any(a for a, _ in g[1:]):
                raise Refused(f"{name}: a reshape that merges a padded dim behind another dim")
        if bool(gi[0][0]) != bool(gj[0][0]):
            raise Refused(f"{name}: a reshape that moves padding")


_SLICE = aten.slice.Tensor
_SELECT = aten.select.int
_EXPAND = aten.expand.default


def _chain_forms(fbase, dtype, fchain, name, learned=None) -> tuple:
    """The forms of a view chain's result, checking each step (NOTE [buckets])."""
    form = tuple(fbase)
    for fstep in fchain:
        op = fstep[0]
        out = _step_forms(fstep, form, dtype, learned)
        if not (_padded(form) or _padded(out)) or op in _DIM_MOVERS or op is DSELECT:
            pass        # (DSELECT: the index is data, inside the exact extent)
        elif op in _RESHAPES:
            _check_reshape(form, out, name)
        elif op is DSLICE:
            dim, length, stp = at(fstep[1], _PROBES[0])
            # A window's padded length may grow no faster than its base's: XLA moves the start of
            # a slice that would run past the end back inside (``dynamic_slice`` clamps), so
            # ``data[990:994]`` of 1,000 rows padded to 32 read rows 968..999, its valid prefix
            # the wrong rows (a ragged last batch of a long dataset).
            if out[dim][0] > form[dim][0]:
                raise Refused(f"{name}: a window whose padded length grows faster than its base "
                              "(it could pass the base's end)")
            if form[dim][0] and stp != 1 and out[dim][0]:
                raise Refused(f"{name}: a strided window along a padded dim")
        elif op is _SLICE or op is _SELECT:
            dim = at(fstep[1][0] if fstep[1] else (0, 0), 0) % max(len(form), 1)
            if form[dim][0]:
                raise Refused(f"{name}: a fixed slice along a padded dim")
        else:
            raise Refused(f"{name}: view {op} of a padded tensor")
        form = out
    return form


# --------------------------------------------------------------------------- one op's plan
class NodePlan:
    """How one op runs padded: its structure as forms, its rule and what the rule needs."""
    __slots__ = ("rule", "extra", "low", "meta", "name", "targs", "tkw", "chains", "out_avals",
                 "in_forms", "out_forms", "base_forms", "ndyn", "mut", "read_forms")


def _is_pointwise(func) -> bool:
    import torch        # (tags only: the runtime holds no torch tensors)
    return torch.Tag.pointwise in func.tags


def _arg(targs, tkw, pos, name):
    """A static argument of the op: positional ``pos`` or keyword ``name`` (None if absent)."""
    v = None
    if pos is not None and pos < len(targs):
        v = targs[pos]
    else:
        for k, x in tkw:
            if k == name:
                v = x
    if type(v) is tuple and v and v[0] is CS:
        return v[2]
    if type(v) is tuple and v and v[0] in (TS, SS):
        raise Refused("a tensor or scalar input where a static argument was expected")
    return v


def _forms_in(x, out=None) -> list:
    """The forms in a structure."""
    out = [] if out is None else out
    if _is_form(x):
        out.append(x)
    elif type(x) is tuple or type(x) is list:
        for y in x:
            _forms_in(y, out)
    return out


def plan_node(entry, forms, learned=None) -> NodePlan:
    """The plan of one op whose ints have ``forms`` (in ``parts`` order); raises ``Refused``."""
    info = entry.key[0]
    func, name = info.func, info.name
    targs, tkw, ins, outs = parts(entry)
    it = iter(forms)
    f_targs, f_tkw, f_ins, f_outs = (_put(targs, it), _put(tkw, it), _put(ins, it),
                                     _put(outs, it))
    n = NodePlan()
    n.name, n.low, n.meta = name, info.low, info.low.meta
    n.targs, n.tkw = f_targs, f_tkw
    n.chains = tuple(fi[2] for fi in f_ins)
    n.base_forms = tuple(tuple(fi[0]) for fi in f_ins)
    n.out_avals = f_outs
    n.ndyn = [sum(1 for st in c if st[0] in DYNAMIC) for c in n.chains]
    n.in_forms = []
    for (bshape, bdt, chain, size, dt), (fb, _, fchain, fsize, _) in zip(ins, f_ins):
        fin = _chain_forms(fb, bdt, fchain, name, learned) if chain else tuple(fb)
        if tuple(fin) != tuple(fsize):
            raise Refused(f"{name}: a view whose sizes do not follow from its chain")
        n.in_forms.append(tuple(fsize))
    n.out_forms = [None if o is None else tuple(o[0]) for o in f_outs]
    # What later ops read of each output: a write's outputs are the new values of the bases it
    # wrote (runtime/node.py, ``build``), whole even when it wrote through a view of one
    # (nanoGPT's ``logits[logits < v] = -inf`` on ``x[:, -1, :]``).
    n.read_forms = list(n.out_forms)
    for j, m in enumerate(entry.out[1] or ()):
        if j < len(n.read_forms) and m < len(n.base_forms):
            n.read_forms[j] = n.base_forms[m]
    n.rule, n.extra, n.mut = "exact", entry.fn, None
    touched = (any(_padded(f) for f in n.in_forms) or any(_padded(fb) for fb in n.base_forms)
               or any(f is not None and _padded(f) for f in n.out_forms)
               or any(a for a, _ in _forms_in(f_targs)) or any(a for a, _ in _forms_in(f_tkw)))
    if not touched:
        return n        # nothing of it depends on the length: its own function, unpadded
    n.rule, n.extra = "plain", None     # (its function is the op: a stable program-store key)
    mut, rng = entry.out[1], entry.out[2]
    if rng:
        fp = n.in_forms[0] if n.in_forms else ()
        if func is not _MULTINOMIAL or mut or len(fp) < 2 or fp[-1][0]:
            raise Refused(f"{name} draws random numbers")
        # rows drawn from independently: padded rows are given a valid distribution (ones) so
        # the distribution checks see only valid rows; their samples are cut off
        n.rule, n.extra, n.mut = "multinomial", None, "rng"
        return n
    if mut:
        func = _plan_write(n, info, ins, targs, tkw, mut, name)
    if func in _BOOL_PUT:
        pass                                # (_plan_write: elementwise)
    elif func in _FACTORIES or _is_pointwise(func):
        # Broadcasting: each input's dim (aligned from the right) is the output's or a 1.
        fo = n.out_forms[0] if n.out_forms and n.out_forms[0] is not None else None
        if fo is not None and func not in _FACTORIES:
            for f in n.in_forms:
                for d in range(1, len(f) + 1):
                    if d > len(fo) or (f[-d] != fo[-d] and f[-d] != (0, 1)):
                        raise Refused(f"{name}: inputs whose sizes do not broadcast alike "
                                      "padded")
    elif func in _REDUCTIONS:
        pos, ident = _REDUCTIONS[func]
        f0 = n.in_forms[0]
        nd = len(f0)
        dims = _arg(targs, tkw, pos, "dim") if pos is not None else None
        if dims is None or dims == () or dims == []:
            if func in (aten.argmax.default, aten.argmin.default) and _padded(f0):
                raise Refused(f"{name} over every dim of a padded tensor (a flat index)")
            dims = tuple(range(nd))
        elif type(dims) is int:
            dims = (dims,)
        dims = tuple(d % max(nd, 1) for d in dims)
        pdims = tuple(d for d in dims if d < nd and f0[d][0])
        if pdims:
            n.rule, n.extra = "reduce", (pdims, ident, dims)
    elif func in _SCANS:
        pass                                # each position depends on the prefix only
    elif func in _RESHAPES and n.out_forms and n.out_forms[0] is not None:
        # a recorded reshape (``_unsafe_view`` after a matmul): a copy whose padding stays where
        # a view's would (NOTE [buckets])
        _check_reshape(n.in_forms[0], n.out_forms[0], name)
    elif func is _LAYER_NORM:
        k = len(_arg(targs, tkw, 1, "normalized_shape"))
        if _padded(n.in_forms[0][len(n.in_forms[0]) - k:]):
            raise Refused(f"{name} normalizes over a padded dim")
    elif func in _PRODUCTS:
        masks = []
        for i, d in _PRODUCTS[func]:
            f = n.in_forms[i]
            d %= len(f)
            if f[d][0]:
                masks.append((i, d))
        if masks:
            n.rule, n.extra = "contract", tuple(masks)
    elif _SDPA is not None and func is _SDPA:
        q, k, v = n.in_forms[:3]
        if q[-1][0] or k[-1][0] or v[-1][0]:
            raise Refused(f"{name} with a padded head dim")
        if k[-2][0]:
            n.rule, n.extra = "sdpa", k[-2]
    elif func in _INDEXED:
        ii, xi, _ = _INDEXED[func]
        if func is aten.embedding.default and _padded(n.in_forms[xi]):
            raise Refused(f"{name} of a padded table")
        if _padded(n.in_forms[ii]):
            n.rule, n.extra = "index", ii
    elif func is _INDEX:
        n.rule, n.extra = "advanced", _plan_index(n, ins, targs, name)
    elif func in _ALONG:
        n.rule, n.extra = "along", _plan_along(n, func, targs, tkw, name)
    elif func is _TOPK:
        fx = n.in_forms[0]
        d = _arg(targs, tkw, 2, "dim")
        d = (-1 if d is None else d) % max(len(fx), 1)
        if fx and fx[d][0]:
            k = _arg(targs, tkw, 1, "k")
            largest = _arg(targs, tkw, 3, "largest")
            n.rule, n.extra = "topk", (d, fx[d], k, True if largest is None else bool(largest))
    elif func is _CAT:
        fo = n.out_forms[0]
        d = (_arg(targs, tkw, 1, "dim") or 0) % len(fo)
        if fo[d][0]:
            if any(len(f) != len(fo) for f in n.in_forms):
                raise Refused(f"{name} of tensors of other ranks")
            n.rule, n.extra = "cat", (d, tuple(f[d] for f in n.in_forms))
    else:
        raise Refused(f"{name} has no rule for padded dims")
    return n


def _plan_index(n: NodePlan, ins, targs, name):
    """``x[..., i, ...]`` (``index.Tensor``, integer index tensors): each index tensor's padded
    positions are masked to 0, and an index along a padded dim of ``x`` is checked against and
    wrapped by the dim's exact length (``x[:, [-1]]`` is the last valid position, not the padded
    end). Returns ((input, its padded dims), ...) and ((input, form of the dim it indexes, its
    number among the index tensors), ...)."""
    f0 = n.in_forms[0]
    slots = targs[1] if len(targs) > 1 else ()
    masks, wraps, seen = [], [], set()
    k = 0
    for d, sl in enumerate(slots):
        if sl is None:
            continue
        i = sl[1]
        if to_np_dtype(ins[i][4]) in (np.bool_, np.uint8):
            raise Refused(f"{name} with a boolean mask (a data-dependent shape)")
        fi = n.in_forms[i]
        if _padded(fi) and i not in seen:
            masks.append((i, tuple(range(len(fi)))))
        if f0[d][0]:
            if i in seen:
                raise Refused(f"{name}: one index tensor for two dims")
            wraps.append((i, f0[d], k))
        seen.add(i)
        k += 1
    return tuple(masks), tuple(wraps)


_BOOL_PUT = {f for f in (getattr(getattr(aten, p, None), "default", None)
                         for p in ("index_put", "index_put_", "_index_put_impl_")) if f is not None}


def _plan_write(n: NodePlan, info, ins, targs, tkw, mut, name):
    """An op writing tensors in place (NOTE [buckets]): admitted where the write is elementwise
    and each tensor written is a whole base (no view of it), so the padding written is padding:
    an in-place pointwise op (``masked_fill_``, ``add_``), or ``x[mask] = v`` (``index_put_``
    with one boolean mask over x's leading dims and one value, which PyTorch makes of
    ``logits[logits < v] = -inf``). Sets ``n.mut``; returns the op whose rule applies."""
    for m in mut:
        if n.chains[m]:
            raise Refused(f"{name} writes a view of a padded tensor in place")
    func = info.func
    if func in _BOOL_PUT:
        slots = targs[1] if len(targs) > 1 else ()
        used = [sl for sl in slots if sl is not None]
        vals = targs[2] if len(targs) > 2 else None
        if (len(used) != 1 or to_np_dtype(ins[used[0][1]][4]) not in (np.bool_, np.uint8)
                or slots[0] is None):
            raise Refused(f"{name} with other than one boolean mask")
        fx, fm = n.in_forms[0], n.in_forms[used[0][1]]
        if tuple(fm) != tuple(fx[:len(fm)]):
            raise Refused(f"{name}: a mask whose sizes are not its input's")
        if not (type(vals) is tuple and vals and vals[0] is TS) or \
                any(f != (0, 1) for f in n.in_forms[vals[1]]):
            raise Refused(f"{name} writing more than one value through a mask")
    else:
        f = info.functional or func
        if not _is_pointwise(f):
            raise Refused(f"{name} writes a tensor in place")
        func = f
    n.mut = (tuple(mut), info.kind == "self_mut")
    return func


def _plan_along(n: NodePlan, func, targs, tkw, name):
    """``gather`` and ``index_select`` (input 0 indexed by input 1 along ``dim``): the index's
    padded positions masked to 0; an index along a padded dim checked against the dim's exact
    length (negative indices are out of range for these ops, as on CPU) with CPU's error.
    Returns (mask the index?, the form of the dim indexed if padded, exception, message)."""
    fx, fi = n.in_forms[0], n.in_forms[1]
    nd = len(fx)
    d = (_arg(targs, tkw, 1, "dim") or 0) % max(nd, 1)
    if func is aten.gather.default:
        if len(fi) != nd:
            raise Refused(f"{name} with an index of another rank")
        for j in range(nd):
            if j != d and fi[j][0] and not (fi[j][0] <= fx[j][0] and fi[j][1] <= fx[j][1]):
                raise Refused(f"{name}: an index padded along a dim its input is not")
        exc, msg = RuntimeError, f"index {{index}} is out of bounds for dimension {d} with size " \
            "{size}"
    elif nd > 1 and d == 1:
        exc, msg = RuntimeError, "INDICES element is out of DATA bounds, id={index} axis_dim={size}"
    else:
        exc, msg = IndexError, "index out of range in self"
    wrap = fx[d] if nd and fx[d][0] else None
    return _padded(fi), wrap, exc, msg


# --------------------------------------------------------------------------- the padded program
def _zero_outside(ix, ext):
    """Indices outside [0, ext) (already flagged by an index check) read position 0 instead."""
    return jnp.where((ix < 0) | (ix >= ext), jnp.zeros((), ix.dtype), ix)


def _valid(shape, dim, form, t):
    ext = form[0] * t + form[1]
    return lax.broadcasted_iota(jnp.int32, shape, dim) < ext


def _identity(ident, dtype):
    if ident == "mean" or ident == 0:
        return jnp.zeros((), dtype)
    if isinstance(ident, bool):
        return jnp.asarray(ident, dtype)
    big = ident == "+inf"
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(jnp.inf if big else -jnp.inf, dtype)
    if dtype == jnp.bool_:
        return jnp.asarray(big, dtype)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.max if big else info.min, dtype)


def _mask_dims(x, dims, forms, fill, t):
    for d in dims:
        if forms[d][0]:
            x = jnp.where(_valid(x.shape, d, forms[d], t), x, fill)
    return x


class NodeFn:
    """One op's padded function ``(arrays, scalars, t) -> outputs`` at bucket length ``P``."""

    def __init__(self, plan: NodePlan, P: int):
        self.p = plan
        self.targs = at(plan.targs, P)
        self.tkw = at(plan.tkw, P)
        self.chains = at(plan.chains, P)
        self.out_avals = at(plan.out_avals, P)
        self.dtypes = [None if a is None else a[1] for a in self.out_avals]

    def __call__(self, arrays, scalars, t):
        p = self.p
        rng_key = None
        if p.mut == "rng":     # the generator's (seed, offset) come last (NOTE [rng offsets])
            from . import prng
            rng_key = prng.key(scalars[-2], scalars[-1])
            scalars = scalars[:-2]
        total = sum(p.ndyn)
        dyns = [()] * len(self.chains)
        if total:
            k = len(scalars) - total
            scalars, offs = scalars[:k], scalars[k:]
            dyns, k = [], 0
            for n in p.ndyn:
                dyns.append(offs[k:k + n])
                k += n
        vals = [None if a is None else (apply_chain(a, c, d) if c else a)
                for a, c, d in zip(arrays, self.chains, dyns)]
        rule = p.rule
        if rule == "contract":
            for i, d in p.extra:
                vals[i] = _mask_dims(vals[i], (d % vals[i].ndim,), p.in_forms[i],
                                     jnp.zeros((), vals[i].dtype), t)
        elif rule == "index":
            i = p.extra
            vals[i] = _mask_dims(vals[i], range(vals[i].ndim), p.in_forms[i],
                                 jnp.zeros((), vals[i].dtype), t)
        elif rule == "advanced":
            masks, wraps = p.extra
            for i, dims in masks:
                vals[i] = _mask_dims(vals[i], dims, p.in_forms[i], jnp.zeros((), vals[i].dtype), t)
            for i, (a, b), k in wraps:
                ext = jnp.asarray(a * t + b)
                ix = vals[i]
                check_index_sized(ix, ext, IndexError,
                                  f"index {{index}} is out of bounds for dimension {k} with size "
                                  "{size}")
                ix = jnp.where(ix < 0, ix + ext.astype(ix.dtype), ix)
                vals[i] = _zero_outside(ix, ext)
        elif rule == "along":
            mask, wrap, exc, msg = p.extra
            ix = vals[1]
            if mask:
                ix = _mask_dims(ix, range(ix.ndim), p.in_forms[1], jnp.zeros((), ix.dtype), t)
            if wrap is not None:
                ext = jnp.asarray(wrap[0] * t + wrap[1])
                check_index_sized(ix, ext, exc, msg, allow_negative=False)
                ix = _zero_outside(ix, ext)
            vals[1] = ix
        elif rule == "multinomial":
            w = vals[0]
            vals[0] = _mask_dims(w, range(w.ndim - 1), p.in_forms[0], jnp.ones((), w.dtype), t)
        elif rule == "topk":
            d, form, k, largest = p.extra
            x = vals[0]
            # padding is never selected: the smallest value for largest (ties go to the lower,
            # valid, index), NaN for smallest (sorted last, after any valid NaN)
            if jnp.issubdtype(x.dtype, jnp.floating):
                fill = jnp.asarray(-jnp.inf if largest else jnp.nan, x.dtype)
            else:
                fill = _identity("-inf" if largest else "+inf", x.dtype)
            vals[0] = _mask_dims(x, (d,), p.in_forms[0], fill, t)
            check(form[0] * t + form[1] < k, RuntimeError, "selected index k out of range")
        elif rule == "reduce":
            pdims, ident, dims = p.extra
            x = vals[0]
            vals[0] = _mask_dims(x, pdims, p.in_forms[0], _identity(ident, x.dtype), t)
        elif rule == "sdpa":
            kf = p.extra
            k, v = vals[1], vals[2]
            vals[2] = _mask_dims(v, (v.ndim - 2,), p.in_forms[2], jnp.zeros((), v.dtype), t)
            vals[1] = k
        kw = dict(self.tkw)
        if rng_key is not None:
            kw["key"] = rng_key
        if p.meta:
            kw["_avals"] = self.out_avals
        args = [_fill(a, vals, scalars) for a in self.targs]
        kw = {k: _fill(x, vals, scalars) for k, x in kw.items()}
        if rule == "cat":
            res = [self._cat(args, t)]
        else:
            if rule == "sdpa":
                keys = _valid((vals[1].shape[-2],), 0, p.extra, t)
                m = kw.get("attn_mask")
                if m is None:
                    m = keys
                elif m.dtype == jnp.bool_:
                    m = m & keys
                else:
                    m = m + jnp.where(keys, jnp.zeros((), m.dtype), -jnp.inf)
                kw["attn_mask"] = m
            res = p.low.fn(*args, **kw)
            res = list(res) if isinstance(res, (tuple, list)) else [res]
            if type(p.mut) is tuple:   # the new values of the bases written (_plan_write)
                mut, self_mut = p.mut
                res = res if self_mut else res[:len(mut)]
                return [_rounded(jnp.broadcast_to(jnp.asarray(r), a[0]), jnp.dtype(a[1]))
                        for r, a in zip(res, self.out_avals)]
            if rule == "reduce" and p.extra[1] == "mean":
                res = [self._mean(vals[0], res[0], t)]
        return [r if r is None or d is None or r.dtype == d else r.astype(d)
                for r, d in zip(res, self.dtypes)]

    def _mean(self, x, out, t):
        """A mean over padded dims: the sum of the masked input over the exact count."""
        pdims, _, dims = self.p.extra
        f = self.p.in_forms[0]
        count = 1
        for d in dims:
            a, b = f[d]
            count = count * (a * t + b)
        dt = out.dtype
        keep = out.ndim == x.ndim
        s = jnp.sum(x.astype(dt), axis=dims, keepdims=keep)
        return s / count.astype(dt) if hasattr(count, "astype") else s / count

    def _cat(self, args, t):
        p = self.p
        d, forms = p.extra
        shape, dt = self.out_avals[0]
        out = jnp.zeros(shape, dt)
        off = jnp.zeros((), jnp.int32)
        xs = args[0]
        for x, (a, b) in zip(xs, forms):
            start = [jnp.zeros((), jnp.int32)] * len(shape)
            start[d] = off
            out = lax.dynamic_update_slice(out, x.astype(dt), start)
            off = off + (a * t + b)
        return out


# --------------------------------------------------------------------------- a region's plan
def _at(plan, ints, stats):
    """(plan, length) where ``plan`` (a region's bucket plan, or why it was refused) takes the
    sizes ``ints``, or None (a version off the plan's forms compiles exactly: bucket_misfits)."""
    if plan.__class__ is str:
        return None
    t = plan.fit.value(ints)
    if t is None:
        stats["bucket_misfits"] += 1
        return None
    return plan, t


class BucketPlan:
    """A region structure run in buckets: its fit, its ops' plans, the forms of its external
    inputs, and the programs made for it so far ((bucket length, outputs, scalar types) ->
    ``BucketProgram``)."""
    __slots__ = ("fit", "nodes", "ext_forms", "programs", "desc")


class BucketProgram:
    """One compiled program of a bucket (``P``), with its index-check messages; ``pick``: which
    of its outputs a run reads (None: all, in order; NOTE [fewer outputs])."""
    __slots__ = ("compiled", "msgs", "P", "runs", "summary", "pick")


def plan_region(f: Fit, entries, wirings, lengths, learned=None) -> BucketPlan:
    """The bucket plan of a region whose version ``entries`` fit ``f`` (``lengths``: how many
    ints each entry has); raises ``Refused``."""
    nodes, k = [], 0
    for e, m in zip(entries, lengths):
        nodes.append(plan_node(e, f.forms[k:k + m], learned))
        k += m
    ext_forms: dict = {}
    for j, (n, wiring) in enumerate(zip(nodes, wirings)):
        for i, w in enumerate(wiring):
            if w is None or i >= len(n.base_forms):
                continue
            bf = n.base_forms[i]
            if type(w) is int:
                if ext_forms.setdefault(w, bf) != bf:
                    raise Refused("an input read with two different sizes")
            else:
                src = nodes[w[0]].read_forms[w[1]]
                if src != bf:
                    raise Refused(f"{n.name}: an input whose sizes differ from its producer's")
    bp = BucketPlan()
    bp.fit, bp.nodes, bp.ext_forms, bp.programs = f, nodes, ext_forms, {}
    bp.desc = None
    return bp


def describe_plan(bp: BucketPlan, P: int, wirings, out_sig, is_float, device,
                  in_dtypes=()) -> str | None:
    """The stable description of a bucket's program (its program-store key): the plan at ``P``
    and the dtypes of the region's inputs (the plan's forms are sizes only)."""
    from .diskcache import Unstable, describe
    try:
        parts_ = ["bucket", str(P), str(device), describe(tuple(is_float)),
                  " ".join(str(d) for d in in_dtypes),
                  describe(tuple(out_sig)), describe(tuple(wirings)),
                  describe(tuple(sorted((k, at(v, P)) for k, v in bp.ext_forms.items())))]
        for n in bp.nodes:
            parts_.append(describe((n.name, n.rule, n.extra if n.rule != "exact" else None,
                                    at(n.targs, P), at(n.tkw, P), at(n.chains, P),
                                    at(n.out_avals, P), tuple(n.in_forms), n.base_forms)))
    except (Unstable, AttributeError):
        return None
    return "\n".join(parts_)


def region_function(bp: BucketPlan, P: int, wirings, scalar_counts, out_sig, is_float):
    """``(don, keep, packed scalars) -> (outputs, flags)`` of the region at bucket ``P``; the
    length ``T`` is the last scalar."""
    from .execute import _unpack_scalars, run_nodes
    fns = [n.extra if n.rule == "exact" else NodeFn(n, P) for n in bp.nodes]
    exact = [n.rule == "exact" for n in bp.nodes]
    starts, s0 = [], 0
    for c in scalar_counts:
        starts.append((s0, c))
        s0 += c
    is_float = tuple(is_float) + (False,)
    msgs: list = []

    def region(don, keep, packed):
        scalars = _unpack_scalars(packed, is_float)
        t = jnp.asarray(scalars[-1]).astype(jnp.int32)
        steps = ((fn if ex else (lambda a, sc, f=fn: f(a, sc, t)), wiring, scalars[s:s + c])
                 for fn, wiring, (s, c), ex in zip(fns, wirings, starts, exact))
        return run_nodes(steps, keep, out_sig, msgs)
    region.msgs = msgs
    return region


def pad(array, shape, moves):
    """``array`` zero-padded at the end of each dim to ``shape``, where ``array`` is. On a CPU
    device through the host (no program, so a new length compiles nothing); elsewhere a small
    program per shape (a host round trip would cost more than its compile)."""
    if tuple(array.shape) == tuple(shape):
        return array
    dev = next(iter(array.devices()))
    if dev.platform != "cpu":
        return _moved(moves, ("pad", tuple(array.shape), tuple(shape)), array)
    host = np.asarray(array)
    out = np.zeros(shape, host.dtype)
    out[tuple(slice(0, n) for n in host.shape)] = host
    with x64(True):
        return jax.device_put(out, dev)


def cut(array, shape, moves):
    """The exact ``shape`` prefix of a padded ``array`` (as ``pad``)."""
    if tuple(array.shape) == tuple(shape):
        return array
    dev = next(iter(array.devices()))
    if dev.platform != "cpu":
        return _moved(moves, ("cut", tuple(array.shape), tuple(shape)), array)
    host = np.asarray(array)[tuple(slice(0, n) for n in shape)]
    with x64(True):
        return jax.device_put(np.ascontiguousarray(host), dev)


def _moved(moves, key, array):
    """A pad or cut program from ``moves`` (a Cache: (what, shape in, shape out) -> program)."""
    fn = moves.get(key)
    if fn is None:
        what, src, dst = key
        if what == "pad":
            cfg = [(0, d - s, 0) for s, d in zip(src, dst)]
            fn = jax.jit(lambda a: lax.pad(a, jnp.zeros((), a.dtype), cfg))
        else:
            fn = jax.jit(lambda a: a[tuple(slice(0, n) for n in dst)])
        moves[key] = fn
    with x64(True):
        return fn(array)


# --------------------------------------------------------------------------- the manager
class BucketHit:
    """A region key that runs in a bucket: the plan, its length ``t``, and the structure it was
    found for (a hit compares it: NOTE [verified hits] in regions.py)."""
    __slots__ = ("plan", "t", "entries", "wirings")

    def __init__(self, plan, t, entries, wirings):
        self.plan, self.t, self.entries, self.wirings = plan, t, entries, list(wirings)

    def matches(self, entries, wirings) -> bool:
        return self.entries == entries and self.wirings == wirings


class Buckets:
    """What bucketing learned (NOTE [buckets]): versions of each region structure, the plans made
    from them (or why not), and their compiled programs."""

    def __init__(self):
        from ..scheduler.cache import Cache
        self.versions = Cache("bucket versions", 4096)   # structure -> [(ints, entries, lens)]
        self.plans = Cache("bucket plans", 4096)         # structure -> BucketPlan or a refusal
        self.ints = Cache("bucket ints", 1 << 15)        # id(entry) -> (entry, ints)
        self.moves = Cache("bucket pad and cut programs", 4096)   # off CPU: NOTE on pad()
        self.learned = LearnedStore()   # NOTE [learned on disk] (learned.py)

    def caches(self) -> list:
        return [self.versions, self.plans, self.ints, self.moves]

    def _ints(self, entries):
        """(ints, may-change mask, skeletons, ints per entry) of a version, or Nones."""
        out, mask, skels, lens = [], [], [], []
        cache = self.ints
        for e in entries:
            c = cache.get(id(e))
            if c is None or c[0] is not e:
                try:
                    c = cache[id(e)] = (e,) + flatten(e)
                except Refused:
                    return None, None, None, None
            out.extend(c[1])
            mask.extend(c[2])
            skels.append(c[3])
            lens.append(len(c[1]))
        return out, mask, skels, lens

    def note(self, struct, entries) -> None:
        """An exact version of ``struct`` compiled: keep the first two that differ.

        NOTE [bucket families]: versions and plans are kept per structure *and skeleton* (what is
        left of the ops' keys without their ints: views, dtypes, static arguments). Two sites of
        one structure that differ in more than sizes (HF's ``generate()`` grows the attention
        mask with ``cat([mask, new_ones(B, 1)])`` and the tokens with ``cat([ids,
        next[:, None]])``: one op, the same wiring, one input a view) are two families; under one
        key the first took the place and the second never had a bucket, so it ran op by op in a
        loop's first call and compiled per length in its second."""
        ints, mask, skels, lens = self._ints(entries)
        if ints is None:
            return
        fam = (struct, tuple(skels))
        vs = self.versions.get(fam)
        if vs is None:
            self.versions[fam] = [(ints, list(entries), lens, mask, skels)]
        elif len(vs) < 2 and vs[0][0] != ints:
            vs.append((ints, list(entries), lens, mask, skels))

    def find(self, struct, entries, wirings, stats):
        """(plan, length) to run this version of ``struct`` in a bucket, or None."""
        ints, mask, skels, lens = self._ints(entries)
        if ints is None:
            return None
        fam = (struct, tuple(skels))
        plan = self.plans.get(fam)
        if plan is None:
            vs = self.versions.get(fam)
            if vs is None:
                return None
            if mask != vs[0][3] or ints == vs[0][0]:
                return None
            # Two versions give the forms (each is exact on them; a later version that does not
            # follow them compiles exactly: bucket_misfits), a third checks them.
            f = fit([vs[0][0], ints] + [v[0] for v in vs[1:2]], mask)
            if f is None:
                return None
            f.skels = skels
            try:
                plan = plan_region(f, vs[0][1], wirings, vs[0][2], self.learned)
            except Refused as e:
                plan = str(e)
                stats["bucket_refusals"][plan] += 1
            except Exception as e:      # a view or rule this code did not foresee: no buckets
                plan = f"{type(e).__name__}: {e}"
                stats["bucket_refusals"][plan] += 1
            self.plans[fam] = plan
            if plan.__class__ is not str and self.learned.on:
                key = _family_key(fam)
                if key is not None:
                    self.learned.put("fits", key, (tuple(vs[0][0]), tuple(ints)))
        return _at(plan, ints, stats)

    def recall(self, struct, entries, wirings, stats):
        """(plan, length) to run the first version of ``struct`` seen in this process in a bucket
        that an earlier process learned (NOTE [learned on disk] in learned.py), or None."""
        if not self.learned.has_fits():
            return None
        ints, mask, skels, lens = self._ints(entries)
        if ints is None:
            return None
        fam = (struct, tuple(skels))
        plan = self.plans.get(fam)
        if plan is None:
            key = _family_key(fam)
            vs = self.learned.fit_versions(key) if key is not None else None
            if vs is None:
                return None
            # Made again from the two versions, and it must take this one: else it is stale.
            f = fit([list(vs[0]), list(vs[1]), ints], mask) if vs[0] != vs[1] else None
            if f is None:
                self.learned.drop_fit(key)
                return None
            f.skels = skels
            try:
                plan = plan_region(f, entries, wirings, lens, self.learned)
            except Exception:           # (refused: what made it no longer holds)
                self.learned.drop_fit(key)
                return None
            self.plans[fam] = plan
        return _at(plan, ints, stats)

    def program(self, plan, P, run, device, store, debug, stats, why=""):
        """The compiled program of ``plan`` at bucket ``P`` (compiled, or loaded from disk)."""
        is_float = tuple(type(s) is float for s in run.scalars)
        pk = (P, run.out_sig, is_float)
        prog = plan.programs.get(pk)
        if prog is not None:
            return prog
        # NOTE [fewer outputs]: a loop's last iteration is read at a sync after the loop, when the
        # loop's own variables are gone: it leaves fewer values than the iterations cut at the
        # loop's boundary (nanoGPT's sampling: the tokens, not the logits, top-k and next token),
        # and compiled a program of its own (18-25% of the first call's compile time). A program
        # of this bucket that leaves every value it needs serves it; the others are dropped.
        outs = set(run.out_sig)
        for (P2, sig2, f2), p2 in plan.programs.items():
            if P2 == P and f2 == is_float and p2.pick is None and outs <= set(sig2):
                prog = BucketProgram()
                prog.compiled, prog.msgs, prog.P, prog.runs = p2.compiled, p2.msgs, P, 0
                prog.summary, prog.pick = p2.summary, tuple(sig2.index(s) for s in run.out_sig)
                plan.programs[pk] = prog
                return prog
        import time
        import warnings
        from .diskcache import fresh_compiles
        from .dtypes import x64
        from .execute import pack_scalars, sharding
        t0 = time.perf_counter()
        key = describe_plan(plan, P, run.wirings, run.out_sig, is_float, device,
                            [v.dtype for v in run.ext]) \
            if store is not None and store.on else None
        got = store.load(key, device) if key is not None else None
        prog = BucketProgram()
        prog.P, prog.runs, prog.pick = P, 0, None
        if got is not None:
            prog.compiled, prog.msgs = got[0], got[1]["msgs"]
            how = "loaded from disk"
        else:
            fn = region_function(plan, P, run.wirings, [len(n.scalars) for n in run.nodes],
                                 run.out_sig, is_float)
            keep = [jax.ShapeDtypeStruct(at(plan.ext_forms[i], P), v.dtype,
                                         sharding=sharding(device)) if i in plan.ext_forms
                    else v.array for i, v in enumerate(run.ext)]
            scalars = pack_scalars(list(run.scalars) + [P])
            hits = stats["jax_disk_hits"]
            with x64(True), warnings.catch_warnings(), \
                    (fresh_compiles() if key is not None else _NULL):
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                prog.compiled = jax.jit(fn, out_shardings=sharding(device)).lower(
                    [], keep, scalars).compile()
            prog.msgs = list(fn.msgs)
            if stats["jax_disk_hits"] == hits:
                dt = time.perf_counter() - t0
                stats["compiles"] += 1
                stats["region_compiles"] += 1
                stats["compile_seconds"] += dt
                if key is not None:
                    store.save(key, prog.compiled, {"msgs": prog.msgs})
            how = "compiled"
        dt = time.perf_counter() - t0
        stats["bucket_programs"] += 1
        prog.summary = (f"{len(plan.nodes)} ops ({run.nodes[0].name} .. "
                        f"{run.nodes[len(plan.nodes) - 1].name}) padded to the bucket of length "
                        f"{at(plan.fit.forms[plan.fit.pos0], P)}")
        stats["miss_reasons"].append((prog.summary, (f"{why}; " if why else "") + "a new bucket "
                                      f"of a region whose sizes keep changing; {how}", dt))
        del stats["miss_reasons"][:-64]
        if debug >= 2:
            import sys
            print(f"[deferfuse] region BUCKET {how} in {dt * 1e3:.1f} ms: {prog.summary}"
                  + (f" (outputs {run.out_sig})" if debug >= 3 else ""), file=sys.stderr)
        plan.programs[pk] = prog
        return prog

    def execute(self, prog, hit, run, device):
        """Run a bucket program for ``run`` (length ``hit.t``): pad, run, cut; (results, flags)."""
        from .execute import run_region
        plan, P = hit.plan, prog.P
        keep = [pad(v.array, at(plan.ext_forms[i], P), self.moves) if i in plan.ext_forms
                else v.array for i, v in enumerate(run.ext)]
        res, flags = run_region(prog.compiled, [], keep, list(run.scalars) + [hit.t], device)
        prog.runs += 1
        if prog.pick is not None:
            res = [res[j] for j in prog.pick]
        return [cut(r, v.shape, self.moves) for r, v in zip(res, run.outs)], flags


    def refuse(self, plan, err, stats) -> None:
        """A plan whose program could not be made: never used again (its structure compiles
        exactly, as one with no plan)."""
        why = f"{type(err).__name__} making a bucket program: {str(err)[:200]}"
        stats["bucket_refusals"][why] += 1
        for key, v in self.plans.items():
            if v is plan:
                self.plans[key] = why
                fk = _family_key(key) if self.learned.on else None
                if fk is not None:
                    self.learned.drop_fit(fk)
            elif type(v) is list and plan in v:
                v.remove(plan)
                self.versions.pop(key, None)        # (its versions made the failing plan)

    # ------------------------------------------------------------------- one op (strict mode)
    def note_op(self, entry) -> None:
        """An op's own program compiled for these sizes (strict and debug mode): a version of its
        structure without sizes (``ohash``: NOTE [shapeless loop bodies]). Many ops share one
        (every linear layer), so a few versions are kept, and a new one is fitted to the closest."""
        if getattr(entry, "ohash", None) is None or entry.out[1] or entry.out[2]:
            return
        ints, mask, skels, lens = self._ints([entry])
        if ints is None:
            return
        fam = ("op", entry.ohash)
        vs = self.versions.get(fam)
        if vs is None:
            vs = self.versions[fam] = []
        if len(vs) < 8 and all(v[0] != ints for v in vs):
            vs.append((ints, [entry], lens, mask, skels))

    def _op_find(self, entry, wiring, stats):
        fam = ("op", entry.ohash)
        ints, mask, skels, lens = self._ints([entry])
        if ints is None:
            return None
        plans = self.plans.get(fam)
        if plans is None:
            plans = self.plans[fam] = []
        for plan in plans:
            if plan.fit.skels == skels:
                t = plan.fit.value(ints)
                if t is not None:
                    return plan, t
        vs = [v for v in self.versions.get(fam, ()) if v[4] == skels and v[3] == mask]
        if not vs or len(plans) >= 8:
            return None
        # the closest version: the fewest sizes differ (another layer differs in its weights too)
        v = min(vs, key=lambda v: sum(x != y for x, y in zip(v[0], ints)))
        f = fit([v[0], ints], mask)
        if f is None:
            return None
        f.skels = skels
        try:
            plan = plan_region(f, v[1], [wiring], v[2])
        except Refused as e:
            stats["bucket_refusals"][str(e)] += 1
            return None
        except Exception as e:
            stats["bucket_refusals"][f"{type(e).__name__}: {e}"] += 1
            return None
        plans.append(plan)
        t = f.value(ints)
        return None if t is None else (plan, t)

    def op_program(self, entry, ins, scalars, store, debug, stats):
        """NOTE [buckets] for one op (strict and debug mode run each op as its own program): a
        callable ``(arrays, scalars) -> (outputs, flags)`` running ``entry`` padded in a bucket,
        when an earlier version of the same op with other sizes fits; else None."""
        if getattr(entry, "ohash", None) is None or entry.out[1] or entry.out[2]:
            return None
        wiring = tuple(None if v is None else i for i, v in enumerate(ins))
        found = self._op_find(entry, wiring, stats)
        if found is None:
            return None
        plan, t = found
        run = _OpRun(entry, ins, scalars, wiring)
        try:
            prog = self.program(plan, plan.fit.bucket(t), run, entry.dev, store, debug, stats,
                                f"{entry.name} with new sizes")
        except Exception as e:     # a case the rules did not foresee: this op runs exactly
            self.refuse(plan, e, stats)
            return None
        hit = BucketHit(plan, t, [entry], [wiring])
        entry.msgs = [m[1:] for m in prog.msgs]     # (exception type, message) per flag
        shapes = [None if a is None else _Shape(a[0]) for a in entry.res_avals]
        buckets = self

        def call(arrays, scalars_):
            stats["bucketed_ops"] += 1
            r = _OpRun(entry, [None if a is None else _Arr(a) for a in arrays], scalars_, wiring)
            r.outs = shapes
            return buckets.execute(prog, hit, r, entry.dev)
        return call


def _family_key(fam) -> str | None:
    """The stable description of a region family (NOTE [bucket families]), or None."""
    from .diskcache import Unstable, describe
    try:
        return describe(fam)
    except (Unstable, AttributeError):
        return None


class _Shape:
    __slots__ = ("shape",)

    def __init__(self, shape):
        self.shape = shape


class _Arr:
    """An input array seen as a Value (what ``Buckets.execute`` reads of one)."""
    __slots__ = ("array", "dtype", "shape")

    def __init__(self, a):
        self.array, self.dtype, self.shape = a, a.dtype, a.shape


class _OpNode:
    __slots__ = ("name", "scalars")


class _OpRun:
    """One op as a region of one node (what ``Buckets.program`` and ``execute`` read of a run)."""
    __slots__ = ("nodes", "wirings", "out_sig", "scalars", "ext", "outs")

    def __init__(self, entry, ins, scalars, wiring):
        n = _OpNode()
        n.name, n.scalars = entry.name, scalars
        self.nodes, self.wirings, self.scalars = [n], [wiring], list(scalars)
        self.ext = [v if v is not None else _NoInput for v in ins]
        self.out_sig = tuple((0, i) for i, a in enumerate(entry.res_avals) if a is not None)
        self.outs = [_Shape(a[0]) for a in entry.res_avals if a is not None]


class _NoInput:
    array = None
    dtype = None


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


_NULL = _Null()
