"""Ops whose output size depends on the data, run on the device: nonzero, masked_select, indexing
with a boolean mask, unique (sorted), unique_consecutive, bincount, repeat_interleave.

NOTE [data-dependent sizes]: as on torch_xla, the only host sync is the output *size*: one small
count (a scalar) is read back, and the data stays on the device. The result is then computed on
the device at a static size, the count's bucket (the next power of two, at least 8, never more
than the input holds: ``runtime/buckets.bucket_of``), and cut back to the count with a view. So a
loop whose count changes compiles one program per bucket, not one per count. In defer mode the
read of the count is a sync point like ``.item()`` (reason ``"data-dependent shape"``).

Anything these handlers do not cover (a mask of another dtype, shapes that do not broadcast, an
index with more dims than the tensor, ``unique_dim``, empty input to ``unique_consecutive`` with a
``dim``) goes to the CPU fallback as before, which raises CPU's own error for bad input.
"""
from __future__ import annotations

import functools

import torch

from .dispatch import Fallback, _run, to_cpu
from .opinfo import op_info
from .runtime.buckets import bucket_of
from .tensor import TpuTensor, as_tpu

aten = torch.ops.aten
_WHY = "data-dependent shape"
_MASKS = (torch.bool, torch.uint8)


def _count(t: TpuTensor) -> int:
    """The value of the 0-d count ``t``: the one host read (a sync point in defer mode)."""
    return int(to_cpu(t, _WHY).item())


def _size(n: int, cap: int) -> int:
    """The static size a result of ``n`` rows is computed at: ``n``'s bucket, at most ``cap``."""
    return min(bucket_of(n), cap)


def _cut(t: TpuTensor, n: int) -> TpuTensor:
    return t if t.shape[0] == n else aten.slice.Tensor(t, 0, 0, n)


def _nonzero_rows(x: TpuTensor, fill: int = -1):
    """(indices of x's nonzero elements computed at a bucketed size, with padding ``fill``;
    their count)."""
    numel = x.numel()
    n = _count(aten.count_nonzero.default(x)) if numel else 0
    return aten.nonzero_static.default(x, size=_size(n, numel), fill_value=fill), n


def _h_nonzero(func, args, kwargs):
    x = args[0]
    if type(x) is not TpuTensor or x.is_complex():
        raise Fallback(_WHY)
    idx, n = _nonzero_rows(x)
    return _cut(idx, n)


def _broadcast(a, b):
    try:
        return tuple(torch.broadcast_shapes(a.shape, b.shape))
    except RuntimeError:
        raise Fallback(_WHY) from None      # CPU's own message


def _h_masked_select(func, args, kwargs):
    x, mask = args[0], args[1] if len(args) > 1 else kwargs["mask"]
    if type(x) is not TpuTensor or type(mask) is not TpuTensor or mask.dtype != torch.bool:
        raise Fallback(_WHY)                # CPU's errors (mask dtype, devices)
    shape = _broadcast(x, mask)
    flat_m = aten.expand.default(mask, shape).reshape(-1)
    flat_x = aten.expand.default(x, shape).reshape(-1)
    idx, n = _nonzero_rows(flat_m, fill=0)
    return _cut(aten.index_select.default(flat_x, 0, aten.select.int(idx, 1, 0)), n)


def _cpu_int(i) -> bool:
    return isinstance(i, torch.Tensor) and type(i) is not TpuTensor and i.device.type == "cpu" \
        and i.dtype not in _MASKS


def _h_index(func, args, kwargs):
    """``x[mask]`` (aten.index.Tensor with boolean or uint8 index tensors): each mask becomes its
    nonzero() index columns, as PyTorch's own expandTensors does; then the integer index."""
    x, indices = args[0], args[1]
    if type(x) is TpuTensor and any(_cpu_int(i) for i in indices):
        # CPU integer index tensors move to x's device, as PyTorch's indexing does on CUDA (a
        # CPU mask stays: its nonzero() below is CPU work)
        # (as_tpu: .to() makes a plain tensor, NOTE [mixed arguments])
        indices = [as_tpu(i.to(x.device)) if _cpu_int(i) else i for i in indices]
        args = (x, indices, *args[2:])
    if not any(i is not None and i.dtype in _MASKS for i in indices):
        return _run(func, op_info(func), args, kwargs)
    out = []
    for i in indices:
        if i is None or i.dtype not in _MASKS:
            out.append(i)
            continue
        d = len(out)
        if i.dim() == 0 or d + i.dim() > x.dim() or any(
                i.shape[j] != x.shape[d + j] for j in range(i.dim())):
            raise Fallback(_WHY)            # CPU's IndexError and its message
        if type(i) is TpuTensor:
            nz = _cut(*_nonzero_rows(i))
        else:
            nz = i.nonzero()                # a CPU mask: its nonzero() is CPU work, no sync
        out.extend(aten.select.int(nz, 1, j) for j in range(i.dim()))
    return aten.index.Tensor(x, out)


def _groups(flat: TpuTensor, sort: bool):
    """The runs of equal values of ``flat`` (sorted first when ``sort``): (the values in order,
    the permutation sorting them or None, the bool marks of each run's first element, the run
    starts at a bucketed size padded with numel, the number of runs)."""
    N = flat.numel()
    perm = None
    if sort:
        key = flat.to(torch.uint8) if flat.dtype == torch.bool else flat
        sv, perm = aten.sort.stable(key, stable=True)
        if key is not flat:
            sv = sv.to(torch.bool)
    else:
        sv = flat
    # NaN != NaN: every NaN is a run of its own, as on CPU.
    return (sv, perm) + _run_starts(aten.ne.Tensor(sv[1:], sv[:-1]), N)


def _run_starts(differs: TpuTensor, size: int):
    """From ``differs`` (element i + 1 differs from element i, of ``size`` elements): (the bool
    marks of each run's first element, the run starts at a bucketed size padded with ``size``,
    the number of runs)."""
    first = aten.cat.default([aten.ones.default([1], dtype=torch.bool, device=differs.device),
                              differs])
    starts, n = _nonzero_rows(first, fill=size)
    return first, aten.select.int(starts, 1, 0), n


def _run_counts(starts: TpuTensor, size: int, n: int) -> TpuTensor:
    """The length of each of the ``n`` runs starting at ``starts`` (padded with ``size``)."""
    end = aten.full.default([1], size, dtype=torch.int64, device=starts.device)
    return _cut(aten.cat.default([starts[1:], end]) - starts, n)


def _inverse_counts(first, perm, starts, size: int, n: int, inverse: bool, counts: bool):
    """(each element's run, or an empty int64 tensor; each run's length, or an empty one) of the
    ``n`` runs marked by ``first`` over ``size`` elements in the order ``perm`` sorted them
    (None: as they are)."""
    empty = aten.empty.memory_format([0], dtype=torch.int64, device=first.device)
    inv = cnt = empty
    if inverse:
        inv = first.to(torch.int64).cumsum(0) - 1        # each sorted element's run
        if perm is not None:
            inv = aten.scatter.src(aten.empty_like.default(inv), 0, perm, inv)
    if counts:
        cnt = _run_counts(starts, size, n)
    return inv, cnt


def _unique(x: TpuTensor, sort: bool, inverse: bool, counts: bool):
    """(values, inverse or an empty int64 tensor, counts or an empty int64 tensor)."""
    if type(x) is not TpuTensor or x.is_complex():
        raise Fallback(_WHY)
    empty = aten.empty.memory_format([0], dtype=torch.int64, device=x.device)
    N = x.numel()
    if N == 0:
        inv = aten.empty.memory_format(list(x.shape), dtype=torch.int64, device=x.device)
        return (aten.empty.memory_format([0], dtype=x.dtype, device=x.device),
                inv if inverse else empty, empty)
    flat = x.reshape(-1)
    sv, perm, first, starts, n = _groups(flat, sort)
    values = _cut(aten.index_select.default(sv, 0, starts.clamp(max=N - 1)), n)
    inv, cnt = _inverse_counts(first, perm, starts, N, n, inverse, counts)
    return values, inv.reshape(x.shape) if inverse else inv, cnt


def _h_unique2(func, args, kwargs):
    a = dict(zip(("self", "sorted", "return_inverse", "return_counts"), args), **kwargs)
    # Unsorted unique comes back sorted too (as on CUDA): PyTorch leaves its order unspecified.
    return _unique(a["self"], True, a.get("return_inverse", False), a.get("return_counts", False))


def _h_unique(func, args, kwargs):
    a = dict(zip(("self", "sorted", "return_inverse"), args), **kwargs)
    return _unique(a["self"], True, a.get("return_inverse", False), False)[:2]


def _h_unique_consecutive(func, args, kwargs):
    a = dict(zip(("self", "return_inverse", "return_counts", "dim"), args), **kwargs)
    x, inverse, counts = a["self"], a.get("return_inverse", False), a.get("return_counts", False)
    if a.get("dim") is not None:
        return _unique_consecutive_dim(x, a["dim"], inverse, counts)
    return _unique(x, False, inverse, counts)


def _slices(x, dim: int):
    """(dim made non-negative, the number of slices along it, the slices as the rows of a 2-D
    tensor) for the ``dim=`` variants of unique; CPU's path for what they do not cover."""
    if type(x) is not TpuTensor or x.is_complex() or x.dim() == 0 or x.numel() == 0:
        raise Fallback(_WHY)        # CPU's errors and its rules for empty slices
    dim = dim + x.dim() if dim < 0 else dim
    if not 0 <= dim < x.dim():
        raise Fallback(_WHY)
    L = x.shape[dim]
    return dim, L, aten.movedim.int(x, dim, 0).reshape(L, -1)


def _unique_consecutive_dim(x, dim: int, inverse: bool, counts: bool):
    """unique_consecutive along ``dim``: runs of equal slices (each slice compared whole)."""
    dim, L, rows = _slices(x, dim)
    first, starts, n = _run_starts(aten.ne.Tensor(rows[1:], rows[:-1]).any(1), L)
    values = aten.index_select.default(x, dim, _cut(starts, n))
    return (values, *_inverse_counts(first, None, starts, L, n, inverse, counts))


@functools.cache
def _lexsort_op():
    """``deferfuse::lexsort_rows(rows) -> perm``: the stable permutation sorting the rows of a 2-D
    tensor lexicographically, one XLA sort over every column as a key (registered on first use)."""
    import jax.numpy as jnp
    from jax import lax

    from .jax_op import jax_op

    def lexsort_rows(rows):
        if jnp.issubdtype(rows.dtype, jnp.floating):
            rows = rows + jnp.zeros((), rows.dtype)      # -0.0 sorts as 0.0, as CPU compares
        cols = [rows[:, j] for j in range(rows.shape[1])]
        iota = lax.iota(jnp.int64, rows.shape[0])
        return lax.sort((*cols, iota), num_keys=len(cols), is_stable=True)[-1]
    jax_op("deferfuse::lexsort_rows", backward=lambda rows, ct: (jnp.zeros_like(rows),))(
        lexsort_rows)
    return torch.ops.deferfuse.lexsort_rows.default


def _h_unique_dim(func, args, kwargs):
    """``unique(x, dim=d)``: the distinct slices along ``d``, sorted lexicographically (one sort
    with every column a key), then grouped as ``unique_consecutive(dim=...)`` groups them; one read
    of the number of distinct slices."""
    a = dict(zip(("self", "dim", "sorted", "return_inverse", "return_counts"), args), **kwargs)
    x = a["self"]
    dim, L, rows = _slices(x, a["dim"])
    key = rows.to(torch.uint8) if rows.dtype == torch.bool else rows
    perm = _lexsort_op()(key)
    srows = aten.index_select.default(rows, 0, perm)
    first, starts, n = _run_starts(aten.ne.Tensor(srows[1:], srows[:-1]).any(1), L)
    pick = aten.index_select.default(perm, 0, _cut(starts, n))
    values = aten.index_select.default(x, dim, pick)
    return (values, *_inverse_counts(first, perm, starts, L, n, a.get("return_inverse", False),
                                     a.get("return_counts", False)))


def _h_bincount(func, args, kwargs):
    """bincount: its length is max(minlength, the largest value + 1), one read of the input's
    smallest and largest values (a negative one raises CPU's error); the counts (or weights)
    are added on the device at that length's bucket and cut to it."""
    x = args[0]
    weights = args[1] if len(args) > 1 else kwargs.get("weights")
    minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
    if (type(x) is not TpuTensor or x.dim() != 1 or x.is_floating_point() or x.is_complex()
            or x.dtype == torch.bool or minlength < 0
            or (weights is not None and (type(weights) is not TpuTensor or weights.dim() != 1
                                         or weights.shape[0] != x.shape[0]
                                         or weights.dtype in (torch.float16, torch.bfloat16)
                                         or weights.is_complex()))):
        raise Fallback(_WHY)                # CPU's errors, and its kernels' dtypes
    if x.numel():
        lo, hi = to_cpu(aten.stack.default([aten.min.default(x), aten.max.default(x)]),
                        _WHY).tolist()
        if lo < 0:
            raise Fallback(_WHY)            # CPU's "non-negative integral inputs" error
        n = max(minlength, hi + 1)
    else:
        n = minlength
    if weights is None:
        dtype = torch.int64
        w = aten.ones_like.default(x, dtype=dtype)
    else:
        dtype = weights.dtype if weights.is_floating_point() else torch.float64
        w = aten._to_copy.default(weights, dtype=dtype)
    size = bucket_of(n) if n else 0
    out = aten.zeros.default([size], dtype=dtype, device=x.device)
    if x.numel():
        out = aten.index_put.default(out, [x], w, True)
    return _cut(out, n)


def _h_repeat_interleave(func, args, kwargs):
    """``repeat_interleave(repeats)`` (and so ``x.repeat_interleave(repeats_tensor, dim)``): the
    index i repeated repeats[i] times. Its length, the sum, is read once with the smallest repeat
    (a negative one raises CPU's error), unless ``output_size`` gives it: then nothing is read and
    the sum and the sign are checked on the device (NOTE [device asserts]), as CUDA does without
    a sync. The indices come from a search of the running sums at the length's bucket."""
    a = dict(zip(("repeats",), args), **kwargs)
    r, size = a["repeats"], a.get("output_size")
    if type(r) is not TpuTensor or r.dim() != 1 or r.dtype not in (torch.int32, torch.int64) \
            or r.numel() == 0:
        raise Fallback(_WHY)                # CPU's errors; an empty one is CPU's too
    ends = aten.cumsum.default(r, 0, dtype=torch.int64)
    if size is None:
        n, lo = to_cpu(aten.stack.default([ends[-1], aten.min.default(r).to(torch.int64)]),
                       _WHY).tolist()
        if lo < 0:
            raise Fallback(_WHY)            # CPU's "repeats can not be negative"
        at = bucket_of(n) if n else 0
    else:
        n = at = int(size)
        aten._assert_async.msg(aten.eq.Scalar(ends[-1], n), "allocated size does not match required size")
        aten._assert_async.msg(aten.ge.Scalar(aten.min.default(r), 0), "repeats can not be negative")
    pos = aten.arange.default(at, dtype=torch.int64, device=r.device)
    idx = aten.searchsorted.Tensor(ends, pos, right=True).to(r.dtype)
    return _cut(idx, n)


HANDLERS = {
    aten.unique_dim.default: _h_unique_dim,
    aten.repeat_interleave.Tensor: _h_repeat_interleave,
    aten.bincount.default: _h_bincount,
    aten.nonzero.default: _h_nonzero,
    aten.masked_select.default: _h_masked_select,
    aten.index.Tensor: _h_index,
    aten._unique2.default: _h_unique2,
    aten._unique.default: _h_unique,
    aten.unique_consecutive.default: _h_unique_consecutive,
}


def register() -> None:
    """Route the ops above to their handlers (instead of the CPU fallback)."""
    from .specials import register as add
    add(HANDLERS)
