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
