"""What deferfuse needs to know about an aten op, computed once per op and cached.

How the op runs (``kind``), which arguments are Python numbers that become inputs, which
arguments it writes, and what it returns.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch._decomp import core_aten_decompositions, decomposition_table

from .attention import DECOMPOSITIONS as ATTENTION_DECOMPOSITIONS
from .ctc import DECOMPOSITIONS as CTC_DECOMPOSITIONS
from .histogram import DECOMPOSITIONS as HISTOGRAM_DECOMPOSITIONS
from .lstsq import DECOMPOSITIONS as LSTSQ_DECOMPOSITIONS
from .runtime.lowering import LOWERINGS

aten = torch.ops.aten

# Ops whose output shape depends on the data. Those with a handler in datadep.py (a SPECIAL) run on
# the device with one read of their size; the rest sync and run on CPU (counted as such).
DATA_DEPENDENT = {o for o in (
    getattr(getattr(aten, p, None), ov, None) for p, ov in (
        ("nonzero", "default"), ("masked_select", "default"), ("_unique2", "default"),
        ("unique_dim", "default"), ("unique_consecutive", "default"), ("_unique", "default"),
        ("repeat_interleave", "Tensor"), ("argwhere", "default"), ("nonzero_numpy", "default"),
        ("equal", "default"), ("allclose", "default"), ("bincount", "default"))) if o is not None}

# Argument types whose Python numbers become inputs (a number in a Tensor slot included).
# Views returning several tensors: each output becomes a slice/select step (deferfuse/meta.py).
MULTI_VIEWS = {o for o in (getattr(getattr(aten, p, None), ov, None) for p, ov in (
    ("split", "Tensor"), ("split_with_sizes", "default"), ("unbind", "int"),
    ("split", "sizes"), ("tensor_split", "sections"))) if o is not None}



def number_slot(t) -> bool:
    """Whether a Python number in an argument of schema type ``t`` becomes a program input: a
    ``Scalar``/``float``/``complex`` (optional or not), a number given for a ``Tensor`` (a wrapped
    number), or a list of numbers (the per-tensor step sizes of foreach optimizers). Matched on
    the schema's types, never on their printed names (``Scalar?`` prints ``Optional[number]``).
    Integer slots (dims, sizes) and bools stay static: they shape the program."""
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch.ListType):
        e = t.getElementType()
        return isinstance(e, (torch.NumberType, torch.FloatType))
    return isinstance(t, (torch.NumberType, torch.FloatType, torch.ComplexType, torch.TensorType))


class OpInfo:
    __slots__ = ("func", "kind", "scalar_pos", "scalar_kw", "mut_pos", "mut_kw", "returns",
                 "functional", "low", "name", "overwrites")

    def __repr__(self):
        return f"OpInfo({self.name}, {self.kind})"


def _functional_of(func):
    """The functional overload computing what ``func`` (in-place or out=) writes, or None."""
    schema = func._schema
    packet_name = schema.name.split("::")[1]
    ov = func._overloadname
    if packet_name.endswith("_") and not packet_name.startswith("_") or packet_name.startswith("_foreach") and packet_name.endswith("_"):
        p = getattr(aten, packet_name[:-1], None)
        if p is None:
            return None
        return getattr(p, ov, None)
    # out= variant: find the overload with the same non-out arguments. Only when every written
    # argument is keyword-only (out=): an op writing a positional argument (batch norm's running
    # stats) is not an out= variant of anything.
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if any(not a.kwarg_only for a in written):
        return None
    keep = [a for a in schema.arguments if not (a.alias_info is not None and a.alias_info.is_write)]
    p = getattr(aten, packet_name, None)
    if p is None:
        return None
    names = [a.name for a in keep]
    for other in p.overloads():
        o = getattr(p, other)
        if o is func or any(a.alias_info is not None and a.alias_info.is_write for a in o._schema.arguments):
            continue
        if [a.name for a in o._schema.arguments] == names:
            return o
    return None


# In-place ops that overwrite all of self without reading it.
_OVERWRITE_NAMES = {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "exponential_",
                    "cauchy_", "log_normal_", "geometric_", "bernoulli_"}

_INFOS: dict = {}       # op -> OpInfo: one per op overload, bounded by the op set


def clear() -> None:
    """Forget every op's classification (a lowering registered or replaced since is seen)."""
    _INFOS.clear()


def op_info(func) -> OpInfo:
    info = _INFOS.get(func)
    if info is not None:
        return info
    info = OpInfo()
    schema = func._schema
    info.func = func
    info.name = str(func)
    args = schema.arguments
    info.scalar_pos = frozenset(i for i, a in enumerate(args)
                                if not a.kwarg_only and number_slot(a.type))
    info.scalar_kw = frozenset(a.name for a in args if number_slot(a.type))
    mut = [(i, a) for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
    info.mut_pos = tuple(i for i, a in mut if not a.kwarg_only)
    info.mut_kw = tuple(a.name for i, a in mut if a.kwarg_only)
    # Which argument each aliasing return is (for mutating ops returning their inputs).
    rets = []
    for r in schema.returns:
        if r.alias_info is None:
            rets.append(None)
            continue
        sets = r.alias_info.before_set
        for i, a in enumerate(args):
            if a.alias_info is not None and a.alias_info.before_set == sets:
                rets.append((i, a.name, a.kwarg_only))
                break
        else:
            rets.append(None)
    info.returns = tuple(rets)
    info.functional = None
    info.low = LOWERINGS.get(func)
    info.overwrites = schema.name.split("::")[1] in _OVERWRITE_NAMES
    if func in DATA_DEPENDENT:
        info.kind = "data_dependent"
    elif mut:
        if info.low is not None:
            info.kind = "self_mut"
        elif _own_kernel(func) is not None:
            info.kind = "decomp"
        else:
            f = _functional_of(func)
            if f is not None and f in LOWERINGS:
                info.functional = f
                info.low = LOWERINGS[f]
                info.kind = "func_mut"
            elif func in _DECOMP:
                info.kind = "decomp"
            else:
                info.kind = "fallback"
    elif func.is_view and (info.low is not None or func in MULTI_VIEWS):
        info.kind = "view"
    elif func.is_view:
        # A copy would silently break aliasing: never fall back to CPU for a view.
        info.kind = "decomp" if (func in _DECOMP or torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd")) else "unsupported_view"
    elif info.low is not None:
        info.kind = "lowered"
    elif func in _DECOMP or torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd"):
        info.kind = "decomp"
    elif _own_kernel(func) is not None:
        info.kind = "decomp"
    else:
        info.kind = "fallback"
    _INFOS[func] = info
    return info


def op_info_with(func, **static) -> OpInfo:
    """``func``'s OpInfo with its lowering called with ``static`` keyword arguments too: a fact
    the recorder reads that changes the program (NOTE [half layer norm parameter gradients]).
    The variant is another object with another name, so op keys (in memory, by identity) and
    the program store's descriptions (by ``repr``) of two values never meet. Kept with the
    others, one per op and values (bounded by the op set times the values a program uses)."""
    key = (func, tuple(sorted(static.items())))
    info = _INFOS.get(key)
    if info is not None:
        return info
    base = op_info(func)
    info = OpInfo()
    for slot in OpInfo.__slots__:
        setattr(info, slot, getattr(base, slot))
    info.name = f"{base.name}[{','.join(f'{k}={v!r}' for k, v in key[1])}]"
    info.low = replace(base.low, fn=functools.partial(base.low.fn, **static))
    _INFOS[key] = info
    return info


# Decompositions that stay in aten (never torch._refs, whose prims have no lowering here).
_DECOMP = {k: v for k, v in decomposition_table.items()
           if not getattr(v, "__module__", "").startswith("torch._refs")}
_DECOMP.update(core_aten_decompositions())
_DECOMP.update(ATTENTION_DECOMPOSITIONS)
_DECOMP.update(HISTOGRAM_DECOMPOSITIONS)
_DECOMP.update(CTC_DECOMPOSITIONS)
_DECOMP.update(LSTSQ_DECOMPOSITIONS)


def decompose(func, args, kwargs):
    d = _DECOMP.get(func)
    if d is not None:
        return d(*args, **kwargs)
    k = _own_kernel(func)
    if k is not None:
        return func._op_dk(k, *args, **kwargs)
    return func.decompose(*args, **kwargs)


_KERNEL_KEYS = (torch._C.DispatchKey.PrivateUse1, torch._C.DispatchKey.CompositeExplicitAutograd)
_OWN: dict = {}


def _own_kernel(func):
    """NOTE [own kernels]: an op from outside aten (a library's, such as FSDP2's
    ``fsdp.all_gather_copy_in`` or the functional collectives' ``_wrap_tensor_autograd``) with a
    kernel for PrivateUse1, or one for every backend (CompositeExplicitAutograd), is written in
    torch ops: run that kernel on the tpu tensors themselves, its ops recorded or run like any
    other, rather than on CPU copies (which broke the views such kernels return). The dispatch
    key of that kernel, or None."""
    k = _OWN.get(func, 0)
    if k == 0:
        k = None
        if func.namespace != "aten":
            for key in _KERNEL_KEYS:
                if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key.name):
                    k = key
                    break
        _OWN[func] = k
    return k
