"""``torch.linalg.lstsq`` on tpu tensors, written as tpu ops (PyTorch has CPU and CUDA kernels
only, so it ran on CPU).

The solution is the minimum-norm least-squares solution from an SVD, singular values at or below
``rcond`` times the largest taken as zero (LAPACK's gelsy, gelsd and gelss give it; gels assumes
full rank, where it is the same solution). The other outputs follow CPU's drivers (default
``gelsy``):

========  ====================================  ==========  ===============
driver    residuals (m > n)                     rank        singular values
========  ====================================  ==========  ===============
gels      always                                empty       empty
gelsy     empty                                 per matrix  empty
gelsd     when every matrix has full rank       per matrix  per matrix
gelss     when every matrix has full rank       per matrix  per matrix
========  ====================================  ==========  ===============

gelsd and gelss with m > n read whether every matrix has full rank (one sync: the output's shape
depends on it, as on CPU).
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _check(a, b, rcond, driver) -> None:
    """CPU's errors for these operands: CPU's lstsq on stand-ins of the same dtypes, ranks and
    matrix sizes (batches of one, a full-rank ``eye`` for ``a``), so only argument checks fail."""
    def stand_in(t, eye):
        if t.dim() < 2:
            return torch.zeros(t.shape, dtype=t.dtype)
        m = (torch.eye(*t.shape[-2:], dtype=t.dtype) if eye
             else torch.zeros(t.shape[-2:], dtype=t.dtype))
        return m.reshape((1,) * (t.dim() - 2) + tuple(t.shape[-2:]))
    try:
        torch.linalg.lstsq(stand_in(a, True), stand_in(b, False), rcond, driver=driver)
    except (RuntimeError, ValueError, TypeError) as e:
        raise type(e)(str(e)) from None


def linalg_lstsq(a, b, rcond=None, *, driver=None):
    _check(a, b, rcond, driver)
    driver = driver or "gelsy"
    vector = b.dim() == a.dim() - 1
    if vector:
        b = b.unsqueeze(-1)
    m, n = a.shape[-2:]
    # rank and singular values have a's own batch shape (CPU's); the solution the broadcast one
    real = a.real.dtype if a.is_complex() else a.dtype
    if rcond is None:
        rcond = torch.finfo(real).eps * max(m, n)
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    keep = s > rcond * s[..., :1] if s.shape[-1] else s > 0
    inv = torch.where(keep, 1 / torch.where(keep, s, torch.ones((), dtype=s.dtype, device=s.device)),
                      torch.zeros((), dtype=s.dtype, device=s.device))
    x = vh.mH @ (inv.unsqueeze(-1).to(a.dtype) * (u.mH @ b))
    rank = keep.sum(-1) if driver != "gels" else a.new_empty(0, dtype=torch.int64)
    residuals = a.new_empty(0, dtype=real)
    if m > n and (driver == "gels" or (driver in ("gelsd", "gelss")
                                       and bool((rank == n).all()))):
        residuals = ((a @ x - b).abs() ** 2).sum(-2)
    sv = s if driver in ("gelsd", "gelss") else a.new_empty(0, dtype=real)   # (not residuals's)
    if vector:
        x = x.squeeze(-1)
    return x, residuals, rank, sv


DECOMPOSITIONS = {aten.linalg_lstsq.default: linalg_lstsq}
