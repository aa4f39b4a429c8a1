"""torch.autocast('tpu') follows PyTorch's CPU autocast policy; a bf16 step matches CPU autocast."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from util import assert_same


def _step(device, dev_type):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    m, x, y = m.to(device), x.to(device), y.to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with torch.autocast(dev_type, dtype=torch.bfloat16):
        out = m(x)
        loss = F.cross_entropy(out, y)
    loss.backward()
    opt.step()
    return out, loss, [p.detach() for p in m.parameters()]


def test_autocast_bf16_step_matches_cpu_autocast():
    want = _step("cpu", "cpu")
    got = _step("tpu", "tpu")
    assert got[0].dtype == torch.bfloat16          # linear runs in bf16
    assert got[1].dtype == torch.float32           # cross_entropy runs in float32
    assert_same(got[0], want[0], atol=2e-2, rtol=2e-2)
    assert_same(got[1], want[1], atol=1e-2, rtol=1e-2)
    for g, w in zip(got[2], want[2]):
        assert_same(g, w, atol=2e-2, rtol=2e-2)


def test_ops_outside_autocast_lists_keep_dtype():
    x = torch.randn(4, 4)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        t = x.to("tpu")
        assert (t.exp() + 1).dtype == torch.float32
        assert (t @ t).dtype == torch.bfloat16
