"""nn ops (runtime/lowering/nn.py, norms.py, embedding.py, sampling.py, rnn.py): forward and
gradients against CPU eager, and no CPU fallbacks."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import deferfuse
from util import assert_same

TOL = dict(atol=1e-4, rtol=1e-4)


def _tpu(x):
    if isinstance(x, torch.Tensor):
        y = x.detach().to("tpu")
        return y.requires_grad_() if x.requires_grad else y
    return x


class Const:
    """An input of ``check`` that gets no gradient."""
    def __init__(self, x):
        self.x = x


def check(fn, *inputs, tol=TOL, module=None):
    """Run ``fn(module, *inputs)`` on CPU and on tpu; compare outputs, input grads, param grads.
    Floating inputs get gradients unless wrapped in ``Const``."""
    cpu_in = [x.x if isinstance(x, Const) else
              x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point()
              else x for x in inputs]
    tpu_in = [_tpu(x) for x in cpu_in]
    cpu_m = module
    tpu_m = copy.deepcopy(module).to("tpu") if module is not None else None
    deferfuse.reset_metrics()
    want = fn(cpu_m, *cpu_in)
    got = fn(tpu_m, *tpu_in)
    assert_same(got, want, **tol, msg="output")
    wants = want if isinstance(want, (tuple, list)) else [want]
    gots = got if isinstance(got, (tuple, list)) else [got]
    cots = [torch.randn(w.shape) for w in wants]
    sum((w * c).sum() for w, c in zip(wants, cots)).backward()
    sum((g * c.to("tpu")).sum() for g, c in zip(gots, cots)).backward()
    for i, (c, t) in enumerate(zip(cpu_in, tpu_in)):
        if isinstance(c, torch.Tensor) and c.requires_grad:
            assert_same(t.grad, c.grad, **tol, msg=f"grad of input {i}")
    if module is not None:
        for (n, pc), pt in zip(cpu_m.named_parameters(), tpu_m.parameters()):
            assert_same(pt.grad, pc.grad, **tol, msg=f"grad of {n}")
        for (n, bc), bt in zip(cpu_m.named_buffers(), tpu_m.buffers()):
            assert_same(bt, bc, **tol, msg=f"buffer {n}")
    assert deferfuse.metrics()["cpu_fallbacks"] == {}, deferfuse.metrics()["cpu_fallbacks"]
    return got


def run_module(m, *xs):
    return m(*xs)


# ------------------------------------------------------------------------------------ conv

@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_conv2d_groups_stride_padding():
    m = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)
    check(run_module, torch.randn(2, 4, 7, 7), module=m)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_conv_transpose2d():
    m = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
    check(run_module, torch.randn(2, 4, 5, 5), module=m)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_conv1d():
    m = nn.Conv1d(3, 5, 3, padding=2, dilation=2, bias=False)
    check(run_module, torch.randn(2, 3, 10), module=m)


# ------------------------------------------------------------------------------------ norms

def test_layer_norm():
    check(run_module, torch.randn(3, 4, 6), module=nn.LayerNorm((4, 6)))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_group_norm():
    m = nn.GroupNorm(2, 6)
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    check(run_module, torch.randn(2, 6, 3, 3), module=m)


def test_norms_of_constant_rows():
    """A row (layer norm) or group (group norm) whose values are all equal: its mean is that value
    exactly on CPU (Welford's algorithm), so a small eps (rstd = 1/sqrt(eps) = 1000) does not turn
    an ulp of ``sum / n`` into the output; the group norm's output is CPU's
    ``scale * x + (bias - scale * mean)`` bit for bit (wavtokenizer's decoder on a constant code)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 6, 1, generator=g) * 0.0662).expand(2, 6, 3).contiguous()
    w, b = torch.randn(6, generator=g), torch.randn(6, generator=g)
    want = torch.ops.aten.native_group_norm(x, w, b, 2, 6, 3, 6, 1e-6)
    got = torch.ops.aten.native_group_norm(*[t.to("tpu") for t in (x, w, b)], 2, 6, 3, 6, 1e-6)
    for gt, wt in zip(got, want):
        assert_same(gt, wt, atol=0, rtol=0)
    m = nn.GroupNorm(6, 6, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(w)
        m.bias.copy_(b)
    check(run_module, x, module=m)
    rows = (torch.randn(4, 1, generator=g) * 3).expand(4, 7).contiguous()
    w7, b7 = torch.randn(7, generator=g), torch.randn(7, generator=g)
    want = F.layer_norm(rows, (7,), w7, b7, 1e-6)
    assert_same(F.layer_norm(rows.to("tpu"), (7,), w7.to("tpu"), b7.to("tpu"), 1e-6), want, atol=0, rtol=0)


def test_group_norm_empty_batch():
    """A batch of zero samples: empty output and gradients, and the weight's and bias's zeros."""
    m = nn.GroupNorm(1, 2)
    check(run_module, torch.randn(0, 2), module=m)


def test_batch_norm_train_updates_running_stats():
    m = nn.BatchNorm2d(3, momentum=0.2)
    with torch.no_grad():
        m.running_mean.fill_(0.5)
        m.running_var.fill_(2.0)
    mt = copy.deepcopy(m).to("tpu")
    for _ in range(2):
        x = torch.randn(4, 3, 5, 5) * 3 + 1
        xc, xt = x.clone().requires_grad_(), x.to("tpu").requires_grad_()
        yc, yt = m(xc), mt(xt)
        assert_same(yt, yc, **TOL)
        cot = torch.randn(yc.shape)
        (yc * cot).sum().backward()
        (yt * cot.to("tpu")).sum().backward()
        assert_same(xt.grad, xc.grad, **TOL)
    assert_same(mt.weight.grad, m.weight.grad, **TOL)
    assert_same(mt.bias.grad, m.bias.grad, **TOL)
    assert_same(mt.running_mean, m.running_mean, **TOL)
    assert_same(mt.running_var, m.running_var, **TOL)     # unbiased variance, as on CPU
    assert_same(mt.num_batches_tracked, m.num_batches_tracked)


def test_batch_norm_eval():
    m = nn.BatchNorm2d(3)
    with torch.no_grad():
        m.running_mean.copy_(torch.randn(3))
        m.running_var.copy_(torch.rand(3) + 0.5)
        m.weight.normal_()
    m.eval()
    check(run_module, torch.randn(2, 3, 4, 4), module=m)


# ------------------------------------------------------------------------------------ embedding

def test_embedding_padding_idx():
    m = nn.Embedding(10, 4, padding_idx=2)
    idx = torch.tensor([[0, 2, 5], [5, 9, 2]])
    out = check(lambda mod, i: mod(i), idx, module=m)
    assert out.shape == (2, 3, 4)
    check(lambda mod, i: mod(i), idx, module=nn.Embedding(10, 3, scale_grad_by_freq=True))


# ------------------------------------------------------------------------------------ losses

@pytest.mark.parametrize("kw", [dict(ignore_index=1), dict(label_smoothing=0.2, reduction="sum")])
def test_cross_entropy(kw):
    x = torch.randn(6, 5)
    t = torch.tensor([0, 1, 4, 1, 3, 2])
    w = torch.rand(5) + 0.5
    check(lambda _, a, b, c: F.cross_entropy(a, b, weight=c, **kw), x, t, Const(w))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_cross_entropy_2d_and_probs():
    x = torch.randn(2, 4, 3, 3)
    t = torch.randint(0, 4, (2, 3, 3))
    t[0, 0, 0] = -100
    check(lambda _, a, b: F.cross_entropy(a, b, reduction="none"), x, t)
    check(lambda _, a, b: F.cross_entropy(a, b.softmax(1), label_smoothing=0.1), x,
          torch.randn(2, 4, 3, 3))


def test_regression_losses():
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    check(lambda _, a, b: (F.mse_loss(a, b), F.mse_loss(a, b, reduction="none"),
                           F.smooth_l1_loss(a, b, reduction="sum", beta=0.5),
                           F.huber_loss(a, b, delta=0.7)), x, y)


def test_binary_cross_entropy():
    x, y, w = torch.rand(4, 3) * 0.9 + 0.05, torch.rand(4, 3), torch.rand(4, 3)
    check(lambda _, a, b, c: F.binary_cross_entropy(a, b, weight=c), x, Const(y), Const(w))
    check(lambda _, a, b, c: F.binary_cross_entropy_with_logits(a, b, pos_weight=c[0]),
          torch.randn(4, 3), y, Const(w))


# ------------------------------------------------------------------------------------ pooling

@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_pooling():
    x = torch.randn(2, 3, 7, 7)
    check(lambda _, a: (F.max_pool2d(a, 3, stride=2, padding=1),
                        F.max_pool2d(a, 2, ceil_mode=True),
                        F.avg_pool2d(a, 3, stride=2, padding=1),
                        F.avg_pool2d(a, 3, stride=2, padding=1, count_include_pad=False,
                                     ceil_mode=True),
                        F.adaptive_avg_pool2d(a, (3, 2))), x)


def test_max_pool_indices():
    x = torch.randn(2, 2, 6, 6)
    want = F.max_pool2d(x, 3, stride=2, padding=1, dilation=1, return_indices=True)
    got = F.max_pool2d(x.to("tpu"), 3, stride=2, padding=1, dilation=1, return_indices=True)
    assert_same(got, want)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("hw,kw", [
    ((32, 40), dict(size=(8, 10))),                 # shrink: each output averages a wide window
    ((32, 40), dict(size=(13, 7))),                 # uneven factors per axis
    ((10, 12), dict(size=(25, 30))),                # grow
    ((17, 23), dict(scale_factor=(0.5, 1.7))),      # scale factors, one shrinking, one growing
    ((32, 40), dict(size=(8, 10), align_corners=True)),
    ((64, 64), dict(size=(5, 3))),
])
@pytest.mark.slow_params("strict", "hw3", "hw4", "hw5")   # long: defer, three shapes by default
def test_interpolate_antialias(mode, hw, kw):
    """interpolate(..., antialias=True) (torchvision's Resize on tensors): lowered, forward and
    gradient as CPU's, in float32 and float64."""
    for dt in (torch.float32, torch.float64):
        x = torch.randn(2, 3, *hw, dtype=dt)
        check(lambda _, a: F.interpolate(a, mode=mode, antialias=True, **kw), x,
              tol=dict(atol=2e-5, rtol=1e-5))


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_interpolate_antialias_half_as_cuda(mode):
    """CPU refuses an antialiased interpolate in bfloat16 and float16 ("compute_index_ranges_weights"
    not implemented); CUDA (and tpu) compute it, and models call it in half precision off CPU
    (transformers' cosmos3_edge upcasts on CPU only). Forward and gradient: CPU's float32 result
    rounded to the dtype."""
    for dt in (torch.bfloat16, torch.float16):
        x = torch.randn(2, 3, 7, 6).to(dt)
        g = torch.randn(2, 3, 4, 5).to(dt)
        xc = x.float().requires_grad_()
        want = F.interpolate(xc, size=(4, 5), mode=mode, antialias=True)
        want.backward(g.float())
        xt = x.to("tpu").requires_grad_()
        got = F.interpolate(xt, size=(4, 5), mode=mode, antialias=True)
        got.backward(g.to("tpu"))
        torch.testing.assert_close(got.cpu(), want.detach().to(dt))
        torch.testing.assert_close(xt.grad.cpu(), xc.grad.to(dt))
        with pytest.raises(NotImplementedError, match="not implemented for"):
            F.interpolate(x, size=(4, 5), mode=mode, antialias=True)    # CPU still refuses it


# ------------------------------------------------------------------------------------ attention, softmax

@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_sdpa_causal_and_float_mask():
    q, k, v = torch.randn(2, 2, 5, 4), torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    mask = torch.randn(5, 6)
    check(lambda _, a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, k[..., :5, :],
          v[..., :5, :])
    check(lambda _, a, b, c, m: F.scaled_dot_product_attention(a, b, c, attn_mask=m, scale=0.3),
          q, k, v, mask)



def _grad_fn(t):
    return type(t.grad_fn).__name__


@pytest.mark.parametrize("case", ["causal", "bool_mask_2d", "float_mask_4d", "gqa", "plain",
                                  "causal_and_mask", "row_all_masked"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_sdpa_takes_cpus_flash_op(case):
    """Where CPU eager runs its flash kernel, tpu runs the same single op (one grad_fn, one backward
    op), not the 20-odd ops of the math path; values and gradients match CPU."""
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    kw, extra = {}, ()
    if case == "causal":
        k, v, kw = k[..., :5, :], v[..., :5, :], dict(is_causal=True)
    elif case == "bool_mask_2d":
        extra = (Const(torch.rand(5, 6) > 0.3),)
    elif case == "float_mask_4d":
        extra = (Const(torch.randn(2, 1, 5, 6)),)
    elif case == "gqa":
        k, v, kw = k[:, :2], v[:, :2], dict(enable_gqa=True, scale=0.25)
    elif case == "causal_and_mask":     # CPU's flash kernel applies both
        extra, kw = (Const(torch.rand(5, 6) > 0.3),), dict(is_causal=True)
    elif case == "row_all_masked":      # a row that attends to nothing is zeros, not NaN
        m = torch.rand(2, 4, 5, 6) > 0.3
        m[:, :, 1] = False
        extra = (Const(m),)
    want_fn = F.scaled_dot_product_attention(q.detach().requires_grad_(), k, v,
                                             *[e.x for e in extra], **kw)
    got = check(lambda _, a, b, c, *m: F.scaled_dot_product_attention(a, b, c, *m, **kw),
                q, k, v, *extra)
    assert _grad_fn(got) == _grad_fn(want_fn) == "ScaledDotProductFlashAttentionForCpuBackward0"
    deferfuse.sync()
    n = deferfuse.metrics()["ops_recorded"]
    assert n < 20, f"{n} ops recorded for one attention forward and backward"


@pytest.mark.parametrize("case", ["3d", "dropout", "mask_needs_grad", "flash_disabled"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_sdpa_math_path_where_cpu_takes_it(case):
    """Inputs CPU's flash kernel does not take go through PyTorch's math path, as on CPU."""
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    if case == "3d":
        check(lambda _, a, b, c: F.scaled_dot_product_attention(a, b, c), q[0], k[0], v[0])
    elif case == "mask_needs_grad":
        got = check(lambda _, a, b, c, m: F.scaled_dot_product_attention(a, b, c, attn_mask=m),
                    q, k, v, torch.randn(5, 6))
        assert _grad_fn(got) != "ScaledDotProductFlashAttentionForCpuBackward0"
    elif case == "flash_disabled":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH):
            got = check(lambda _, a, b, c: F.scaled_dot_product_attention(a, b, c), q, k, v)
        assert _grad_fn(got) != "ScaledDotProductFlashAttentionForCpuBackward0"
    else:
        out = F.scaled_dot_product_attention(q.to("tpu"), k.to("tpu"), v.to("tpu"), dropout_p=0.5)
        assert out.shape == (2, 4, 5, 8) and out.dtype == torch.float32
        assert torch.isfinite(out.cpu()).all()


def test_sdpa_errors_as_cpu():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    bad = [dict(attn_mask=torch.randn(5, 5, requires_grad=True), is_causal=True),
           dict(kv=(k.double(), v)), dict(kv=(k[:, :3], v[:, :3])),
           dict(kv=(k[:, :2], v[:, :2]))]
    for kw in bad:
        kk, vv = kw.pop("kv", (k, v))
        with pytest.raises(RuntimeError) as want:
            F.scaled_dot_product_attention(q, kk, vv, **kw)
        tkw = {n: _tpu(x) for n, x in kw.items()}
        with pytest.raises(RuntimeError) as got:
            F.scaled_dot_product_attention(q.to("tpu"), kk.to("tpu"), vv.to("tpu"), **tkw)
            deferfuse.sync()
        assert str(want.value).split("\n")[0] in str(got.value), (str(want.value), str(got.value))


@pytest.mark.parametrize("shape", [(5,), (4, 5), (2, 3, 5), (2, 2, 3, 5)])
@pytest.mark.parametrize("grads", ["all", "frozen_weight", "bias_only", "no_bias", "weight_only"])
def test_linear_is_one_op_each_way(shape, grads):
    """F.linear (every nn.Linear) records one op forward and one backward (deferfuse/linear.py),
    for every rank and every set of inputs that need gradients; values and gradients match CPU."""
    x, w, b = torch.randn(*shape), torch.randn(6, 5), torch.randn(6)
    need = {"all": "xwb", "frozen_weight": "xb", "bias_only": "b", "no_bias": "xw",
            "weight_only": "w"}[grads]
    args = [x if "x" in need else Const(x), w if "w" in need else Const(w)]
    if grads != "no_bias":
        args.append(b if "b" in need else Const(b))
    got = check(lambda _, *a: F.linear(*a), *args)
    assert _grad_fn(got) == "LinearBackward"
    tpu = [a.x.to("tpu") if isinstance(a, Const) else a.to("tpu").requires_grad_() for a in args]
    y = F.linear(*tpu)
    grad = torch.randn(y.shape).to("tpu")
    deferfuse.sync()
    deferfuse.reset_metrics()
    y.backward(grad)
    deferfuse.sync()
    m = deferfuse.metrics()
    assert m["ops_recorded"] + m["ops_eager"] == 1     # linear_backward (linear ran before)


def test_linear_without_grad_is_one_op():
    x, w, b = torch.randn(2, 3, 5), torch.randn(6, 5), torch.randn(6)
    xt, wt, bt = x.to("tpu"), w.to("tpu").requires_grad_(), b.to("tpu")
    deferfuse.sync()
    with torch.no_grad():
        deferfuse.reset_metrics()
        got = F.linear(xt, wt, bt)
        deferfuse.sync()
        m = deferfuse.metrics()
        assert m["ops_recorded"] + m["ops_eager"] == 1
    assert got.grad_fn is None and not got.requires_grad
    assert_same(got, F.linear(x, w, b), **TOL)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_linear_double_backward():
    """create_graph=True through a linear layer (a gradient penalty) differentiates twice."""
    def penalty(x, w, b):
        y = torch.tanh(F.linear(x, w, b)).sum()
        gx, = torch.autograd.grad(y, x, create_graph=True)
        return (gx ** 2).sum()
    check(lambda _, *a: penalty(*a), torch.randn(4, 5), torch.randn(6, 5), torch.randn(6))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_linear_half_precision():
    x, w, b = torch.randn(2, 3, 16), torch.randn(8, 16), torch.randn(8)
    for dt in (torch.bfloat16, torch.float16):
        check(lambda _, *a: F.linear(*a), x.to(dt), w.to(dt), b.to(dt), tol=dict(atol=2e-2, rtol=2e-2))


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_linear_other_inputs_take_cpus_composite():
    """Integer operands, a 2-D bias and a 1-D weight are left to PyTorch's composite, as on CPU."""
    xi, wi = torch.randint(-3, 3, (4, 5)), torch.randint(-3, 3, (6, 5))
    assert_same(F.linear(xi.to("tpu"), wi.to("tpu")), F.linear(xi, wi))
    x, w, b2 = torch.randn(4, 5), torch.randn(6, 5), torch.randn(4, 6)
    got = check(lambda _, *a: F.linear(*a), x, w, b2)
    assert _grad_fn(got) != "LinearBackward"
    check(lambda _, *a: F.linear(*a), x, torch.randn(5))


def test_linear_errors_as_cpu():
    """Mismatched shapes and dtypes raise CPU's error, in every mode (never a promoted result)."""
    x = torch.randn(4, 5)
    bad = [(x, torch.randn(6, 4)), (x, torch.randn(6, 5).double()), (x, torch.randn(6, 5), torch.randn(5)),
           (x, torch.randn(6, 5), torch.randn(6).double()), (torch.randn(2, 3, 5), torch.randn(6, 4))]
    for args in bad:
        with pytest.raises(RuntimeError) as want:
            F.linear(*args)
        with pytest.raises(RuntimeError) as got:
            F.linear(*[a.to("tpu") for a in args])
            deferfuse.sync()
        assert str(got.value) == str(want.value)


def test_linear_input_modified_in_place_after_use():
    """Writing in place to an input the backward needs raises CPU's error at backward."""
    def run(dev):
        x = torch.randn(4, 5).to(dev)
        w = torch.randn(6, 5).to(dev).requires_grad_()
        y = F.linear(x, w)
        x.add_(1)
        with pytest.raises(RuntimeError) as e:
            y.sum().backward()
        return str(e.value).split(";")[0]
    assert run("tpu").split(":")[0] == run("cpu").split(":")[0]



@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("masks", ["none", "padding", "causal", "both", "row_all_masked"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_transformer_encoder_inference_fast_path(norm_first, masks):
    """nn.TransformerEncoderLayer in eval mode under no_grad takes PyTorch's fused kernel
    (_transformer_encoder_layer_fwd, with _native_multi_head_attention inside): it runs on JAX
    like CPU's kernel, NaN rows included (a sequence whose keys are all padding)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, norm_first=norm_first,
                                       activation="gelu" if norm_first else "relu")
    m = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 10, 32)
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[0, 6:] = True
    if masks == "row_all_masked":
        pad[1] = True
    kw = {"none": {}, "padding": dict(src_key_padding_mask=pad),
          "causal": dict(mask=nn.Transformer.generate_square_subsequent_mask(10)),
          "both": dict(mask=nn.Transformer.generate_square_subsequent_mask(10),
                       src_key_padding_mask=pad),
          "row_all_masked": dict(src_key_padding_mask=pad)}[masks]
    mt = copy.deepcopy(m).to("tpu")
    with torch.no_grad():
        want = m(x, **kw)
        deferfuse.reset_metrics()
        got = mt(x.to("tpu"), **{k: v.to("tpu") for k, v in kw.items()})
        assert_same(got, want, **TOL)
    assert deferfuse.metrics()["cpu_fallbacks"] == {}


@pytest.mark.parametrize("left_aligned", [True, False])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_transformer_encoder_nested_fast_path_declined(left_aligned):
    """With enable_nested_tensor=True (the default), eval, no_grad and a padding mask, CPU turns a
    left-aligned batch into a nested tensor; tpu has none, so it runs PyTorch's padded path: the
    valid positions are CPU's, and for a mask that is not left-aligned (CPU's padded path too)
    every position is."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    m = nn.TransformerEncoder(layer, 2).eval()
    x = torch.randn(2, 6, 16)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    if left_aligned:
        pad[1, 4:] = True
    else:
        pad[1, 1] = True
    mt = copy.deepcopy(m).to("tpu")
    with torch.no_grad():
        want = m(x, src_key_padding_mask=pad)
        deferfuse.reset_metrics()
        got = mt(x.to("tpu"), src_key_padding_mask=pad.to("tpu"))
        deferfuse.sync()
    assert deferfuse.metrics()["cpu_fallbacks"] == {}
    if left_aligned:
        assert_same(got[~pad.to("tpu")], want[~pad], **TOL)
        assert torch.equal(want[pad], torch.zeros_like(want[pad]))   # CPU's nested path
    else:
        assert_same(got, want, **TOL)
    m2 = copy.deepcopy(mt)
    m2.mask_check = False       # straight to torch._nested_tensor_from_mask: a clear error
    with torch.no_grad(), pytest.raises(NotImplementedError, match="enable_nested_tensor=False"):
        m2(x.to("tpu"), src_key_padding_mask=pad.to("tpu"))


@pytest.mark.parametrize("kw", [{}, dict(key_padding_mask=True), dict(need_weights=False),
                                dict(average_attn_weights=False)])
def test_multihead_attention_inference_fast_path(kw):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    if "key_padding_mask" in kw:
        pad = torch.zeros(2, 5, dtype=torch.bool)
        pad[1, 3:] = True
        kw = dict(key_padding_mask=pad)
    mt = copy.deepcopy(m).to("tpu")
    xt = x.to("tpu")
    with torch.no_grad():
        want = m(x, x, x, **kw)
        deferfuse.reset_metrics()
        got = mt(xt, xt, xt, **{k: v.to("tpu") if torch.is_tensor(v) else v for k, v in kw.items()})
        assert_same(got[0], want[0], **TOL)
        if want[1] is None:
            assert got[1] is None
        else:
            assert_same(got[1], want[1], **TOL)
    assert deferfuse.metrics()["cpu_fallbacks"] == {}

@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_softmax_dims():
    x = torch.randn(3, 4, 5)
    check(lambda _, a: (F.softmax(a, 0), F.softmax(a, -1), F.log_softmax(a, 1), F.log_softmax(a, 2)), x)


# ------------------------------------------------------------------------------------ dropout

@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_dropout_statistics():
    x = torch.rand(100, 100).to("tpu") + 1
    y = F.dropout(x, 0.3, training=True)
    assert y.device.type == "tpu" and y.dtype == x.dtype and y.shape == x.shape
    yc, xc = y.cpu(), x.cpu()
    zero = yc == 0
    assert abs(zero.float().mean().item() - 0.3) < 0.03
    torch.testing.assert_close(yc[~zero], xc[~zero] / 0.7)


def test_dropout_grad_and_seed():
    x = torch.randn(20, 30).to("tpu").requires_grad_()
    torch.manual_seed(3)
    y1 = F.dropout(x, 0.5, training=True)
    torch.manual_seed(3)
    y2 = F.dropout(x, 0.5, training=True)
    assert torch.equal(y1.cpu(), y2.cpu())
    y1.sum().backward()
    keep = (y1.cpu() != 0).float()
    torch.testing.assert_close(x.grad.cpu(), keep * 2)


def test_dropout_eval_identity():
    m = nn.Dropout(0.4).eval()
    x = torch.randn(5, 5).to("tpu")
    assert_same(m(x), x.cpu())


@pytest.mark.parametrize("case", ["embedding", "embedding_negative", "cross_entropy", "nll_loss"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_out_of_range_class_or_row_raises_index_error(case):
    fns = {
        "embedding": lambda d: F.embedding(torch.tensor([1, 7], device=d), torch.ones(5, 3, device=d)),
        "embedding_negative": lambda d: F.embedding(torch.tensor([-1], device=d),
                                                    torch.ones(5, 3, device=d)),
        "cross_entropy": lambda d: F.cross_entropy(torch.ones(2, 4, device=d),
                                                   torch.tensor([1, 9], device=d)),
        "nll_loss": lambda d: F.nll_loss(torch.ones(2, 4, device=d), torch.tensor([1, -3], device=d)),
    }
    with pytest.raises(IndexError):
        fns[case]("cpu")
    with pytest.raises(IndexError, match="out of"):
        fns[case]("tpu").sum().item()     # defer: raised at the sync
    # ignore_index entries are never checked
    got = F.cross_entropy(torch.ones(2, 4, device="tpu"), torch.tensor([1, -100], device="tpu"))
    assert_same(got, F.cross_entropy(torch.ones(2, 4), torch.tensor([1, -100])))


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(16,), (5, 16), (3, 5, 16), (2, 3, 5, 16)])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_linear_half_precision_rounds_as_cpu(dt, shape, contiguous):
    """Half precision with a bias is rounded once (addmm) for a 2-D or contiguous input and twice
    (product, then bias) otherwise, as CPU's composite does: results equal CPU's bit for bit.
    Integer inputs make every float32 sum exact, so only the rounding can differ; their range
    makes the sums too large for the half type's mantissa."""
    g = torch.Generator().manual_seed(7)
    r = 21 if dt == torch.bfloat16 else 51
    if contiguous:
        make = lambda t: t
        full = torch.randint(1 - r, r, shape, generator=g).to(dt)
    elif len(shape) == 1:
        make = lambda t: t[::2]
        full = torch.randint(1 - r, r, (32,), generator=g).to(dt)
    else:
        make = lambda t: t.transpose(-1, -2)
        full = torch.randint(1 - r, r, shape[:-2] + shape[:-3:-1], generator=g).to(dt)
    x = make(full)
    w = torch.randint(1 - r, r, (8, 16), generator=g).to(dt)
    b = (torch.randint(-3, 4, (8,), generator=g) + 0.5).to(dt)
    once = (x.float() @ w.float().t() + b.float()).to(dt)
    twice = ((x.float() @ w.float().t()).to(dt).float() + b.float()).to(dt)
    assert not torch.equal(once, twice)     # these inputs tell the two roundings apart
    want = F.linear(x, w, b)
    xt = make(full.to("tpu"))
    assert xt.shape == x.shape and xt.is_contiguous() == x.is_contiguous()
    got = F.linear(xt, w.to("tpu").requires_grad_(), b.to("tpu"))
    assert torch.equal(got.cpu(), want)


# ------------------------------------------------------------------------------------ recurrent

def _flat(out):
    """An RNN's (output, state) as one list: the output, then each state tensor."""
    y, state = out
    return [y, *(state if isinstance(state, tuple) else (state,))]


@pytest.mark.parametrize("kind,kw", [
    ("LSTM", dict(num_layers=2, batch_first=True)),
    ("LSTM", dict(bidirectional=True, bias=False)),
    ("LSTM", dict(proj_size=3)),
    ("GRU", dict(num_layers=2, bidirectional=True)),
    ("GRU", dict(bias=False, batch_first=True)),
])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_recurrent_layers(kind, kw):
    # On an accelerator PyTorch's LSTM and GRU run a fused cell per step (CPU runs unfused ops):
    # the lowerings in runtime/lowering/rnn.py, against CPU's arithmetic, gradients included.
    m = getattr(nn, kind)(5, 6, **kw)
    layers = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
    x = torch.randn(3, 4, 5)
    h0 = torch.randn(layers, 4 if not kw.get("batch_first") else 3, kw.get("proj_size") or 6)
    if kind == "LSTM":
        c0 = torch.randn(layers, h0.shape[1], 6)
        check(lambda m, x, h, c: _flat(m(x, (h, c))), x, h0, c0, module=m)
    else:
        check(lambda m, x, h: _flat(m(x, h)), x, h0, module=m)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("use", ["both", "h", "c"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_lstm_cell(bias, use):
    # "h" / "c": the backward gets no gradient for the other state (an absent grad_cy / grad_hy).
    m = nn.LSTMCell(5, 6, bias=bias)
    pick = {"both": lambda o: list(o), "h": lambda o: o[0], "c": lambda o: o[1]}[use]
    check(lambda m, x, h, c: pick(m(x, (h, c))), torch.randn(4, 5), torch.randn(4, 6),
          torch.randn(4, 6), module=m)


@pytest.mark.parametrize("bias", [True, False])
def test_gru_cell(bias):
    check(lambda m, x, h: m(x, h), torch.randn(4, 5), torch.randn(4, 6),
          module=nn.GRUCell(5, 6, bias=bias))


@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_recurrent_cell_double_backward(kind):
    # create_graph=True: PyTorch's differentiable cell backward (ordinary ops) instead of the fused one.
    m = getattr(nn, kind)(3, 4)
    x = torch.randn(2, 3)

    def grad_norm(m, x):
        y = m(x)
        y = y[0] if isinstance(y, tuple) else y
        (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        return g.pow(2).sum()
    check(grad_norm, x, module=m)


def test_recurrent_cell_bad_shapes_raise():
    gates, h = torch.randn(4, 24).to("tpu"), torch.randn(4, 5).to("tpu")
    with pytest.raises(RuntimeError, match=r"\[B, 4\*H\]"):
        torch.ops.aten._thnn_fused_lstm_cell(gates, gates, h)
    with pytest.raises(RuntimeError, match=r"\[B, 3\*H\]"):
        torch.ops.aten._thnn_fused_gru_cell(gates, gates[:, :12], h)


@pytest.mark.parametrize("lengths_on", ["cpu", "tpu"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_ctc_loss_lengths_on_cpu_or_tpu(lengths_on, reduction):
    # CUDA takes the lengths as CPU tensors (speech recipes pass them so); PyTorch's composite for
    # tensor subclasses divided the tpu loss by the CPU lengths and raised a device mismatch.
    lp = torch.randn(10, 4, 6).log_softmax(-1).requires_grad_()
    tg = torch.randint(1, 6, (4, 3))
    il, tl = torch.full((4,), 10), torch.tensor([3, 2, 3, 1])
    want = F.ctc_loss(lp, tg, il, tl, reduction=reduction)
    (g_want,) = torch.autograd.grad(want.sum(), lp)
    lpt = lp.detach().to("tpu").requires_grad_()
    if lengths_on == "tpu":
        il, tl = il.to("tpu"), tl.to("tpu")
    got = F.ctc_loss(lpt, tg.to("tpu"), il, tl, reduction=reduction)
    (g_got,) = torch.autograd.grad(got.sum(), lpt)
    assert_same(got, want, atol=1e-5, rtol=1e-5)
    assert_same(g_got, g_want, atol=1e-5, rtol=1e-5)


@pytest.mark.modes("defer")
def test_ctc_loss_edges_on_tpu():
    """CTC forward and backward lowered (runtime/lowering/losses.py), no CPU fallback: repeated
    labels (a blank must separate them), an empty target, an input too short for its target (inf,
    and zero_infinity's zeros), an empty input, inputs shorter than the batch's longest; padded
    and concatenated targets."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 5, 6, generator=g)
    il, tl = [7, 5, 1, 0, 7], [3, 0, 2, 0, 4]
    tg = torch.randint(1, 6, (5, 4), generator=g)
    tg[0, :2] = 2                                           # a repeated label
    flat = torch.cat([tg[b, :n] for b, n in enumerate(tl)])
    before = dict(deferfuse.metrics()["cpu_fallbacks"])
    for targets, zero_infinity, reduction in ((tg, False, "mean"), (flat, True, "none")):
        def run(x, tg):
            x = x.requires_grad_()
            loss = F.ctc_loss(x.log_softmax(-1), tg, il, tl, reduction=reduction,
                              zero_infinity=zero_infinity)
            return loss, torch.autograd.grad(loss.sum(), x)[0]
        want, g_want = run(x.clone(), targets)
        got, g_got = run(x.to("tpu"), targets.to("tpu"))
        assert_same(got, want, atol=1e-5, rtol=1e-5)
        assert_same(g_got, g_want, atol=1e-5, rtol=1e-5)
    assert deferfuse.metrics()["cpu_fallbacks"] == before


@pytest.mark.parametrize("enforce_sorted", [True, False])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_packed_sequence_through_lstm(enforce_sorted):
    # pack_padded_sequence keeps batch_sizes on CPU (PackedSequence requires it; a CPU fallback
    # had brought it to tpu and the LSTM refused it); the packed LSTM runs on tpu.
    m = nn.LSTM(4, 5, batch_first=True)
    lens = torch.tensor([6, 4, 2]) if enforce_sorted else torch.tensor([2, 6, 4])

    def run(m, x):
        p = nn.utils.rnn.pack_padded_sequence(x, lens, batch_first=True,
                                              enforce_sorted=enforce_sorted)
        assert p.batch_sizes.device.type == "cpu"
        out, (h, c) = m(p)
        y, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return [y, h, c]
    check(run, torch.randn(3, 6, 4), module=m)


@pytest.mark.parametrize("dim", [0, 2])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_weight_norm_gradients(dim):
    # _weight_norm_interface_backward is lowered (it ran on CPU before): weight-normalized convs
    # (HiFi-GAN, wav2vec2's positional conv) train without a CPU round trip.
    m = nn.utils.parametrizations.weight_norm(nn.Conv1d(3, 4, 3), dim=dim)
    check(run_module, torch.randn(2, 3, 5), module=m)


# per_sample_weights exist for mode='sum' only, and mode='max' takes no scale_grad_by_freq
# (PyTorch raises ValueError for both, before any op runs)
_BAG_CASES = [(m, c) for m in ("sum", "mean", "max")
              for c in ("offsets", "2d", "padding", "weights", "freq", "last_offset")
              if not (c == "weights" and m != "sum") and not (c == "freq" and m == "max")]


@pytest.mark.parametrize("mode,case", _BAG_CASES)
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_embedding_bag_gradients(mode, case):
    # nn.EmbeddingBag's backward (_embedding_bag_backward, per-sample-weight gradient) on tpu, once
    # a CPU fallback that synced every training step.
    torch.manual_seed(0)
    w = torch.randn(10, 5)
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 2, 7])
    kw = dict(mode=mode)
    if case == "2d":
        idx = idx.reshape(2, 5)
    else:
        kw["offsets"] = torch.tensor([0, 3, 3, 6]) if case != "last_offset" else torch.tensor([0, 4, 7, 10])
        kw["include_last_offset"] = case == "last_offset"
    if case == "padding":
        kw["padding_idx"] = 2
    if case == "freq":
        kw["scale_grad_by_freq"] = True
    psw = torch.rand(idx.shape[0], requires_grad=True) if case == "weights" else None
    g = torch.randn(F.embedding_bag(idx, w, **kw).shape)

    def grads(dev):
        wd = w.to(dev).requires_grad_()
        args = dict(kw, **{k: v.to(dev) for k, v in kw.items() if isinstance(v, torch.Tensor)})
        p = None
        if psw is not None:
            p = psw.detach().to(dev).requires_grad_()
            args["per_sample_weights"] = p
        out = F.embedding_bag(idx.to(dev), wd, **args)
        ins = [wd] + ([p] if p is not None else [])
        return [out] + list(torch.autograd.grad(out, ins, g.to(dev)))

    want = grads("cpu")
    if case == "freq":
        # CPU's embedding_bag backward divides by the wrong index's count when counts differ
        # (pytorch/pytorch#190063, fixed upstream; CUDA was right): the reference is CPU eager
        # F.embedding, whose scale_grad_by_freq is right, summed or averaged per bag.
        wd = w.clone().requires_grad_()
        bag = torch.searchsorted(kw["offsets"], torch.arange(idx.shape[0]), right=True) - 1
        rows = F.embedding(idx, wd, scale_grad_by_freq=True)
        out = torch.zeros(4, 5).index_add(0, bag, rows)
        if mode == "mean":
            out = out / torch.bincount(bag, minlength=4).clamp(min=1)[:, None]
        want = [out, torch.autograd.grad(out, wd, g)[0]]
    deferfuse.reset_metrics()
    got = grads("tpu")
    for a, b in zip(got, want):
        assert_same(a, b, atol=1e-5, rtol=1e-5)
    assert deferfuse.metrics()["cpu_fallbacks"] == {}


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_embedding_bag_dense_backward_op(mode):
    # The op itself (PyTorch's own backward calls it from _embedding_bag_backward on CPU and CUDA).
    torch.manual_seed(0)
    w, g = torch.randn(8, 3), torch.randn(3, 3)
    idx, off = torch.tensor([1, 4, 4, 0, 6, 2, 7]), torch.tensor([0, 3, 3])
    aux = torch.ops.aten._embedding_bag(w, idx, off, False, mode, False, None, False, 4)[1:]
    args = (idx, aux[0], aux[1], aux[2], 8, False, mode, None, 4)
    want = torch.ops.aten._embedding_bag_dense_backward(g, *args)
    got = torch.ops.aten._embedding_bag_dense_backward(
        g.to("tpu"), *[a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args])
    assert_same(got, want, atol=1e-6, rtol=1e-6)


def _check_grid_sample(x, grid, mode, padding, align):
    def run(dev):
        a, g = x.to(dev).requires_grad_(), grid.to(dev).requires_grad_()
        out = F.grid_sample(a, g, mode=mode, padding_mode=padding, align_corners=align)
        go = torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape) / out.numel()
        return [out] + list(torch.autograd.grad(out, (a, g), go.to(dev)))

    want = run("cpu")
    deferfuse.reset_metrics()
    for a, b in zip(run("tpu"), want):
        assert_same(a, b, atol=1e-4, rtol=1e-4)
    assert deferfuse.metrics()["cpu_fallbacks"] == {}


# Strict mode runs the same lowerings op by op (its compiles make it the slow half): slow.
@pytest.mark.slow_params("strict", "reflection")     # reflection's two cases in make test-full
@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding,align", [("zeros", False), ("border", True), ("reflection", False),
                                           ("reflection", True)])
def test_grid_sample_gradients(mode, padding, align):
    # grid_sampler_2d_backward (the vjp of a JAX grid sampler), once a CPU fallback; the grid
    # reaches past [-1, 1] so padding matters.
    torch.manual_seed(0)
    _check_grid_sample(torch.randn(2, 3, 5, 7), torch.rand(2, 4, 6, 2) * 2.4 - 1.2, mode, padding,
                       align)


@pytest.mark.slow_params("strict")
@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("padding,align", [("zeros", False), ("border", True), ("reflection", False)])
def test_grid_sample_3d(mode, padding, align):
    # grid_sampler_3d (no PyTorch decomposition) and its backward, both once CPU fallbacks.
    torch.manual_seed(0)
    _check_grid_sample(torch.randn(2, 3, 4, 5, 6), torch.rand(2, 3, 4, 5, 3) * 2.4 - 1.2, mode,
                       padding, align)


_MARGIN_TARGETS = torch.tensor([[3, 0, -1, 1, 2], [1, 1, 4, -1, 0], [-1, 2, 3, 4, 0]])


@pytest.mark.parametrize("loss", ["multi_p1_weight", "multi_p2", "multilabel"])
@pytest.mark.parametrize("dims", [2, 1])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_margin_losses(loss, dims, reduction):
    # Lowered forward and backward. PyTorch's decomposition of multilabel_margin_loss_forward read
    # past a row's first -1 (wrong values, silently), both forward decompositions gave a 1-D input's
    # unreduced loss shape (1,) where CPU gives (), and the backward ops ran on CPU.
    torch.manual_seed(0)
    x = torch.randn(3, 5) if dims == 2 else torch.randn(5)
    if loss == "multilabel":
        t = _MARGIN_TARGETS if dims == 2 else _MARGIN_TARGETS[1]

        def f(a, dev):
            return F.multilabel_margin_loss(a, t.to(dev), reduction=reduction)
    else:
        t = torch.tensor([4, 0, 2]) if dims == 2 else torch.tensor(2)
        p, w = (1, torch.rand(5)) if loss == "multi_p1_weight" else (2, None)

        def f(a, dev):
            return F.multi_margin_loss(a, t.to(dev), p=p, margin=0.7, reduction=reduction,
                                       weight=None if w is None else w.to(dev))

    def run(dev):
        a = x.to(dev).requires_grad_()
        out = f(a, dev)
        go = torch.rand(out.shape, generator=torch.Generator().manual_seed(1))
        return [out, torch.autograd.grad(out, a, go.to(dev))[0]]

    want = run("cpu")
    deferfuse.reset_metrics()
    for a, b in zip(run("tpu"), want):
        assert_same(a, b, atol=1e-5, rtol=1e-5)
    assert deferfuse.metrics()["cpu_fallbacks"] == {}


@pytest.mark.parametrize("fn,args,msg", [
    (F.multi_margin_loss, (torch.randn(3, 5), torch.tensor([1, 7, 0])), "target out of range"),
    (F.multilabel_margin_loss,
     (torch.randn(2, 5), torch.tensor([[1, 7, -1, 0, 0], [0, -1, 0, 0, 0]])),
     "'target' is out of range"),
    (F.multi_margin_loss, (torch.randn(3, 5), torch.tensor([1, 0])), "target tensor should be 1-D"),
])
def test_margin_loss_errors(fn, args, msg):
    with pytest.raises(RuntimeError, match=msg):
        fn(*args)
    with pytest.raises(RuntimeError, match=msg):
        fn(*[a.to("tpu") for a in args]).cpu()


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_padded_to_a_fixed_id_count_compiles_once(mode):
    """docs/frameworks.md's padding rule for batches whose number of ids changes: pad the ids to a
    fixed count with any valid id, pass the bags' starts and, last, the exact count, with
    ``include_last_offset=True``. The padded ids are in no bag (not in the last one: sums, means
    and maxima are CPU's on the exact ids, and so is the gradient), and every batch after the
    first compiles nothing."""
    deferfuse.clear_caches()    # the other modes' versions of this structure would count as churn
    torch.manual_seed(0)
    w = torch.randn(20, 4)
    wt = w.to("tpu").requires_grad_()
    P = 16
    for step, n in enumerate((5, 7, 11)):
        idx = torch.randint(0, 20, (n,))
        starts = torch.tensor([0, 2, 2, n - 1])              # an empty bag among them
        g = torch.randn(4, 4)
        wd = w.clone().requires_grad_()
        want = F.embedding_bag(idx, wd, starts, mode=mode)
        (gw,) = torch.autograd.grad(want, wd, g)
        padded = torch.cat([idx, torch.zeros(P - n, dtype=idx.dtype)])
        offsets = torch.cat([starts, torch.tensor([n])])
        if step == 1:
            compiles = deferfuse.metrics()["compiles"]
        got = F.embedding_bag(padded.to("tpu"), wt, offsets.to("tpu"), mode=mode,
                              include_last_offset=True)
        (gt,) = torch.autograd.grad(got, wt, g.to("tpu"))
        assert_same(got, want, atol=1e-6, rtol=1e-6)
        assert_same(gt, gw, atol=1e-6, rtol=1e-6)
    assert deferfuse.metrics()["compiles"] == compiles, deferfuse.metrics()["miss_reasons"]
    assert deferfuse.metrics()["cpu_fallbacks"] == {}
