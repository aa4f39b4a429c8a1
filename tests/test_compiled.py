"""Compiled mode: torch.compile on tpu through the same lowering table, against CPU eager.

Dynamo and AOTAutograd take seconds per graph here, so these tests are few and small."""
import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import deferfuse
from deferfuse.tensor import is_tpu
from util import assert_same

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
from demo import TinyGPT  # noqa: E402

pytestmark = pytest.mark.modes("defer")     # compiled graphs mix with the eager mode in force


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_function_compiles_to_one_graph_and_matches_cpu():
    def f(a, b):
        return F.gelu(a @ b.t()).sum(-1) * 2 - a.mean()
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    cf = torch.compile(f, backend="tpu", fullgraph=True)
    for _ in range(2):
        got = cf(x.to("tpu"), w.to("tpu"))
        assert is_tpu(got)
        assert_same(got, f(x, w), atol=1e-5)
    m = deferfuse.metrics()
    assert m["dynamo_graphs"] == 1 and m["graph_compiles"] == 1 and m["compiled_calls"] == 2


def test_gpt_training_compiled_with_compiled_optimizer_matches_cpu():
    """nanoGPT's way: torch.compile(model) with no backend (the tpu backend for tpu tensors),
    AdamW, a compiled optimizer step, .item() logging; losses and parameters equal CPU's, and
    nothing compiles after the first steps."""
    torch.manual_seed(0)
    ref = TinyGPT(vocab=64, d=32, layers=1, t=16)
    model = copy.deepcopy(ref).to("tpu")
    # eps: the key bias's gradient is zero but for rounding noise (softmax ignores a shift of
    # every key), which Adam's default eps would blow up into a step of lr either way.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-5)
    cm = torch.compile(model, fullgraph=True)
    step = torch.compile(opt.step)
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    xt, yt = x.to("tpu"), y.to("tpu")
    for i in range(4):
        logits = cm(xt)
        loss = F.cross_entropy(logits.view(-1, 64), yt.view(-1))
        loss.backward()
        step()
        opt.zero_grad()
        want = F.cross_entropy(ref(x).view(-1, 64), y.view(-1))
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
        if i == 1:
            compiles = deferfuse.metrics()["graph_compiles"]
    assert deferfuse.metrics()["graph_compiles"] == compiles
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p, q.detach(), atol=2e-5, rtol=1e-4)
    m = deferfuse.metrics()
    assert m["graphs_run_eagerly"] == 0, m["graph_fallback_reasons"]
    # NOTE [no backward cut for graphs]: backward() of a compiled graph dispatches nothing.
    assert "backward" not in m["syncs"], m["syncs"]


def test_a_loop_that_reads_its_loss_every_few_steps_is_cut_at_backward():
    """NOTE [no backward cut for graphs]: a step that reads its loss runs as one program; a loop
    that does not is still cut at each backward() (the last step's backward graph and update with
    this step's forward graph), as in defer mode. Parameters and the last loss equal CPU's."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model = copy.deepcopy(ref).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    cm = torch.compile(model, backend="tpu", fullgraph=True)
    step = torch.compile(opt.step, backend="tpu")
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    xt, yt = x.to("tpu"), y.to("tpu")
    for _ in range(4):
        loss = F.cross_entropy(cm(xt), yt)
        loss.backward()
        step()
        opt.zero_grad()
        want = F.cross_entropy(ref(x), y)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p, q.detach(), atol=1e-5, rtol=1e-5)
    assert deferfuse.metrics()["syncs"].get("backward", 0) == 3     # steps 2-4


def test_default_backend_changes_nothing_for_cpu(monkeypatch):
    """NOTE [default backend]: tpu graphs go to the tpu backend; CPU graphs still to Inductor."""
    import torch._inductor.compile_fx as cfx
    seen = []
    monkeypatch.setattr(cfx, "compile_fx", lambda gm, inputs, **kw: (seen.append(gm), gm.forward)[1])

    def f(a):
        return (a * 2).sin()
    x = torch.randn(4)
    torch.compile(f)(x)
    assert len(seen) == 1
    before = deferfuse.metrics()["dynamo_graphs"]
    torch._dynamo.reset()
    assert_same(torch.compile(f)(x.to("tpu")), f(x))
    assert len(seen) == 1 and deferfuse.metrics()["dynamo_graphs"] == before + 1


def test_an_input_viewed_as_real_from_a_complex_tensor():
    """RoPE's q and k are ``view_as_real`` views of a complex product; a compiled function taking
    them (TorchTitan's compiled flex attention) failed while Dynamo fakeified them, on the wrapper
    subclass ("view_as_real is only supported for complex tensors").
    The same views of a real base (``view_as_complex``) too; a misuse still raises."""
    torch._dynamo.reset()
    x = torch.randn(2, 4, 8, dtype=torch.complex64)
    r = torch.randn(2, 3, 4, 2)

    def f(q, c):
        return q * 2 + 1, c * c
    want = f(torch.view_as_real(x * 2).flatten(2).transpose(1, 2), torch.view_as_complex(r + 1))
    xt, rt = x.to("tpu"), r.to("tpu")
    got = torch.compile(f)(torch.view_as_real(xt * 2).flatten(2).transpose(1, 2),
                           torch.view_as_complex(rt + 1))
    for g, w in zip(got, want):
        assert_same(g, w, atol=1e-5, rtol=1e-5)
    with pytest.raises(Exception, match="view_as_real is only supported for complex tensors"):
        torch.compile(torch.view_as_real)(torch.ones(3, device="tpu"))


def test_graph_breaks_run_in_the_eager_mode_and_are_reported():
    def f(x):
        y = x.sin() * 3
        if y.sum().item() > 0:          # a graph break: .item()
            y = y + 1
        return (y * y).cos()
    cf = torch.compile(f, backend="tpu")
    for n in (5, 5, 6):
        x = torch.randn(n)
        assert_same(cf(x.to("tpu")), f(x), atol=1e-5)
    text = deferfuse.report(file=False)
    assert "graph breaks" in text and "item()" in text


def test_dropout_in_a_graph_follows_manual_seed():
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 2)).to("tpu")
    cm = torch.compile(model, backend="tpu")
    x = torch.ones(4, 8, device="tpu")
    torch.manual_seed(3)
    a = cm(x).cpu()
    torch.manual_seed(3)
    b = cm(x).cpu()
    c = cm(x).cpu()
    assert torch.equal(a, b) and not torch.equal(b, c)


def test_factories_sized_by_dynamic_dimensions_match_cpu():
    """With dynamic shapes a factory's size is an expression of the graph's size symbols
    (``arange(16 * n)``, ``zeros(n, 3)``, an ``arange`` over a dynamic dimension, as vLLM's
    paged attention makes its causal mask): each program computes it from its own sizes."""
    def f(x, n):
        r = torch.arange(n * 16, device=x.device).float()
        m = torch.arange(x.shape[0], device=x.device)[:, None] <= torch.arange(4, device=x.device)
        return x.sum() + r.sum() + torch.zeros(n, 3, device=x.device).sum(), x * m
    cf = torch.compile(f, backend="tpu")
    for n in (2, 3, 4, 3):
        x = torch.randn(n, 4)
        got, want = cf(x.to("tpu"), n), f(x, n)
        assert_same(got[0], want[0], atol=1e-4)
        assert_same(got[1], want[1])
    m = deferfuse.metrics()
    assert m["graphs_run_eagerly"] == 0 and m["graph_compiles"] == 3


def test_a_jax_function_is_an_op_in_every_mode():
    import jax
    import jax.numpy as jnp

    @deferfuse.jax_op("deferfuse_test::rms_norm", static=("eps",))
    def rms_norm(x, w, eps=1e-6):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + eps)).astype(x.dtype) * w

    def ref(x, w, eps=1e-6):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    x, w = torch.randn(4, 8), torch.randn(8)
    assert_same(rms_norm(x.to("tpu"), w.to("tpu")), ref(x, w), atol=1e-5)
    torch.testing.assert_close(rms_norm(x, w), ref(x, w), atol=1e-5, rtol=1e-5)   # on CPU too
    for mode in ("strict", "defer"):
        with deferfuse.mode(mode):
            xt = x.to("tpu").requires_grad_()
            wt = w.to("tpu").requires_grad_()
            rms_norm(xt, wt, 1e-5).square().sum().backward()
            xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
            ref(xc, wc, 1e-5).square().sum().backward()
            assert_same(xt.grad, xc.grad, atol=1e-4, rtol=1e-4)
            assert_same(wt.grad, wc.grad, atol=1e-4, rtol=1e-4)
    cf = torch.compile(lambda a, b: rms_norm(a, b) * 2, backend="tpu", fullgraph=True)
    assert_same(cf(x.to("tpu"), w.to("tpu")), 2 * ref(x, w), atol=1e-5)
    assert deferfuse.metrics()["cpu_fallbacks"] == {}


def test_a_jax_op_with_a_64_bit_result():
    """A JAX function returning int64 (an argsort) keeps int64 in its fake (meta) result, as the
    lowering computes it under 64-bit JAX: the op's dtype is the same on tpu and on CPU."""
    import jax.numpy as jnp

    @deferfuse.jax_op("deferfuse_test::order")
    def order(x):
        return jnp.argsort(x, stable=True).astype(jnp.int64)
    x = torch.randn(7)
    want = torch.argsort(x, stable=True)
    assert_same(order(x.to("tpu")), want)
    assert torch.equal(order(x), want)
    cf = torch.compile(lambda a: order(a) + 1, backend="tpu", fullgraph=True)
    assert_same(cf(x.to("tpu")), want + 1)


@pytest.mark.slow   # the default run has test_vary's "static compiled" generate (tokens, graphs)
def test_hugging_face_static_cache_generate_compiles_on_tpu():
    """transformers compiles a static-cache generate() step with torch.compile(backend="tpu")
    for a model on tpu: it runs, and its tokens are CPU's greedy tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=None, pad_token_id=0)
    ref = LlamaForCausalLM(cfg).eval()
    model = copy.deepcopy(ref).to("tpu")
    ids = torch.randint(2, 128, (1, 6))
    want = ref.generate(ids, max_new_tokens=5, do_sample=False)
    got = model.generate(ids.to("tpu"), max_new_tokens=5, do_sample=False,
                         cache_implementation="static")
    assert torch.equal(got.cpu(), want)
    assert deferfuse.metrics()["dynamo_graphs"] >= 1


def _tiny_llama(layers=1):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=64, bos_token_id=1, eos_token_id=None,
                      pad_token_id=0)
    return LlamaForCausalLM(cfg)


def _compiles() -> tuple:
    m = deferfuse.metrics()
    return m["dynamo_graphs"], m["graph_compiles"], m["compiles"]


@pytest.mark.parametrize("cache", [pytest.param("dynamic", marks=pytest.mark.slow), "static"])
def test_hugging_face_generate_with_forward_compiled_matches_cpu(cache):
    """generate() with model.forward under torch.compile(backend="tpu"): a graph's outputs (a
    static cache's buffers made in the first forward, a dynamic cache's length) reach generate()'s
    eager code as tpu tensors; the tokens are CPU's, and a fourth call compiles nothing (defer's
    step detection still reshapes the regions around the graphs in the first calls)."""
    ref = _tiny_llama().eval()
    model = copy.deepcopy(ref).to("tpu")
    model.forward = torch.compile(model.forward, backend="tpu")
    ids = torch.randint(2, 128, (2, 6))
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
              disable_compile=True)
    if cache == "static":
        kw["cache_implementation"] = cache
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        for i in range(4):
            if i == 3:
                before = _compiles()
            got = model.generate(ids.to("tpu"), attention_mask=torch.ones_like(ids).to("tpu"),
                                 **kw)
            assert torch.equal(got.cpu(), want)
    assert _compiles() == before
    assert deferfuse.metrics()["graphs_run_eagerly"] == 0


def test_hugging_face_llama_whole_training_step_compiled_matches_cpu():
    """One torch.compile over zero_grad, forward (its dynamic cache makes tensors with
    torch.tensor(..., device="tpu") inside the graph), backward and AdamW's step: the losses are
    CPU's, and the third step compiles nothing."""
    ref = _tiny_llama().train()
    model = copy.deepcopy(ref).to("tpu")
    ids = torch.randint(2, 128, (2, 8))

    def make_step(m, x):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            return loss
        return step
    ref_step = make_step(ref, ids)
    step = torch.compile(make_step(model, ids.to("tpu")), backend="tpu")
    for i in range(3):
        if i == 2:
            before = _compiles()
        assert step().item() == pytest.approx(ref_step().item(), rel=1e-5, abs=1e-6)
    assert _compiles() == before
    assert deferfuse.metrics()["graphs_run_eagerly"] == 0


@pytest.mark.slow
def test_hugging_face_llama_trains_20_steps_compiled_as_on_cpu():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=None, pad_token_id=0)
    ref = LlamaForCausalLM(cfg)
    model = copy.deepcopy(ref).to("tpu")
    cm = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    for _ in range(20):
        ids = torch.randint(2, 128, (2, 16))
        loss = cm(input_ids=ids.to("tpu"), labels=ids.to("tpu")).loss   # (its dynamic cache too)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want = ref(input_ids=ids, labels=ids).loss
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(want.item(), rel=1e-4, abs=1e-5)
    assert deferfuse.metrics()["graphs_run_eagerly"] == 0


def test_an_index_error_in_a_graph_is_raised_at_the_read():
    emb = nn.Embedding(5, 3).to("tpu")
    cf = torch.compile(lambda i: emb(i) * 2, backend="tpu", fullgraph=True)
    good = cf(torch.tensor([1, 4], device="tpu"))
    assert_same(good, emb.weight.detach().cpu()[[1, 4]] * 2)
    bad = cf(torch.tensor([1, 7], device="tpu"))     # dispatched; checked when read
    with pytest.raises(IndexError, match="index out of range"):
        bad.cpu()
    assert_same(cf(torch.tensor([0], device="tpu")), emb.weight.detach().cpu()[[0]] * 2)


def test_module_to_tpu_after_a_cpu_forward_pass():
    """nn.Module._apply converts parameters with a new Parameter, as for CUDA (a traceable subclass
    would be swapped in, and a parameter that an autograd graph on CPU still holds refused)."""
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    want = lin(x)                      # holds the CPU weight in its graph
    lin = lin.to("tpu")
    assert_same(lin(x.to("tpu")).detach(), want.detach())


def test_windows_at_moving_offsets_as_graph_inputs_match_cpu():
    """A compiled graph whose inputs are windows of one tensor at moving offsets (truncated BPTT
    over one token stream, NOTE [dynamic offsets]) reads and writes each window where it is."""
    def f(x, w):
        y = torch.tanh(x @ w)
        x.mul_(0.5)                 # written through the window into the stream
        return y.sum(0)
    d, w = torch.randn(20, 4), torch.randn(4, 3)
    t, tw = d.to("tpu"), w.to("tpu")
    cf = torch.compile(f, backend="tpu")
    for i in range(0, 12, 3):
        got = cf(t[i:i + 5], tw)
        want = f(d[i:i + 5], w)
        assert_same(got, want, atol=1e-5)
        assert_same(t, d, atol=1e-6)
        assert_same(t[i + 1], d[i + 1], atol=1e-6)      # a select at a moving offset


def test_inputs_sliced_along_an_inner_dimension_match_cpu():
    """TorchTitan's chunked loss gives its compiled cross-entropy chunks of the labels: views at
    offsets along dimension 1 of a slice (``labels[:, 1:]`` split in 8). Dynamo replays such a
    view on a fake base and checks where it lands; the replayed view started at offset 0 and the
    check failed ("Expected cond to be True")."""
    def f(x, y):
        return F.cross_entropy(x.flatten(0, 1), y.flatten(0, 1), reduction="sum")
    lab, x = torch.randint(0, 10, (2, 33)), torch.randn(2, 4, 10)
    t, xt = lab.to("tpu"), x.to("tpu")
    cf = torch.compile(f, backend="tpu")
    for i in (1, 3):
        got = cf(xt, torch.split(t[:, 1:], 4, dim=1)[i])
        assert_same(got, f(x, torch.split(lab[:, 1:], 4, dim=1)[i]), atol=1e-4)
    got = cf(xt[:1], t[1:, 5:9])
    assert_same(got, f(x[:1], lab[1:, 5:9]), atol=1e-4)
