"""Compiled mode on the plain PrivateUse1 tpu tensor (NOTE [compiled plain
tensors] in deferfuse/compiled.py): ``torch.compile(backend="tpu")`` takes plain tensors, whose
graphs Dynamo and AOTAutograd trace as plain PrivateUse1 graphs, and gives plain tensors back.
Every output and every input a graph writes is compared with CPU eager (dtype, shape, values)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import deferfuse
from deferfuse import plain
from util import assert_same


pytestmark = pytest.mark.modes("defer")     # compiled graphs mix with the eager mode in force


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _is_plain(t):
    """A plain tpu tensor (a Parameter too), not a ``TpuTensor``."""
    return type(t) in (torch.Tensor, nn.Parameter) and plain.PLAIN.is_plain(t)


@pytest.mark.modes("strict", "defer")     # a graph runs at once in strict mode
def test_a_function_compiles_to_one_graph_of_plain_tensors_and_matches_cpu():
    def f(a, b):
        y = F.gelu(a @ b.t())
        return y.sum(-1) * 2 - a.mean(), y.t(), (a > 0).sum()
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    cf = torch.compile(f, backend="tpu", fullgraph=True)
    for _ in range(2):
        got = cf(x.to("tpu"), w.to("tpu"))
        want = f(x, w)
        for g, v in zip(got, want):
            assert _is_plain(g)
            assert_same(g, v, atol=1e-5)
        # the transposed output keeps the traced strides, as CPU's
        assert got[1].stride() == want[1].stride()
        assert_same(got[1].contiguous(), want[1].contiguous(), atol=1e-5)
        # outputs are ordinary tpu tensors: eager ops on them
        assert_same(got[1][1:3] * 2 + got[0][:3].unsqueeze(0), want[1][1:3] * 2 + want[0][:3],
                    atol=1e-5)
    m = deferfuse.metrics()
    assert m["dynamo_graphs"] == 1 and m["graph_compiles"] == 1 and m["compiled_calls"] == 2
    assert m["graphs_run_eagerly"] == 0, m["graph_fallback_reasons"]


@pytest.mark.modes("strict", "defer")     # a graph runs at once in strict mode
def test_training_with_a_compiled_model_and_optimizer_step_matches_cpu():
    """Forward and backward graphs (AOTAutograd) and a compiled SGD step with momentum (a graph
    writing the parameters and momentum buffers, its inputs): losses, gradients, parameters and
    optimizer states equal CPU's every step."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model = copy.deepcopy(ref).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    cm = torch.compile(model, backend="tpu", fullgraph=True)
    step = torch.compile(opt.step, backend="tpu")
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    xt, yt = x.to("tpu"), y.to("tpu")
    for _ in range(3):
        loss = F.cross_entropy(cm(xt), yt)
        loss.backward()
        want = F.cross_entropy(ref(x), y)
        want.backward()
        assert_same(loss, want.detach(), atol=1e-5)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert _is_plain(p.grad)
            assert_same(p.grad, q.grad, atol=1e-5)
        step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert _is_plain(p)
            assert_same(p, q.detach(), atol=1e-5)
            assert_same(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"],
                        atol=1e-5)
    assert deferfuse.metrics()["graphs_run_eagerly"] == 0




def _adamw_steps(first_eager: int, grads_late: bool, steps: int = 4):
    """AdamW over two tpu parameters with its step compiled (after ``first_eager`` eager steps)
    against CPU; with ``grads_late`` the second parameter has no gradient on the first step (its
    state starts a step later). Every parameter, moment and step count equals CPU's each step
    (Dynamo may move a step count to the parameter's device: its value is compared)."""
    torch.manual_seed(0)
    ref = [torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)]
    ps = [nn.Parameter(p.detach().clone().to("tpu")) for p in ref]
    opt = torch.optim.AdamW(ps, lr=0.05)
    ref_opt = torch.optim.AdamW(ref, lr=0.05)
    step = torch.compile(opt.step, backend="tpu")
    x = torch.randn(5, 4)
    xt = x.to("tpu")
    for k in range(steps):
        def loss(w, b, xx):
            h = xx @ w
            return h.square().mean() if (grads_late and k == 0) else (h + b).square().mean()
        loss(*ps, xt).backward()
        loss(*ref, x).backward()
        c0 = deferfuse.metrics()["graph_compiles"]
        (step if k >= first_eager else opt.step)()
        ref_opt.step()
        if k == steps - 1:      # a repeated compiled step compiles nothing
            assert deferfuse.metrics()["graph_compiles"] == c0
        opt.zero_grad()
        ref_opt.zero_grad()
        for p, q in zip(ps, ref):
            assert_same(p, q.detach(), atol=1e-5)
            assert (p in opt.state) == (q in ref_opt.state)
            if q not in ref_opt.state:      # (no gradient yet: no state, as on CPU)
                continue
            st, want = opt.state[p], ref_opt.state[q]
            assert st["step"].dtype == want["step"].dtype
            assert st["step"].item() == want["step"].item(), f"step {k}"
            assert_same(st["exp_avg"], want["exp_avg"], atol=1e-5)
            assert_same(st["exp_avg_sq"], want["exp_avg_sq"], atol=1e-5)
    assert deferfuse.metrics()["graphs_run_eagerly"] == 0
    return [opt.state[p]["step"] for p in ps]


@pytest.mark.modes("strict", "defer")     # a graph runs at once in strict mode
def test_a_compiled_adamw_step_writes_its_cpu_step_counts_as_cpu_does():
    """Compiled from the first step, AdamW's step counts stay CPU tensors: the optimizer graph's
    host slice adds one to each and writes them back (NOTE [host slice])."""
    counts = _adamw_steps(0, False)
    assert [c.device.type for c in counts] == ["cpu", "cpu"]
    assert [c.item() for c in counts] == [4.0, 4.0]


def test_a_compiled_adamw_step_after_eager_steps_matches_cpu():
    """Eager steps first (the second parameter's state a step behind), then compiled ones."""
    assert [c.item() for c in _adamw_steps(2, True)] == [4.0, 3.0]


@pytest.mark.modes("strict", "defer")     # a graph runs at once in strict mode
def test_a_compiled_adamw_step_creating_a_late_state_matches_cpu():
    """The step that makes the second parameter's state has its CPU step count in a list with the
    first's (moved to tpu by Dynamo): the device computes the new count, read back into the CPU
    tensor (NOTE [read-back outputs] in compiled.py; it stayed 0 and the parameters left CPU's)."""
    _adamw_steps(0, True)


@pytest.mark.modes("strict", "defer")
def test_a_cpu_scalar_written_from_a_device_value_in_a_graph_matches_cpu():
    """``_foreach_add_`` over a tpu tensor and a CPU scalar tensor: the scalar's new value is a
    device output read back, in each mode, three calls (the program cached after the first)."""
    def f(ts):
        torch._foreach_add_(ts, 1)
    cf = torch.compile(f, backend="tpu")
    a, b = torch.zeros(()), torch.tensor(0.0)
    ta, tb = a.to("tpu"), b.clone()
    for _ in range(3):
        f([a, b])
        cf([ta, tb])
        assert tb.device.type == "cpu"
        assert_same(ta, a)
        assert torch.equal(tb, b), (tb, b)

def test_graph_breaks_run_eagerly_between_graphs():
    def f(x):
        y = x.sin() * 3
        if y.sum().item() > 0:          # a graph break: .item()
            y = y + 1
        return (y * y).cos()
    cf = torch.compile(f, backend="tpu")
    for n in (5, 5, 6):
        x = torch.randn(n)
        assert_same(cf(x.to("tpu")), f(x), atol=1e-5)
    assert deferfuse.metrics()["dynamo_graphs"] >= 2


def test_new_shapes_compile_new_programs_and_stay_right():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).eval()
    cm = torch.compile(copy.deepcopy(model).to("tpu"), backend="tpu")
    with torch.no_grad():
        for b in (3, 5, 7, 5, 7):
            x = torch.randn(b, 8)
            assert_same(cm(x.to("tpu")), model(x), atol=1e-5)
    m = deferfuse.metrics()
    # batch 3 (static), then Dynamo's dynamic graph: one program for 5, one for 7, reused after
    assert m["graph_compiles"] == 3 and m["graphs_run_eagerly"] == 0


def test_backward_traced_into_the_forward_graph_and_a_compiled_adamw_step_match_cpu():
    """docs/compiled.md's lowest host cost: with ``trace_autograd_ops`` Dynamo traces
    ``loss.backward()`` into the graph of a function returning ``loss.detach()`` (one graph for
    forward and backward), the AdamW step compiled on its own: two graph calls a step, losses,
    gradients, parameters and step counts CPU's, nothing compiled after warm-up."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    runs = {}
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        for dev in ("cpu", "tpu"):
            torch._dynamo.reset()
            m = copy.deepcopy(model).to(dev)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            xd, yd = x.to(dev), y.to(dev)

            def fb():
                loss = F.cross_entropy(m(xd), yd)
                loss.backward()
                return loss.detach()
            cfb = torch.compile(fb, backend="tpu") if dev == "tpu" else fb
            step = torch.compile(opt.step, backend="tpu") if dev == "tpu" else opt.step
            losses, grads = [], []
            for i in range(5):
                if i == 3:
                    m0 = deferfuse.metrics()
                opt.zero_grad(set_to_none=True)
                losses.append(cfb())
                grads.append([p.grad.clone() for p in m.parameters()])
                step()
            runs[dev] = (losses, grads, list(m.parameters()),
                         [opt.state[p]["step"] for p in m.parameters()])
    m1 = deferfuse.metrics()
    assert m1["compiled_calls"] - m0["compiled_calls"] == 4      # two steps, two graphs each
    assert m1["compiles"] == m0["compiles"] and m1["graph_compiles"] == m0["graph_compiles"]
    assert m1["graphs_run_eagerly"] == 0, m1["graph_fallback_reasons"]
    (lc, gc, pc, sc), (lt, gt, pt, st) = runs["cpu"], runs["tpu"]
    for a, b in zip(lt, lc):
        assert_same(a, b, atol=1e-5)
    for a, b in zip(gt, gc):
        assert_same(a, b, atol=1e-5)
    assert_same(pt, pc, atol=1e-5)
    # the step counts stay CPU tensors, as CPU's AdamW keeps them
    assert [(t.device.type, t.dtype, t.item()) for t in st] == \
        [(t.device.type, t.dtype, t.item()) for t in sc] == [("cpu", torch.float32, 5.0)] * 4


def test_a_transposed_output_with_a_dynamic_size_keeps_cpu_strides():
    """A transposed output whose strides depend on a dynamic size (``(1, s0)`` once Dynamo marks
    the batch dynamic) takes its strides from each call's shape: it raised a TypeError (a
    symbolic stride handed to the C++ tensor) from the second batch size on."""
    def f(a, w):
        return (w @ a.t()).t() * 2, a.sum()
    cf = torch.compile(f, backend="tpu")
    w = torch.randn(6, 4)
    for b in (3, 5, 7, 5):
        a = torch.randn(b, 4)
        got, want = cf(a.to("tpu"), w.to("tpu")), f(a, w)
        assert_same(got, want, atol=1e-5)
        assert got[0].stride() == want[0].stride() == (1, b)
        assert_same(got[0] + 1, want[0] + 1, atol=1e-5)     # an eager op over its layout
    m = deferfuse.metrics()
    # batch 3 (static), then the dynamic graph: one program for 5, one for 7, reused after
    assert m["graph_compiles"] == 3 and m["graphs_run_eagerly"] == 0


@pytest.mark.modes("strict", "defer")     # a graph runs at once in strict mode
def test_in_place_writes_into_inputs_and_their_views_match_cpu():
    """A graph writing its inputs: a whole tensor, a window of a bigger tensor (the write lands in
    the base, seen by the base and its other views), and returning a view of a written input."""
    def f(x, w, acc):
        y = torch.tanh(x @ w)
        x.mul_(0.5)
        acc.add_(y.sum(0))
        return y, x.t()
    d, w, a = torch.randn(20, 4), torch.randn(4, 3), torch.zeros(3)
    t, tw, ta = d.to("tpu"), w.to("tpu"), a.to("tpu")
    side = t[2:9:3]                     # another view of the written base
    cf = torch.compile(f, backend="tpu")
    for i in (0, 3, 6):
        got = cf(t[i:i + 5], tw, ta)
        want = f(d[i:i + 5], w, a)
        assert_same(got[0], want[0], atol=1e-5)
        assert_same(got[1], want[1], atol=1e-6)
        assert got[1].stride() == want[1].stride()
        assert_same(t, d, atol=1e-6)
        assert_same(ta, a, atol=1e-5)
        assert_same(side, d[2:9:3], atol=1e-6)


def test_an_in_place_function_returning_its_argument_matches_cpu():
    def f(x):
        x.mul_(0.999)
        x.add_(0.001)
        x.clamp_(-2.0, 2.0)
        x.sin_()
        return x
    d = torch.randn(64)
    t = d.to("tpu")
    cf = torch.compile(f, backend="tpu")
    for _ in range(2):
        got = cf(t)
        f(d)
        assert_same(got, d, atol=1e-6)
        assert_same(t, d, atol=1e-6)


def test_batch_norm_running_stats_written_by_the_graph_match_cpu():
    """BatchNorm in training mode: the graph writes its buffers (running mean and variance, the
    batch count) and the backward pass; then eval mode reads them."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    model = copy.deepcopy(ref).to("tpu")
    cm = torch.compile(model, backend="tpu")
    for _ in range(2):
        x = torch.randn(8, 4)
        out, want = cm(x.to("tpu")), ref(x)
        assert_same(out, want.detach(), atol=1e-5)
        out.pow(2).sum().backward()
        want.pow(2).sum().backward()
        for (n, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
            assert_same(b, c, atol=1e-5, msg=n)
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert_same(p.grad, q.grad, atol=1e-4, msg=n)
    model.eval()
    ref.eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert_same(cm(x.to("tpu")), ref(x), atol=1e-5)


def test_inputs_that_are_views_match_cpu():
    """Slices, transposes and selects of tpu tensors as graph inputs (read only)."""
    def f(a, b):
        return (a * 2 + b).relu().sum(0)
    d = torch.randn(6, 4)
    t = d.to("tpu")
    cf = torch.compile(f, backend="tpu")
    assert_same(cf(t[1:4], t[2:5]), f(d[1:4], d[2:5]), atol=1e-6)
    assert_same(cf(t.t()[:, :4], t[:4].t()), f(d.t()[:, :4], d[:4].t()), atol=1e-6)
    assert_same(cf(t[3], t[:, 1][:4]), f(d[3], d[:, 1][:4]), atol=1e-6)


def test_reduce_overhead_mode_on_tpu_tensors_matches_cpu():
    """``torch.compile(model, mode="reduce-overhead")`` (no backend: tpu inputs go to the tpu
    backend, NOTE [default backend]): the mode is accepted and the values are CPU's."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 7), nn.SiLU(), nn.Linear(7, 2))
    model = copy.deepcopy(ref).to("tpu")
    cm = torch.compile(model, mode="reduce-overhead")
    for _ in range(2):
        x = torch.randn(4, 5)
        out, want = cm(x.to("tpu")), ref(x)
        assert _is_plain(out)
        assert_same(out, want.detach(), atol=1e-5)
        out.sum().backward()
        want.sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.grad, q.grad, atol=1e-5)


def test_tensors_made_from_data_in_a_graph_with_backward_match_cpu():
    """``torch.tensor(data, device="tpu")`` in traced code moves its data to the device while
    Dynamo's fake mode is active (NOTE [real ops under a fake mode] in plain_torch.py): empty,
    one-element and longer constants, forward and backward."""
    def f(x, dev):
        empty = torch.tensor([], dtype=x.dtype, device=dev)
        scale = torch.tensor(2.5, device=dev)
        w = torch.tensor([1.0, -2.0, 0.5], device=dev)
        return (torch.cat([empty, x]) * scale * w).sum() + empty.numel()
    cf = torch.compile(f, backend="tpu", fullgraph=True)
    x = torch.randn(3)
    for _ in range(2):
        xt = x.clone().to("tpu").requires_grad_()
        xc = x.clone().requires_grad_()
        got, want = cf(xt, "tpu"), f(xc, "cpu")
        got.backward()
        want.backward()
        assert_same(got, want, atol=1e-6)
        assert_same(xt.grad, xc.grad, atol=1e-6)
    assert deferfuse.metrics()["dynamo_graphs"] == 1


def test_dtype_views_as_graph_inputs_match_cpu():
    """Inputs that are views of another dtype than their storage (``view_as_real`` of a complex
    product, as RoPE makes q and k; ``view_as_complex`` of a real one): the plain view has its
    own dtype (it had its base's, complex64, before), and the graph reads it as CPU does."""
    x = torch.randn(2, 4, 8, dtype=torch.complex64)
    r = torch.randn(2, 3, 4, 2)

    def f(q, c):
        return q * 2 + 1, c * c
    xt, rt = x.to("tpu"), r.to("tpu")
    q, c = torch.view_as_real(xt * 2).flatten(2).transpose(1, 2), torch.view_as_complex(rt + 1)
    qc, cc = torch.view_as_real(x * 2).flatten(2).transpose(1, 2), torch.view_as_complex(r + 1)
    for a, b in ((q, qc), (c, cc)):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
    got, want = torch.compile(f, backend="tpu")(q, c), f(qc, cc)
    for g, w in zip(got, want):
        assert_same(g, w, atol=1e-5, rtol=1e-5)


def test_flex_attention_in_a_compiled_graph_matches_cpu():
    """Flex attention's HOPs stay whole in a plain graph; they are traced again through PyTorch's
    dense implementation (NOTE [flex attention in plain graphs] in compiled.py): one graph,
    nothing run eagerly, output and gradients equal CPU eager's."""
    import warnings
    from torch.nn.attention import flex_attention as fa

    def bias(s, b, h, qi, ki):
        return s + (qi - ki).to(s.dtype) * 0.1

    def f(q, k, v):
        return fa.flex_attention(q, k, v, score_mod=bias).sum(1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    cf = torch.compile(f, backend="tpu", fullgraph=True)
    tq, tk, tv = (x.to("tpu").requires_grad_() for x in (q, k, v))
    cq, ck, cv = (x.clone().requires_grad_() for x in (q, k, v))
    got = cf(tq, tk, tv)

    def dense(q, k, v):     # CPU eager flex attention has no backward: its formula, written out
        pos = torch.arange(8)
        s = q @ k.transpose(-1, -2) / 2.0 + (pos[:, None] - pos[None, :]).float() * 0.1
        return (s.softmax(-1) @ v).sum(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # CPU eager flex attention warns that it is unfused
        with torch.no_grad():
            torch.testing.assert_close(dense(q, k, v), f(q, k, v), atol=1e-5, rtol=1e-5)
    want = dense(cq, ck, cv)
    assert_same(got, want.detach(), atol=1e-5)
    (got * got).sum().backward()
    (want * want).sum().backward()
    for a, b in ((tq, cq), (tk, ck), (tv, cv)):
        assert_same(a.grad, b.grad, atol=1e-5)
    m = deferfuse.metrics()
    assert m["graphs_run_eagerly"] == 0, m["graph_fallback_reasons"]


def test_a_graph_run_eagerly_takes_plain_tensors(monkeypatch):
    """A graph with an op no lowering covers runs op by op in the eager mode in force
    (compiled._Eager, on the plain tensors themselves): outputs (a view of a written input
    among them), the write and the gradient equal CPU's. The LoweringError is forced here."""
    from deferfuse import compiled
    from deferfuse.errors import LoweringError

    def no_lowering(self, *a, **k):
        raise LoweringError("every op", "forced by the test")
    monkeypatch.setattr(compiled.PlainGraph, "__init__", no_lowering)

    def f(x, w):
        x.mul_(2)
        return (x @ w).relu(), x[1:].t()
    c, w = torch.randn(3, 4), torch.randn(4, 2)
    t, tw = c.to("tpu"), w.to("tpu").requires_grad_()
    wc = w.clone().requires_grad_()
    cf = torch.compile(f, backend="tpu")
    for _ in range(2):
        got, want = cf(t, tw), f(c, wc)
        for g, v in zip(got, want):
            assert _is_plain(g)
            assert_same(g, v.detach(), atol=1e-5)
            assert g.stride() == v.stride()
        assert_same(t, c)
        got[0].sum().backward()
        want[0].sum().backward()
        assert_same(tw.grad, wc.grad, atol=1e-5)
    assert deferfuse.metrics()["graphs_run_eagerly"] >= 1


@pytest.mark.parametrize("case", ["diagonal", "unbind", "split", "transposed_output"])
def test_a_graph_writing_python_views_and_strided_outputs_matches_cpu(case):
    """Inputs the Python view path made (a chain of Python steps on the plain tensor), and a
    graph output with a transposed layout (its Storage's layout, ``_dense_stride``) fed back as
    the written input: the write lands in the base, as on CPU."""
    def f(x):
        x.add_(1)
        return x * 2
    view = {"diagonal": lambda t: t.diagonal(), "unbind": lambda t: t.unbind(0)[1],
            "split": lambda t: t.split(2, 1)[1], "transposed_output": lambda t: t}[case]
    c = torch.randn(4, 4)
    t = c.to("tpu")
    if case == "transposed_output":
        t, c = torch.compile(lambda a: a.t() * 1, backend="tpu")(t), c.t() * 1
        assert t.stride() == c.stride() == (1, 4)
    cf = torch.compile(f, backend="tpu")
    for _ in range(2):
        got, want = cf(view(t)), f(view(c))
        for g, w in ((got, want), (t, c), (view(t), view(c))):
            assert_same(g, w, atol=1e-6)
            assert g.stride() == w.stride()


_DYNAMO_FIRST = """
import torch._dynamo.utils                 # Dynamo's rule maps may be built before deferfuse
import copy, json, torch, deferfuse
import torch.nn as nn, torch.nn.functional as F
from torch._dynamo.utils import counters
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
out = {}
for dev in ("cpu", "tpu"):
    m = copy.deepcopy(model).to(dev)
    def fb(xd, yd):
        loss = F.cross_entropy(m(xd), yd)
        loss.backward()
        return loss.detach()
    f = torch.compile(fb, backend="tpu") if dev == "tpu" else fb
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        out[dev] = [f(x.to(dev), y.to(dev)).item() for _ in range(3)]
    out[dev + "_grad"] = m[0].weight.grad.cpu().flatten()[:8].tolist()
out["breaks"] = sum(counters["graph_break"].values())
print(json.dumps(out))
"""


@pytest.mark.modes("defer")
def test_backward_traced_into_the_graph_when_dynamo_was_imported_before_deferfuse():
    """A program that imports ``torch._dynamo`` before deferfuse: Dynamo's rule map named the
    original ``torch.autograd.grad``, took deferfuse's wrapper for code to skip, and broke the
    traced backward off its graph (right values, twice the graph calls). Now the map is rebuilt
    when the wrappers are installed: no graph break, values CPU's (gradients summed over three
    calls)."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TORCHTPU_MODE="defer")
    r = subprocess.run([sys.executable, "-c", _DYNAMO_FIRST], cwd=root, env=env, text=True,
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["breaks"] == 0, out
    assert out["tpu"] == pytest.approx(out["cpu"], rel=1e-5, abs=1e-6)
    assert out["tpu_grad"] == pytest.approx(out["cpu_grad"], rel=1e-5, abs=1e-6)
