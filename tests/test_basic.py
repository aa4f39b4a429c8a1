import pytest
import torch

import deferfuse
from util import assert_same


def test_to_and_back():
    x = torch.randn(3, 4)
    t = x.to("tpu")
    assert t.device == torch.device("tpu", 0)
    assert_same(t, x)


def test_arith_matches_cpu():
    x, y = torch.randn(5, 6), torch.randn(5, 6)
    assert_same(x.to("tpu") * 2 + y.to("tpu"), x * 2 + y)
    assert_same((x.to("tpu") @ y.t().to("tpu")).sum(), (x @ y.t()).sum(), atol=1e-4)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_equal_allclose_return_python_bools_without_cpu_fallback():
    import deferfuse
    a = torch.randn(3)
    for b in (a.clone(), a + 1e-9, a + 1, a[:2]):
        assert torch.equal(a.to("tpu"), b.to("tpu")) is torch.equal(a, b)
        if b.shape == a.shape:
            assert torch.allclose(a.to("tpu"), b.to("tpu"), atol=1e-6) is torch.allclose(a, b, atol=1e-6)
    assert deferfuse.metrics()["cpu_fallbacks"] == {}


def test_write_through_conj_view():
    x = torch.randn(3, dtype=torch.complex64)
    t = x.to("tpu")
    c, cc = t.conj(), x.conj()
    c.mul_(2)
    cc.mul_(2)
    assert_same(t, x)
    assert_same(c.resolve_conj(), cc.resolve_conj())


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_linalg_errors_raise_linalg_error():
    import deferfuse
    a = torch.randn(4, 4)
    a = a @ a.T + 4 * torch.eye(4)
    assert_same(torch.linalg.cholesky(a.to("tpu")), torch.linalg.cholesky(a), atol=1e-5, rtol=1e-5)
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.cholesky(-torch.eye(3).to("tpu")).sum().item()
    assert deferfuse.metrics()["cpu_fallbacks"] == {}
