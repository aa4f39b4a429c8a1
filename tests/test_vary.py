"""Programs that vary (issue 25): moving offsets, growing sequences and new shapes compile a few
programs, never one per offset or length, and compute what CPU computes."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import deferfuse
from util import assert_same


def _compiles():
    return deferfuse.metrics()["compiles"]


# --------------------------------------------------------------------------- offsets are data
def test_moving_windows_compile_once_and_match_cpu():
    d = torch.randn(40, 3)
    t = d.to("tpu")
    got, want, after = [], [], []
    for i in range(0, 30, 4):
        # slice, narrow, select (negative too), a strided slice, integer indexing of a view
        a = t[i:i + 5] * 2 + t.narrow(0, i + 1, 5).sum(0)
        b = t[i] - t[-1 - i] + t[i:i + 9:3].mean(0) + t[i + 2:i + 6][1]
        got.append(torch.cat([a.reshape(-1), b]).cpu())
        a = d[i:i + 5] * 2 + d.narrow(0, i + 1, 5).sum(0)
        b = d[i] - d[-1 - i] + d[i:i + 9:3].mean(0) + d[i + 2:i + 6][1]
        want.append(torch.cat([a.reshape(-1), b]))
        after.append(_compiles())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert after[1] == after[-1], after        # no offset after the first compiles anything
    m = deferfuse.metrics()
    assert m["recompiles"] == 0 and m["shape_fallbacks"] == 0 and m["shape_splits"] == 0


def test_clamped_and_negative_starts_normalise_as_pytorch():
    d = torch.arange(24.).reshape(6, 4)
    t = d.to("tpu")
    for sl in [slice(-3, None), slice(-100, 2), slice(4, 100), slice(-2, -1), slice(5, 3),
               slice(1, None, 2), slice(None, -4)]:
        assert_same(t[sl] + 0, d[sl] + 0)
        assert_same(t[:, sl] * 1, d[:, sl] * 1)
    for i in (-6, -1, 0, 5):
        assert_same(t[i] + 0, d[i] + 0)
        assert_same(t.select(1, i % 4 - 4) + 0, d.select(1, i % 4 - 4) + 0)
    with pytest.raises(IndexError):
        t[6]
    with pytest.raises(IndexError):
        t.select(1, -5)


def test_writes_through_moving_windows_match_cpu():
    want = torch.zeros(12, 2)
    t = want.to("tpu")
    after = []
    for i in range(8):
        for x in (t, want):
            x[i:i + 3] += 1                     # in place through a slice
            x[i] = i + 0.25                     # a row
            x[i + 1:i + 4, 1].mul_(2)           # a slice of a select... of a slice
            x.narrow(0, i + 2, 2).copy_(x[i:i + 2] * 0.5)
        after.append(_compiles())
    assert_same(t, want)
    assert after[1] == after[-1], after


def test_as_strided_offset_is_data():
    d = torch.arange(30.)
    t = d.to("tpu")
    after = []
    for off in range(0, 20, 3):
        assert_same(t.as_strided((3, 2), (3, 1), off) * 2, d.as_strided((3, 2), (3, 1), off) * 2)
        assert_same(t[1:].as_strided((2, 2), (1, 2), off) + 1,
                    d[1:].as_strided((2, 2), (1, 2), off) + 1)
        after.append(_compiles())
    assert after[1] == after[-1], after
    with pytest.raises(RuntimeError):
        t.as_strided((3, 2), (3, 1), 28) + 0     # past the storage: PyTorch's error


def test_views_at_moving_offsets_keep_autograd():
    w = torch.randn(20, 4, requires_grad=True)
    wt = w.detach().to("tpu").requires_grad_()
    for i in range(0, 12, 5):
        (w[i:i + 4] * torch.arange(4.)[:, None]).sum().backward()
        (wt[i:i + 4] * torch.arange(4.).to("tpu")[:, None]).sum().backward()
    assert_same(wt.grad, w.grad)


# --------------------------------------------------------------------------- truncated BPTT
V, T, B = 20, 6, 3


class _LSTMLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(V, 8), nn.LSTM(8, 8), nn.Linear(8, V)

    def forward(self, x, h):
        y, h = self.rnn(self.emb(x), h)
        return self.out(y), h


class _TransformerLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.out = nn.Linear(16, V)

    def forward(self, x, h):
        n = x.shape[0]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=x.device), 1)
        return self.out(self.enc(self.emb(x), mask=mask)), h


def _bptt(model, data, dev, steps):
    """The classic truncated-BPTT loop: batches are slices of one long token tensor."""
    model = model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = data.to(dev)
    h, losses, compiles = None, [], []
    for k in range(steps):
        i = k * T
        x, y = data[i:i + T], data[i + 1:i + 1 + T]
        if isinstance(h, tuple):
            h = tuple(s.detach() for s in h)
        out, h = model(x, h)
        loss = F.cross_entropy(out.reshape(-1, V), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        compiles.append(_compiles())
    return losses, compiles


@pytest.mark.parametrize("arch", ["lstm", "transformer"])
def test_bptt_over_slices_of_one_tensor_compiles_once(arch):
    torch.manual_seed(0)
    model = _LSTMLM() if arch == "lstm" else _TransformerLM()
    data = torch.randint(0, V, (8 * T + 1, B))
    import copy
    want, _ = _bptt(copy.deepcopy(model), data, "cpu", 8)
    deferfuse.reset_metrics()
    got, compiles = _bptt(model, data, "tpu", 8)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert compiles[2] == compiles[-1], compiles      # every batch after the second: nothing
    m = deferfuse.metrics()
    assert m["shape_fallbacks"] == 0 and m["shape_splits"] == 0 and m["recompiles"] == 0, m
    assert "op by op" not in deferfuse.report(file=False)


# --------------------------------------------------------------------------- the program store
_SECOND_RUN = r"""
import sys, torch, torch.nn as nn, deferfuse
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(30, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 30)).to("tpu")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.randint(0, 30, (40,)).to("tpu")
losses = []
for i in range(0, 20, 5):
    x, y = data[i:i + 5], data[i + 1:i + 6]
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    losses.append(loss.item())
bad = torch.tensor([3, 31]).to("tpu")
try:
    model(bad).sum().item()
    err = "none"
except IndexError as e:
    err = "IndexError"
m = deferfuse.metrics()
print(",".join(f"{v:.6f}" for v in losses), err, m["compiles"], m["program_disk_hits"],
      "loaded from" in deferfuse.report(file=False))
"""


@pytest.mark.modes("defer", "strict")
def test_second_process_compiles_nothing_and_says_so(tmp_path, tpu_mode):
    import subprocess
    import sys
    env = {**__import__("os").environ, "DEFERFUSE_CACHE_DIR": str(tmp_path),
           "TORCHTPU_MODE": tpu_mode}
    runs = [subprocess.run([sys.executable, "-c", _SECOND_RUN], env=env, capture_output=True,
                           text=True, check=True).stdout.split() for _ in range(2)]
    first, second = runs
    assert first[:2] == second[:2] and first[1] == "IndexError", runs   # losses, the error
    assert int(first[2]) > 0 and int(first[3]) == 0, first
    assert int(second[2]) == 0, second         # nothing compiled: every program came from disk
    assert int(second[3]) > 0 and second[4] == "True", second
