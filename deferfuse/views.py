"""View ops on ``tpu`` tensors: a new tensor over the same storage with one more step in its view
chain (see NOTE [storage model] in tensor.py). Nothing runs and nothing is recorded; the results'
sizes, strides, chains and signatures are cached per (op, input signature, static arguments).
"""
from __future__ import annotations

import torch

from .dispatch import Fallback
from .engine import engine
from .meta import infer_view
from .opinfo import MULTI_VIEWS
from .runtime.node import const
from .scheduler.records import sig_id
from .tensor import TpuTensor, make

aten = torch.ops.aten

_views = engine.views       # (op, input signature, static arguments) -> views made
_aliases = engine.aliases   # signature -> (size, stride, offset)


def run_view(func, info, args, kwargs):
    base = args[0]
    if type(base) is not TpuTensor:
        raise Fallback("view of a non-tpu tensor")
    # The views made (see _views_of): a function of the op, the input's signature (its storage's
    # shape and dtype and its view chain) and the static arguments, so cached.
    key = [info, base._sig]     # OpInfo: object hashing (OpOverload.__hash__ is Python)
    for a in args[1:]:
        ta = type(a)
        if ta is list:
            a = tuple(a)
        elif ta is bool or ta is float:
            a = const(a)        # NOTE [typed constants] (runtime/node.py)
        elif isinstance(a, torch.Tensor):
            key = None
            break
        key.append(a)
    if key is not None and kwargs:
        key.append(tuple((k, const(v) if type(v) in (bool, float) else v) for k, v in kwargs.items()))
    if key is not None:
        key = tuple(key)
        views = _views.get(key)
        if views is None:
            views = _views[key] = _views_of(func, base, infer_view(func, args, kwargs))
    else:
        views = _views_of(func, base, infer_view(func, args, kwargs))
    st = base._s
    if views[1]:
        return [make(st, chain, size, stride, offset, dtype, sig)
                for size, stride, offset, dtype, chain, sig in views[0]]
    size, stride, offset, dtype, chain, sig = views[0][0]
    return make(st, chain, size, stride, offset, dtype, sig)


ALIAS_OPS = (aten.detach.default, aten.alias.default)


def run_alias(func, info, args, kwargs):
    """detach and alias: the same view of the same storage (autograd detaches every tensor it
    saves, so this is common enough for a path of its own)."""
    base = args[0]
    if type(base) is not TpuTensor:
        return run_view(func, info, args, kwargs)
    sig = base._sig
    m = _aliases.get(sig)
    if m is None:
        m = _aliases[sig] = (tuple(base.shape), tuple(base.stride()), base.storage_offset())
    return make(base._s, base._chain, m[0], m[1], m[2], base.dtype, sig)


def _views_of(func, base, outs):
    """([(size, stride, offset, dtype, view chain, signature)], returns a list) of a view op's
    results on ``base``, from its meta results [(size, stride, offset, dtype, step)]."""
    views = []
    for size, stride, offset, dtype, step in outs:
        if step is None:                      # alias
            chain = base._chain
        elif step[0] is aten.as_strided.default:
            chain = (step,)                   # relative to the storage, not to the input view
        else:
            chain = base._chain + (step,)
        sig = sig_id((base._s.val.shape, base._s.dtype, chain, tuple(size), tuple(stride), dtype))
        views.append((size, stride, offset, dtype, chain, sig))
    return views, func in MULTI_VIEWS
