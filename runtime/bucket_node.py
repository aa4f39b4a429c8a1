"""Buckets (NOTE [buckets] in buckets.py): how one op runs padded (``plan_node``), from the
padding rule its lowering states (``@op(..., pad=...)``: NOTE [padding rules] in
lowering/padding.py).

Padding is exact where it is used. Data that the padding adds is never read into a valid position:
each op is admitted only by a rule below, from what it does along its padded dims (dims whose size
depends on the length; valid data is the prefix of exact size ``a * s + b``), and anything else
refuses the whole region (it then runs as before; ``metrics()['bucket_refusals']`` says which op):

- elementwise ops (PyTorch's ``pointwise`` tag) and dtype conversions; factories and ``tril``/
  ``triu``, whose values depend on the index alone (``arange(T)`` padded is ``arange(P)``, whose
  first T values are ``arange(T)``'s), ``cumsum`` (a prefix depends on the prefix);
- views that move dims (transpose, permute, squeeze, unsqueeze, expand); reshapes, as plain
  reshapes where each padded dim is the first dim of its group of merged or split dims
  (``(T, C) -> (T * C)``), else compacted (``(T, B) -> (T * B)`` with ``B`` padded: NOTE
  [compacting reshapes] in bucket_reshape.py); windows at dynamic offsets
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
  distribution, so CPU's checks see only valid rows), their samples are cut off;
- ``index_put`` with integer index tensors that are not padded (checked and wrapped as advanced
  indexing), ``scatter``/``scatter_add`` (``Scatter``), ``nll_loss`` and its backward (padded
  targets ignored), and backward ops whose weight gradients sum over padded rows
  (``ZeroPadded``: their inputs' padding set to 0).

Other in-place writes (to a view, ``index_copy_``, a mask's count of values), other random ops
touching padded dims and everything not listed refuse the region. Where a region is refused, its
shapes go on compiling as before (shape churn: runtime/flush.py).
"""
from __future__ import annotations

import jax
import numpy as np

from . import bucket_reshape
from .bucket_fit import _PROBES, Refused, _is_form, _padded, _put, at, parts
from .dtypes import to_np_dtype
from .lowering import LOWERINGS, aten
from .lowering.padding import (Along, Attention, Batched, Cat, Contract, Embedding, Factory, Index,
                               IndexPut, MoveDims, Multinomial, Normalize, Pointwise, Reduce,
                               Refuse, Reshape, Scan, Scatter, Slice, Targets, TopK, ZeroPadded)
from .node import CS, SS, TS
from .viewchain import DSELECT, DSLICE, DYNAMIC, apply_step


def _step_forms(fstep, fin, dtype, learned=None) -> tuple:
    """The forms of a view step's output shape, from its shape at two lengths (kept in
    ``learned``, a LearnedStore, for the next process: NOTE [learned on disk] in learned.py).
    The lengths are large ones (a size that only looks linear at small lengths is found out);
    a step that cannot take them (a window from the start of a shorter base: a Transformer's
    ``pe[:T]`` of its 64 positions) is measured at the first version's length and the next."""
    try:
        return _step_forms_at(fstep, fin, dtype, learned, _PROBES[:2])
    except Refused:
        raise
    except Exception:       # (JAX's error for a slice longer than its operand)
        return _step_forms_at(fstep, fin, dtype, learned, (0, 1))


def _step_forms_at(fstep, fin, dtype, learned, probes) -> tuple:
    key = shapes = None
    if learned is not None and learned.on:
        from .diskcache import Unstable, describe
        try:
            key = describe(("step", fstep, fin, str(dtype), tuple(probes)))
        except Unstable:
            key = None
        shapes = learned.step(key) if key is not None else None
    if shapes is None:
        shapes = []
        for t in probes:
            st = at(fstep, t)
            x = jax.ShapeDtypeStruct(at(fin, t), dtype)
            shapes.append(tuple(jax.eval_shape(lambda v: apply_step(v, st, 0), x).shape))
        if key is not None:
            learned.put("steps", key, tuple(shapes))
    (s1, s2), (t1, t2) = shapes, probes
    out = []
    for x, y in zip(s1, s2):
        a, r = divmod(y - x, t2 - t1)
        if r:
            raise Refused("a view whose size is not linear in the length")
        out.append((a, x - a * t1))
    return tuple(out)


def _chain_forms(fbase, dtype, fchain, name, learned=None, widen=None, compact=None) -> tuple:
    """The forms of a view chain's result, checking each step (NOTE [buckets]); ``widen``: a
    list that takes (dim, the window's length form) where the chain's first step is a window
    that may pass its base's end; ``compact``: a dict that takes {step: (forms in, forms out,
    groups)} for each reshape step that NOTE [compacting reshapes] (bucket_reshape.py) runs."""
    form = tuple(fbase)
    for j, fstep in enumerate(fchain):
        op = fstep[0]
        out = _step_forms(fstep, form, dtype, learned)
        low = LOWERINGS.get(op)      # (None for the dynamic steps, DSLICE and DSELECT)
        rule = type(low.pad) if low is not None else None
        if not (_padded(form) or _padded(out)) or rule is MoveDims or op is DSELECT:
            pass        # (DSELECT: the index is data, inside the exact extent)
        elif rule is Reshape:
            gs = bucket_reshape.plan(form, out, name)
            if gs is not None:
                if compact is None:
                    raise Refused(f"{name}: a reshape that merges a padded dim behind another")
                compact[j] = (tuple(form), tuple(out), gs)
        elif op is DSLICE:
            dim, length, stp = at(fstep[1], _PROBES[0])
            # A window's padded length may grow no faster than its base's: XLA moves the start of
            # a slice that would run past the end back inside (``dynamic_slice`` clamps), so
            # ``data[990:994]`` of 1,000 rows padded to 32 read rows 968..999, its valid prefix
            # the wrong rows (a ragged last batch of a long dataset).
            # Such a window, the first step of its chain, reads a base widened with its padded
            # length in the program (NOTE [widened bases]); elsewhere in a chain it refuses.
            if out[dim][0] > form[dim][0]:
                if j or widen is None or stp != 1:
                    raise Refused(f"{name}: a window whose padded length grows faster than its "
                                  "base (it could pass the base's end)")
                widen.append((dim, out[dim]))
            if form[dim][0] and stp != 1 and out[dim][0]:
                raise Refused(f"{name}: a strided window along a padded dim")
        elif rule is Slice:
            dim = at(fstep[1][0] if fstep[1] else (0, 0), 0) % max(len(form), 1)
            if form[dim][0]:
                raise Refused(f"{name}: a fixed slice along a padded dim")
        else:
            raise Refused(f"{name}: view {op} of a padded tensor")
        form = out
    return form


# --------------------------------------------------------------------------- one op's plan
class NodePlan:
    """How one op runs padded: its structure as forms, its rule and what the rule needs;
    ``compact``: per input, None or its chain's compacting reshapes (NOTE [compacting
    reshapes])."""
    __slots__ = ("rule", "extra", "low", "meta", "name", "targs", "tkw", "chains", "out_avals",
                 "in_forms", "out_forms", "base_forms", "ndyn", "mut", "read_forms", "widen",
                 "compact")


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
    n.widen = widen = []
    n.compact = []
    for (bshape, bdt, chain, size, dt), (fb, _, fchain, fsize, _) in zip(ins, f_ins):
        w: list = []
        c: dict = {}
        fin = _chain_forms(fb, bdt, fchain, name, learned, w, c) if chain else tuple(fb)
        widen.append(w[0] if w else None)     # NOTE [widened bases] (bucket_fn.py)
        n.compact.append(tuple(sorted(c.items())) if c else None)
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
    # The op's padding rule (NOTE [padding rules] in lowering/padding.py): an in-place op's is
    # its functional form's (``info.low`` is that lowering).
    rule = getattr(info.low, "pad", None)
    kind = type(rule)
    if rng and (kind is not Multinomial or mut):
        raise Refused(f"{name} draws random numbers")
    if mut:
        _plan_write(n, info, rule, ins, targs, tkw, mut, name)
    planner = _PLANNERS.get(kind)
    if planner is None:
        why = rule.why if kind is Refuse and rule.why else "has no rule for padded dims"
        raise Refused(f"{name}: {why}" if kind is Refuse else f"{name} {why}")
    planner(n, rule, func, ins, targs, tkw, name)
    return n


def _plan_pointwise(n, rule, func, ins, targs, tkw, name):
    # Broadcasting: each input's dim (aligned from the right) is the output's or a 1.
    fo = n.out_forms[0] if n.out_forms and n.out_forms[0] is not None else None
    if fo is not None:
        for f in n.in_forms:
            for d in range(1, len(f) + 1):
                if d > len(fo) or (f[-d] != fo[-d] and f[-d] != (0, 1)):
                    raise Refused(f"{name}: inputs whose sizes do not broadcast alike padded")


def _plan_admitted(n, rule, func, ins, targs, tkw, name):
    """Factories (values by index alone) and prefix scans."""


def _plan_reduce(n, rule, func, ins, targs, tkw, name):
    f0 = n.in_forms[0]
    nd = len(f0)
    dims = _arg(targs, tkw, rule.dims, "dim") if rule.dims is not None else None
    if dims is None or dims == () or dims == []:
        if rule.index and _padded(f0):
            raise Refused(f"{name} over every dim of a padded tensor (a flat index)")
        dims = tuple(range(nd))
    elif type(dims) is int:
        dims = (dims,)
    dims = tuple(d % max(nd, 1) for d in dims)
    pdims = tuple(d for d in dims if d < nd and f0[d][0])
    if pdims:
        n.rule, n.extra = "reduce", (pdims, rule.identity, dims)


def _plan_reshape(n, rule, func, ins, targs, tkw, name):
    # a recorded reshape (``_unsafe_view`` after a matmul): a copy whose padding stays where a
    # view's would (NOTE [buckets]); views reach plan_node as chains of their readers' inputs
    if not n.out_forms or n.out_forms[0] is None:
        raise Refused(f"{name} has no rule for padded dims")
    gs = bucket_reshape.plan(n.in_forms[0], n.out_forms[0], name)
    if gs is not None:      # NOTE [compacting reshapes] (bucket_reshape.py)
        n.rule, n.extra = "reshape", (tuple(n.in_forms[0]), tuple(n.out_forms[0]), gs)


def _plan_normalize(n, rule, func, ins, targs, tkw, name):
    k = len(_arg(targs, tkw, rule.shape, "normalized_shape"))
    if _padded(n.in_forms[0][len(n.in_forms[0]) - k:]):
        raise Refused(f"{name} normalizes over a padded dim")


def _plan_contract(n, rule, func, ins, targs, tkw, name):
    masks = []
    for i, d in rule.operands:
        f = n.in_forms[i]
        d %= len(f)
        if f[d][0]:
            masks.append((i, d))
    if masks:
        n.rule, n.extra = "contract", tuple(masks)


def _plan_attention(n, rule, func, ins, targs, tkw, name):
    q, k, v = n.in_forms[:3]
    if q[-1][0] or k[-1][0] or v[-1][0]:
        raise Refused(f"{name} with a padded head dim")
    if k[-2][0]:
        n.rule, n.extra = "sdpa", k[-2]


def _plan_batched(n, rule, func, ins, targs, tkw, name):
    def ok(f):
        k = len(f)
        allowed = {d % k for d in rule.dims if -k <= d < k}
        return all(d in allowed for d, (a, _) in enumerate(f) if a)
    for i, f in enumerate(n.in_forms):
        if f is not None and _padded(f) and (i in rule.fixed or not ok(f)):
            raise Refused(f"{name}: a padded dim it does not run independently along")
    for f in n.out_forms:
        if f is not None and not ok(f):
            raise Refused(f"{name}: a padded dim it does not run independently along")
    if any(a for a, _ in _forms_in(n.targs)) or any(a for a, _ in _forms_in(n.tkw)):
        raise Refused(f"{name}: an argument that follows the length")
    zero = tuple(i for i, f in enumerate(n.in_forms) if f is not None and _padded(f))
    if rule.steps is not None and n.in_forms and n.in_forms[0] is not None:
        f0 = n.in_forms[0]
        form = f0[rule.steps] if -len(f0) <= rule.steps < len(f0) else (0, 0)
        if form[0]:     # a recurrence over a padded time dim: its exact steps (bucket_fn.py)
            n.rule, n.extra = "steps", (zero if rule.zero else (), tuple(form))
            return
    if rule.zero and zero:
        n.rule, n.extra = "zero", zero


def _plan_embedding(n, rule, func, ins, targs, tkw, name):
    if _padded(n.in_forms[rule.table]):
        raise Refused(f"{name} of a padded table")
    if _padded(n.in_forms[rule.index]):
        n.rule, n.extra = "index", rule.index


def _plan_advanced(n, rule, func, ins, targs, tkw, name):
    n.rule, n.extra = "advanced", _plan_index(n, ins, targs, name)


def _plan_along_rule(n, rule, func, ins, targs, tkw, name):
    n.rule, n.extra = "along", _plan_along(n, func, targs, tkw, name)


def _plan_topk(n, rule, func, ins, targs, tkw, name):
    fx = n.in_forms[0]
    d = _arg(targs, tkw, 2, "dim")
    d = (-1 if d is None else d) % max(len(fx), 1)
    if fx and fx[d][0]:
        k = _arg(targs, tkw, 1, "k")
        largest = _arg(targs, tkw, 3, "largest")
        n.rule, n.extra = "topk", (d, fx[d], k, True if largest is None else bool(largest))


def _plan_cat(n, rule, func, ins, targs, tkw, name):
    fo = n.out_forms[0]
    d = (_arg(targs, tkw, 1, "dim") or 0) % len(fo)
    if fo[d][0]:
        if any(len(f) != len(fo) for f in n.in_forms):
            raise Refused(f"{name} of tensors of other ranks")
        n.rule, n.extra = "cat", (d, tuple(f[d] for f in n.in_forms))


def _plan_multinomial(n, rule, func, ins, targs, tkw, name):
    fp = n.in_forms[0] if n.in_forms else ()
    if len(fp) < 2 or fp[-1][0]:
        raise Refused(f"{name} draws random numbers")
    # rows drawn from independently: padded rows are given a valid distribution (ones) so the
    # distribution checks see only valid rows; their samples are cut off
    n.rule, n.extra, n.mut = "multinomial", None, "rng"


def _plan_no_op_rule(n, rule, func, ins, targs, tkw, name):
    # views that move dims or slice are planned in their readers' chains (_chain_forms)
    raise Refused(f"{name} has no rule for padded dims")


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


def _plan_write(n: NodePlan, info, rule, ins, targs, tkw, mut, name) -> None:
    """An op writing tensors in place (NOTE [buckets]): admitted where the write is elementwise
    or an ``index_put`` (``_plan_put``), and each tensor written is a whole base (no view of it),
    so the padding written is padding. Sets ``n.mut``."""
    for m in mut:
        if n.chains[m]:
            raise Refused(f"{name} writes a view of a padded tensor in place")
    if type(rule) is not IndexPut and type(rule) is not Pointwise:
        raise Refused(f"{name} writes a tensor in place")
    n.mut = (tuple(mut), info.kind == "self_mut")


def _plan_put(n, rule, func, ins, targs, tkw, name):
    """``x[i] = v`` (``index_put``, in place or not): ``x[mask] = v`` with one boolean mask over
    x's leading dims and one value, which PyTorch makes of ``logits[logits < v] = -inf``
    (elementwise); or integer index tensors that are not padded, an index into a padded dim
    checked and wrapped as ``Index`` does, the values padded only where the indexed view is."""
    slots = targs[1] if len(targs) > 1 else ()
    used = [sl for sl in slots if sl is not None]
    vals = targs[2] if len(targs) > 2 else None
    if not (type(vals) is tuple and vals and vals[0] is TS):
        raise Refused(f"{name} without a tensor of values")
    fx, fv = n.in_forms[0], n.in_forms[vals[1]]
    if any(to_np_dtype(ins[sl[1]][4]) in (np.bool_, np.uint8) for sl in used):
        if len(used) != 1 or slots[0] is None:
            raise Refused(f"{name} with other than one boolean mask")
        fm = n.in_forms[used[0][1]]
        if tuple(fm) != tuple(fx[:len(fm)]):
            raise Refused(f"{name}: a mask whose sizes are not its input's")
        if any(f != (0, 1) for f in fv):
            raise Refused(f"{name} writing more than one value through a mask")
        return
    if not used:
        raise Refused(f"{name} without an index")
    for sl in used:
        if _padded(n.in_forms[sl[1]]):
            raise Refused(f"{name} with a padded index tensor (its padded entries would write)")
    masks, wraps = _plan_index(n, ins, targs, name)
    # The forms of x[indices]: the index tensors' broadcast shape (constant) where the indexed
    # dims were when they are adjacent, else first; the values broadcast to it from the right.
    bshape = np.broadcast_shapes(*[tuple(b for _, b in n.in_forms[sl[1]]) for sl in used])
    at_ = [d for d, sl in enumerate(slots) if sl is not None]
    rest = [f for d, f in enumerate(fx) if d >= len(slots) or slots[d] is None]
    bforms = [(0, b) for b in bshape]
    if at_ == list(range(at_[0], at_[0] + len(at_))):
        target = list(fx[:at_[0]]) + bforms + list(fx[at_[-1] + 1:])
    else:
        target = bforms + rest
    if len(fv) > len(target) or any(f != g and f != (0, 1)
                                    for f, g in zip(fv[::-1], target[::-1])):
        raise Refused(f"{name}: values whose sizes are not the indexed view's")
    if wraps:
        n.rule, n.extra = "advanced", (masks, wraps)


def _plan_scatter(n, rule, func, ins, targs, tkw, name):
    """``scatter``/``scatter_add`` (NOTE [padding rules]: ``Scatter``). Returns through
    ``n.extra``: (mask the index?, dims whose sources are set to 0, the form of the dim written
    if padded)."""
    fx, fi = n.in_forms[0], n.in_forms[1]
    nd = len(fx)
    d = (_arg(targs, tkw, 1, "dim") or 0) % max(nd, 1)
    if len(fi) != nd:
        raise Refused(f"{name} with an index of another rank")
    fs = n.in_forms[2] if len(n.in_forms) > 2 and n.in_forms[2] is not None else None
    for j in range(nd):
        if not fi[j][0]:
            continue
        if j == d and not rule.add:
            raise Refused(f"{name} with an index padded along the dim it writes")
        if j != d and not (fi[j][0] <= fx[j][0] and fi[j][1] <= fx[j][1]):
            raise Refused(f"{name}: an index padded along a dim its input is not")
        if fs is not None and (len(fs) != nd or not (fi[j][0] <= fs[j][0]
                                                     and fi[j][1] <= fs[j][1])):
            raise Refused(f"{name}: an index padded along a dim its source is not")
    zero = (d,) if rule.add and fi[d][0] else ()
    wrap = fx[d] if nd and fx[d][0] else None
    if _padded(fi) or wrap is not None:
        n.rule, n.extra = "scatter", (_padded(fi), zero, wrap,
                                      f"index {{index}} is out of bounds for dimension {d} with "
                                      "size {size}")


def _plan_zero(n, rule, func, ins, targs, tkw, name):
    """Inputs whose padding is set to 0 (NOTE [padding rules]: ``ZeroPadded``)."""
    if rule.unless is not None and _arg(targs, tkw, *rule.unless):
        raise Refused(f"{name}: an argument that counts padded positions ({rule.unless[1]})")
    if rule.normalized is not None:
        k = len(_arg(targs, tkw, *rule.normalized))
        if _padded(n.in_forms[1][len(n.in_forms[1]) - k:]):
            raise Refused(f"{name} normalizes over a padded dim")
    zero = tuple(i for i in rule.inputs
                 if i < len(n.in_forms) and n.in_forms[i] is not None and _padded(n.in_forms[i]))
    if zero:
        n.rule, n.extra = "zero", zero


def _plan_targets(n, rule, func, ins, targs, tkw, name):
    """A loss with a target per row (NOTE [padding rules]: ``Targets``)."""
    fx = n.in_forms[rule.probs]
    cdim = 0 if len(fx) == 1 else 1
    if fx[cdim][0]:
        raise Refused(f"{name} over a padded class dim")
    ignore = _arg(targs, tkw, rule.ignore, "ignore_index")
    if type(ignore) is not int:
        raise Refused(f"{name} with an ignore_index that is not a number")
    zero = tuple(i for i in rule.zero if _padded(n.in_forms[i]))
    if _padded(n.in_forms[rule.target]) or zero:
        n.rule, n.extra = "targets", (rule.target, ignore, zero)


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


# What each kind of rule plans (NOTE [padding rules]); a kind not here refuses.
_PLANNERS = {Pointwise: _plan_pointwise, Factory: _plan_admitted, Scan: _plan_admitted,
             IndexPut: _plan_put, Reduce: _plan_reduce, Reshape: _plan_reshape,
             Normalize: _plan_normalize, Contract: _plan_contract, Attention: _plan_attention,
             Embedding: _plan_embedding, Index: _plan_advanced, Along: _plan_along_rule,
             TopK: _plan_topk, Cat: _plan_cat, Multinomial: _plan_multinomial,
             Scatter: _plan_scatter, ZeroPadded: _plan_zero, Targets: _plan_targets,
             Batched: _plan_batched,
             MoveDims: _plan_no_op_rule,
             Slice: _plan_no_op_rule}
