"""Factorizations, solves and determinants (LU, Cholesky, QR, eigen and singular values ...).

They follow LAPACK's conventions where PyTorch exposes them: packed LU with 1-based int32 pivots,
``info`` the 1-based index of the first failure (0: success). For real input,
``_linalg_det``/``_linalg_slogdet`` factor A^T as PyTorch does for a contiguous A, so their
LU/pivots outputs match what the backward formulas expect. The FFT, pairwise distances,
``_trilinear`` and ``_grouped_mm``, which factor nothing, are in transforms.py.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
from jax import lax

from . import check, op
from .padding import Refuse

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("a factorization or transform mixes every position of its input")


def _per_matrix(f, *xs, core):
    """``f(*xs)`` over matrices whose batch dims (``core[i]`` trailing dims of ``xs[i]`` are one
    matrix; the batch dims are alike) run one matrix at a time on the CPU platform.

    NOTE [LAPACK batches on CPU]: jaxlib 0.10's CPU LAPACK kernels (trsm, getrf, potrf, syevd,
    gesdd, geqrf, ...) split a large enough batch into chunks scheduled on XLA's intra-op thread
    pool, and the calling thread, itself a worker of that pool, blocks until they are done
    (``ParallelBatchMap`` -> ``BlockingCounter::Wait``). XLA's thunk executor runs independent
    operations of one program at once, so two batched solves with no data between them (a gated
    delta net's two ``solve_triangular`` on one system: minicpm_ocr, qwen3_5) can occupy both
    workers of a 2-core machine, each waiting for chunks that no free worker will run: the program
    never finishes and its reader waits forever. A batch of one runs inline (no chunk is
    scheduled), so on CPU a batch loops (``lax.map``) over single matrices; other platforms have
    no such kernels and keep the batched call."""
    from .. import platform
    batch = xs[0].shape[:xs[0].ndim - core[0]]
    n = math.prod(batch)
    if n <= 1 or platform.name() != "cpu":
        return f(*xs)
    flat = [x.reshape((n,) + x.shape[x.ndim - c:]) for x, c in zip(xs, core)]
    out = lax.map(lambda args: f(*args), flat)
    return jax.tree_util.tree_map(lambda o: o.reshape(batch + o.shape[1:]), out)


def _solve_tri(a, b, **kw):
    """``lax.linalg.triangular_solve`` of matrices with alike batch dims (NOTE [LAPACK batches on
    CPU])."""
    return _per_matrix(lambda a, b: lax.linalg.triangular_solve(a, b, **kw), a, b, core=(2, 2))



def _mT(a):
    return jnp.swapaxes(a, -1, -2)


def _mH(a):
    return jnp.conj(_mT(a)) if jnp.iscomplexobj(a) else _mT(a)


def _diag(a):
    return jnp.diagonal(a, axis1=-2, axis2=-1)


def _empty(_avals, i):
    shape, dt = _avals[i]
    return jnp.zeros(shape, dt)


def _info(bad):
    """1-based index of the first True along the last axis, 0 when none (LAPACK's ``info``)."""
    if bad.shape[-1] == 0:
        return jnp.zeros(bad.shape[:-1], jnp.int32)
    first = jnp.argmax(bad, axis=-1)
    return jnp.where(jnp.any(bad, axis=-1), first + 1, 0).astype(jnp.int32)


def _check(info, check_errors, exc, message):
    """``check_errors=True``: raise PyTorch's error when any ``info`` is nonzero (through the
    runtime's flags: at once in strict mode, at the next sync in defer mode). The message cannot
    name the failing element: it is fixed when the program is traced."""
    if check_errors and info.size:
        check(info != 0, exc, message)


_SINGULAR = "the input matrix is singular"
_NOT_PD = "the input is not positive-definite"


def _lu(a):
    """(packed LU, 0-based pivots, permutation) with A[..., perm, :] = L @ U."""
    return _per_matrix(lax.linalg.lu, a, core=(2,))


def _bcast(*xs, core):
    """Broadcast the batch dims of matrices ``xs`` (``core[i]`` trailing dims each are kept)."""
    batch = jnp.broadcast_shapes(*(x.shape[:x.ndim - c] for x, c in zip(xs, core)))
    return [jnp.broadcast_to(x, batch + x.shape[x.ndim - c:]) for x, c in zip(xs, core)]


def _rows(b, perm):
    return jnp.take_along_axis(b, perm[..., :, None], axis=-2)


def _lu_solve(lu, perm, b, left=True, adjoint=False):
    """Solve with A = P L U given its packed LU and permutation (b: a batch of matrices)."""
    if not left:   # X A = B  <=>  A^H X^H = B^H ;  X A^H = B  <=>  A X^H = B^H
        return _mH(_lu_solve(lu, perm, _mH(b), True, not adjoint))
    lu, perm, b = _bcast(lu, perm, b, core=(2, 1, 2))
    if not adjoint:
        y = _solve_tri(lu, _rows(b, perm), left_side=True, lower=True, unit_diagonal=True)
        return _solve_tri(lu, y, left_side=True, lower=False)
    cj = jnp.iscomplexobj(lu)
    y = _solve_tri(lu, b, left_side=True, lower=False, transpose_a=True, conjugate_a=cj)
    y = _solve_tri(lu, y, left_side=True, lower=True, transpose_a=True, conjugate_a=cj,
                   unit_diagonal=True)
    return _rows(y, jnp.argsort(perm, axis=-1))


def _perm(pivots, n):
    """Permutation from LAPACK's 1-based pivots."""
    return lax.linalg.lu_pivots_to_permutation(pivots - 1, n)


def _factor_T(a):
    """LU of A^T for real A (PyTorch's choice for contiguous input), of A for complex."""
    t = not jnp.iscomplexobj(a)
    lu, piv, perm = _lu(_mT(a) if t else a)
    return lu, piv, perm, t


@op("linalg_lu_factor_ex.default")
def lu_factor_ex(a, *, pivot=True, check_errors=False):
    lu, piv, _ = _lu(a)
    info = _info(_diag(lu) == 0)
    _check(info, check_errors, RuntimeError, "torch.linalg.lu_factor_ex: a diagonal element of U "
           "is zero and using it on lu_solve would result in a division by zero.")
    return lu, piv + 1, info


@op("linalg_lu.default")
def linalg_lu(a, *, pivot=True):
    lu, _, perm = _lu(a)
    return _unpack(lu, perm)


def _unpack(lu, perm):
    m, n = lu.shape[-2:]
    k = min(m, n)
    L = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    U = jnp.triu(lu[..., :k, :])
    P = _mT(jnp.eye(m, dtype=lu.dtype)[perm])
    return P, L, U


@op("lu_unpack.default", meta=True)
def lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True, *, _avals):
    P, L, U = _unpack(lu, _perm(pivots, lu.shape[-2]))
    return (P if unpack_pivots else _empty(_avals, 0),
            L if unpack_data else _empty(_avals, 1),
            U if unpack_data else _empty(_avals, 2))


@op("linalg_lu_solve.default")
def linalg_lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    return _lu_solve(lu, _perm(pivots, lu.shape[-1]), b, left, adjoint)


@op("_linalg_solve_ex.default")
def linalg_solve_ex(a, b, *, left=True, check_errors=False):
    # PyTorch (this version) factors A itself here, unlike _linalg_det/_linalg_slogdet.
    lu, piv, perm = _lu(a)
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])
    x = _lu_solve(lu, perm, b[..., None] if vector else b, left)
    info = _info(_diag(lu) == 0)
    _check(info, check_errors, torch.linalg.LinAlgError,
           f"torch.linalg.solve_ex: The solver failed because {_SINGULAR}.")
    return (x[..., 0] if vector else x), lu, piv + 1, info


@op("linalg_inv_ex.default")
def linalg_inv_ex(a, *, check_errors=False):
    lu, _, perm = _lu(a)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    info = _info(_diag(lu) == 0)
    _check(info, check_errors, torch.linalg.LinAlgError, "linalg.inv_ex: A diagonal element is "
           f"zero, the inversion could not be completed because {_SINGULAR}.")
    return _lu_solve(lu, perm, eye), info


def _parity(piv):
    swaps = jnp.sum(piv != jnp.arange(piv.shape[-1], dtype=piv.dtype), axis=-1)
    return jnp.where(swaps % 2 == 1, -1, 1)


@op("_linalg_det.default")
def linalg_det(a):
    lu, piv, _, _ = _factor_T(a)
    det = jnp.prod(_diag(lu), axis=-1) * _parity(piv).astype(lu.dtype)
    return det, lu, piv + 1


@op("_linalg_slogdet.default")
def linalg_slogdet(a):
    lu, piv, _, _ = _factor_T(a)
    d = _diag(lu)
    ad = jnp.abs(d)
    if jnp.iscomplexobj(d):
        unit = jnp.where(ad == 0, 0, d / jnp.where(ad == 0, 1, ad))
    else:
        unit = jnp.sign(d)
    sign = jnp.prod(unit, axis=-1) * _parity(piv).astype(d.dtype)
    return sign, jnp.sum(jnp.log(ad), axis=-1), lu, piv + 1


def _chol_info(a):
    """LAPACK potrf's ``info`` for a (lower-triangle) matrix whose factorization failed: the order
    of the first leading minor that is not positive-definite, by an unblocked Cholesky."""
    n = a.shape[-1]
    rows = lax.broadcasted_iota(jnp.int32, a.shape[:-1], a.ndim - 2)

    def body(j, carry):
        L, info = carry
        lj = L[..., j, :]                                   # row j: columns < j are filled
        d = jnp.real(a[..., j, j]) - jnp.sum(jnp.abs(lj) ** 2, axis=-1)
        bad = ~(d > 0)
        info = jnp.where((info == 0) & bad, j + 1, info)
        s = jnp.sqrt(jnp.where(bad, 1, d)).astype(a.dtype)
        col = (a[..., :, j] - jnp.einsum("...ik,...k->...i", L, jnp.conj(lj))) / s[..., None]
        col = jnp.where(rows > j, col, jnp.where(rows == j, s[..., None], 0))
        return L.at[..., :, j].set(col), info

    L0 = jnp.zeros_like(a)
    return lax.fori_loop(0, n, body, (L0, jnp.zeros(a.shape[:-2], jnp.int32)))[1]


@op("linalg_cholesky_ex.default")
def linalg_cholesky_ex(a, *, upper=False, check_errors=False):
    src = _mH(a) if upper else a            # upper reads A's upper triangle = lower of A^H
    L = _per_matrix(lambda m: lax.linalg.cholesky(m, symmetrize_input=False), src, core=(2,))
    failed = ~jnp.all(jnp.isfinite(L), axis=(-2, -1))
    if a.shape[-1] == 0:
        info = jnp.zeros(a.shape[:-2], jnp.int32)
    else:
        info = lax.cond(jnp.any(failed), lambda: _chol_info(src),
                        lambda: jnp.zeros(a.shape[:-2], jnp.int32))
    _check(info, check_errors, torch.linalg.LinAlgError, "linalg.cholesky_ex: The factorization "
           f"could not be completed because {_NOT_PD}.")
    return (_mH(L) if upper else L), info


@op("cholesky.default")
def cholesky(a, upper=False):
    return linalg_cholesky_ex(a, upper=upper)[0]


@op("cholesky_solve.default")
def cholesky_solve(b, L, upper=False):
    b, L = _bcast(b, L, core=(2, 2))
    if upper:   # A = U^H U
        y = _solve_tri(L, b, left_side=True, lower=False, transpose_a=True,
                       conjugate_a=jnp.iscomplexobj(L))
        return _solve_tri(L, y, left_side=True, lower=False)
    y = _solve_tri(L, b, left_side=True, lower=True)
    return _solve_tri(L, y, left_side=True, lower=True, transpose_a=True,
                      conjugate_a=jnp.iscomplexobj(L))


@op("cholesky_inverse.default")
def cholesky_inverse(L, upper=False):
    eye = jnp.broadcast_to(jnp.eye(L.shape[-1], dtype=L.dtype), L.shape)
    return cholesky_solve(eye, L, upper)


@op("triangular_solve.default")
def triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    b, a = _bcast(b, a, core=(2, 2))
    x = _solve_tri(a, b, left_side=True, lower=not upper, transpose_a=transpose,
                   unit_diagonal=unitriangular)
    return x, a


@op("linalg_solve_triangular.default")
def linalg_solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    a, b = _bcast(a, b, core=(2, 2))
    return _solve_tri(a, b, left_side=left, lower=not upper, unit_diagonal=unitriangular)


@op("_linalg_eigh.default", meta=True)
def linalg_eigh(a, UPLO="L", compute_v=True, *, _avals):
    w, v = _per_matrix(lambda m: jnp.linalg.eigh(m, UPLO=UPLO, symmetrize_input=False), a, core=(2,))
    return w, (v if compute_v else _empty(_avals, 1))


@op("linalg_qr.default", meta=True)
def linalg_qr(a, mode="reduced", *, _avals):
    if mode == "r":
        return _empty(_avals, 0), _per_matrix(lambda m: jnp.linalg.qr(m, mode="r"), a, core=(2,))
    return _per_matrix(lambda m: jnp.linalg.qr(m, mode=mode), a, core=(2,))


@op("_linalg_svd.default", meta=True)
def linalg_svd(a, full_matrices=False, compute_uv=True, *, driver=None, _avals):
    if not compute_uv:
        s = _per_matrix(lambda m: jnp.linalg.svd(m, full_matrices=False, compute_uv=False), a,
                        core=(2,))
        return _empty(_avals, 0), s, _empty(_avals, 2)
    return _per_matrix(lambda m: jnp.linalg.svd(m, full_matrices=full_matrices), a, core=(2,))


@op("linalg_pinv.atol_rtol_tensor", meta=True)
def linalg_pinv(a, atol=None, rtol=None, hermitian=False, *, _avals):
    """Pseudo-inverse by SVD (eigh when hermitian) with PyTorch's tolerance rule."""
    if a.size == 0:
        return _empty(_avals, 0)
    real = jnp.finfo(a.dtype).dtype
    if rtol is None:
        default = jnp.finfo(real).eps * max(a.shape[-2:])
        rtol = default if atol is None else jnp.where(atol > 0, 0, default)
    atol = 0 if atol is None else atol
    atol, rtol = (jnp.asarray(t, real)[..., None] for t in (atol, rtol))
    if hermitian:
        s, u = _per_matrix(lambda m: jnp.linalg.eigh(m, symmetrize_input=False), a, core=(2,))
        sa = jnp.abs(s)
        tol = jnp.maximum(atol, rtol * jnp.max(sa, axis=-1, keepdims=True))
        inv = jnp.where(sa > tol, 1 / s, 0).astype(a.dtype)
        return jnp.matmul(u * inv[..., None, :], _mH(u))
    u, s, vh = _per_matrix(lambda m: jnp.linalg.svd(m, full_matrices=False), a, core=(2,))
    tol = jnp.maximum(atol, rtol * s[..., :1])
    inv = jnp.where(s > tol, 1 / s, 0).astype(a.dtype)
    return jnp.matmul(_mH(vh) * inv[..., None, :], _mH(u))


@op("_linalg_check_errors.default")
def linalg_check_errors(info, api_name, *, is_matrix):
    """Raise ``torch.linalg.LinAlgError`` when any ``info`` is nonzero (through the flags)."""
    _check(info, True, torch.linalg.LinAlgError,
           f"{api_name}: the factorization could not be completed (LAPACK info != 0: the input is "
           "singular or not positive-definite)")
    return ()


# --------------------------------------------------------------------------------------------
# Householder (LAPACK's geqrf format: R on and above the diagonal, reflectors below, ``tau``)

@op("geqrf.default")
def geqrf(a):
    # XLA's geqrf primitive is not exported by jax.lax.linalg (only used by its qr)
    f = getattr(lax.linalg, "geqrf", None)
    if f is None:
        from jax._src.lax.linalg import geqrf as f
    return _per_matrix(f, a, core=(2,))


@op("linalg_eig.default")
def linalg_eig(a):
    """Eigen-decomposition of a general matrix: LAPACK's geev through JAX, which offers it on CPU
    only (on other platforms this raises NotImplementedError and the op runs on the host CPU).
    LAPACK normalizes each eigenvector to unit norm with its largest component real, as CPU
    eager's geev does."""
    from .. import platform
    if platform.name() != "cpu":
        raise NotImplementedError("linalg_eig: JAX has a general eigensolver on CPU only")
    ct = jnp.complex128 if a.dtype in (jnp.float64, jnp.complex128) else jnp.complex64
    if not a.size:
        return (jnp.zeros(a.shape[:-1], ct), jnp.zeros(a.shape, ct))
    w, v = _per_matrix(lambda m: lax.linalg.eig(m, compute_left_eigenvectors=False), a, core=(2,))
    return w.astype(ct), v.astype(ct)


@op("_linalg_eigvals.default")
def linalg_eigvals(a):
    """The eigenvalues alone (``linalg.eigvals`` of a tensor no gradient is asked for, which a
    tensor subclass never is: a plain tpu tensor reaches this op)."""
    from .. import platform
    if platform.name() != "cpu":
        raise NotImplementedError("linalg_eigvals: JAX has a general eigensolver on CPU only")
    ct = jnp.complex128 if a.dtype in (jnp.float64, jnp.complex128) else jnp.complex64
    if not a.size:
        return jnp.zeros(a.shape[:-1], ct)
    return _per_matrix(lambda m: lax.linalg.eig(m, compute_left_eigenvectors=False,
                                                compute_right_eigenvectors=False)[0], a,
                       core=(2,)).astype(ct)


@op("linalg_householder_product.default")
def householder_product(a, tau):
    return _per_matrix(lax.linalg.householder_product, a, tau, core=(2, 1))


@op("ormqr.default")
def ormqr(a, tau, other, left=True, transpose=False):
    """op(Q) @ other (or other @ op(Q)), Q the m x m product of the reflectors in ``a``."""
    m, k = a.shape[-2], tau.shape[-1]
    a = a[..., :, :k]
    pad = [(0, 0)] * (a.ndim - 1) + [(0, m - k)]
    q = householder_product(jnp.pad(a, pad), jnp.pad(tau, pad[1:]))
    if transpose:
        q = _mH(q)
    return jnp.matmul(q, other) if left else jnp.matmul(other, q)
