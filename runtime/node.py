"""Build the pure JAX function of one recorded op from its structure (the node's key parts).

The function runs only while JAX traces (strict eager's per-op jit, or a fused region), so its
Python cost is paid once per compile, never per call.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from . import prng
from .dtypes import cast
from .lowering.precision import HALF, round_to
from .viewchain import apply_chain, n_dynamic, scatter_chain

# NOTE [half outputs]: every op's output is rounded to its dtype, as in eager PyTorch. XLA computes
# half-precision elementwise ops in float32 and, in a fused region, may skip the rounding between
# one op's output and the next op (a fused chain of float16 ops matched neither strict mode nor
# CPU: 12% of the elements of a five-op chain differed), so a bfloat16 or float16 output is
# rounded with ``reduce_precision``, which XLA keeps, before the cast.

# Slot markers inside an op's argument template (a hashable tuple): a tensor input (TS, i), a
# scalar input (SS, i, type), a baked Python number (CS, type, value[, tag]).
TS = "\0tensor"
SS = "\0scalar"
CS = "\0const"
_NAN = float("nan")     # every baked nan is this object: equal to itself in a key (by identity)


def const(a) -> tuple:
    """The template entry of a Python number baked into an op's key. NOTE [typed constants]: the
    key carries the number's type, and for a float the sign of zero, because ``2 == 2.0 == True``
    and ``0.0 == -0.0`` in Python: keyed by value alone, ``full(.., 2)`` and ``full(.., 2.0)``
    shared one entry, and the second got the first's int64 dtype. A nan is one canonical object,
    so a key holding it equals itself."""
    ta = type(a)
    if ta is float:
        if a != a:
            return (CS, ta, _NAN, "nan")
        if a == 0.0:
            return (CS, ta, a, math.copysign(1.0, a))
        return (CS, ta, a)
    if ta is complex:
        return (CS, ta, a, repr(a))
    return (CS, ta, a)


def _rounded(r, dt):
    """``r`` as an output of dtype ``dt``; a half-precision output rounded by an op XLA keeps
    (NOTE [half outputs])."""
    if dt in HALF:
        return round_to(r.astype(jnp.float32), dt).astype(dt)
    return r if r.dtype == dt else cast(r, dt)    # NOTE [float to int casts] (dtypes.py)


def _fill(x, vals, scalars):
    if type(x) is tuple:
        if x:
            h = x[0]
            if h is TS:
                return vals[x[1]]
            if h is SS:
                return scalars[x[1]]
            if h is CS:
                return x[2]
        return tuple(_fill(y, vals, scalars) for y in x)
    return x


def build(low, targs, tkwargs, chains, bases, mut, self_mut, out_avals):
    """The function ``(arrays, scalars) -> outputs`` of one op.

    ``arrays`` are the base values of the tensor inputs;
    ``chains[i]`` reads input i's view out of its base; ``bases[i]`` is (shape, dtype) of base i.
    ``scalars`` are the template's scalar inputs, then the dynamic offsets of each input's chain
    in input order (NOTE [dynamic offsets] in viewchain.py), then, when ``low.rng``, the
    generator's seed and offset (NOTE [rng offsets] in prng.py).
    A mutating op (``mut``: the inputs it writes) returns the new base values of those inputs;
    with ``self_mut`` the lowering itself returns the written values, else the op's functional
    form does. Other ops return their outputs cast to the dtypes of ``out_avals`` (PyTorch's,
    from meta inference); a lowering registered with ``meta=True`` receives ``_avals=out_avals``.
    """
    rng = low.rng
    fn = low.fn
    out_dtypes = [a[1] if a is not None else None for a in out_avals]
    ndyn = [n_dynamic(c) for c in chains]
    total_dyn = sum(ndyn)

    def node_fn(arrays, scalars):
        arrays = list(arrays)
        if rng:     # the generator's (seed, offset) come last (NOTE [rng offsets] in prng.py)
            kw_key = prng.key(scalars[-2], scalars[-1])
            scalars = scalars[:-2]
        dyns = [()] * len(chains)
        if total_dyn:
            k = len(scalars) - total_dyn
            scalars, offs = scalars[:k], scalars[k:]
            dyns, k = [], 0
            for n in ndyn:
                dyns.append(offs[k:k + n])
                k += n
        kw = dict(tkwargs)
        if rng:
            kw["key"] = kw_key
        if low.meta:
            kw["_avals"] = out_avals
        vals = [None if a is None else (apply_chain(a, c, d) if c else a)
                for a, c, d in zip(arrays, chains, dyns)]
        args = [_fill(a, vals, scalars) for a in targs]
        kw = {k: _fill(v, vals, scalars) for k, v in kw.items()}
        res = fn(*args, **kw)
        res = list(res) if isinstance(res, (tuple, list)) else [res]
        if mut:
            if not self_mut:
                res = res[:len(mut)]
            outs = []
            for r, m in zip(res, mut):
                base = arrays[m]
                if bases[m][1] in HALF:
                    r = _rounded(jnp.asarray(r), bases[m][1])   # NOTE [half outputs]
                if base is None:   # overwritten whole without being read
                    shape, dt = bases[m]
                    outs.append(cast(jnp.broadcast_to(jnp.asarray(r), shape), dt))
                else:
                    outs.append(scatter_chain(base, chains[m], r, dyns[m]))
        else:
            outs = [r if r is None or d is None else _rounded(r, d)
                    for r, d in zip(res, out_dtypes)]
        return outs

    return node_fn
