"""Buckets (NOTE [buckets] in buckets.py): a region's bucket plan (its ops' plans and its inputs'
forms), its program's stable description and function, and padding and cutting arrays."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .bucket_fit import Fit, Refused, at
from .bucket_fn import NodeFn
from .bucket_node import plan_node
from .dtypes import x64
from .transfer import put_on


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
    inputs, the programs made for it so far ((bucket length, outputs, scalar types) ->
    ``BucketProgram``), and ``seen``: up to two lengths it took (two: its line is confirmed by
    versions, NOTE [a new base grows alike] in buckets.py)."""
    __slots__ = ("fit", "nodes", "ext_forms", "programs", "desc", "seen")


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
    bp.desc, bp.seen = None, set()
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
                                    at(n.out_avals, P), tuple(n.in_forms), n.base_forms,
                                    tuple(n.widen), tuple(n.compact))))
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
    return put_on(out, dev)


def cut(array, shape, moves):
    """The exact ``shape`` prefix of a padded ``array`` (as ``pad``)."""
    if tuple(array.shape) == tuple(shape):
        return array
    dev = next(iter(array.devices()))
    if dev.platform != "cpu":
        return _moved(moves, ("cut", tuple(array.shape), tuple(shape)), array)
    host = np.asarray(array)[tuple(slice(0, n) for n in shape)]
    return put_on(np.ascontiguousarray(host), dev)


def repad(array, exact, shape, moves):
    """A padded ``array`` whose data is its ``exact`` prefix (a lazily cut value: NOTE [lazy
    cuts] in buckets.py) as ``shape``, zero-padded past ``exact``: one host copy on a CPU device
    (the cut and the pad of an exact array were two), a cut then a pad program elsewhere."""
    dev = next(iter(array.devices()))
    if dev.platform != "cpu":
        return pad(cut(array, exact, moves), shape, moves)
    host = np.asarray(array)
    out = np.zeros(shape, host.dtype)
    part = tuple(slice(0, n) for n in exact)
    out[part] = host[part]
    return put_on(out, dev)


def pad_edge(array, length: int, moves):
    """The 1-D ``array`` padded at its end to ``length`` with copies of its last entry (a packed
    batch's sequence boundaries: the padding adds empty sequences, NOTE [packed boundaries] in
    deferfuse/packed.py). Where ``array`` is, as ``pad``: through the host on a CPU device, a
    small program per length elsewhere."""
    n = array.shape[0]
    if n == length or n == 0:
        return array
    dev = next(iter(array.devices()))
    if dev.platform != "cpu":
        return _moved(moves, ("edge", (n,), (length,)), array)
    host = np.asarray(array)
    return put_on(np.concatenate([host, np.repeat(host[-1:], length - n)]), dev)


def _moved(moves, key, array):
    """A pad or cut program from ``moves`` (a Cache: (what, shape in, shape out) -> program)."""
    fn = moves.get(key)
    if fn is None:
        what, src, dst = key
        if what == "pad":
            cfg = [(0, d - s, 0) for s, d in zip(src, dst)]
            fn = jax.jit(lambda a: lax.pad(a, jnp.zeros((), a.dtype), cfg))
        elif what == "edge":
            fn = jax.jit(lambda a: jnp.pad(a, (0, dst[0] - src[0]), mode="edge"))
        else:
            fn = jax.jit(lambda a: a[tuple(slice(0, n) for n in dst)])
        moves[key] = fn
    with x64(True):
        return fn(array)
