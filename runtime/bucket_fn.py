"""Buckets (NOTE [buckets] in buckets.py): one op's padded function (``NodeFn``), carrying out
its plan (bucket_node.py) with the exact length ``t`` as a traced value."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import bucket_reshape
from .bucket_fit import at
from .bucket_node import NodePlan
from .dtypes import cast
from .lowering import check, check_index_sized
from .node import _fill, _rounded
from .viewchain import DYNAMIC, apply_chain, apply_step


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


def _padded_index(ix, forms, mask, wrap, exc, msg, t):
    """An index tensor of a gather or scatter at bucket length: its padded entries read or write
    position 0 (``mask``), and indices checked against the exact extent ``wrap`` (``exc(msg)`` as
    CPU raises it) and kept inside it."""
    valid = None
    if mask:
        ix = _mask_dims(ix, range(ix.ndim), forms, jnp.zeros((), ix.dtype), t)
        valid = _mask_dims(jnp.ones(ix.shape, bool), range(ix.ndim), forms, False, t)
    if wrap is not None:
        ext = jnp.asarray(wrap[0] * t + wrap[1])
        # the padding's 0 is out of range of an empty dim: only the exact entries are checked
        check_index_sized(ix, ext, exc, msg, allow_negative=False, valid=valid)
        ix = _zero_outside(ix, ext)
    return ix


class NodeFn:
    """One op's padded function ``(arrays, scalars, t) -> outputs`` at bucket length ``P``."""

    def __init__(self, plan: NodePlan, P: int):
        self.p, self.P = plan, P
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
        vals = [None if a is None else (self._chain(self._widened(a, i), i, c, d, t) if c else a)
                for i, (a, c, d) in enumerate(zip(arrays, self.chains, dyns))]
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
            valid = {}
            for i, dims in masks:
                vals[i] = _mask_dims(vals[i], dims, p.in_forms[i], jnp.zeros((), vals[i].dtype), t)
                valid[i] = _mask_dims(jnp.ones(vals[i].shape, bool), dims, p.in_forms[i], False, t)
            for i, (a, b), k in wraps:
                ext = jnp.asarray(a * t + b)
                ix = vals[i]
                check_index_sized(ix, ext, IndexError,
                                  f"index {{index}} is out of bounds for dimension {k} with size "
                                  "{size}", valid=valid.get(i))
                ix = jnp.where(ix < 0, ix + ext.astype(ix.dtype), ix)
                vals[i] = _zero_outside(ix, ext)
        elif rule == "along":
            mask, wrap, exc, msg = p.extra
            vals[1] = _padded_index(vals[1], p.in_forms[1], mask, wrap, exc, msg, t)
        elif rule == "scatter":
            mask, zero, wrap, msg = p.extra
            if zero:    # scatter_add: padded index entries along the dim add nothing
                src = vals[2]
                vals[2] = _mask_dims(src, zero, p.in_forms[1], jnp.zeros((), src.dtype), t)
            vals[1] = _padded_index(vals[1], p.in_forms[1], mask, wrap, RuntimeError, msg, t)
        elif rule == "zero":
            for i in p.extra:
                v = vals[i]
                vals[i] = _mask_dims(v, range(v.ndim), p.in_forms[i], jnp.zeros((), v.dtype), t)
        elif rule == "steps":
            for i in p.extra[0]:
                v = vals[i]
                vals[i] = _mask_dims(v, range(v.ndim), p.in_forms[i], jnp.zeros((), v.dtype), t)
        elif rule == "targets":
            ti, ignore, zero = p.extra
            tg = vals[ti]
            vals[ti] = _mask_dims(tg, range(tg.ndim), p.in_forms[ti],
                                  jnp.asarray(ignore, tg.dtype), t)
            for i in zero:
                v = vals[i]
                vals[i] = _mask_dims(v, range(v.ndim), p.in_forms[i], jnp.zeros((), v.dtype), t)
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
            # padded keys and values set to 0 (a NaN or a huge padded key would reach the valid
            # scores through the key mask's addition), then masked out of the softmax below
            k, v = vals[1], vals[2]
            vals[2] = _mask_dims(v, (v.ndim - 2,), p.in_forms[2], jnp.zeros((), v.dtype), t)
            vals[1] = _mask_dims(k, (k.ndim - 2,), p.in_forms[1], jnp.zeros((), k.dtype), t)
        kw = dict(self.tkw)
        if rng_key is not None:
            kw["key"] = rng_key
        if rule == "steps":     # a recurrence's exact steps (Batched's ``steps``)
            a, b = p.extra[1]
            kw["_steps"] = a * t + b
        if p.meta:
            kw["_avals"] = self.out_avals
        args = [_fill(a, vals, scalars) for a in self.targs]
        kw = {k: _fill(x, vals, scalars) for k, x in kw.items()}
        if rule == "cat":
            res = [self._cat(args, t)]
        elif rule == "reshape":     # NOTE [compacting reshapes] (bucket_reshape.py)
            fin, fout, gs = p.extra
            res = [bucket_reshape.reshape(vals[0], fin, fout, gs, t, self.P)]
        else:
            if rule == "sdpa":
                keys = _valid((vals[1].shape[-2],), 0, p.extra, t)
                m = kw.get("attn_mask")
                if m is None:
                    m = keys
                elif m.dtype == jnp.bool_:
                    m = m & keys
                else:       # (a select, not an addition: a NaN in the padding stays out)
                    m = jnp.where(keys, m, jnp.asarray(-jnp.inf, m.dtype))
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
        return [r if r is None or d is None or r.dtype == d else cast(r, d)
                for r, d in zip(res, self.dtypes)]

    def _chain(self, a, i, chain, dyn, t):
        """Input ``i``'s view chain of ``a``, its compacting reshapes (NOTE [compacting
        reshapes] in bucket_reshape.py) run at the exact length ``t``."""
        compact = self.p.compact[i] if i < len(self.p.compact) else None
        if not compact:
            return apply_chain(a, chain, dyn)
        steps = dict(compact)
        k = 0
        for j, step in enumerate(chain):
            if step[0] in DYNAMIC:
                a = apply_step(a, step, dyn[k])
                k += 1
            elif j in steps:
                fin, fout, gs = steps[j]
                a = bucket_reshape.reshape(a, fin, fout, gs, t, self.P)
            else:
                a = apply_step(a, step)
        return a

    def _widened(self, a, i):
        """NOTE [widened bases]: a window whose padded length grows faster than its base (the
        last, shorter batch ``data[i:i + n]`` of a dataset; a Transformer's ``pe[:T]``) could
        pass the base's end at a bucket's length, and XLA would move its start back inside
        (``dynamic_slice`` clamps): its valid rows would be the wrong ones. The base is read
        widened by the window's padded length (zeros), so the start stays where it is."""
        w = self.p.widen[i] if i < len(self.p.widen) else None
        if w is None:
            return a
        dim, form = w
        pads = [(0, 0)] * a.ndim
        pads[dim] = (0, at(form, self.P))
        return jnp.pad(a, pads)

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
