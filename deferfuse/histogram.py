"""``torch.histogram`` and ``torch.histogramdd`` on tpu tensors, as the ops CPU's kernels run.

PyTorch has CPU kernels only for these (no composite), so without this they ran on CPU. Here each
is written as tpu ops (``DECOMPOSITIONS``, taken by ``opinfo.decompose``): bin edges by
``linspace`` between the outermost edges (CPU's ``select_outer_bin_edges``: the range given, else
the data's min and max, widened by 0.5 on each side where they are equal, and an error where they
are not finite), each value's bin by a binary search over the edges (CPU's linear interpolation
with a local search gives the same bins), the rightmost bin closed on the right, values outside
the edges (and NaN) skipped, counts or weights added per bin, then ``density``.

Edges taken from the data are read once (a sync, as on CPU, which reads them to build the edges
and to raise on an infinite range); a given range or given edges need no read.
"""
from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _outer_edges(flat: torch.Tensor, rng) -> list:
    """[(left, right)] per dimension of ``flat`` (M, N), as Python floats (CPU's rule)."""
    n = flat.shape[-1]
    if rng is not None:
        if len(rng) != 2 * n:
            raise RuntimeError(f"torch.histogramdd: for a {n}-dimensional histogram range should "
                               f"have {2 * n} elements, but got {len(rng)}")
        edges = [(float(rng[2 * d]), float(rng[2 * d + 1])) for d in range(n)]
    elif flat.numel():
        if flat.dtype not in (torch.float32, torch.float64):
            raise RuntimeError(f'"histogramdd" not implemented for '
                               f"'{str(flat.dtype).replace('torch.', '').capitalize()}'")
        lo, hi = aten.aminmax.default(flat, dim=0)
        lohi = torch.stack([lo, hi]).tolist()           # one read of 2 * N values
        edges = list(zip(lohi[0], lohi[1]))
    else:
        edges = [(0.0, 1.0)] * n
    out = []
    for d, (a, b) in enumerate(edges):
        if not (math.isfinite(a) and math.isfinite(b)):
            raise RuntimeError(f"torch.histogramdd: dimension {d}'s range [{_g(a)}, {_g(b)}] is "
                               "not finite")
        if a > b:
            raise RuntimeError(f"torch.histogramdd: min should not exceed max, but got min "
                               f"{_g(a)} max {_g(b)} for dimension {d}")
        if a == b:
            a, b = a - 0.5, b + 0.5
        out.append((a, b))
    return out


def _g(v: float) -> str:
    return f"{v:g}"


def _bin_edges(flat, bins, rng):
    return [torch.linspace(a, b, int(k) + 1, dtype=flat.dtype, device=flat.device)
            for (a, b), k in zip(_outer_edges(flat, rng), bins)]


def _hist(flat: torch.Tensor, edges: list, weight, density: bool) -> torch.Tensor:
    """The histogram of ``flat`` (M, N) over ``edges`` (N increasing 1-D tensors)."""
    m, n = flat.shape
    counts = [e.numel() - 1 for e in edges]
    index = torch.zeros(m, dtype=torch.int64, device=flat.device)
    keep = torch.ones(m, dtype=torch.bool, device=flat.device)
    for d, e in enumerate(edges):
        col = flat[:, d]
        keep = keep & (col >= e[0]) & (col <= e[-1])
        pos = torch.searchsorted(e, col.contiguous(), right=True) - 1
        pos = pos.clamp(0, max(counts[d] - 1, 0))       # the rightmost bin includes its right edge
        index = index * counts[d] + pos
    w = (weight.reshape(m) if weight is not None
         else torch.ones(m, dtype=flat.dtype, device=flat.device))
    w = torch.where(keep, w, torch.zeros((), dtype=w.dtype, device=w.device))
    total = math.prod(counts)
    hist = torch.zeros(total, dtype=flat.dtype, device=flat.device)
    if total and m:
        hist = hist.index_put((index.clamp(0, total - 1),), w, accumulate=True)
    hist = hist.reshape(counts)
    if density:
        hist = hist / hist.sum()
        for d, e in enumerate(edges):
            shape = [1] * n
            shape[d] = counts[d]
            hist = hist / e.diff().reshape(shape)
    return hist


def _check(x, weight):
    if weight is not None and weight.dtype != x.dtype:
        raise RuntimeError("torch.histogramdd: if weight tensor is provided, input tensor and "
                           f"weight tensor should have the same dtype, but got input({x.dtype}), "
                           f"and weight({weight.dtype})")


def _flat(x):
    return x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)


def histogram_bin_ct(x, bins=100, *, range=None, weight=None, density=False):
    if bins <= 0:
        raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {bins} for dimension 0")
    _check(x, weight)
    flat = x.reshape(-1, 1)
    edges = _bin_edges(flat, [bins], range)
    return _hist(flat, edges, weight, density), edges[0]


def histogram_bins_tensor(x, bins, *, weight=None, density=False):
    if bins.dim() != 1:
        raise RuntimeError("torch.histogramdd: bins tensor should have one dimension, but got "
                           f"{bins.dim()} dimensions in the bins tensor for dimension 0")
    _check(x, weight)
    edges = bins.contiguous()
    return _hist(x.reshape(-1, 1), [edges], weight, density), edges.clone()


def histogramdd_bin_edges(x, bins, range=None, weight=None, density=False):
    return _bin_edges(_flat(x), bins, range)


def histogramdd_from_bin_cts(x, bins, range=None, weight=None, density=False):
    _check(x, weight)
    flat = _flat(x)
    return _hist(flat, _bin_edges(flat, bins, range), weight, density)


def histogramdd_from_bin_tensors(x, bins, *, weight=None, density=False):
    _check(x, weight)
    return _hist(_flat(x), [b.contiguous() for b in bins], weight, density)


DECOMPOSITIONS = {
    aten.histogram.bin_ct: histogram_bin_ct,
    aten.histogram.bins_tensor: histogram_bins_tensor,
    aten._histogramdd_bin_edges.default: histogramdd_bin_edges,
    aten._histogramdd_from_bin_cts.default: histogramdd_from_bin_cts,
    aten._histogramdd_from_bin_tensors.default: histogramdd_from_bin_tensors,
}
