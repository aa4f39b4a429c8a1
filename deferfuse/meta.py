"""Shape, stride and dtype of an op's outputs from PyTorch's meta kernels, never by running it.

Results are cached with the op's structural key by the dispatcher, so this runs once per structure.
"""
from __future__ import annotations

import torch

from . import metaplain as plain
from .config import config
from .cpuwords import ARG_ERRORS, check_arguments, check_dtypes, raise_like_cpu
from .metarules import RULES
from .metasize import SizeRules
from .tensor import TpuTensor

aten = torch.ops.aten
_META = torch.device("meta")
_GROUPED_MM = getattr(getattr(aten, "_grouped_mm", None), "default", None)
try:
    from torch._meta_registrations import _create_grouped_mm_output_tensor as _grouped_mm_out
except ImportError:     # another torch: its own meta kernel decides
    _grouped_mm_out = None


def _to_meta(a):
    if type(a) is TpuTensor:
        numel = 1
        for s in a._s.val.shape:
            numel *= s
        if a._chain:
            # A view: place it in a meta storage as large as its base, at its offset.
            return torch.empty(max(numel, a.storage_offset() + 1), dtype=a.dtype, device=_META).as_strided(
                a.shape, a.stride(), a.storage_offset())
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=_META)
    if isinstance(a, (list, tuple)):
        return type(a)(_to_meta(x) for x in a)
    if isinstance(a, torch.device) and a.type == "tpu":
        return _META
    if isinstance(a, torch.Tensor) and a.device.type != "cpu":
        return a
    return a


def _desc(m):
    if m is None:
        return None
    if not isinstance(m, torch.Tensor):
        raise NotImplementedError(f"non-tensor output {type(m).__name__}")
    return (tuple(m.shape), tuple(m.stride()), m.dtype)


def infer(func, args, kwargs):
    """(structure, [(size, stride, dtype) or None per output]) of ``func``'s outputs; bad
    arguments raise what CPU raises (NOTE [CPU's words])."""
    check_dtypes(func, args, kwargs)
    try:
        return _infer(func, args, kwargs)
    except NotImplementedError:
        raise
    except ARG_ERRORS as e:
        raise_like_cpu(func, args, kwargs, e)


def _infer(func, args, kwargs):
    rule = RULES.get(func)
    if rule is not None:
        return rule(*args, **kwargs)
    check_arguments(func, args, kwargs)
    return _meta_outputs(func, args, kwargs)


def _meta_outputs(func, args, kwargs):
    """(structure, descs) of ``func``'s outputs from its meta kernel (NOTE [meta memo])."""
    key = memo.key(func, args, kwargs)
    if key is not None:
        r = memo.get(key)
        if r is not None:
            return r
    rk = sizes.key(func, args, kwargs) if config.meta_rules else None
    if rk is not None:
        r = sizes.derive(rk)
        if r is not None:
            _cross_check(func, args, kwargs, r, _run_meta,
                         "derived by rule", "NOTE [sizes by rule] in deferfuse/metasize.py; "
                         "DEFERFUSE_META_RULES=0 turns the rules off")
            sizes.derived += 1
            if key is not None:
                memo.put(key, r)
            return r
    r = _run_meta(func, args, kwargs)
    if rk is not None:
        sizes.learn(rk, r)
    if key is not None:
        memo.put(key, r)
    return r


def _cross_check(func, args, kwargs, r, kernel, how: str, where: str) -> None:
    """In debug mode or with ``DEFERFUSE_CROSS_CHECK=1``: a rule's answer ``r`` for ``func`` must
    equal what ``kernel`` gives on the same arguments."""
    if config.cross_check or config.mode == "debug":
        exact = kernel(func, args, kwargs)
        if exact != r:
            raise AssertionError(
                f"deferfuse internal error: {func}'s outputs {how} {r} differ from its meta "
                f"kernel's {exact} ({where})")


def _run_meta(func, args, kwargs):
    # NOTE [meta without dynamo] (metaplain.py)
    r = plain.answer(func, args, kwargs) if config.meta_plain else None
    if r is not None:
        _cross_check(func, args, kwargs, r, _kernel_outputs, "answered by rule",
                     "NOTE [meta without dynamo] in deferfuse/metaplain.py")
        return r
    return _kernel_outputs(func, args, kwargs)


# op -> the position of a value argument that may be a CPU 0-dim tensor beside tpu tensors
_CPU_SCALAR_VALUE = {aten.masked_fill.Tensor: 2, aten.masked_fill_.Tensor: 2,
                     aten.index_fill.int_Tensor: 3, aten.index_fill_.int_Tensor: 3}


def _cpu_scalar(a) -> bool:
    return isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() == 0


def _kernel_outputs(func, args, kwargs):
    margs = [_to_meta(a) for a in args]
    mkw = {k: _to_meta(v) for k, v in kwargs.items()}
    if func is _GROUPED_MM and _grouped_mm_out is not None:
        # Its meta kernel copies CUDA's bfloat16-only check; CPU eager (and the lowering) take
        # any float dtype, and transformers' MoE layers call it on tpu: use the shape rule alone.
        a, b = margs[0], margs[1]
        offs = margs[2] if len(margs) > 2 else mkw.get("offs")
        dt = (margs[4] if len(margs) > 4 else mkw.get("out_dtype")) or a.dtype
        return "one", (_desc(_grouped_mm_out(a, b, offs, dt)),)
    at = _CPU_SCALAR_VALUE.get(func)
    if at is not None and len(margs) > at and _cpu_scalar(margs[at]):
        # masked_fill's and index_fill's value may be a CPU scalar tensor on an accelerator
        # (PyTorch's reference allows it for PrivateUse1, not for the meta tensor standing in)
        margs[at] = torch.empty((), dtype=margs[at].dtype, device=_META)
    if not func._schema.returns:      # in-place ops declared "-> ()" (_foreach_add_ ...)
        try:
            func(*margs, **mkw)           # checks the arguments; there is nothing to infer
        except NotImplementedError:
            pass                          # no meta kernel (_fused_sgd_, _fused_adagrad_)
        return "none", ()
    out = (plain.kernel(func) if config.meta_plain else func)(*margs, **mkw)
    if isinstance(out, torch.Tensor):
        return "one", (_desc(out),)
    if isinstance(out, list):
        return "list", tuple(_desc(m) for m in out)
    if isinstance(out, tuple):
        return "tuple", tuple(_desc(m) for m in out)
    raise NotImplementedError(f"{func} returned {type(out).__name__}")


# The modules whose answers MetaMemo keeps on disk: another version of any makes another file.
_MEMO_SOURCES = ("meta.py", "metaplain.py", "metasize.py", "cpuwords.py")


class MetaMemo:
    """NOTE [meta memo]: what the meta kernels answered, kept on disk for the next process.

    A second process of the same script computes every op's output shapes again before it can find
    its programs in the store (NOTE [program store] in runtime/diskcache.py): nanoGPT's sampling
    loop makes 757 op signatures (each length a new one), and running their meta kernels (with
    PyTorch importing ``torch._dynamo`` at the first elementwise reference) took about half of
    its second process's call. Answers are kept by a description of the op and its arguments that
    is the same in every process (op, default dtype, each tpu tensor's sizes, strides, offset,
    dtype, base and conjugate/negative bits, every other argument's value with its type); an
    argument with no such description (a CPU tensor, whose values a meta kernel may read; a
    generator) is never kept. Only answers are kept, never errors, and the file is keyed by the
    torch version and the source of the modules that answer (``_MEMO_SOURCES``). Written once at
    exit (merged with what another process wrote meanwhile, replaced atomically), at most
    ``capacity`` entries."""

    def __init__(self, capacity: int = 1 << 15):
        self.capacity = capacity
        self.path = None
        self.table = None       # loaded on first use
        self.new = {}
        self.hits = self.misses = 0

    def enable(self, folder: str) -> None:
        import atexit
        import hashlib
        import os
        h = hashlib.sha256(torch.__version__.encode())
        here = os.path.dirname(__file__)
        for name in _MEMO_SOURCES:      # the code whose answers the memo keeps
            with open(os.path.join(here, name), "rb") as f:
                h.update(f.read())
        self.path = os.path.join(folder, f"meta-{h.hexdigest()[:24]}.pkl")
        atexit.register(self.save)

    def _load(self) -> dict:
        import pickle
        try:
            with open(self.path, "rb") as f:
                t = pickle.load(f)
            return t if isinstance(t, dict) else {}
        except Exception:
            return {}

    def key(self, func, args, kwargs):
        if self.path is None:
            return None
        try:
            return (str(func), str(torch.get_default_dtype()), _stable(args), _stable(kwargs))
        except _Unkept:
            return None

    def get(self, key):
        if self.table is None:
            self.table = self._load()
        r = self.table.get(key)
        if r is None:
            self.misses += 1
        else:
            self.hits += 1
        return r

    def put(self, key, value) -> None:
        if len(self.table) < self.capacity:
            self.table[key] = value
            self.new[key] = value

    def save(self) -> None:
        if not self.new or self.path is None:
            return
        import pickle
        from .runtime.diskcache import write_atomic
        try:
            table = self._load()
            for k, v in self.new.items():
                if len(table) >= self.capacity:
                    break
                table[k] = v
            write_atomic(self.path, pickle.dumps(table, protocol=pickle.HIGHEST_PROTOCOL))
            self.new = {}
        except Exception:
            pass


class _Unkept(Exception):
    pass


_PLAIN = (int, float, bool, str, complex, type(None))
_NAMED = (torch.dtype, torch.device, torch.layout, torch.memory_format)


def _stable(x):
    t = type(x)
    if t in _PLAIN:
        return (t.__name__, x)
    if t is TpuTensor:
        return ("T", tuple(x.shape), tuple(x.stride()), x.storage_offset(), str(x.dtype),
                tuple(x._s.val.shape), bool(x._chain), x.is_conj(), x.is_neg())
    if t is tuple or t is list:
        return (t.__name__,) + tuple(_stable(y) for y in x)
    if t is dict:
        return ("dict",) + tuple((k, _stable(v)) for k, v in sorted(x.items()))
    if isinstance(x, _NAMED):
        return (t.__name__, str(x))
    raise _Unkept(t.__name__)


memo = MetaMemo()
sizes = SizeRules()        # NOTE [sizes by rule]


# Views that return several outputs become one slice/select step per output.
def _split_steps(func, base, args, kwargs, outs):
    dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    dim = dim % max(base.dim(), 1)
    steps = []
    if func in (aten.unbind.int,):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0) % max(base.dim(), 1)
        return [(aten.select.int, (dim, i), ()) for i in range(len(outs))]
    start = 0
    for o in outs:
        n = o.shape[dim]
        steps.append((aten.slice.Tensor, (dim, start, start + n, 1), ()))
        start += n
    return steps


from .opinfo import MULTI_VIEWS as _MULTI  # noqa: E402


def _static(x):
    if isinstance(x, list):
        return tuple(_static(y) for y in x)
    return x


def infer_view(func, args, kwargs):
    """[(size, stride, offset, dtype, step)] of a view op's outputs; step None for an alias. Bad
    arguments raise what CPU raises (NOTE [CPU's words])."""
    try:
        return _infer_view(func, args, kwargs)
    except NotImplementedError:
        raise
    except ARG_ERRORS as e:
        raise_like_cpu(func, args, kwargs, e)


def _infer_view(func, args, kwargs):
    base = args[0]
    m = _to_meta(base)
    out = func(m, *[_to_meta(a) for a in args[1:]], **{k: _to_meta(v) for k, v in kwargs.items()})
    if func in (aten.detach.default, aten.alias.default, aten.lift_fresh.default):
        return [(tuple(out.shape), tuple(out.stride()), out.storage_offset(), out.dtype, None)]
    if isinstance(out, (list, tuple)):
        if func not in _MULTI:
            raise NotImplementedError(f"multi-output view {func}")
        steps = _split_steps(func, base, args, kwargs, out)
        return [(tuple(o.shape), tuple(o.stride()), o.storage_offset(), o.dtype, s)
                for o, s in zip(out, steps)]
    if func is aten.as_strided.default:
        size, stride = _static(args[1]), _static(args[2])
        off = args[3] if len(args) > 3 and args[3] is not None else kwargs.get("storage_offset")
        off = base.storage_offset() if off is None else off
        _check_storage_bounds(base, size, stride, off)
        step = (func, (size, stride, off, base._s.val.shape, _base_stride(base)), ())
    else:
        step = (func, tuple(_static(a) for a in args[1:]), tuple((k, _static(v)) for k, v in kwargs.items()))
    return [(tuple(out.shape), tuple(out.stride()), out.storage_offset(), out.dtype, step)]


def _check_storage_bounds(base, size, stride, offset) -> None:
    """CPU's error for an as_strided view reaching past the end of its storage (the meta kernel
    has no storage to check against)."""
    if any(n == 0 for n in size):
        return
    numel = 1
    for n in base._s.val.shape:
        numel *= n
    item = base.element_size()
    needed = (offset + sum((n - 1) * st for n, st in zip(size, stride)) + 1) * item
    if needed > numel * item:
        raise RuntimeError(
            f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset}, and "
            f"itemsize {item} requiring a storage size of {needed} are out of bounds for storage "
            f"of size {numel * item}")


def _base_stride(t):
    """NOTE [storage layout]: the strides of the tensor the storage was made for. A storage's value
    is a JAX array of that tensor's shape (row-major, logically), but ``as_strided`` offsets refer
    to memory, laid out by those strides: a channels_last tensor's memory is NHWC. The as_strided
    lowering puts the value in memory order first (runtime/lowering/views.py)."""
    if t._s.stride is not None:
        return tuple(t._s.stride)
    shape = t._s.val.shape
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(st))
