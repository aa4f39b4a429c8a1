"""Small models train on tpu with losses and parameters matching CPU eager step for step."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import deferfuse
from util import assert_same


class Block(nn.Module):
    """A pre-norm transformer block with causal attention."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=50, d=32, t=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(t, d) * 0.02)
        self.block = Block(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.block(self.emb(idx) + self.pos[: idx.shape[1]]))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.c1(x)))
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _mlp():
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 5))


MODELS = {
    "mlp": (_mlp, lambda: (torch.randn(16, 12), torch.randint(0, 5, (16,)))),
    "transformer": (TinyLM, lambda: (torch.randint(0, 50, (4, 16)), torch.randint(0, 50, (4, 16)))),
    "convnet": (ConvNet, lambda: (torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))),
}
# Adam divides by sqrt(v) + eps: a parameter whose true gradient is zero (a conv bias before batch
# norm, the key bias of attention) gets rounding noise of ~1e-9 as its gradient, which eps=1e-8 turns
# into a full lr-sized step in a random direction on either device. eps=1e-4 keeps those noise steps
# negligible while real gradients (~1e-2) still take normal Adam steps.
OPTIMS = {
    "sgd": lambda p, fe: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4, foreach=fe),
    "adam": lambda p, fe: torch.optim.Adam(p, lr=1e-2, eps=1e-4, foreach=fe),
    "adamw": lambda p, fe: torch.optim.AdamW(p, lr=1e-2, eps=1e-4, weight_decay=0.1, foreach=fe),
}


def _train(model_name, opt_name, foreach, device, steps=4):
    make, data = MODELS[model_name]
    torch.manual_seed(0)
    model = make()
    x, y = data()
    model = model.to(device)
    x, y = x.to(device), y.to(device)
    opt = OPTIMS[opt_name](model.parameters(), foreach)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach())
    return losses, list(model.parameters()) + list(model.buffers())


# Each model with two optimizers; foreach (the default) and for-loop paths both covered (the
# transformer's SGD for-loop case, the longest, in the slow run: mlp and convnet cover the for-loop path).
CASES = [("mlp", "sgd", None), ("mlp", "adam", False), ("transformer", "adamw", None),
         pytest.param("transformer", "sgd", False, marks=pytest.mark.slow), ("convnet", "adamw", None), ("convnet", "adam", False)]


@pytest.mark.parametrize("model_name,opt_name,foreach", CASES)
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_train_matches_cpu(model_name, opt_name, foreach):
    want_l, want_p = _train(model_name, opt_name, foreach, "cpu")
    got_l, got_p = _train(model_name, opt_name, foreach, "tpu")
    for i, (g, w) in enumerate(zip(got_l, want_l)):
        assert_same(g, w, atol=2e-5, rtol=2e-5, msg=f"loss at step {i}")
    for g, w in zip(got_p, want_p):
        assert_same(g.detach(), w.detach(), atol=5e-5, rtol=5e-5)
    assert deferfuse.metrics()["cpu_fallbacks"] == {}, deferfuse.metrics()["cpu_fallbacks"]


@pytest.mark.modes("strict", "debug", "defer")
@pytest.mark.parametrize("call", ["backward", "grad"])
def test_an_error_in_a_backward_op_raises_it(call, monkeypatch):
    # NOTE [errors in backward] (deferfuse/route.py): an op of the backward pass that raised
    # (no lowering with the CPU fallback off, a lowering that failed) aborted the interpreter. Here
    # relu's backward op raises, as such an op would.
    from deferfuse.engine import engine
    op = torch.ops.aten.threshold_backward.default

    def broken(func, info, args, kwargs):
        raise deferfuse.LoweringError(func, "no lowering (a stand-in for this test)")
    monkeypatch.setitem(engine.routes, id(op), (broken, None, op))
    x = torch.randn(4, 3).to("tpu").requires_grad_()
    loss = torch.relu(x).sum()
    with pytest.raises(deferfuse.LoweringError, match="threshold_backward"):
        if call == "backward":
            loss.backward()
        else:
            torch.autograd.grad(loss, x)
    monkeypatch.undo()
    # the process goes on: a backward pass after it is right
    w = torch.randn(3, 2)
    wt = w.to("tpu").requires_grad_()
    (wt.tanh() * 2).sum().backward()
    assert_same(wt.grad, 2 * (1 - w.tanh() ** 2))


@pytest.mark.parametrize("device_thread", [False, True])
def test_backward_runs_on_the_calling_thread(device_thread):
    # NOTE [backward thread] (deferfuse/device.py): PyTorch hands an accelerator's backward pass to
    # a device thread of its own; tpu runs it where backward() was called, as for CPU tensors.
    import threading
    seen = []
    w = torch.randn(3, 2)
    wt = w.to("tpu").requires_grad_()
    with deferfuse.override(backward_thread=device_thread):
        y = wt * 3
        y.register_hook(lambda g: seen.append(threading.get_ident()))   # runs where the node runs
        y.sum().backward()
    assert len(seen) == 1
    assert (seen[0] == threading.get_ident()) != device_thread
    assert_same(wt.grad, torch.full((3, 2), 3.0))
