"""Every aten op on a ``tpu`` tensor comes here: meta inference, writes, and then the op runs
(strict/debug eager) or is recorded (defer); view ops go on to ``views.py``.

The hot path is ``torch_dispatch`` -> ``_run``: build the op's structural key by hand (no
tree_map: ``op_key`` in opkey.py), look it up, and either call the cached per-op jit or append a
node to the pending trace.
"""
from __future__ import annotations

import operator
import sys
import warnings

import torch

from .config import config
from .engine import engine, user_error
from .opinfo import op_info
from .opkey import op_key
from .runtime import execute, prng, transfer
from .runtime.dtypes import to_np_dtype
from .runtime.node import build
from .scheduler.records import sig_id
from .scheduler.policy import Sync
from .cpuwords import dtype_error
from .entries import kept_form
from .meta import infer
from .tensor import Storage, TpuTensor, as_tpu, make, new_tensor

aten = torch.ops.aten
_VAL = operator.attrgetter("_s.val")
_local = engine.local          # .ts: the calling thread's ThreadState (NOTE [threads])
_lock = engine.lock
_ops = engine.ops              # op key -> Entry


class Entry:
    """What one op structure needs at run time, computed on its first call."""
    __slots__ = ("fn", "jit", "out", "khash", "name", "key", "res_avals", "msgs", "fast", "made",
                 "dev", "dyn", "skey", "ohash", "draws")


def user_frame() -> str:
    """'file:line' of the innermost caller outside torch and deferfuse."""
    return engine.sources.site(sys._getframe(1))


# --------------------------------------------------------------------------------------------
# building blocks

def read(t: TpuTensor, reason: str = Sync.CPU):
    """The concrete JAX array of ``t`` (its view applied), running pending work first."""
    arr = engine.ready(t._s.val, t._s.device, reason)
    if not t._chain:
        return arr
    return execute.read_view(arr, t._chain, t._dyn)


def read_host(t: TpuTensor, reason: str = Sync.CPU):
    """The concrete JAX array of ``t`` for a read by the host (a sync point in defer mode)."""
    v = t._s.val
    trace = _local.ts.trace
    if v.node is not None and v.node.trace is trace:
        engine.sync(reason, want=v)
    elif trace.nodes and config.backward_cut:
        # NOTE [backward cut]: the value was computed before the pending trace (a loss whose
        # forward pass ran at backward()): dispatch the trace, wait for none of it.
        engine.sync(reason, later=True)
    return read(t, reason)


def to_cpu(t: TpuTensor, reason: str = Sync.CPU) -> torch.Tensor:
    """A CPU copy of ``t`` (a sync point in defer mode)."""
    arr = read_host(t, reason)
    out = transfer.to_torch(arr, t.dtype)
    return out.reshape(t.shape) if out.shape != t.shape else out


# --------------------------------------------------------------------------------------------
# the generic op path

class ResizeOuts(Exception):
    """``out=`` tensors whose shape is not the result's: resized as CPU resizes them (NOTE [resize]
    in specials.py), then the op runs again (route.py). ``outs``: [(tensor, result shape)]."""

    def __init__(self, outs):
        super().__init__()
        self.outs = outs


class Fallback(Exception):
    """Raised by the op path when the op cannot run on JAX (``why``); the router runs the op on
    CPU instead (fallback.py)."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def _run(func, info, args, kwargs):
    gen = None
    if kwargs and info.low.rng and kwargs.get("generator") is not None:
        # The op draws from this generator, not the device's (NOTE [rng offsets] in
        # runtime/prng.py); it is never part of the op's key, so a new generator object makes no
        # new cache entry (no compile per call).
        gen = kwargs["generator"]
        kwargs = dict(kwargs, generator=None)
    low = info.low
    key, tensors, scalars, dev = op_key(info, args, kwargs)
    targs, tkw = key[1], key[2]
    entry = _ops.get(key)
    if entry is None:
        err = dtype_error(func, args, kwargs)
        if err is not None:
            raise type(err)(str(err))       # CPU does not implement the op for these dtypes
        try:
            entry = _compile_entry(func, info, args, kwargs, key, targs, tkw, tensors, dev,
                                   scalars)
        except NotImplementedError as e:
            if getattr(e, "deferfuse_cpu_words", False):
                raise                   # CPU's own refusal (NOTE [CPU's words] in cpuwords.py)
            # No meta kernel, or an output shape that depends on the data (boolean masks).
            msg = str(e)
            why = "data-dependent shape" if ("nonzero" in msg or "data-dependent" in msg
                                             or "dynamic" in msg.lower()) else "no meta kernel"
            _ops[key] = entry = why
    if entry.__class__ is str:
        raise Fallback(entry)
    if entry.dyn:
        # Inputs that are views at dynamic offsets: the offsets are int inputs, after the op's
        # own scalars (NOTE [dynamic offsets] in runtime/viewchain.py).
        for i in entry.dyn:
            scalars.extend(tensors[i]._dyn)
    # Inputs: each tensor's base value; a mutated input that is overwritten whole is not read.
    mut = entry.out[1]
    ins = list(map(_VAL, tensors))
    if info.overwrites and mut:
        for m in mut:
            if not tensors[m]._chain:
                ins[m] = None
    ts = _local.ts
    if ts.mode == "defer":
        with _lock:
            trace = ts.trace
            fast = entry.fast
            if fast is not None:
                # The common case: record an op with new outputs only (no write, no RNG).
                if fast.__class__ is tuple:
                    st = Storage(trace.record(entry, ins, scalars, dev)[0], dev, fast[0], fast[2])
                    trace.storages.append(st.wr)
                    return make(st, (), fast[1], fast[2], 0, fast[0], fast[3])
                # Several new outputs (layer norm, a backward op, a foreach op): per output.
                res = []
                for m, v in zip(fast, trace.record(entry, ins, scalars, dev)):
                    if m is None:
                        res.append(None)
                    else:
                        st = Storage(v, dev, m[0], m[2])
                        trace.storages.append(st.wr)
                        res.append(make(st, (), m[1], m[2], 0, m[0], m[3]))
                return res if entry.out[0][0] == "list" else tuple(res)
            if low.rng:
                scalars.extend(engine.rng.draw(gen, dev, entry.draws))
            outs = trace.record(entry, ins, scalars, dev)
            return _bind(func, info, entry, outs, tensors, args, kwargs, dev)
    if low.rng:
        scalars.extend(engine.rng.draw(gen, dev, entry.draws))
    outs = engine.run_node(entry, ins, scalars, dev)
    return _bind(func, info, entry, outs, tensors, args, kwargs, dev)


def _bind(func, info, entry, outs, tensors, args, kwargs, dev):
    out_meta, mut = entry.out[0], entry.out[1]
    if mut:
        for k, m in enumerate(mut):
            st = tensors[m]._s
            v = outs[k]
            if v.node is not None:
                v.node.trace.track_mut(st, v)
            st.val = v
        rets = info.returns
        if not rets:
            return None
        res = []
        for r in rets:
            if r is None:
                res.append(None)
            elif r[2]:
                res.append(kwargs[r[1]])
            else:
                res.append(args[r[0]])
        if len(res) == 1:
            return res[0]
        return tuple(res)
    structure, metas = out_meta
    if structure == "none":     # an op declared "-> ()" (_linalg_check_errors ...)
        return None
    # entry.made: (dtype, size, stride or None, _sig) per output
    made = [None if m is None else new_tensor(v, dev, m[0], m[1], m[2], sig=m[3])
            for m, v in zip(entry.made, outs)]
    if structure == "one":
        return made[0]
    if structure == "list":
        return made
    return tuple(made)


def _infer(func, info, args, kwargs):
    if info.kind in ("self_mut", "func_mut"):
        with warnings.catch_warnings():
            # the meta kernel's own out= resize warning: ours, CPU's words, comes from route.py
            warnings.filterwarnings("ignore", "An output with one or more elements was resized")
            return infer(func, args, kwargs)
    return infer(func, args, kwargs)


def _compile_entry(func, info, args, kwargs, key, targs, tkw, tensors, dev, scalars):
    # NOTE [entries on disk] (entries.py): what an earlier process learned for this key.
    store = engine.entry_store
    skey = store.key(key) if store.on else None
    kept = store.get(skey) if skey is not None else None
    if kept is None:
        out = _infer(func, info, args, kwargs)
    else:
        out = kept[0]
        if config.cross_check or config.mode == "debug":
            exact = kept_form(_infer(func, info, args, kwargs))
            if exact != out:
                store.stale += 1
                raise AssertionError(
                    f"deferfuse internal error: {info.name}'s outputs kept on disk {out} differ "
                    f"from its meta kernel's {exact} (NOTE [entries on disk] in "
                    f"deferfuse/entries.py; DEFERFUSE_LEARNED_ENTRIES=0 turns the store off)")
    e = Entry()
    e.dev = dev
    e.name = info.name
    # hash(-1) == hash(-2) in CPython: mix in the text of the key so such keys never collide.
    e.khash = hash((key, repr(key)))
    e.ohash = _shapeless_hash(key)
    mut = ()
    if info.kind in ("self_mut", "func_mut"):
        mut_objs = [args[i] for i in info.mut_pos if i < len(args)] + \
                   [kwargs[n] for n in info.mut_kw if n in kwargs]
        flat = []
        for o in mut_objs:
            flat.extend(o if isinstance(o, (list, tuple)) else [o])
        mut = tuple(next(j for j, t in enumerate(tensors) if t is o) for o in flat if o is not None)
        structure, metas = out
        wrong = [(tensors[m], tuple(d[0])) for m, d in zip(mut, metas)
                 if d is not None and tuple(d[0]) != tuple(tensors[m].shape)]
        if wrong:
            raise ResizeOuts(wrong)
        out_avals = tuple((tuple(tensors[m].shape), to_np_dtype(tensors[m].dtype)) for m in mut)
        metas = ()
        structure = None
    else:
        structure, metas = out
        out_avals = tuple(None if m is None else (tuple(m[0]), to_np_dtype(m[2])) for m in metas)
    bases = tuple((t._s.val.shape, t._s.val.dtype) for t in tensors)
    chains = tuple(t._chain for t in tensors)
    e.fn = build(info.low, targs, tkw, chains, bases, mut, info.kind == "self_mut", out_avals)
    e.dyn = tuple(i for i, t in enumerate(tensors) if t._dyn)
    e.out = ((structure, metas), mut, info.low.rng, out_avals)
    e.jit = None
    e.skey = None       # its stable description, made when a program is stored (diskcache.py)
    e.key = key
    e.draws = 0
    if info.low.rng:
        # How many values it draws: the offset its generator moves by (NOTE [rng offsets]).
        avals = [None if (info.overwrites and m in mut and not t._chain) else bases[m]
                 for m, t in enumerate(tensors)]
        dyn = [o for i in e.dyn for o in tensors[i]._dyn]
        e.draws = kept[1] if kept is not None else prng.draws(e.fn, avals, [*scalars, *dyn, 0, 0])
    res = [tuple(bases[m]) for m in mut] if mut else [a for a in out_avals]
    e.res_avals = tuple(None if a is None else (a[0], a[1], _nbytes(a[0], a[1])) for a in res)
    # One new output and nothing written or random: _run's fast path in defer mode takes
    # (dtype, size, stride or None when contiguous, the output tensor's _sig).
    made = []
    for m in metas:
        if m is None:
            made.append(None)
            continue
        size, stride, dtype = tuple(m[0]), tuple(m[1]), m[2]
        made.append((dtype, size, None if stride == _contig(size) else stride,
                     sig_id((size, dtype, (), size, stride, dtype))))
    e.made = tuple(made)
    e.fast = None
    if not mut and not info.low.rng:
        if structure == "one" and made[0] is not None:
            e.fast = made[0]        # a tuple (dtype, size, stride, sig)
        elif structure in ("tuple", "list"):
            e.fast = made           # a list: one such tuple (or None) per output
    _ops[key] = e
    if skey is not None and kept is None:
        store.put(skey, out, e.draws)
    return e


def _skeleton(x):
    """``x`` with every int replaced by a marker (sizes, dims, lengths), bools kept."""
    t = type(x)
    if t is int:
        return "\0int"
    if t is tuple or t is list:
        return tuple(_skeleton(y) for y in x)
    return x


def _shapeless_hash(key) -> int:
    """NOTE [shapeless loop bodies]: the hash of an op's structure without its sizes (its op, the
    form of its arguments, the kinds of views and the ranks and dtypes of its inputs), which step
    detection (deferfuse/record.py) finds loop bodies with: a generate() loop whose sequence grows
    by one token per step repeats the same ops with new shapes, and hashed with its shapes it was
    one 1,400-op trace with no loop in it."""
    info, targs, tkw, sigs, dev = key
    forms = []
    for i in sigs:
        sig = sig_id.of.get(i)
        if sig is None:
            forms.append(i)
            continue
        base_shape, base_dtype, chain, size, stride, dtype = sig
        forms.append((len(base_shape), base_dtype, tuple(s[0] for s in chain), len(size), dtype))
    text = repr((info, _skeleton(targs), _skeleton(tkw), forms, dev))
    return hash(text)


def from_cpu(c: torch.Tensor, device: int = 0, dtype=None) -> TpuTensor:
    """A new tpu tensor holding a copy of the CPU tensor ``c``."""
    if dtype is not None and c.dtype != dtype:
        c = c.to(dtype)
    v = transfer.host_value(c, device)
    return new_tensor(v, device, c.dtype, tuple(c.shape), _contig(c.shape))


def _nbytes(shape, dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def _contig(shape):
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def copy_into(dst: TpuTensor, src) -> TpuTensor:
    """``dst.copy_(src)`` for any src (tpu tensor, CPU tensor), through the lowered copy_."""
    if type(src) is not TpuTensor:
        # a plain tpu tensor a factory made inside the op path: read as a CPU tensor, its bytes
        # were the engine's storage record
        src = as_tpu(src)
    if isinstance(src, torch.Tensor) and type(src) is not TpuTensor:
        if (not dst._chain and src.dtype == dst.dtype and src.shape == dst.shape
                and dst._s.val.shape == tuple(src.shape)):
            # All of dst's storage is overwritten by a host tensor (``x.to("tpu")`` is an empty
            # tensor and this copy): the storage takes the transferred value itself, with no copy
            # op recorded or run. Ops recorded before read the old value, as they should.
            dst._s.val = transfer.host_value(src, dst._s.device)
            return dst
        src = from_cpu(src, dst._s.device)
    return _run(aten.copy_.default, op_info(aten.copy_.default), (dst, src), {})




# --------------------------------------------------------------------------------------------
# host-side conveniences of TpuTensor that read values (PyTorch implements them with raw data
# pointers, which a tpu tensor does not have)

def _repr(self, *, tensor_contents=None):
    try:
        cpu = to_cpu(self, Sync.PRINT)
    except Exception as e:
        raise user_error(e)     # NOTE [user frames] (engine.py)
    s = torch._tensor_str._str(cpu)
    dev = f"device='{self.device}'"
    if s.endswith(")"):
        # Insert the device after the values, where PyTorch puts it for cuda tensors.
        head, tail = s[:-1], ")"
        for marker in (", grad_fn=", ", requires_grad=True"):
            i = head.find(marker)
            if i >= 0:
                head, tail = head[:i], head[i:] + ")"
                break
        return f"{head}, {dev}{tail}"
    return s


def _tolist(self):
    try:
        return to_cpu(self, Sync.TOLIST).tolist()
    except Exception as e:
        raise user_error(e)


TpuTensor.__repr__ = _repr
TpuTensor.tolist = _tolist
