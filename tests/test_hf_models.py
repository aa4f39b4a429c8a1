"""Hugging Face transformers models train and generate on tpu exactly like CPU eager.

Tiny models built from config classes with random weights (no hub access; see hf_matrix.py for the
builders and the standalone table, bench/results/hf_models.md for its latest output). Each test
runs in strict and defer modes (conftest). The default run covers gpt2 and llama; the other
architectures (hf_matrix.CORE, then forward/backward of hf_matrix.WIDER) are marked slow
(``pytest -m slow tests/test_hf_models.py``).
"""
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import deferfuse  # noqa: E402
import hf_matrix as hm  # noqa: E402

transformers.logging.set_verbosity_error()

FAST = {"gpt2", "llama"}   # default run; everything else is slow

# Architectures whose forward+backward does not match CPU yet: name -> the failing op / cause.
XFAIL_TRAIN: dict = {}
# Architectures whose greedy generation does not match CPU yet.
XFAIL_GENERATE: dict = {}

# Ops still allowed to fall back to CPU per architecture (anything new fails the test).
ALLOWED_FALLBACKS: dict = {}

CAUSAL = [n for n, (k, _, _) in hm.CORE.items() if k == "causal"]
GENERATIVE = [n for n, (k, _, _) in hm.CORE.items() if k != "masked"]


def _params(names, xfail, fast=FAST):
    out = []
    for n in names:
        marks = [] if n in fast else [pytest.mark.slow]
        if n in xfail:
            marks.append(pytest.mark.xfail(strict=True, reason=xfail[n]))
        out.append(pytest.param(n, id=n, marks=marks))
    return out


def _check_fallbacks(arch):
    got = set(deferfuse.metrics()["cpu_fallbacks"])
    extra = got - set(ALLOWED_FALLBACKS.get(arch, ()))
    assert not extra, f"{arch}: ops fell back to CPU: {sorted(extra)}"


@pytest.mark.parametrize("arch", _params(hm.CORE, XFAIL_TRAIN))
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_forward_backward(arch, tpu_mode):
    """Logits, loss and every parameter's gradient match CPU (atol=rtol=1e-4)."""
    hm.check_forward_backward(arch)
    _check_fallbacks(arch)


@pytest.mark.parametrize("arch", _params(GENERATIVE, XFAIL_GENERATE))
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_greedy_generate(arch, tpu_mode):
    """generate(do_sample=False) with the default dynamic cache gives CPU's tokens."""
    hm.check_generate(arch)
    _check_fallbacks(arch)


@pytest.mark.parametrize("arch", _params(hm.WIDER, XFAIL_TRAIN, fast=()))
def test_forward_backward_wider(arch, tpu_mode):
    """The same check for the wider set of architectures (mixture-of-experts included)."""
    hm.check_forward_backward(arch)
    _check_fallbacks(arch)


@pytest.mark.parametrize("arch", _params(GENERATIVE, XFAIL_GENERATE, fast={"llama"}))
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_greedy_generate_static_cache(arch, tpu_mode):
    """generate(cache_implementation='static') (decode step not compiled) gives CPU's tokens."""
    hm.check_generate(arch, "static")
    _check_fallbacks(arch)


@pytest.mark.parametrize("arch", _params(["gpt2", "llama", "t5"], XFAIL_GENERATE, fast={"gpt2"}))
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_sampled_generate(arch, tpu_mode):
    """generate(do_sample=True) gives in-vocabulary tokens of the right shape (values differ from
    CPU by design: the tpu device draws from JAX's RNG)."""
    hm.check_sample(arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_sampled_generate_static_cache(arch, tpu_mode):
    """Sampling with cache_implementation='static' (decode step not compiled)."""
    hm.check_sample(arch, cache="static")


@pytest.mark.slow
@pytest.mark.modes("strict")
def test_static_cache_generate_autocompile(tpu_mode):
    """With a static cache, generate() compiles its decode step with torch.compile(backend="tpu")
    for a model on tpu (transformers' default compile config): greedy tokens equal CPU's."""
    model, batch = hm.cpu_reference("gpt2")[:2]
    tm = hm.to_tpu(model)
    b = {k: v.to("tpu") for k, v in batch.items()}
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        want = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"],
                              disable_compile=True, **kw)
        got = tm.generate(b["input_ids"], attention_mask=b["attention_mask"], **kw)
    assert torch.equal(got.cpu(), want)
    assert deferfuse.metrics()["dynamo_graphs"] >= 1


def test_to_device_keeps_tied_weights(tpu_mode):
    """Module.to('tpu') re-creates parameters (PrivateUse1 tensors aren't shallow-copy compatible
    with CPU ones); gpt2's lm_head stays tied to wte with no tie_weights() call."""
    model = hm.cpu_reference("gpt2")[0]
    assert model.lm_head.weight is model.transformer.wte.weight
    tm = hm.to_tpu(model)
    assert tm.lm_head.weight is tm.transformer.wte.weight
    assert tm.lm_head.weight.device.type == "tpu"


def _train_llama(device, steps):
    from transformers import get_linear_schedule_with_warmup
    torch.manual_seed(0)
    model = hm.build("llama")
    model.train()
    model = hm.to_tpu(model) if device == "tpu" else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=steps)
    g = torch.Generator().manual_seed(2)
    losses, norms, compiles = [], [], []
    for _ in range(steps):
        ids = torch.randint(3, hm.VOCAB, (hm.BATCH, hm.SEQ), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        compiles.append(deferfuse.metrics()["compiles"])
    return losses, norms, compiles, model


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_llama_training_loop(tpu_mode):
    """20 steps of AdamW + linear warmup schedule + clip_grad_norm_ in defer mode: losses match CPU
    eager within 1e-4 step for step, and nothing compiles after the first few steps (the changing
    learning rate is a traced scalar)."""
    steps = 20
    want, want_norms, _, cpu_model = _train_llama("cpu", steps)
    deferfuse.reset_metrics()
    got, got_norms, compiles, tpu_model = _train_llama("tpu", steps)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(want_norms), atol=1e-4, rtol=1e-4)
    assert want[-1] < want[0], want  # the run actually trains
    assert compiles[-1] == compiles[3], f"compiles kept growing: {compiles}"
    for (n, p), (_, q) in zip(cpu_model.named_parameters(), tpu_model.named_parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), atol=1e-4, rtol=1e-4, msg=n)
