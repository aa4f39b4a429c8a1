"""What training frameworks call on ``tpu``: the device module's queries, flex attention (eager
and compiled, score and block masks, forward and backward), the RNG HOPs of compiled activation
checkpointing, and Ray Train's process-group backends. Each against CPU eager."""
import copy
import math

import pytest
import torch
from torch.nn.attention import flex_attention as fa

import deferfuse
from util import assert_same, cpu

pytestmark = pytest.mark.usefixtures("no_cpu_fallbacks")


# --------------------------------------------------------------------------------------------
# torch.tpu: the device-module calls TorchTitan and Ray make on torch.cuda

@pytest.mark.modes("strict")
def test_device_module_queries():
    m = torch.tpu
    n = m.device_count()
    assert n >= 1 and m.is_available() and m.current_device() == 0
    p = m.get_device_properties(0)
    assert isinstance(p.name, str) and p.name and p.total_memory > 0
    assert p.multi_processor_count >= 1
    assert m.get_device_name() == p.name and m.get_device_capability() == (p.major, p.minor)
    free, total = m.mem_get_info()
    assert 0 <= free <= total
    x = torch.ones(256, 256, device="tpu")
    m.synchronize()
    stats = m.memory_stats()
    assert stats["allocated_bytes.all.current"] >= x.numel() * 4
    assert m.memory_allocated() >= x.numel() * 4 and m.max_memory_allocated() >= m.memory_allocated()
    m.reset_peak_memory_stats()
    m.empty_cache()
    m.set_device(0)
    with m.device(0):
        assert m.current_device() == 0
    # torch.tpu.memory: what a profiler's memory snapshot calls (TorchTitan's)
    m.memory._record_memory_history(max_entries=10)
    assert m.memory._snapshot() == {"segments": [], "device_traces": [[]]}
    assert m.memory.memory_allocated() == m.memory_allocated()
    # torch.accelerator and torch.get_device_module name the same module
    assert torch.get_device_module("tpu") is m
    assert torch.accelerator.current_accelerator().type == "tpu"


# --------------------------------------------------------------------------------------------
# flex attention

L, E = 128, 16


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)


def _bias(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx).float() * 0.05 + h * 0.1


def _dense(q, k, v, score_mod=None, mask_mod=None, scale=None, gqa=False):
    """The CPU reference: flex attention written out densely (CPU's flex attention has no
    backward)."""
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    b = torch.arange(q.shape[0])[:, None, None, None]
    h = torch.arange(q.shape[1])[None, :, None, None]
    qi = torch.arange(q.shape[2])[None, None, :, None]
    ki = torch.arange(k.shape[2])[None, None, None, :]
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, qi, ki), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return s.softmax(-1) @ v, lse


def _inputs(hq=2, hkv=2):
    torch.manual_seed(0)
    return (torch.randn(2, hq, L, E), torch.randn(2, hkv, L, E), torch.randn(2, hkv, L, E))


def _compare(fn, score_mod, mask_mod, gqa=False, hq=2, hkv=2):
    """``fn(q, k, v, block_mask)`` on tpu: output and the gradients of q, k, v against
    ``_dense`` on CPU."""
    q, k, v = _inputs(hq, hkv)
    bm = fa.create_block_mask(mask_mod, None, None, L, L, device="tpu") if mask_mod else None
    tq, tk, tv = (x.to("tpu").requires_grad_() for x in (q, k, v))
    out = fn(tq, tk, tv, bm)
    g = torch.randn(out.shape)
    out.backward(g.to("tpu"))
    cq, ck, cv = (x.clone().requires_grad_() for x in (q, k, v))
    want, _ = _dense(cq, ck, cv, score_mod, mask_mod, gqa=gqa)
    want.backward(g)
    assert_same(out, want.detach(), atol=2e-5, rtol=1e-5, msg="output")
    for name, t, c in (("q", tq, cq), ("k", tk, ck), ("v", tv, cv)):
        assert_same(t.grad, c.grad, atol=3e-5, rtol=1e-5, msg=f"grad {name}")


# Strict mode runs the first case alone (the same ops one program each: slow, and no new path).
@pytest.mark.modes("defer", "strict")
@pytest.mark.slow_params("strict")
@pytest.mark.parametrize("case", ["score_mod+causal", "window", "gqa+bias"])
def test_flex_attention_eager(case, tpu_mode):
    """Eager: PyTorch's own dense flex attention on tpu tensors, forward and backward, with a
    score function, a block mask, or both, GQA too."""
    score_mod, mask_mod, gqa, hq, hkv = {
        "score_mod+causal": (_bias, _causal, False, 2, 2),
        "window": (None, _window, False, 2, 2),
        "gqa+bias": (_bias, None, True, 4, 2),
    }[case]

    def fn(q, k, v, bm):
        return fa.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa)
    _compare(fn, score_mod, mask_mod, gqa, hq, hkv)


@pytest.mark.modes("strict")
def test_flex_attention_strict():
    """Strict mode, one op at a time: a score function with a block mask."""
    def fn(q, k, v, bm):
        return fa.flex_attention(q, k, v, score_mod=_bias, block_mask=bm)
    _compare(fn, _bias, _causal)


@pytest.mark.modes("strict")
def test_flex_attention_cpu_unchanged():
    """CPU keeps PyTorch's checks: its flex attention still has no backward."""
    q = torch.randn(1, 1, L, E, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        fa.flex_attention(q, q, q)


@pytest.mark.modes("defer")
def test_flex_attention_lse():
    q, k, v = _inputs()
    bm = fa.create_block_mask(_causal, None, None, L, L, device="tpu")
    out, aux = fa.flex_attention(q.to("tpu"), k.to("tpu"), v.to("tpu"), score_mod=_bias,
                                 block_mask=bm, return_aux=fa.AuxRequest(lse=True))
    want, lse = _dense(q, k, v, _bias, _causal)
    assert_same(out, want, atol=2e-5, rtol=1e-5)
    assert_same(aux.lse, lse, atol=2e-5, rtol=1e-5)


@pytest.mark.modes("defer")
def test_flex_attention_compiled():
    """A compiled module with flex attention inside: one graph (no break), every op lowered
    (no graph run eagerly), forward and backward equal to CPU."""
    lin = torch.nn.Linear(E, E)

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = lin

        def forward(self, q, k, v, bm):
            return self.proj(fa.flex_attention(q, k, v, score_mod=_bias, block_mask=bm))

    ref_lin = copy.deepcopy(lin)
    m = Attn().to("tpu")
    compiled = torch.compile(m, backend="tpu", fullgraph=True)
    deferfuse.reset_metrics()

    def fn(q, k, v, bm):
        return compiled(q, k, v, bm)

    def ref_mod(s, b, h, qi, ki):
        return _bias(s, b, h, qi, ki)
    q, k, v = _inputs()
    bm = fa.create_block_mask(_causal, None, None, L, L, device="tpu")
    tq, tk, tv = (x.to("tpu").requires_grad_() for x in (q, k, v))
    out = fn(tq, tk, tv, bm)
    out.sum().backward()
    cq, ck, cv = (x.clone().requires_grad_() for x in (q, k, v))
    want = ref_lin(_dense(cq, ck, cv, ref_mod, _causal)[0])
    want.sum().backward()
    assert_same(out, want.detach(), atol=3e-5, rtol=1e-5)
    for t, c in ((tq, cq), (tk, ck), (tv, cv)):
        assert_same(t.grad, c.grad, atol=5e-5, rtol=1e-5)
    assert_same(m.proj.weight.grad, ref_lin.weight.grad, atol=1e-4, rtol=1e-5)
    met = deferfuse.metrics()
    assert met["dynamo_graphs"] == 1, met["graph_recompiles"]
    assert met["graphs_run_eagerly"] == 0, met["graph_fallback_reasons"]


# --------------------------------------------------------------------------------------------
# compiled activation checkpointing: run_and_save_rng_state / run_with_rng_state

@pytest.mark.modes("defer")
def test_compiled_checkpoint_recomputes_the_same_dropout():
    """``torch.compile`` of a checkpointed block with dropout: AOTAutograd recomputes the dropout
    in the backward graph through ``run_with_rng_state`` with the state the forward graph saved
    (``run_and_save_rng_state``). The gradient must use the forward's mask: it is read off the
    output (the kept entries are the nonzero ones) and the gradient computed on CPU from it. The
    state stays on the device: no sync but the reads of the test."""
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 32))

        def inner(self, x):
            return torch.nn.functional.dropout(x * self.w, 0.5, training=True)

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    m = Block().to("tpu")
    compiled = torch.compile(m, backend="tpu")
    x, g = torch.randn(64, 32), torch.randn(64, 32)
    deferfuse.reset_metrics()
    masks = []
    for _ in range(2):
        m.w.grad = None
        y = compiled(x.to("tpu"))
        y.backward(g.to("tpu"))
        keep = cpu(y) != 0
        masks.append(keep)
        assert 0.3 < keep.float().mean().item() < 0.7
        assert_same(y, (keep * x * cpu(m.w) * 2), atol=1e-5)
        assert_same(m.w.grad, keep * x * 2 * g, atol=1e-5)
    assert not torch.equal(masks[0], masks[1])      # each step draws anew
    met = deferfuse.metrics()
    assert met["graphs_run_eagerly"] == 0, met["graph_fallback_reasons"]
    assert set(met["syncs"]) == {"cpu"}, met["syncs"]      # the test's own reads alone


# --------------------------------------------------------------------------------------------
# Ray Train

@pytest.mark.slow       # a local Ray cluster and three trainings: about 2 minutes on 2 cores
@pytest.mark.modes("strict")      # (the workers run in deferfuse's default mode)
def test_ray_torch_trainer(tmp_path):
    """``TorchTrainer``, 2 workers, DDP, ``TorchConfig(backend="tpu")`` and ``"tpu_dist"``, model on
    ``tpu``, no hook in the workers (they never import deferfuse): losses and weights within 1e-6
    of the same training with gloo on CPU. Ray's ``"tpu_dist"`` first imports ``torch_tpu._loader``
    (TorchTPU's package, which deferfuse does not replace): the workers get an empty stand-in on
    their path, which registers nothing."""
    ray = pytest.importorskip("ray", reason="Ray Train is optional: pip install -e '.[ray]'")
    pytest.importorskip("ray.train.torch", reason="Ray Train is optional: pip install -e '.[ray]'")
    import json
    import os
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    stub = tmp_path / "stub" / "torch_tpu"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "_loader.py").write_text("def load():\n    pass\n")
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, str(stub.parent)] + os.environ.get("PYTHONPATH", "").split(os.pathsep))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        import ray_worker
        runs = {}
        for backend, dev in (("gloo", "cpu"), ("tpu", "tpu"), ("tpu_dist", "tpu")):
            out = str(tmp_path / backend)
            TorchTrainer(ray_worker.train_loop, train_loop_config={"device": dev, "out": out},
                         scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                      resources_per_worker={"CPU": 1}),
                         torch_config=TorchConfig(backend=backend),
                         run_config=RunConfig(storage_path=str(tmp_path / "ray"),
                                              name=backend)).fit()
            runs[backend] = [json.loads(open(f"{out}.{r}.json").read()) for r in range(2)]
    finally:
        ray.shutdown()
    for backend in ("tpu", "tpu_dist"):
        for rank in range(2):
            got, want = runs[backend][rank], runs["gloo"][rank]
            assert got["backend"] == backend and got["device"].startswith("tpu")
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                       atol=1e-6, rtol=0)
            for a, b in zip(got["weights"], want["weights"]):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------------
# varlen flash attention (aten._flash_attention_forward/_backward with sequence boundaries)

LENS, CU = [5, 11, 7], torch.tensor([0, 5, 16, 23], dtype=torch.int32)


def _varlen_ref(q, k, v, window, cu=CU):
    """Each packed sequence on its own through SDPA on CPU, the window as a boolean mask."""
    parts = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = e - s
        i, j = torch.arange(n)[:, None], torch.arange(n)[None]
        mask = torch.ones(n, n, dtype=torch.bool)
        if window[0] >= 0:
            mask &= j >= i - window[0]
        if window[1] >= 0:
            mask &= j <= i + window[1]
        qq, kk, vv = (x[s:e].transpose(0, 1) for x in (q, k, v))
        parts.append(torch.nn.functional.scaled_dot_product_attention(
            qq, kk, vv, attn_mask=mask, enable_gqa=True).transpose(0, 1))
    return torch.cat(parts)


def _varlen_compare(fn, window):
    q = torch.randn(sum(LENS), 4, 8)
    k, v = torch.randn(sum(LENS), 2, 8), torch.randn(sum(LENS), 2, 8)
    tq, tk, tv = (x.to("tpu").requires_grad_() for x in (q, k, v))
    out = fn(tq, tk, tv, CU.to("tpu"))
    g = torch.randn(out.shape)
    out.backward(g.to("tpu"))
    cq, ck, cv = (x.clone().requires_grad_() for x in (q, k, v))
    want = _varlen_ref(cq, ck, cv, window)
    want.backward(g)
    assert_same(out, want.detach(), atol=1e-5, rtol=1e-5)
    for t, c in ((tq, cq), (tk, ck), (tv, cv)):
        assert_same(t.grad, c.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.modes("defer")
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (3, 1)], ids=["causal", "full", "window"])
def test_varlen_attention(window):
    """``torch.nn.attention.varlen.varlen_attn`` (TorchTitan's varlen attention) on packed
    sequences: each against SDPA on its own sequence on CPU, forward and backward, GQA too."""
    from torch.nn.attention.varlen import varlen_attn

    def fn(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, max(LENS), max(LENS), window_size=window,
                           enable_gqa=True)
    _varlen_compare(fn, window)


@pytest.mark.modes("defer")
def test_varlen_attention_compiled():
    """The same under ``torch.compile``: varlen_attn's custom ops are traced through to the
    lowered flash ops (one graph, none run eagerly)."""
    from torch.nn.attention.varlen import varlen_attn

    @torch.compile(backend="tpu", fullgraph=True)
    def fn(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, max(LENS), max(LENS), window_size=(-1, 0),
                           enable_gqa=True)
    deferfuse.reset_metrics()
    _varlen_compare(fn, (-1, 0))
    met = deferfuse.metrics()
    assert met["dynamo_graphs"] == 1 and met["graphs_run_eagerly"] == 0, met["graph_fallback_reasons"]


def _varlen_lse_ref(q, k, cu=CU):
    """Each packed sequence's log-sum-exp of its causal scores on CPU, (heads, tokens)."""
    parts = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qq = q[s:e].transpose(0, 1)
        kk = k[s:e].transpose(0, 1).repeat_interleave(q.shape[1] // k.shape[1], dim=0)
        sc = qq @ kk.transpose(1, 2) / q.shape[-1] ** 0.5
        sc = sc.masked_fill(~torch.ones(e - s, e - s, dtype=torch.bool).tril(), -torch.inf)
        parts.append(torch.logsumexp(sc, dim=-1))
    return torch.cat(parts, dim=1)


@pytest.mark.modes("defer", "strict")
@pytest.mark.slow_params("strict")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_varlen_attention_out(compiled):
    """``varlen_attn_out`` (``torch_attn::_varlen_attn_out``: CUDA's
    ``_flash_attention_forward_no_dropout_inplace``) writes varlen attention into a given output
    (here a view of a larger buffer) and returns it with its log-sum-exp: each against SDPA and
    the log-sum-exp of the scores of each sequence on CPU; the rest of the buffer untouched. Its
    boundaries are padded as ``varlen_attn``'s (NOTE [packed boundaries]). Compiled, AOTAutograd
    functionalizes the op (no lowering): the graph runs eagerly, with the same values."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn_out

    def fn(out, q, k, v, cu):
        return varlen_attn_out(out, q, k, v, cu, cu, max(LENS), max(LENS), window_size=(-1, 0),
                               enable_gqa=True, return_aux=AuxRequest(lse=True))
    if compiled:
        torch._dynamo.reset()           # (the other mode's run compiled this function already)
        fn = torch.compile(fn, backend="tpu", fullgraph=True)
    q = torch.randn(sum(LENS), 4, 8)
    k, v = torch.randn(sum(LENS), 2, 8), torch.randn(sum(LENS), 2, 8)
    buf = torch.full((2, sum(LENS), 4, 8), 7.0, device="tpu")
    deferfuse.reset_metrics()
    with torch.no_grad():
        out, lse = fn(buf[1], *(x.to("tpu") for x in (q, k, v)), CU.to("tpu"))
    assert_same(out, _varlen_ref(q, k, v, (-1, 0)), atol=1e-5, rtol=1e-5)
    assert_same(buf[1], _varlen_ref(q, k, v, (-1, 0)), atol=1e-5, rtol=1e-5)
    assert_same(buf[0], torch.full((sum(LENS), 4, 8), 7.0))
    assert_same(lse, _varlen_lse_ref(q, k), atol=1e-5, rtol=1e-5)
    m = deferfuse.metrics()
    assert m["cpu_fallbacks"] == {}, m["cpu_fallbacks"]
    assert m["packed_padded"] >= 1, m["packed_padded"]
    if compiled:
        assert m["graph_fallback_reasons"] == [
            "auto_functionalized_v2(torch_attn._varlen_attn_out.default): no lowering in a "
            "compiled graph"], m["graph_fallback_reasons"]


# Packed batches of 23 tokens with 1 to 11 sequences: boundaries of 2 to 12 entries.
PACKED = [[23], [5, 11, 7], [10, 13], [1, 2, 3, 17], [4, 4, 4, 4, 4, 3], [8, 15],
          [2] * 10 + [3], [6, 6, 11]]


def _packed_batches(fn, packed=PACKED):
    """``fn(q, k, v, cu, longest)`` on each batch of ``packed``, forward and backward, against
    SDPA on each sequence on CPU; the programs made (compiles and disk-cache hits) after each."""
    made = []
    for lens in packed:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        q = torch.randn(sum(lens), 4, 8)
        k, v = torch.randn(sum(lens), 2, 8), torch.randn(sum(lens), 2, 8)
        tq, tk, tv = (x.to("tpu").requires_grad_() for x in (q, k, v))
        out = fn(tq, tk, tv, cu.to("tpu"), max(lens))
        g = torch.randn(out.shape)
        out.backward(g.to("tpu"))
        cq, ck, cv = (x.clone().requires_grad_() for x in (q, k, v))
        want = _varlen_ref(cq, ck, cv, (-1, 0), cu)
        want.backward(g)
        assert_same(out, want.detach(), atol=1e-5, rtol=1e-5, msg=str(lens))
        for t, c in ((tq, cq), (tk, ck), (tv, cv)):
            assert_same(t.grad, c.grad, atol=1e-5, rtol=1e-5, msg=str(lens))
        m = deferfuse.metrics()
        made.append(m["compiles"] + m["disk_cache_hits"])
    return made


@pytest.mark.modes("defer", "strict")
def test_varlen_packed_batches_share_programs():
    """NOTE [packed boundaries]: 8 packed batches of 1 to 11 sequences (and other longest
    lengths) run in the programs the first batch made: the boundaries are padded to a bucket with
    empty sequences, and the longest length keys nothing. Values and gradients are CPU's."""
    from torch.nn.attention.varlen import varlen_attn

    def fn(q, k, v, cu, longest):
        return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0),
                           enable_gqa=True)
    deferfuse.reset_metrics()
    made = _packed_batches(fn)
    assert made[1:] == [made[0]] * (len(PACKED) - 1), made
    assert deferfuse.metrics()["packed_padded"] >= 2 * len(PACKED), deferfuse.metrics()


@pytest.mark.modes("defer")
def test_varlen_packed_batches_compiled_share_programs():
    """The same under ``torch.compile(backend="tpu")``: Dynamo makes the boundaries' length and
    the longest length dynamic after the first batch; the graph pads the boundaries to a bucket
    and leaves the longest length out of its key, so the forward and the backward graph each
    compile 2 programs (the first batch's static graph, then one for every other batch) instead
    of one per number of sequences."""
    from torch.nn.attention.varlen import varlen_attn

    @torch.compile(backend="tpu", fullgraph=True)
    def fn(q, k, v, cu, longest):
        return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0),
                           enable_gqa=True)
    deferfuse.reset_metrics()
    made = _packed_batches(fn)
    m = deferfuse.metrics()
    assert m["dynamo_graphs"] == 2 and m["graphs_run_eagerly"] == 0, m["graph_fallback_reasons"]
    assert m["graph_compiles"] <= 4, m["graph_compiles"]       # forward and backward, 2 each
    assert made[2:] == [made[1]] * (len(PACKED) - 2), made
    assert m["packed_padded"] >= 2 * (len(PACKED) - 1), m["packed_padded"]


@pytest.mark.modes("defer")
def test_varlen_boundaries_read_elsewhere_are_not_padded():
    """A graph that also reads the boundaries (here their last entry, the token count) keeps
    them exact: only inputs read by nothing but the flash ops are padded (the backward graph's
    are: it reads them only in the flash backward op). Values are CPU's."""
    from torch.nn.attention.varlen import varlen_attn

    @torch.compile(backend="tpu", fullgraph=True)
    def fn(q, k, v, cu, longest):
        out = varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0),
                          enable_gqa=True)
        return out * (cu[-1] / 23.0)        # (every batch of PACKED has 23 tokens: times 1)
    deferfuse.reset_metrics()
    _packed_batches(fn, PACKED[:3])
    assert deferfuse.metrics()["packed_padded"] == 2          # the backward graph's, twice
