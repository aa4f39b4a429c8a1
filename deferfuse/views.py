"""View ops on ``tpu`` tensors: a new tensor over the same storage with one more step in its view
chain (see NOTE [storage model] in tensor.py). Nothing runs and nothing is recorded; the results'
sizes, strides, chains and signatures are cached per (op, input signature, static arguments).
"""
from __future__ import annotations

import torch

from .dispatch import Fallback
from .engine import engine
from .meta import _base_stride, infer_view
from .opinfo import MULTI_VIEWS
from .runtime.node import const
from .runtime.viewchain import DSELECT, DSLICE, DSTRIDED
from .scheduler.records import sig_id
from .tensor import TpuTensor, make

aten = torch.ops.aten

_views = engine.views       # (op, input signature, static arguments) -> views made
_aliases = engine.aliases   # signature -> (size, stride, offset)


def run_view(func, info, args, kwargs):
    base = args[0]
    if type(base) is not TpuTensor:
        raise Fallback("view of a non-tpu tensor")
    if func in _MOVING:
        t = _moving_view(func, info, base, args, kwargs)
        if t is not None:
            return t
    elif func is aten.unbind.int:
        ts = _moving_unbind(info, base, args, kwargs)
        if ts is not None:
            return ts
    # NOTE [view cache keys]: the views made (see _views_of) are a function of the op, the input's
    # signature (its storage's shape and dtype, its view chain, sizes and strides) and the static
    # arguments, so cached under (op, signature, arguments...). A view at a dynamic offset
    # (_moving_view) is cached under (op, its step kind, signature, its static sizes): the kind, a
    # string where the generic key has the signature, keeps the two kinds of entry apart (an
    # as_strided with and one without an offset, ``x[2:1]`` and ``x[i:i+2]``, once shared one
    # entry). The signature leaves out a moving input's offset and the storage's layout, so
    # as_strided, whose step names both, adds them.
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
    if key is not None and func is aten.as_strided.default:
        # Its step names the storage's layout, and, with no offset given, the input's offset,
        # which the input's signature leaves out when it moves (NOTE [view cache keys]).
        key.append(base._s.stride)
        if (args[3] if len(args) > 3 else kwargs.get("storage_offset")) is None:
            key.append(base.storage_offset())
    if key is not None:
        key = tuple(key)
        views = _views.get(key)
        if views is None:
            views = _views[key] = _views_of(func, base, infer_view(func, args, kwargs))
    else:
        views = _views_of(func, base, infer_view(func, args, kwargs))
    st = base._s
    dyn = base._dyn
    if dyn:
        # Offsets relative to the input's, which moves (NOTE [dynamic offsets]).
        off0 = base.storage_offset()
        out = []
        for size, stride, offset, dtype, chain, sig, rel in views[0]:
            t = make(st, chain, size, stride, off0 + offset if rel else offset, dtype, sig)
            if rel:
                t._dyn = dyn
            out.append(t)
        return out if views[1] else out[0]
    if views[1]:
        return [make(st, chain, size, stride, offset + views[2] if rel else offset, dtype, sig)
                for size, stride, offset, dtype, chain, sig, rel in views[0]]
    size, stride, offset, dtype, chain, sig, rel = views[0][0]
    return make(st, chain, size, stride, offset + views[2] if rel else offset, dtype, sig)


# NOTE [dynamic offsets] (runtime/viewchain.py): views that only move a window over their input.
_MOVING = (aten.slice.Tensor, aten.select.int, aten.as_strided.default)
_SLICE_ARGS = ("dim", "start", "end", "step")


def _moving_view(func, info, base, args, kwargs):
    """The view at a dynamic offset (its start a program input, not part of its signature), or
    None when the generic path must decide (an error to raise, a window that cannot move)."""
    nd = base.dim()
    if nd == 0:
        return None
    if func is aten.as_strided.default:
        return _moving_strided(info, base, args, kwargs)
    shape = base.shape
    if func is aten.select.int:
        if kwargs or len(args) != 3:
            return None
        dim, index = args[1], args[2]
        if type(dim) is not int or type(index) is not int or not -nd <= dim < nd:
            return None
        dim %= nd
        n = shape[dim]
        if n <= 1 or not -n <= index < n:
            return None         # out of range: the meta kernel raises PyTorch's IndexError
        if index < 0:
            index += n
        key = (info, DSELECT, base._sig, dim)
        v = _views.get(key)
        if v is None:
            size = tuple(shape[:dim]) + tuple(shape[dim + 1:])
            st = base.stride()
            stride = tuple(st[:dim]) + tuple(st[dim + 1:])
            v = _views[key] = _dyn_view(base, (DSELECT, (dim,), ()), size, stride, st[dim])
    else:
        a = dict(zip(_SLICE_ARGS, args[1:]), **kwargs) if kwargs else dict(zip(_SLICE_ARGS, args[1:]))
        dim, start, end, step = a.get("dim", 0), a.get("start"), a.get("end"), a.get("step", 1)
        if type(dim) is not int or type(step) is not int or step < 1 or not -nd <= dim < nd:
            return None
        dim %= nd
        n = shape[dim]
        # PyTorch's slice bounds: None as the ends, negatives from the end, clamped to [0, n].
        if start is None:
            start = 0
        elif type(start) is not int:
            return None
        if end is None:
            end = n
        elif type(end) is not int:
            return None
        if start < 0:
            start += n
        if end < 0:
            end += n
        start = min(max(start, 0), n)
        end = min(max(end, start), n)
        length = (end - start + step - 1) // step
        if length == 0 or (start == 0 and end == n):
            return None         # nothing to move: a window of nothing, or of everything
        key = (info, DSLICE, base._sig, dim, length, step)
        v = _views.get(key)
        if v is None:
            st = base.stride()
            size = tuple(shape[:dim]) + (length,) + tuple(shape[dim + 1:])
            stride = tuple(st[:dim]) + (st[dim] * step,) + tuple(st[dim + 1:])
            v = _views[key] = _dyn_view(base, (DSLICE, (dim, length, step), ()), size, stride,
                                        st[dim])
        index = start
    size, stride, unit, dtype, chain, sig = v
    t = make(base._s, chain, size, stride, base.storage_offset() + index * unit, dtype, sig)
    t._dyn = base._dyn + (index,)
    return t


def _moving_unbind(info, base, args, kwargs):
    """``unbind`` (what ``for t in x`` calls) as one dynamic ``select`` per output: every output
    has the same signature, so a loop over the rows of a tensor (a diffusion pipeline's
    ``for t in timesteps``) is one structure for every row, as ``x[i]`` is."""
    nd = base.dim()
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if nd == 0 or type(dim) is not int or not -nd <= dim < nd or len(args) + len(kwargs) > 2:
        return None
    dim %= nd
    n = base.shape[dim]
    if n <= 1:
        return None
    out = [_moving_view(aten.select.int, info, base, (base, dim, i), {}) for i in range(n)]
    return None if any(t is None for t in out) else out


def _dyn_view(base, step, size, stride, unit):
    """(size, stride, storage offset per unit of the dynamic offset, dtype, chain, signature)."""
    chain = base._chain + (step,)
    return (size, stride, unit, base.dtype, chain,
            sig_id((base._s.val.shape, base._s.dtype, chain, size, stride, base.dtype)))


def _moving_strided(info, base, args, kwargs):
    """``as_strided`` whose storage offset is an input: only with explicit sizes, strides and
    offset that stay inside the storage (anything else: the generic path checks and raises)."""
    a = list(args[1:]) + [kwargs[k] for k in ("size", "stride", "storage_offset") if k in kwargs]
    if len(a) != 3:
        return None
    size, stride, off = a
    if type(off) is not int or off < 0:
        return None
    size, stride = tuple(size), tuple(stride)
    if len(size) != len(stride) or any(type(x) is not int or x < 0 for x in size + stride):
        return None
    numel = 1
    for x in base._s.val.shape:
        numel *= x
    if any(x == 0 for x in size):
        return None
    extent = off + sum((n - 1) * s for n, s in zip(size, stride))
    if extent >= numel:
        item = base.element_size()
        raise RuntimeError(f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset "
                           f"{off}, and itemsize {item} requiring a storage size of "
                           f"{(extent + 1) * item} are out of bounds for storage of size "
                           f"{numel * item}")
    key = (info, DSTRIDED, base._sig, size, stride, base._s.stride)
    v = _views.get(key)
    if v is None:
        step = (DSTRIDED, (size, stride, base._s.val.shape, _base_stride(base)), ())
        chain = (step,)         # relative to the storage, not to the input view
        v = _views[key] = (size, stride, base.dtype, chain,
                           sig_id((base._s.val.shape, base._s.dtype, chain, size, stride,
                                   base.dtype)))
    size, stride, dtype, chain, sig = v
    t = make(base._s, chain, size, stride, off, dtype, sig)
    t._dyn = (off,)
    return t


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
    dyn = base._dyn
    if dyn:
        t = make(base._s, base._chain, m[0], m[1], base.storage_offset(), base.dtype, sig)
        t._dyn = dyn
        return t
    return make(base._s, base._chain, m[0], m[1], m[2], base.dtype, sig)


def _views_of(func, base, outs):
    """([(size, stride, offset, dtype, view chain, signature, rel)], returns a list, the input's
    storage offset) of a view op's results on ``base``, from its meta results [(size, stride,
    offset, dtype, step)]. ``rel``: the offset is relative to the input's (every view but
    ``as_strided``'s, which is the storage's), so it holds wherever the input's window is."""
    views = []
    off0 = base.storage_offset()
    for size, stride, offset, dtype, step in outs:
        rel = True
        if step is None:                      # alias
            chain = base._chain
        elif step[0] is aten.as_strided.default:
            chain = (step,)                   # relative to the storage, not to the input view
            rel = False
        else:
            chain = base._chain + (step,)
        sig = sig_id((base._s.val.shape, base._s.dtype, chain, tuple(size), tuple(stride), dtype))
        views.append((size, stride, offset - off0 if rel else offset, dtype, chain, sig, rel))
    return views, func in MULTI_VIEWS, off0
