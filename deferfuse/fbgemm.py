"""FBGEMM's sparse and jagged ops (``torch.ops.fbgemm.*``, what TorchRec's ``KeyedJaggedTensor``,
``JaggedTensor`` and ``KeyedTensor`` call, and the index check of its table-batched embedding) on
``tpu`` tensors, written in aten ops. The table-batched lookup itself is in ``torchrec.py``.

FBGEMM ships CPU and CUDA kernels only; without these handlers each op would reach the CPU
fallback (copy in, run, copy out). Each handler here computes the op on the device with gathers
at a static size: the sizes come from the op's own arguments (``permuted_lengths_sum``,
``range_size``, ``max_lengths``, the input's shape), which TorchRec always passes from the Python
lists it keeps (``length_per_key``). Where an output size depends on the data and the caller did
not give it (``permute_*_sparse_data`` without ``permuted_lengths_sum``), the size is one host
read of a count (NOTE [data-dependent sizes] in datadep.py), the data stays on the device.
Arguments these handlers do not cover (2-D weights, more than one jagged dimension) go to the CPU
fallback as before, which gives FBGEMM's own CPU result.

The handlers are registered the first time an ``fbgemm`` op reaches the device (route.py), so
importing deferfuse never imports ``fbgemm_gpu``.
"""
from __future__ import annotations

import torch

from .dispatch import Fallback, to_cpu

aten = torch.ops.aten
_WHY = "data-dependent shape"


def _complete(t, dtype=None):
    """[0, t0, t0+t1, ...] along the last dim, in ``dtype`` (t's own by default)."""
    dtype = dtype or t.dtype
    c = torch.cumsum(t, -1, dtype=dtype)
    return torch.cat([torch.zeros(*t.shape[:-1], 1, dtype=dtype, device=t.device), c], -1)


def _h_complete_cumsum(func, args, kwargs):
    (t,) = args
    return _complete(t)


def _h_inclusive_cumsum(func, args, kwargs):
    (t,) = args
    return torch.cumsum(t, -1, dtype=t.dtype)


def _h_exclusive_cumsum(func, args, kwargs):
    (t,) = args
    return _complete(t)[..., :-1].contiguous()


def _segment_of(starts, n: int):
    """For each position 0..n-1, the index of the segment holding it, given the segments' start
    positions (non-decreasing; an empty segment shares its start with the next, and the search
    takes the last segment starting at or before the position, the non-empty one)."""
    pos = torch.arange(n, dtype=starts.dtype, device=starts.device)
    return torch.searchsorted(starts, pos, right=True) - 1, pos


def _read_total(lengths) -> int:
    """The sum of ``lengths``: one host read (a sync point in defer mode)."""
    return int(to_cpu(lengths.sum(), _WHY).item())


def _gather_segments(in_starts, out_lengths, total: int, values, weights):
    """Values (and weights) of the output segments, segment ``i`` being ``out_lengths[i]``
    elements from ``in_starts[i]`` in the input."""
    out_offsets = _complete(out_lengths, torch.int64)
    seg, pos = _segment_of(out_offsets[:-1].contiguous(), total)
    src = in_starts.index_select(0, seg) + (pos - out_offsets.index_select(0, seg))
    out_v = values.index_select(0, src)
    out_w = None if weights is None else weights.index_select(0, src)
    return out_v, out_w


def _permute_sparse(permute, lengths2d, values, weights, total):
    """The rows ``permute`` of the [T, B] jagged ``lengths2d``: (permuted lengths [T', B],
    values, weights)."""
    if weights is not None and weights.dim() != 1:
        raise Fallback("2-D weights")     # FBGEMM's CPU kernel reads them flat
    permute = permute.long()
    out_lengths = lengths2d.index_select(0, permute)
    in_starts = _complete(lengths2d.reshape(-1), torch.int64)[:-1]
    in_starts = in_starts.view(lengths2d.shape).index_select(0, permute).reshape(-1)
    if total is None:
        total = _read_total(out_lengths)
    v, w = _gather_segments(in_starts, out_lengths.reshape(-1), int(total), values, weights)
    return out_lengths, v, w


def _h_permute_2d(func, args, kwargs):
    a = dict(zip(("permute", "lengths", "values", "weights", "permuted_lengths_sum"), args))
    a.update(kwargs)
    return _permute_sparse(a["permute"], a["lengths"], a["values"], a.get("weights"),
                           a.get("permuted_lengths_sum"))


def _h_permute_1d(func, args, kwargs):
    a = dict(zip(("permute", "lengths", "values", "weights", "permuted_lengths_sum"), args))
    a.update(kwargs)
    lengths = a["lengths"]
    out, v, w = _permute_sparse(a["permute"], lengths.view(-1, 1), a["values"], a.get("weights"),
                                a.get("permuted_lengths_sum"))
    return out.view(-1), v, w


def _h_permute_2d_input1d(func, args, kwargs):
    a = dict(zip(("permute", "lengths", "values", "stride", "weights", "permuted_lengths_sum"),
                 args))
    a.update(kwargs)
    lengths = a["lengths"]
    out, v, w = _permute_sparse(a["permute"], lengths.view(-1, int(a["stride"])), a["values"],
                                a.get("weights"), a.get("permuted_lengths_sum"))
    return out.reshape(-1), v, w


def _h_segment_sum_csr(func, args, kwargs):
    a = dict(zip(("batch_size", "csr_seg", "values"), args))
    a.update(kwargs)
    values, csr = a["values"], a["csr_seg"]
    n_seg = csr.numel() - 1
    starts = csr.long() * int(a["batch_size"])
    seg, _ = _segment_of(starts[:-1].contiguous(), values.numel())
    # Elements past the last segment's end belong to no segment: they go to a spare slot.
    seg = torch.where(torch.arange(values.numel(), device=values.device) < starts[-1], seg, n_seg)
    out = torch.zeros(n_seg + 1, dtype=values.dtype, device=values.device)
    return out.index_add(0, seg, values.reshape(-1))[:n_seg].contiguous()


def _h_offsets_range(func, args, kwargs):
    a = dict(zip(("offsets", "range_size"), args))
    a.update(kwargs)
    offsets, n = a["offsets"], int(a["range_size"])
    seg, pos = _segment_of(offsets, n)
    return pos - offsets.index_select(0, seg.clamp(min=0))


def _padded_index(offsets, max_len: int):
    """For a [B, max_len] padded layout of one jagged dim: each slot's row in the values, and
    whether the slot holds a value."""
    offsets = offsets.long()
    lengths = offsets[1:] - offsets[:-1]
    j = torch.arange(max_len, device=offsets.device)
    valid = j[None, :] < lengths[:, None]
    return offsets[:-1, None] + j[None, :], valid


def _h_jagged_to_padded_dense(func, args, kwargs):
    a = dict(zip(("values", "offsets", "max_lengths", "padding_value"), args))
    a.update(kwargs)
    values, offsets, max_lengths = a["values"], a["offsets"], a["max_lengths"]
    if len(offsets) != 1:
        raise Fallback("more than one jagged dimension")
    idx, valid = _padded_index(offsets[0], int(max_lengths[0]))
    pad_value = a.get("padding_value", 0.0)
    if values.shape[0] == 0:
        return torch.full((*idx.shape, *values.shape[1:]), pad_value, dtype=values.dtype,
                          device=values.device)
    safe = torch.where(valid, idx, 0)     # padding slots read row 0, then are replaced
    got = values.index_select(0, safe.reshape(-1)).view(*idx.shape, *values.shape[1:])
    mask = valid.view(*valid.shape, *([1] * (values.dim() - 1)))
    pad = torch.tensor(pad_value, dtype=values.dtype, device=values.device)
    return torch.where(mask, got, pad)


def _h_jagged_to_padded_dense_backward(func, args, kwargs):
    a = dict(zip(("grad_output", "offsets", "total_L"), args))
    a.update(kwargs)
    grad, offsets, total = a["grad_output"], a["offsets"], int(a["total_L"])
    if len(offsets) != 1:
        raise Fallback("more than one jagged dimension")
    idx, valid = _padded_index(offsets[0], grad.shape[1])
    # Padding slots write to a spare row past the end, dropped.
    rows = torch.where(valid, idx, total).reshape(-1)
    inner = grad.shape[2:]
    out = torch.zeros(total + 1, *inner, dtype=grad.dtype, device=grad.device)
    out = out.index_add(0, rows, grad.reshape(-1, *inner))
    return out[:total].contiguous()


def _h_permute_pooled_embs(func, args, kwargs):
    a = dict(zip(("pooled_embs", "offset_dim_list", "permute_list", "inv_offset_dim_list",
                  "inv_permute_list"), args))
    a.update(kwargs)
    x, offs, perm = a["pooled_embs"], a["offset_dim_list"].long(), a["permute_list"].long()
    dims = offs[1:] - offs[:-1]
    out_dims = dims.index_select(0, perm)
    cols, _ = _gather_segments(offs[:-1].index_select(0, perm), out_dims, x.shape[1],
                               torch.arange(x.shape[1], device=x.device), None)
    return x.index_select(1, cols)


def _h_bounds_check_indices(func, args, kwargs):
    """TBE's check of its indices against each feature's table rows, in place. The modes that
    go on (WARNING, IGNORE and their V2) send an index out of range (-1, a pruned row, is in
    range) to row 0 and count it in
    ``warning`` (WARNING); NONE checks nothing; FATAL reads whether any is out of range (a sync)
    and raises. Offsets are not checked."""
    names = ("rows_per_table", "indices", "offsets", "bounds_check_mode", "warning", "weights",
             "B_offsets", "max_B")
    a = dict(zip(names, args))
    a.update(kwargs)
    mode = int(a["bounds_check_mode"])
    if mode == 3:                                         # NONE
        return None
    if a.get("B_offsets") is not None:
        raise Fallback("variable batch sizes")
    rows, indices, offsets = a["rows_per_table"], a["indices"], a["offsets"]
    T = rows.numel()
    B = (offsets.numel() - 1) // max(T, 1)
    bag, _ = _segment_of(offsets.long(), indices.numel())
    feature = torch.div(bag, max(B, 1), rounding_mode="floor").clamp(0, T - 1)
    limit = rows.long().index_select(0, feature)
    bad = (indices < -1) | (indices.long() >= limit)     # -1 is a pruned row, kept
    if mode in (0, 6):                                    # FATAL
        if bool(to_cpu(bad.any(), "bounds check").item()):
            raise IndexError("TBE bounds check: an embedding index is out of its table's range")
        return None
    indices.copy_(torch.where(bad, torch.zeros_like(indices), indices))
    if mode in (1, 5):                                    # WARNING
        w = a["warning"]
        w.add_(bad.sum().to(w.dtype))
    return None


def _h_get_infos_metadata(func, args, kwargs):
    """Two integers from (B, T) alone: FBGEMM's CPU kernel on an empty CPU tensor."""
    a = dict(zip(("unused", "B", "T"), args))
    a.update(kwargs)
    return func(torch.empty(0), a["B"], a["T"])


def handlers() -> dict:
    """``{OpOverload: handler}`` for the FBGEMM ops defined in this process."""
    ops = torch.ops.fbgemm
    table = {
        "asynchronous_complete_cumsum": _h_complete_cumsum,
        "asynchronous_inclusive_cumsum": _h_inclusive_cumsum,
        "asynchronous_exclusive_cumsum": _h_exclusive_cumsum,
        "permute_2D_sparse_data": _h_permute_2d,
        "permute_1D_sparse_data": _h_permute_1d,
        "permute_2D_sparse_data_input1D": _h_permute_2d_input1d,
        "segment_sum_csr": _h_segment_sum_csr,
        "offsets_range": _h_offsets_range,
        "jagged_to_padded_dense_forward": _h_jagged_to_padded_dense,
        "jagged_to_padded_dense_backward": _h_jagged_to_padded_dense_backward,
        "permute_pooled_embs": _h_permute_pooled_embs,
        "permute_pooled_embs_auto_grad": _h_permute_pooled_embs,
        "bounds_check_indices": _h_bounds_check_indices,
        "get_infos_metadata": _h_get_infos_metadata,
    }
    # Looked up defensively: an FBGEMM release may lack some of them.
    return {getattr(ops, name).default: h for name, h in table.items() if hasattr(ops, name)}
