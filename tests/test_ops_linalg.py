"""Matrix products and linear algebra on tpu against CPU eager PyTorch.

Products and a factorization smoke test run in both modes; the breadth of factorizations and the
dtype sweeps (same lowerings) run in defer mode only, where a whole case is one compiled region. Factorizations whose outputs are unique only up to signs (SVD, eigh)
are compared after aligning each vector's sign with CPU's.
"""
import pytest
import torch

import deferfuse
from util import assert_same, to_tpu as tpu

TOL = {torch.float32: (1e-4, 1e-4), torch.float64: (1e-10, 1e-10),
       torch.bfloat16: (5e-2, 1.6e-2), torch.int64: (0, 0)}
# linalg.inv/solve/cholesky check LAPACK's ``info`` through _linalg_check_errors, which has no
# lowering (it must read the value to raise): it runs on CPU until the core handles it.
CHECK_ERRORS = "aten._linalg_check_errors.default"


def check(fn, *inputs, tol=None):
    """``fn`` on tpu copies of ``inputs`` matches ``fn`` on CPU, without CPU fallbacks."""
    want = fn(*inputs)
    deferfuse.reset_metrics()
    got = fn(*tpu(inputs))
    atol, rtol = tol or TOL[inputs[0].dtype]
    assert_same(_plain(got), _plain(want), atol=atol, rtol=rtol)
    fb = set(deferfuse.metrics()["cpu_fallbacks"]) - {CHECK_ERRORS}
    assert not fb, f"fell back to CPU: {fb}"


def _plain(x):
    if isinstance(x, tuple):   # torch.return_types -> plain tuples, recursively
        return tuple(_plain(y) for y in x)
    return x


def make(shape, dtype):
    if dtype == torch.int64:
        return torch.randint(-5, 6, shape)
    return torch.randn(shape).to(dtype)


def well_conditioned(*shape, dtype=torch.float32):
    n = shape[-1]
    return torch.randn(shape, dtype=dtype) + n * torch.eye(n, dtype=dtype)


def spd(*shape, dtype=torch.float32):
    a = torch.randn(shape, dtype=dtype)
    return a @ a.mT + shape[-1] * torch.eye(shape[-1], dtype=dtype)


def products(a, b, ba, bb, v, w, c, u):
    """a: (3,4) b: (4,5) ba: (2,3,4) bb: (2,4,5) v: (4,) w: (4,) c: (3,5) u: (3,)"""
    return (a @ b, torch.mm(a, b), torch.bmm(ba, bb), ba @ b, ba @ bb, a @ v, v @ w,
            torch.addmm(c, a, b), torch.addmm(c, a, b, beta=0.5, alpha=2),
            torch.addmv(u, a, v, alpha=3), torch.addbmm(c, ba, bb),
            torch.baddbmm(c, ba, bb, beta=2), torch.mv(a, v), torch.dot(v, w), torch.outer(v, w),
            torch.addr(a, u, w), torch.einsum("bij,bjk->bik", ba, bb),
            torch.einsum("ij,ij->i", a, a), torch.tensordot(ba, bb, ([0, 2], [0, 1])),
            torch.kron(a[:2, :2], b[:2, :3]), torch.trace(a), torch.trace(b))


def product_inputs(dtype):
    return [make(s, dtype) for s in ((3, 4), (4, 5), (2, 3, 4), (2, 4, 5), (4,), (4,), (3, 5), (3,))]


# --------------------------------------------------------------------------------------------
# float32, both modes

@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_products():
    check(products, *product_inputs(torch.float32))


def test_product_edges():
    a, b, c = torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 5)
    c[0, 0] = float("nan")    # beta=0 ignores the bias, NaN included
    check(lambda a, b, c: (torch.addmm(c, a, b, beta=0), a[:, :0] @ b[:0], a.t().t() @ b,
                           b.t() @ a.t(), torch.vdot(a[0], a[1]),
                           torch.linalg.cross(a[:, :3], b[:3, :3].t()),
                           torch.cross(a[:, None, :3], b[None, :3, :3].mT, dim=-1)), a, b, c)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_solve_inverse_det():
    A = well_conditioned(2, 4, 4)
    B = torch.randn(2, 4, 3)
    check(lambda A, B: (torch.linalg.inv(A), torch.linalg.solve(A, B),
                        torch.linalg.solve(A, B[..., 0]), torch.linalg.det(A),
                        torch.linalg.slogdet(A)), A, B)


@pytest.mark.modes("defer")
def test_solve_variants():
    A = well_conditioned(2, 4, 4)
    B = torch.randn(2, 4, 3)
    check(lambda A, B: (torch.linalg.inv_ex(A), torch.linalg.solve(A, B.mT, left=False),
                        torch.linalg.solve(A[0], B), torch.linalg.solve_ex(A, B),
                        torch.logdet(A[0] @ A[0].mT), torch.linalg.pinv(A[:, :, :3])), A, B)


@pytest.mark.modes("defer")
def test_lu_family():
    A = torch.randn(2, 4, 4)
    B = torch.randn(2, 4, 2)
    R = torch.randn(3, 5)

    def f(A, B, R):
        LU, piv, info = torch.linalg.lu_factor_ex(A)
        return (LU, piv, info, torch.linalg.lu(A), torch.linalg.lu(R), torch.linalg.lu(R.mT),
                torch.lu_unpack(LU, piv), torch.linalg.lu_solve(LU, piv, B),
                torch.linalg.lu_solve(LU, piv, B, adjoint=True),
                torch.linalg.lu_solve(LU, piv, B.mT, left=False))
    check(f, A, B, R)


@pytest.mark.modes("defer")
def test_triangular_and_cholesky():
    S = spd(2, 4, 4)
    B = torch.randn(2, 4, 3)
    T = well_conditioned(4, 4)

    def f(S, B, T):
        L, U = torch.linalg.cholesky(S), torch.linalg.cholesky_ex(S, upper=True)[0]
        return (L, U, torch.cholesky_solve(B, L), torch.cholesky_solve(B, U, upper=True),
                torch.cholesky_inverse(L[0]), torch.linalg.solve_triangular(T, B, upper=True),
                torch.linalg.solve_triangular(T, B, upper=False, unitriangular=True),
                torch.linalg.solve_triangular(T, B.mT, upper=True, left=False),
                torch.triangular_solve(B, T), torch.triangular_solve(B, T, upper=False, transpose=True))
    check(f, S, B, T)


@pytest.mark.modes("defer")
def test_decompositions():
    A = torch.randn(2, 5, 3)
    S = spd(4, 4)
    check(lambda A, S: (torch.linalg.qr(A), torch.linalg.qr(A, mode="complete"),
                        torch.linalg.qr(A, mode="r")[1], torch.linalg.svdvals(A),
                        torch.linalg.eigvalsh(S), torch.linalg.eigvalsh(S, UPLO="U"),
                        torch.linalg.matrix_norm(A, "nuc"), torch.linalg.matrix_norm(A, 2),
                        torch.linalg.matrix_rank(A), torch.linalg.matrix_exp(S / 8)), A, S)


def _align(vecs, ref):
    """``vecs`` (tpu) with each column's sign flipped to agree with ``ref``'s (CPU)."""
    v = vecs.cpu()
    s = torch.sign((v * ref).sum(-2, keepdim=True))
    return v * torch.where(s == 0, 1, s)


@pytest.mark.modes("defer")
@pytest.mark.parametrize("shape", [(6, 5), (2, 5, 7)], ids=str)
def test_svd_pca_lowrank_of_a_rank_three_matrix(shape):
    """svd_lowrank/pca_lowrank draw a random projection (tpu's generator is not CPU's), so their
    factors are not CPU's; on a matrix of rank q their singular values are exact: they must equal
    CPU's (and CPU's svdvals'), and U diag(S) V^T must rebuild the matrix (centred for pca)."""
    g = torch.Generator().manual_seed(3)
    A = torch.randn(*shape[:-1], 3, generator=g) @ torch.randn(*shape[:-2], 3, shape[-1], generator=g)
    for fn, ref in ((torch.svd_lowrank, A), (torch.pca_lowrank, A - A.mean(-2, keepdim=True))):
        torch.manual_seed(0)
        U, S, V = fn(A, q=3)
        U_t, S_t, V_t = fn(A.to("tpu"), q=3)
        assert U_t.device.type == "tpu" and U_t.shape == U.shape and V_t.shape == V.shape
        assert S_t.dtype == S.dtype and S_t.shape == S.shape
        assert_same(S_t, S, atol=1e-4, rtol=1e-4)
        assert_same(S_t, torch.linalg.svdvals(ref)[..., :3], atol=1e-4, rtol=1e-4)
        assert_same((U_t * S_t[..., None, :]) @ V_t.mT, ref, atol=1e-4, rtol=1e-4)


def test_tensor_split_indices_on_tpu_raise_as_on_cuda():
    """tensor_split takes its indices tensor on CPU only; on tpu it raises PyTorch's own error (the
    message CUDA and meta tensors get), never splits at wrong places."""
    x = torch.arange(10.0)
    for idx in (torch.tensor([2, 5]), torch.tensor(3)):
        with pytest.raises(RuntimeError, match="tensor_split expected tensor_indices_or_sections "
                           "to be on cpu, but it's on tpu:0"):
            torch.tensor_split(x.to("tpu"), idx.to("tpu"))
        got = torch.tensor_split(x.to("tpu"), idx)        # CPU indices: CPU's split
        want = torch.tensor_split(x, idx)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w, atol=0, rtol=0)


@pytest.mark.modes("defer")
@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (2, 4, 4)], ids=str)
def test_svd_eigh_up_to_sign(shape):
    A = torch.randn(shape)
    U, S, Vh = torch.linalg.svd(A, full_matrices=False)
    Ut, St, Vht = torch.linalg.svd(A.to("tpu"), full_matrices=False)
    assert_same(St, S, atol=1e-4, rtol=1e-4)
    assert Ut.device.type == "tpu" and Ut.shape == U.shape and Vht.shape == Vh.shape
    torch.testing.assert_close(_align(Ut, U), U, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_align(Vht.mT, Vh.mT), Vh.mT, atol=1e-4, rtol=1e-4)
    Uf, Sf, Vhf = torch.linalg.svd(A.to("tpu"))             # full: check it reconstructs A
    k = Sf.shape[-1]
    rec = (Uf[..., :k] * Sf[..., None, :]) @ Vhf[..., :k, :]
    assert_same(rec, A, atol=1e-4, rtol=1e-4)
    eye = torch.eye(Uf.shape[-1]).expand(Uf.shape)
    assert_same(Uf.mT @ Uf, eye, atol=1e-4, rtol=1e-4)
    if shape[-1] == shape[-2]:
        H = A + A.mT
        for uplo in ("L", "U"):
            L, Q = torch.linalg.eigh(H, UPLO=uplo)
            Lt, Qt = torch.linalg.eigh(H.to("tpu"), UPLO=uplo)
            assert_same(Lt, L, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(_align(Qt, Q), Q, atol=1e-4, rtol=1e-4)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_singular_and_not_positive_definite():
    # Singular with a zero row, so that every LU gives an exact zero pivot (a rank-deficient matrix
    # with no zero row gives CPU's det a rounding residue of ~1e-7 on some CPUs, and exact 0 on others).
    A = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    N = torch.diag(torch.tensor([2.0, 1.0, -1.0, 3.0]))
    N[0, 1] = N[1, 0] = 0.5                                   # leading minor of order 3 fails
    check(lambda A, N: (torch.linalg.inv_ex(A)[1], torch.linalg.lu_factor_ex(A)[2],
                        torch.linalg.det(A), torch.linalg.slogdet(A),
                        torch.linalg.cholesky_ex(N)[1], torch.linalg.cholesky_ex(N, upper=True)[1],
                        torch.linalg.cholesky_ex(N[:2, :2])), A, N)
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.inv(A.to("tpu"))
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.cholesky(N.to("tpu"))
    # check_errors=True raises from the program's flags (defer mode: at the next sync)
    for f in (lambda: torch.linalg.inv_ex(A.to("tpu"), check_errors=True),
              lambda: torch.linalg.cholesky_ex(N.to("tpu"), check_errors=True),
              lambda: torch.linalg.solve_ex(A.to("tpu"), N[:3, :3].to("tpu"), check_errors=True)):
        with pytest.raises(torch.linalg.LinAlgError):
            f()
            deferfuse.sync()
    with pytest.raises(RuntimeError):
        torch.linalg.lu_factor_ex(A.to("tpu"), check_errors=True)
        deferfuse.sync()


@pytest.mark.modes("defer")
def test_under_autograd():
    A = well_conditioned(3, 3).requires_grad_()
    B = torch.randn(3, 2, requires_grad=True)
    At = A.detach().to("tpu").requires_grad_()
    Bt = B.detach().to("tpu").requires_grad_()
    # det/slogdet/solve backward reuse the forward's LU and pivots (of A^T, as PyTorch stores them)
    f = lambda A, B: (torch.linalg.det(A) + torch.linalg.slogdet(A)[1]
                      + torch.linalg.solve(A, B).sum() + torch.linalg.inv(A).sum()
                      + (A @ B).square().sum())
    g = torch.autograd.grad(f(A, B), (A, B))
    gt = torch.autograd.grad(f(At, Bt), (At, Bt))
    assert_same(gt, g, atol=1e-4, rtol=1e-4)


@pytest.mark.xfail(strict=True, reason="det/slogdet backward picks A or A^T's LU by A.is_contiguous(), "
                   "which the lowering cannot see: needs the input's strides from the core")
@pytest.mark.modes("strict")
def test_det_grad_noncontiguous():
    A = well_conditioned(3, 3).requires_grad_()
    At = A.detach().to("tpu").requires_grad_()
    g, = torch.autograd.grad(torch.linalg.det(A.mT), A)
    gt, = torch.autograd.grad(torch.linalg.det(At.mT), At)
    assert_same(gt, g, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# dtype sweeps (defer mode: one region per case)

@pytest.mark.modes("defer")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64], ids=str)
def test_products_dtypes(dtype):
    check(products, *product_inputs(dtype))


@pytest.mark.modes("defer")
def test_int_products_scalars():
    # alpha/beta convert to the integer dtype (truncating) as PyTorch's kernels do
    a, b, c, v, u, w = (torch.randint(-5, 6, s) for s in ((3, 4), (4, 5), (3, 5), (4,), (3,), (5,)))
    ba, bb = torch.randint(-5, 6, (2, 3, 4)), torch.randint(-5, 6, (2, 4, 5))
    check(lambda a, b, c, v, u, w, ba, bb: (
        torch.addmm(c, a, b, beta=3, alpha=-2), torch.addmv(u, a, v, beta=0.6, alpha=2.5),
        torch.baddbmm(c, ba, bb, beta=0.2, alpha=0.6), torch.addbmm(c, ba, bb, alpha=2),
        torch.addr(c, u, w, alpha=2), torch.linalg.cross(a[:, :3], a[:, 1:])),
        a, b, c, v, u, w, ba, bb)


@pytest.mark.modes("defer")
def test_factorizations_float64():
    A = well_conditioned(2, 4, 4, dtype=torch.float64)
    B = torch.randn(2, 4, 3, dtype=torch.float64)
    S = spd(4, 4, dtype=torch.float64)
    check(lambda A, B, S: (torch.linalg.solve(A, B), torch.linalg.slogdet(A),
                           torch.linalg.cholesky(S), torch.linalg.qr(A), torch.linalg.eigvalsh(S),
                           torch.linalg.svdvals(A)), A, B, S, tol=(1e-8, 1e-8))


@pytest.mark.parametrize("case", ["2d_3d", "2d_2d", "3d_2d", "3d_3d"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_grouped_mm_matches_cpu_with_gradients(case):
    # Mixture-of-experts layers (transformers' grouped-mm path); offs holds each group's end,
    # with an empty group.
    torch.manual_seed(0)
    offs = torch.tensor([8, 8, 20, 24], dtype=torch.int32)
    a, b = {"2d_3d": (torch.randn(24, 8), torch.randn(4, 8, 12)),
            "2d_2d": (torch.randn(12, 24), torch.randn(24, 16)),
            "3d_2d": (torch.randn(4, 12, 8), torch.randn(8, 24)),
            "3d_3d": (torch.randn(4, 12, 8), torch.randn(4, 8, 16))}[case]
    o = None if case == "3d_3d" else offs
    a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
    want = torch._grouped_mm(a1, b1, offs=o)
    want.square().sum().backward()
    a2, b2 = a.to("tpu").requires_grad_(), b.to("tpu").requires_grad_()
    got = torch._grouped_mm(a2, b2, offs=None if o is None else o.to("tpu"))
    got.square().sum().backward()
    assert_same(got, want.detach(), atol=1e-4, rtol=1e-4)
    assert_same(a2.grad, a1.grad, atol=1e-4, rtol=1e-4)
    assert_same(b2.grad, b1.grad, atol=1e-4, rtol=1e-4)
    assert deferfuse.metrics()["cpu_fallbacks"] == {}


@pytest.mark.parametrize("name", ["mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot",
                                  "matmul"])
def test_mixed_dtype_products_raise_as_cpu(name):
    """float with double: CPU's kernels refuse; tpu raises CPU's own message in every mode
    (the meta kernels check shapes only, and mm/addmm/mv used to promote silently)."""
    f, d = torch.randn, (lambda *s: torch.randn(*s, dtype=torch.float64))
    args = {"mm": (f(4, 5), d(5, 6)), "addmm": (f(6), f(4, 5), d(5, 6)),
            "bmm": (f(2, 4, 5), d(2, 5, 6)), "baddbmm": (f(2, 4, 6), f(2, 4, 5), d(2, 5, 6)),
            "addbmm": (f(4, 6), f(2, 4, 5), d(2, 5, 6)), "mv": (f(4, 5), d(5)),
            "addmv": (f(4), f(4, 5), d(5)), "dot": (f(5), d(5)), "matmul": (f(3, 4, 5), d(5, 6))}[name]
    fn = getattr(torch, name)
    with pytest.raises(RuntimeError) as want:
        fn(*args)
    with pytest.raises(RuntimeError) as got:
        fn(*[a.to("tpu") for a in args])
        deferfuse.sync()
    assert str(got.value) == str(want.value)


@pytest.mark.modes("defer")
@pytest.mark.parametrize("shape", [(4, 3), (3, 5), (2, 5, 4), (0, 3), (3, 0, 2)], ids=str)
def test_geqrf_layout_and_values(shape):
    """geqrf on tpu (it had no meta kernel, so it ran on CPU): LAPACK's reflectors and tau, in
    CPU's column-major layout; bad input raises CPU's error."""
    a = torch.randn(shape)
    check(torch.geqrf, a)
    got, want = torch.geqrf(tpu(a)), torch.geqrf(a)
    assert [t.stride() for t in got] == [t.stride() for t in want] or a.numel() == 0
    for bad in (torch.randn(3), torch.ones(3, 3, dtype=torch.long)):
        with pytest.raises(type(_raised(lambda: torch.geqrf(bad)))) as e:
            torch.geqrf(tpu(bad))
        assert str(e.value) == str(_raised(lambda: torch.geqrf(bad)))


def _raised(fn):
    try:
        fn()
    except Exception as e:      # noqa: BLE001 - the exception CPU raises is the expectation
        return e
    raise AssertionError("CPU did not raise")


@pytest.mark.modes("defer")
@pytest.mark.parametrize("driver", [None, "gels", "gelsd"], ids=str)
def test_lstsq_drivers(driver):
    """linalg.lstsq on tpu (deferfuse/lstsq.py; PyTorch has no kernel but CPU's and CUDA's): each
    driver's outputs as CPU gives them (which are empty, ranks, singular values, residuals only
    for tall full-rank systems), tall, wide, batched with broadcasting, a vector right-hand side,
    a rank-deficient matrix; CPU's errors."""
    g = torch.Generator().manual_seed(0)
    cases = [((5, 3), (5, 2)), ((3, 5), (3, 2)), ((5, 3), (5,)), ((1, 5, 3), (2, 5, 2))]
    for sa, sb in cases:
        check(lambda a, b: torch.linalg.lstsq(a, b, driver=driver),
              torch.randn(sa, generator=g), torch.randn(sb, generator=g))
    if driver != "gels":        # gels assumes full rank (LAPACK's answer is undefined)
        low = torch.randn(5, 2, generator=g) @ torch.randn(2, 3, generator=g)
        check(lambda a, b: torch.linalg.lstsq(a, b, driver=driver), low,
              torch.randn(5, 2, generator=g))
    for a, b, d in ((torch.randn(3, 3), torch.randn(4, 2), driver),
                    (torch.randn(3, 3), torch.randn(3, 2), "foo"),
                    (torch.randn(3, 3), torch.randn(3, 2, dtype=torch.float64), driver)):
        want = _raised(lambda: torch.linalg.lstsq(a, b, driver=d))
        with pytest.raises(type(want)) as e:
            torch.linalg.lstsq(tpu(a), tpu(b), driver=d)
        assert str(e.value) == str(want)


@pytest.mark.modes("defer")
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64], ids=str)
def test_eig_general_matrices(dtype):
    """linalg.eig / eigvals on tpu (LAPACK's geev through JAX on the CPU platform; it was a CPU
    fallback): eigenvalues and unit eigenvectors as CPU gives them, batched, real and complex."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 4, 4, generator=g, dtype=dtype)
    check(torch.linalg.eig, a, tol=(1e-4, 1e-4))
    check(torch.linalg.eigvals, a[0], tol=(1e-4, 1e-4))


@pytest.mark.modes("defer")
def test_batched_solves_independent_in_one_program():
    """A gated delta net's chunked UT transform (qwen3_5's and minicpm_ocr's linear attention): two
    unitriangular solves of one batch of systems, with no data between them, in one program,
    forward and backward. jaxlib's batched CPU LAPACK kernels deadlocked when XLA ran two such
    solves at once on a 2-core machine (NOTE [LAPACK batches on CPU]): the values against CPU, and
    on the CPU platform every LAPACK call of the lowered program takes single matrices."""
    import re

    import jax
    from deferfuse.runtime import platform
    from deferfuse.runtime.lowering import factorizations as fz

    g = torch.Generator().manual_seed(0)
    n = 64
    A = (0.1 * torch.randn(2, 4, 3, n, n, generator=g)).tril(-1) + torch.eye(n)
    V = torch.randn(2, 4, 3, n, 16, generator=g)
    K = torch.randn(2, 4, 3, n, 16, generator=g)

    def f(A, V, K):
        A, V, K = (t.clone().requires_grad_() for t in (A, V, K))
        x = torch.linalg.solve_triangular(A, V, upper=False, unitriangular=True)
        y = torch.linalg.solve_triangular(A, K, upper=False, unitriangular=True)
        loss = (x * x).sum() + (y.sin()).sum()
        loss.backward()
        return loss.detach(), x.detach(), y.detach(), A.grad, V.grad, K.grad

    check(f, A, V, K, tol=(1e-3, 1e-4))
    if platform.name() == "cpu":
        text = jax.jit(lambda a, b: fz._solve_tri(a, b, left_side=True, lower=True,
                                                  unit_diagonal=True)).lower(
            A.numpy(), V.numpy()).as_text()
        calls = re.findall(r"custom_call @(lapack_\w+)\((.*?)\) :? ?.*?\((tensor<[^)]*)\)", text)
        assert calls, text
        for name, _, types in calls:
            assert all(t.count("x") <= 2 for t in re.findall(r"tensor<([^>]*)>", types)), (name, types)


# matrix_exp follows PyTorch's own algorithm (NOTE [matrix_exp as CPU computes it]): per-matrix
# degree by the 1-norm for a single matrix, degree 18 scaled and squared for a batch. Scales
# that reach each degree of float32's bounds (1, 2, 4, 8, 12, 18 squared 0 and 4 times), and
# float32's ill-conditioned OpInfo sample (norms 26-29, results ~1e5); up to 7x7, CPU's bits.
_MEXP_SCALES = (1e-8, 1e-4, 0.03, 0.3, 1.0, 2.5, 40.0)


@pytest.mark.modes("defer")
@pytest.mark.parametrize("dtype", [torch.float32] + [
    pytest.param(d, marks=pytest.mark.slow) for d in (torch.float64, torch.complex64,
                                                      torch.complex128)])
def test_matrix_exp_bits_as_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    for shape in ((3, 3), (1, 5, 5), (4, 5, 5), (2, 2, 3, 3)):
        n = shape[-1]
        for scale in _MEXP_SCALES:
            a = torch.randn(shape, dtype=dtype, generator=g) * (scale / n)
            want = torch.linalg.matrix_exp(a)
            got = torch.linalg.matrix_exp(a.to("tpu"))
            assert_same(got, want, atol=0, rtol=0, msg=f"{shape} {scale}")
    a = torch.rand((5, 5, 5), dtype=dtype, generator=g) * 18 - 9
    assert_same(torch.linalg.matrix_exp(a.to("tpu")), torch.linalg.matrix_exp(a), atol=0, rtol=0)


@pytest.mark.modes("defer")
def test_matrix_exp_special_values():
    """NaN and inf as CPU's algorithm spreads them (a single matrix with a NaN norm is all NaN;
    an infinite norm scales by 0), empty matrices and batches, 1x1 matrices (``exp``)."""
    nan, inf = float("nan"), float("inf")
    for a in (torch.tensor([[1., nan], [0., 1.]]), torch.tensor([[1., inf], [0., 1.]]),
              torch.tensor([[[1., nan], [0., 1.]], [[0.5, 0.1], [0.2, 0.3]]]),
              torch.tensor([[[1., inf], [0., 1.]], [[0.5, 0.1], [0.2, 0.3]]]),
              torch.zeros(0, 3, 3), torch.zeros(2, 0, 0), torch.tensor([[[0.5]], [[-2.]]]),
              torch.eye(4) * 1e30, torch.tensor([[1e38, 0.], [0., 1.]])):
        assert_same(torch.linalg.matrix_exp(a.to("tpu")), torch.linalg.matrix_exp(a),
                    atol=1e-6, rtol=1e-6, msg=str(a))


@pytest.mark.modes("defer")
@pytest.mark.parametrize("dtype", [torch.float32] + [
    pytest.param(d, marks=pytest.mark.slow) for d in (torch.float64, torch.complex64)])
def test_matrix_exp_backward(dtype):
    """The gradient is the exponential of a 2n x 2n block matrix (PyTorch's formula, lowered
    through the same lowering): single and batched, every degree's range of norms."""
    g = torch.Generator().manual_seed(1)
    tol = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12),
           torch.complex64: (1e-5, 1e-5)}[dtype]
    for shape, scale in (((4, 4), 0.3), ((4, 4), 3.0), ((3, 5, 5), 1.0), ((2, 5, 5), 27.0)):
        a = torch.randn(shape, dtype=dtype, generator=g) * (scale / shape[-1])
        w = torch.randn(shape, dtype=dtype, generator=g)

        def grad(a):
            a = a.clone().requires_grad_()
            y = torch.linalg.matrix_exp(a)
            return torch.autograd.grad((y * w.to(y.device)).abs().sum(), a)[0]
        want = grad(a)
        got = grad(a.to("tpu"))
        atol, rtol = tol
        assert_same(got, want, atol=atol * float(want.abs().max()), rtol=rtol, msg=str(shape))
