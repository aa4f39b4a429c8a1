"""Buckets (NOTE [buckets] in buckets.py): a reshape of a padded tensor.

NOTE [compacting reshapes]: a padded dim is padded at its end, its valid data the prefix of its
exact size. A reshape of the padded array keeps that where each padded dim is the first of its
group of merged or split dims (``(T, C) -> (T * C)``: the valid ``T * C`` values come first). A
padded dim behind another in its group (word_language_model's ``decoded.view(-1, ntoken)`` of a
``(T, B, V)`` output whose batch ``B`` is padded) would interleave the padding with the data: row
``r`` of the merged dim is ``(r // P, r % P)`` of the padded array, not ``(r // B, r % B)`` of the
exact one, and every padding rule after it (a mask of the valid prefix) would read the wrong rows.

Such a group is *compacted*: the reshape is the exact tensor's, placed at the start of the padded
output. Each output position of the group, read as an index into the exact output (row-major over
its exact sizes), is unravelled over the exact input sizes and read from the padded input there;
positions past the exact sizes read position 0 (padding: never trusted to be anything). The merged
dim's size ``T * B`` is ``T * (a * s + b)``, a form like any other, its valid data a prefix again,
so the masks of the ops after it (``log_softmax`` along the other dim, ``nll_loss``'s targets made
the ``ignore_index``) follow with no rule of their own; a split (the backward pass's view of the
gradient back to ``(T, B, V)``) is the same map the other way. The cost is a gather along the
group's dims (one index per position of the group, not of the tensor), where the plain reshape was
free; the alternative, a layout where the padded dim stays outer-most, would have had to reorder
every op before the reshape instead. Groups that keep the prefix are reshaped as they were.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .bucket_fit import _PROBES, Refused, at


def _mul(p, v):
    return tuple(x * y for x, y in zip(p, v))


def groups(fin, fout, name) -> tuple:
    """The reshape's groups: ((i0, i1), (j0, j1), compact) for input dims ``i0:i1`` becoming
    output dims ``j0:j1``, in order; dims of size 1 join the group before them (or the first).
    ``compact``: the group needs NOTE [compacting reshapes]. Raises ``Refused`` where the sizes
    do not match at every length."""
    def vals(f):
        return tuple(f[0] * t + f[1] for t in _PROBES)
    vin, vout = [vals(f) for f in fin], [vals(f) for f in fout]
    out, i, j = [], 0, 0
    one = (1,) * len(_PROBES)
    while i < len(fin) or j < len(fout):
        i0, j0 = i, j
        pi = pj = one
        if i < len(fin):
            pi, i = _mul(pi, vin[i]), i + 1
        if j < len(fout):
            pj, j = _mul(pj, vout[j]), j + 1
        while pi != pj:
            if pi[0] < pj[0] and i < len(fin):
                pi, i = _mul(pi, vin[i]), i + 1
            elif pj[0] < pi[0] and j < len(fout):
                pj, j = _mul(pj, vout[j]), j + 1
            else:
                raise Refused(f"{name}: a reshape whose sizes do not match")
        while i < len(fin) and tuple(fin[i]) == (0, 1):
            i += 1
        while j < len(fout) and tuple(fout[j]) == (0, 1):
            j += 1
        gi = [f for f in fin[i0:i] if tuple(f) != (0, 1)]
        gj = [f for f in fout[j0:j] if tuple(f) != (0, 1)]
        keeps = (not any(a for a, _ in gi[1:]) and not any(a for a, _ in gj[1:])
                 and bool(gi and gi[0][0]) == bool(gj and gj[0][0]))
        if not keeps and 0 in pi:
            raise Refused(f"{name}: a reshape of an empty tensor across a padded dim")
        out.append(((i0, i), (j0, j), not keeps))
    return tuple(out)


def plan(fin, fout, name):
    """None where the plain reshape of the padded tensor keeps every valid value's place, else
    the groups ``reshape`` takes (NOTE [compacting reshapes]); raises ``Refused``."""
    gs = groups(tuple(fin), tuple(fout), name)
    return gs if any(c for _, _, c in gs) else None


def _prod(xs):
    p = 1
    for x in xs:
        p *= x
    return p


def _group_index(fin, fout, t, P):
    """For each position of a group's padded output (row-major), the position of its padded input
    (flattened) it reads; positions past the exact sizes read 0."""
    pin, pout = [at(f, P) for f in fin], [at(f, P) for f in fout]
    ein = [f[0] * t + f[1] if f[0] else f[1] for f in fin]
    eout = [f[0] * t + f[1] if f[0] else f[1] for f in fout]
    rest = lax.iota(jnp.int32, _prod(pout))
    coords = []
    for n in reversed(pout):
        coords.append(rest % n)
        rest = rest // n
    flat, valid = jnp.zeros((), jnp.int32), jnp.ones((), bool)
    for c, e in zip(reversed(coords), eout):
        flat = flat * e + c
        valid = valid & (c < e)
    idx, stride = jnp.zeros((), jnp.int32), 1
    for n, e in zip(reversed(pin), reversed(ein)):
        e = jnp.maximum(e, 1)
        idx = idx + (flat % e) * stride
        flat = flat // e
        stride *= n
    return jnp.where(valid, idx, 0)


def reshape(x, fin, fout, gs, t, P):
    """``x`` (padded to the forms ``fin`` at bucket ``P``) reshaped to ``fout`` as its exact
    values are (NOTE [compacting reshapes]); ``t``: the exact length (traced)."""
    pin = [at(f, P) for f in fin]
    x = jnp.reshape(x, tuple(_prod(pin[i0:i1]) for (i0, i1), _, _ in gs))
    for k, ((i0, i1), (j0, j1), compact) in enumerate(gs):
        if compact:
            ix = _group_index(fin[i0:i1], fout[j0:j1], t, P)
            x = jnp.take(x, ix, axis=k, mode="clip")
    return jnp.reshape(x, tuple(at(f, P) for f in fout))
