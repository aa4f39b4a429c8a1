"""Mixed precision on tpu: ``torch.autocast("tpu")`` casts the ops CUDA's autocast casts, a float16
``GradScaler("tpu")`` skips steps on inf as CUDA's does, and a Hugging Face Llama trains in pure
bfloat16 and under bfloat16 autocast like CPU.

Where CPU's autocast policy for an op is CUDA's, the reference is CPU autocast itself; where the two
differ (CPU leaves ``exp``, ``layer_norm``, ``sum``, ``addmv`` ... alone), it is CPU eager on the
inputs cast as CUDA's policy casts them.
"""
import functools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import deferfuse
from deferfuse import amp
from util import assert_same

BF16_TOL = dict(atol=1e-5, rtol=1.6e-2)     # assert_close's bfloat16 defaults
FP16_TOL = dict(atol=1e-5, rtol=1e-3)


@pytest.mark.modes("strict")
def test_policy_is_cudas():
    """The ops with a tpu autocast kernel are exactly those with a CUDA one in this torch (less
    the two cudnn-only convolutions), and every name in our tables exists."""
    names = torch._C._dispatch_get_all_op_names()
    cuda = {n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA")}
    tpu = {n for n in names
           if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastPrivateUse1")}
    assert tpu == cuda - {"aten::cudnn_convolution", "aten::cudnn_convolution_transpose"}
    assert {"aten::" + n for n in amp.policy_table()} == tpu


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


# (id, fn, inputs, reference): reference "cpu_autocast" runs fn under CPU autocast (CPU's policy
# casts this op as CUDA's does); otherwise it is fn of the CPU inputs cast as CUDA's policy does.
_X, _W, _B = _rand(4, 6), _rand(5, 6, seed=1), _rand(5, seed=2)
_XB = _X.bfloat16()
_CASES = [
    # lower precision on both
    ("linear", lambda x, w, b: F.linear(x, w, b), (_X, _W, _B), "cpu_autocast"),
    ("mm", torch.mm, (_X, _W.t()), "cpu_autocast"),
    ("matmul", torch.matmul, (_X, _W.t()), "cpu_autocast"),
    ("bmm", torch.bmm, (_rand(2, 3, 4), _rand(2, 4, 5, seed=1)), "cpu_autocast"),
    ("baddbmm", torch.baddbmm, (_rand(2, 3, 5), _rand(2, 3, 4, seed=1), _rand(2, 4, 5, seed=2)),
     "cpu_autocast"),
    ("conv2d", lambda x, w: F.conv2d(x, w), (_rand(1, 2, 5, 5), _rand(3, 2, 3, 3, seed=1)),
     "cpu_autocast"),
    # lower precision on CUDA only
    ("addmv", torch.addmv, (_rand(4), _X, _rand(6, seed=3)),
     lambda b, m, v: torch.addmv(b.bfloat16(), m.bfloat16(), v.bfloat16())),
    ("addr", torch.addr, (_X, _rand(4, seed=3), _rand(6, seed=4)),
     lambda m, u, v: torch.addr(m.bfloat16(), u.bfloat16(), v.bfloat16())),
    ("einsum", lambda a, b: torch.einsum("ij,kj->ik", a, b), (_X, _W),
     lambda a, b: torch.einsum("ij,kj->ik", a.bfloat16(), b.bfloat16())),
    ("mv", torch.mv, (_X, _rand(6, seed=3)), lambda m, v: torch.mv(m.bfloat16(), v.bfloat16())),
    # float32 on CUDA, left alone by CPU
    ("exp", torch.exp, (_XB,), lambda x: torch.exp(x.float())),
    ("log1p", lambda x: torch.log1p(x.abs()), (_XB,), lambda x: torch.log1p(x.abs().float())),
    ("rsqrt", lambda x: torch.rsqrt(x.abs() + 1), (_XB,),
     lambda x: torch.rsqrt((x.abs() + 1).float())),
    ("pow", lambda x: torch.pow(x, 2), (_XB,), lambda x: torch.pow(x.float(), 2)),
    ("softplus", F.softplus, (_XB,), lambda x: F.softplus(x.float())),
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (6,), w, b),
     (_XB, _rand(6, seed=4).bfloat16(), _rand(6, seed=5).bfloat16()),
     lambda x, w, b: F.layer_norm(x.float(), (6,), w.float(), b.float())),
    ("group_norm", lambda x: F.group_norm(x, 2), (_rand(2, 4, 3).bfloat16(),),
     lambda x: F.group_norm(x.float(), 2)),
    ("cosine_similarity", F.cosine_similarity, (_XB, _XB.flip(0)),
     lambda a, b: F.cosine_similarity(a.float(), b.float())),
    ("logsumexp", lambda x: torch.logsumexp(x, 1), (_XB,), lambda x: torch.logsumexp(x.float(), 1)),
    # float32 on both
    ("mse_loss", F.mse_loss, (_XB, _XB.flip(0)), "cpu_autocast"),
    ("nll_loss", lambda x, t: F.nll_loss(x, t), (_XB, torch.tensor([0, 3, 5, 1])), "cpu_autocast"),
    ("cdist", torch.cdist, (_XB, _XB.flip(0)), "cpu_autocast"),
    # float32 output dtype on CUDA (unless one is given)
    ("sum", torch.sum, (_XB,), lambda x: torch.sum(x, dtype=torch.float32)),
    ("sum_given_dtype", lambda x: torch.sum(x, 0, dtype=torch.bfloat16), (_XB,),
     lambda x: torch.sum(x, 0, dtype=torch.bfloat16)),
    ("softmax", lambda x: torch.softmax(x, -1), (_XB,),
     lambda x: torch.softmax(x, -1, dtype=torch.float32)),
    ("log_softmax", lambda x: F.log_softmax(x, 0), (_XB,),
     lambda x: F.log_softmax(x, 0, dtype=torch.float32)),
    ("cumsum", lambda x: torch.cumsum(x, 1), (_XB,), lambda x: torch.cumsum(x, 1, dtype=torch.float32)),
    ("cross_entropy", lambda x, t: F.cross_entropy(x, t), (_XB, torch.tensor([0, 3, 5, 1])),
     lambda x, t: F.cross_entropy(x.float(), t)),
    ("vector_norm", torch.linalg.vector_norm, (_XB,),
     lambda x: torch.linalg.vector_norm(x, dtype=torch.float32)),
    ("norm", lambda x: torch.norm(x), (_XB,), lambda x: torch.norm(x, dtype=torch.float32)),
    # promote on CUDA: the widest floating input dtype (float64 ignored)
    ("addcmul", torch.addcmul, (_X, _XB, _XB.flip(0)),
     lambda a, b, c: torch.addcmul(a, b.float(), c.float())),
    ("atan2", torch.atan2, (_XB, _X.flip(0)), lambda a, b: torch.atan2(a.float(), b)),
    # in no list: the input dtype
    ("relu", torch.relu, (_XB,), lambda x: torch.relu(x)),
    ("add", torch.add, (_XB, _X), lambda a, b: torch.add(a, b)),
]


@pytest.mark.parametrize("fn,inputs,ref", [pytest.param(f, i, r, id=n) for n, f, i, r in _CASES])
def test_op_casts_like_cuda(fn, inputs, ref):
    with torch.autocast("tpu", dtype=torch.bfloat16):
        got = fn(*[x.to("tpu") for x in inputs])
    if ref == "cpu_autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = fn(*inputs)
    else:
        want = ref(*inputs)
    assert_same(got, want, **BF16_TOL)


def test_float16_autocast_and_double_inputs():
    x, w = _X.to("tpu"), _W.to("tpu")
    with torch.autocast("tpu", dtype=torch.float16):
        got = x @ w.t()
        dbl = x.double() @ w.double().t()       # float64 is never cast
    assert_same(got, _X.half() @ _W.half().t(), **FP16_TOL)
    assert dbl.dtype == torch.float64


def test_binary_cross_entropy_is_banned_as_on_cuda():
    p, t = torch.rand(4).to("tpu"), torch.rand(4).to("tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(p, t)
        loss = F.binary_cross_entropy_with_logits(p.bfloat16(), t)     # the safe one: float32
    assert loss.dtype == torch.float32


def test_autocast_off_and_nested():
    x = _X.to("tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        assert (x @ x.t()).dtype == torch.bfloat16
        with torch.autocast("tpu", enabled=False):
            assert (x @ x.t()).dtype == torch.float32
        assert x.bfloat16().exp().dtype == torch.float32
    assert x.bfloat16().exp().dtype == torch.bfloat16


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.ln(F.gelu(self.fc1(x))))

    def forward_cuda_casts(self, x):
        """The forward pass with the casts CUDA's policy makes, written out (CPU eager)."""
        bf = torch.bfloat16
        h = F.gelu(F.linear(x.to(bf), self.fc1.weight.to(bf), self.fc1.bias.to(bf)))
        h = F.layer_norm(h.float(), (16,), self.ln.weight, self.ln.bias)
        return F.linear(h.to(bf), self.fc2.weight.to(bf), self.fc2.bias.to(bf))


def _step(device):
    torch.manual_seed(0)
    m = _Net()
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    m, x, y = m.to(device), x.to(device), y.to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    if device == "cpu":
        out = m.forward_cuda_casts(x)
        loss = F.cross_entropy(out.float(), y)
    else:
        with torch.autocast("tpu", dtype=torch.bfloat16):
            out = m(x)
            loss = F.cross_entropy(out, y)
    loss.backward()
    grads = [p.grad.detach() for p in m.parameters()]
    opt.step()
    return out, loss, grads, [p.detach() for p in m.parameters()]


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_autocast_training_step_matches_cuda_policy_on_cpu():
    got, want = _step("tpu"), _step("cpu")
    assert got[0].dtype == torch.bfloat16          # linear runs in bf16
    assert got[1].dtype == torch.float32           # cross_entropy runs in float32
    assert_same(got[0], want[0], **BF16_TOL)
    assert_same(got[1], want[1], **BF16_TOL)
    for g, w in zip(got[2] + got[3], want[2] + want[3]):
        assert g.dtype == torch.float32            # parameters and gradients stay float32
        # gradients of a bfloat16 computation: within two bfloat16 ulps of the largest entry
        assert_same(g, w, atol=2 ** -7 * w.abs().max().item(), rtol=1.6e-2)


def _scaled_fp16(device):
    """float16 autocast with a scale so large that the float16 gradients overflow: the first
    steps are skipped (parameters untouched, the scale halves) until it fits."""
    torch.manual_seed(0)
    m = nn.Linear(4, 3).to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 20, growth_interval=100)
    x = torch.randn(8, 4).to(device)
    out = []
    for _ in range(8):
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = (m(x).float() ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), m.weight.detach().cpu().clone(),
                    m.weight.grad.detach().cpu().clone()))
    return out


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_float16_grad_scaler_skips_steps_on_inf():
    got, want = _scaled_fp16("tpu"), _scaled_fp16("cpu")
    scales = [s for s, _, _ in want]
    assert scales[0] < 2.0 ** 20 and scales[-1] == scales[-2], scales   # skipped, then stepped
    for step, ((gs, gw, gg), (ws, ww, wg)) in enumerate(zip(got, want)):
        assert gs == ws, f"step {step}: scale {gs} != {ws}"
        torch.testing.assert_close(gw, ww, atol=1e-5, rtol=1e-3, msg=f"step {step} weight")
        torch.testing.assert_close(gg, wg, atol=1e-3, rtol=2e-3, equal_nan=True,
                                   msg=f"step {step} grad")
    skipped = [torch.equal(want[i][1], want[i + 1][1]) for i in range(len(want) - 1)]
    assert skipped[0] and not skipped[-1], skipped


# --------------------------------------------------------------------------------------------
# a Hugging Face Llama: 20 steps in pure bfloat16 (parameters and AdamW state) and under
# bfloat16 autocast, losses within bfloat16 tolerance of CPU's

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _llama_run(device, kind, steps=20):
    pytest.importorskip("transformers")
    import hf_matrix as hm
    torch.manual_seed(0)
    model = hm.build("llama")
    model.train()
    if kind == "pure":
        model = model.to(torch.bfloat16)
    model = hm.to_tpu(model) if device == "tpu" else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, hm.VOCAB, (hm.BATCH, hm.SEQ), generator=g).to(device)
    losses = []
    for _ in range(steps):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=kind == "autocast"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    p = next(model.parameters())
    return losses, p.dtype, tuple(v.dtype for k, v in sorted(opt.state[p].items()) if k != "step")


_llama_cpu = functools.lru_cache(maxsize=None)(functools.partial(_llama_run, "cpu"))


@pytest.mark.parametrize("kind", ["pure", "autocast"])
@pytest.mark.slow_params("strict", "autocast")   # long: defer, pure bf16 only in the default run
def test_llama_trains_in_bfloat16(kind, tpu_mode):
    deferfuse.reset_metrics()
    got, p_dtype, state_dtypes = _llama_run("tpu", kind)
    want, _, _ = _llama_cpu(kind)
    if kind == "pure":
        assert p_dtype == torch.bfloat16 and state_dtypes == (torch.bfloat16, torch.bfloat16)
    else:
        assert p_dtype == torch.float32
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **BF16_TOL)
    assert want[-1] < want[0] - 0.5, want          # it trains (one batch, overfitted)
    assert dict(deferfuse.metrics()["cpu_fallbacks"]) == {}
