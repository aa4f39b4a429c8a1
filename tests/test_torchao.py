"""torchao quantization on tpu gives CPU's quantized tensors and CPU's outputs.

Each flow runs on CPU eager and on tpu from the same float weights: ``quantize_`` on CPU then
``.to("tpu")``, and ``quantize_`` of a model already on tpu (its int8/int4/float8 data and scales
equal to CPU's, element for element); forward in strict and defer mode and under
``torch.compile(backend="tpu")``; torchao's and PT2E's quantize/dequantize ops; a few steps of
quantization-aware training; a tiny Llama's logits and greedy tokens. torchao is optional
(``make test-torchao`` installs the ``torchao`` extra and runs this file); without it the file skips.

Configs whose CPU path torchao refuses are not run: ``Float8DynamicActivationFloat8WeightConfig``
(it asserts a CUDA, ROCm or XPU device) and ``Int4WeightOnlyConfig`` (its packings need CUDA, XPU
or the mslk kernels); int4 weights on CPU are ``IntxWeightOnlyConfig(weight_dtype=torch.int4)``,
which is run.
"""
import copy
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")    # torchao's CUDA-only extensions fail to load on CPU, loudly
    torchao = pytest.importorskip("torchao", reason="torchao is optional (make test-torchao, or "
                                  "pip install -e '.[torchao]')")
    import torchao.quantization as Q  # noqa: E402
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig  # noqa: E402

import deferfuse  # noqa: E402
from util import assert_same  # noqa: E402

CONFIGS = {
    "int8_weight_only": lambda: Q.Int8WeightOnlyConfig(),
    "int8_dynamic": lambda: Q.Int8DynamicActivationInt8WeightConfig(),
    "float8_weight_only": lambda: Q.Float8WeightOnlyConfig(),
    "int4_weight_only": lambda: Q.IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                        granularity=Q.PerGroup(32)),
    "int8_dynamic_int4_weight": lambda: Q.Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=Q.PerGroup(32)),
}


def _mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 32)).to(dtype)


def _inner(w):
    """A torchao weight's tensors by name (its data, scales, zero points)."""
    names = list(w.tensor_data_names) + [n for n in getattr(w, "optional_tensor_data_names", None) or ()
                                         if getattr(w, n) is not None]
    return {n: getattr(w, n) for n in names}


def _assert_same_weights(mt, mc):
    for (name, pt), (_, pc) in zip(mt.named_parameters(), mc.named_parameters()):
        if type(pc) is torch.nn.Parameter:    # (a tpu parameter is a TpuTensor marked as one)
            assert isinstance(pt, torch.nn.Parameter), name
            assert_same(pt.detach(), pc.detach(), 0, 0, name)
            continue
        assert type(pt) is type(pc), f"{name}: {type(pt).__name__} != {type(pc).__name__}"
        assert pt.device.type == "tpu"
        got, want = _inner(pt), _inner(pc)
        assert got.keys() == want.keys(), name
        for k in want:    # exact: the same integers, the same scales
            assert_same(got[k], want[k], 0, 0, f"{name}.{k}")


@pytest.mark.parametrize("config", list(CONFIGS))
def test_quantized_model_moved_to_tpu(config, tpu_mode):
    """quantize_ on CPU, then .to("tpu"): the quantized weights keep their class and values, and
    the forward is CPU's."""
    mc = _mlp()
    Q.quantize_(mc, CONFIGS[config]())
    x = torch.randn(8, 64)
    want = mc(x)
    mt = copy.deepcopy(mc).to("tpu")
    _assert_same_weights(mt, mc)
    assert_same(mt(x.to("tpu")), want)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_quantize_on_tpu(config, tpu_mode):
    """quantize_ of a model already on tpu makes CPU's quantized weights (NOTE [broadcast
    division] in runtime/lowering/binary.py: a scale's division is CPU's), with no op on CPU."""
    mc, mt = _mlp(), _mlp().to("tpu")
    Q.quantize_(mc, CONFIGS[config]())
    deferfuse.reset_metrics()
    Q.quantize_(mt, CONFIGS[config]())
    _assert_same_weights(mt, mc)
    x = torch.randn(8, 64)
    assert_same(mt(x.to("tpu")), mc(x))
    assert deferfuse.metrics()["cpu_fallbacks"] == {}


@pytest.mark.modes("defer")
@pytest.mark.parametrize("config", ["int8_weight_only", "int8_dynamic"])
def test_bfloat16_model(config, tpu_mode):
    mc = _mlp(torch.bfloat16)
    Q.quantize_(mc, CONFIGS[config]())
    mt = _mlp(torch.bfloat16).to("tpu")
    Q.quantize_(mt, CONFIGS[config]())
    _assert_same_weights(mt, mc)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    assert_same(mt(x.to("tpu")), mc(x), 0, 0)


@pytest.mark.modes("defer")
@pytest.mark.parametrize("config", list(CONFIGS))
def test_compiled(config, tpu_mode):
    """torch.compile(backend="tpu") of a quantized model: one graph (int8 dynamic's int8 matmul is
    the out_dtype HOP, NOTE [out_dtype on tpu]), CPU's output, and a third call compiles nothing."""
    mc = _mlp()
    Q.quantize_(mc, CONFIGS[config]())
    x = torch.randn(8, 64)
    want = mc(x)
    torch._dynamo.reset()
    deferfuse.reset_metrics()
    f = torch.compile(copy.deepcopy(mc).to("tpu"), backend="tpu")
    xt = x.to("tpu")
    with torch.no_grad():
        assert_same(f(xt), want)
        f(xt).cpu()
        m = deferfuse.metrics()
        assert m["dynamo_graphs"] == 1 and m["graphs_run_eagerly"] == 0, m["graph_fallback_reasons"]
        compiles = m["compiles"] + m["graph_compiles"]
        assert_same(f(xt), want)
    m = deferfuse.metrics()
    assert m["compiles"] + m["graph_compiles"] == compiles


@pytest.mark.modes("defer")
def test_checkpoint(tpu_mode, tmp_path):
    """A quantized tpu model's state_dict saves, and loads (weights_only, the default) on tpu and
    with map_location="cpu", its int8 data and scales CPU's."""
    mc, mt = _mlp(), _mlp().to("tpu")
    Q.quantize_(mc, CONFIGS["int8_weight_only"]())
    Q.quantize_(mt, CONFIGS["int8_weight_only"]())
    torch.save(mt.state_dict(), tmp_path / "q.pt")
    on_cpu = torch.load(tmp_path / "q.pt", map_location="cpu")
    for k, v in mc.state_dict().items():
        assert type(on_cpu[k]) is type(v) and on_cpu[k].device.type == "cpu", k
        saved, ref = (_inner(on_cpu[k]), _inner(v)) if k.endswith("weight") else ({k: on_cpu[k]}, {k: v})
        for n in ref:
            assert torch.equal(saved[n], ref[n]), (k, n)
    back = _mlp().to("tpu")
    Q.quantize_(back, CONFIGS["int8_weight_only"]())
    back.load_state_dict(torch.load(tmp_path / "q.pt"))
    _assert_same_weights(back, mc)


def test_int8_matmul_is_exact(tpu_mode):
    """int8 @ int8 -> int32 (torchao's safe_int_mm) is exact past float32's 2**24: the out_dtype
    HOP runs on tpu (NOTE [out_dtype on tpu]) instead of torchao's float32 fallback."""
    from torchao.kernel.intmm import safe_int_mm
    torch.manual_seed(0)
    a = torch.randint(-128, 128, (8, 4096), dtype=torch.int8)
    b = torch.randint(-128, 128, (4096, 16), dtype=torch.int8)
    a[0], b[:, 0] = 127, 127     # 4096 * 127 * 127 = 66,064,384 > 2**24: float32 would round it
    assert_same(safe_int_mm(a.to("tpu"), b.to("tpu")), safe_int_mm(a, b), 0, 0)


def _quant_ops(x):
    T, qd = torch.ops.torchao, torch.ops.quantized_decomposed
    s, z = T.choose_qparams_affine(x, "ASYMMETRIC", [1, 16], torch.uint8, 0, 255, None,
                                   torch.float32, torch.int32)
    q = T.quantize_affine(x, [1, 16], s, z, torch.uint8, 0, 255)
    fs = T.choose_scale_float8(x, [1, 32], torch.float8_e4m3fn, torch.float32)
    fq = T.quantize_affine_float8_non_decomposed(x, fs, torch.float8_e4m3fn)
    ps, pz = qd.choose_qparams.tensor(x, -128, 127, 1e-5, torch.int8)
    pq = qd.quantize_per_tensor.tensor(x, ps, pz, -128, 127, torch.int8)
    ts, tz = qd.choose_qparams_per_token_asymmetric(x, torch.int8)
    tq = qd.quantize_per_token(x, ts, tz, -128, 127, torch.int8)
    return (s, z, q, T.dequantize_affine(q, [1, 16], s, z, torch.uint8, 0, 255, torch.float32),
            fs, fq, T.dequantize_affine_float8_non_decomposed(fq, fs, torch.float32),
            ps, pz, pq, qd.dequantize_per_tensor.tensor(pq, ps, pz, -128, 127, torch.int8),
            ts, tz, tq)


def test_quantize_ops(tpu_mode):
    """torchao's ops (torch.ops.torchao.*) and PT2E's (quantized_decomposed.*): CPU's values and
    dtypes, no op on CPU."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    want = _quant_ops(x)
    deferfuse.reset_metrics()
    assert_same(_quant_ops(x.to("tpu")), want, 0, 0)
    assert deferfuse.metrics()["cpu_fallbacks"] == {}


def _traceable_quant_ops(x, s, z):
    T, qd = torch.ops.torchao, torch.ops.quantized_decomposed
    fs = T.choose_scale_float8(x, [1, 32], torch.float8_e4m3fn, torch.float32)
    fq = T.quantize_affine_float8_non_decomposed(x, fs, torch.float8_e4m3fn)
    ts, tz = qd.choose_qparams_per_token_asymmetric(x, torch.int8)
    tq = qd.quantize_per_token(x, ts, tz, -128, 127, torch.int8)
    cq = qd.quantize_per_channel(x, s, z, 0, -128, 127, torch.int8)
    return (fq, T.dequantize_affine_float8_non_decomposed(fq, fs, torch.float32), tq,
            qd.dequantize_per_token(tq, ts, tz, -128, 127, torch.int8, torch.float32), cq,
            qd.dequantize_per_channel(cq, s, z, 0, -128, 127, torch.int8))


@pytest.mark.modes("defer")
def test_quantize_ops_compiled(tpu_mode):
    """Under torch.compile the library ops' bodies are traced into the graph (NOTE [quantization
    ops in graphs] in deferfuse/compiled.py): one program, no eager graph. A graph with an op whose
    body reads a value (quantize_per_tensor.tensor calls scale.item()) runs eagerly, CPU's values."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401
    torch.manual_seed(0)
    x, s, z = torch.randn(8, 32), torch.rand(8) / 20 + 0.01, torch.randint(-3, 3, (8,))
    want = _traceable_quant_ops(x, s, z)
    torch._dynamo.reset()
    deferfuse.reset_metrics()
    got = torch.compile(_traceable_quant_ops, backend="tpu")(x.to("tpu"), s.to("tpu"), z.to("tpu"))
    assert_same(got, want, 0, 0)
    m = deferfuse.metrics()
    assert (m["dynamo_graphs"], m["compiled_graphs"], m["graphs_run_eagerly"]) == (1, 1, 0), m
    torch._dynamo.reset()
    deferfuse.reset_metrics()
    assert_same(torch.compile(_quant_ops, backend="tpu")(x.to("tpu")), _quant_ops(x), 0, 0)
    m = deferfuse.metrics()
    assert (m["dynamo_graphs"], m["graphs_run_eagerly"]) == (1, 1), m


def _qat_losses(model, dev, steps=4):
    Q.quantize_(model, QATConfig(
        activation_config=IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False),
        weight_config=IntxFakeQuantizeConfig(torch.int4, group_size=32, is_symmetric=True),
        step="prepare"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 32, generator=g)
        loss = torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.modes("defer")
def test_quantization_aware_training(tpu_mode):
    """QAT (int8 per-token activations, int4 grouped weights, fake-quantized) trains 4 SGD steps
    on tpu with CPU's losses and weights; convert then gives plain Linear layers on both."""
    mc, mt = _mlp(), _mlp().to("tpu")
    want = _qat_losses(mc, "cpu")
    got = _qat_losses(mt, "tpu")
    assert_same(got, want, atol=1e-5, rtol=1e-5)
    for pt, pc in zip(mt.parameters(), mc.parameters()):
        assert_same(pt.detach(), pc.detach(), atol=1e-6, rtol=1e-5)
    Q.quantize_(mc, QATConfig(step="convert"))
    Q.quantize_(mt, QATConfig(step="convert"))
    assert [type(m) for m in mt] == [type(m) for m in mc]


def _tiny_llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval().to(dtype)


@pytest.mark.modes("defer")
@pytest.mark.slow_params("compiled", "int8_dynamic")
@pytest.mark.parametrize("config", ["int8_weight_only", "int8_dynamic"])
@pytest.mark.parametrize("how", ["eager", "compiled"])
def test_tiny_llama(config, how, tpu_mode):
    """A tiny Llama quantized on tpu: logits (and, eager, greedy tokens) equal to the model quantized
    on CPU. Int8 dynamic quantizes each activation row, so a one-ulp difference before a linear
    layer (attention, RMSNorm) can move one activation to the next int8 step, which moves that
    layer's outputs by a step of the scales (~1e-4 here) and then the logits by a few 1e-3:
    its logits are compared within 1e-2, as against another CPU that rounded an ulp differently."""
    pytest.importorskip("transformers")
    mc, mt = _tiny_llama(), _tiny_llama().to("tpu")
    Q.quantize_(mc, CONFIGS[config]())
    Q.quantize_(mt, CONFIGS[config]())
    _assert_same_weights(mt, mc)
    ids = torch.randint(2, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    f = torch.compile(mt, backend="tpu") if how == "compiled" else mt
    tol = dict(atol=1e-5, rtol=1e-5) if config == "int8_weight_only" else dict(atol=1e-2, rtol=0)
    with torch.no_grad():
        assert_same(f(ids.to("tpu")).logits, mc(ids).logits, **tol)
        if how == "eager":
            want = mc.generate(ids[:1], max_new_tokens=5, do_sample=False)
            got = mt.generate(ids[:1].to("tpu"), max_new_tokens=5, do_sample=False)
            assert torch.equal(got.cpu(), want)
