"""Hugging Face transformers on tpu: which architectures train and generate like CPU eager.

Run as a script (``.venv/bin/python tests/hf_matrix.py [--archs a,b] [--modes strict,defer]``) it
prints, per architecture and mode: forward ok, backward ok, greedy generate ok (dynamic and static
cache), sampled generate ok, the ops that fell back to CPU, and the first line of the first error.
``tests/test_hf_models.py`` imports the builders and checks from here.

Every model is built from its config class with tiny sizes and random weights (torch.manual_seed(0));
nothing is fetched from a hub. The tpu copy holds the same weights (deepcopy, then ``.to("tpu")``,
which keeps tied weights tied: see ``device._keep_tied_parameters``).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import sys
import time
import traceback
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

import deferfuse  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from util import assert_same  # noqa: E402

VOCAB = 100
BATCH, SEQ, NEW_TOKENS = 2, 8, 8
ATOL = RTOL = 1e-4
TOKENS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# Shared tiny sizes, by naming scheme.
_LLAMA = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=64)
_BERT = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=64)
_BART = dict(encoder_layers=2, decoder_layers=2, d_model=32, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
             max_position_embeddings=64)
_GPT2 = dict(n_layer=2, n_embd=32, n_head=4, n_positions=64)

# name -> (kind, model_type, config kwargs). kind: causal, masked or seq2seq.
CORE = {
    "gpt2": ("causal", "gpt2", _GPT2),
    "llama": ("causal", "llama", _LLAMA),
    "mistral": ("causal", "mistral", dict(_LLAMA, sliding_window=64)),
    "qwen2": ("causal", "qwen2", _LLAMA),
    "phi3": ("causal", "phi3", _LLAMA),
    "gemma": ("causal", "gemma", dict(_LLAMA, head_dim=8)),
    "opt": ("causal", "opt", dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                  ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64)),
    "gpt_neox": ("causal", "gpt_neox", dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                            intermediate_size=64, max_position_embeddings=64)),
    "bloom": ("causal", "bloom", dict(n_layer=2, hidden_size=32, n_head=4)),
    "falcon": ("causal", "falcon", dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                        max_position_embeddings=64)),
    "bert": ("masked", "bert", _BERT),
    "roberta": ("masked", "roberta", dict(_BERT, max_position_embeddings=64 + 2, pad_token_id=1,
                                          bos_token_id=0, eos_token_id=2)),
    "distilbert": ("masked", "distilbert", dict(n_layers=2, dim=32, n_heads=4, hidden_dim=64,
                                                max_position_embeddings=64)),
    "t5": ("seq2seq", "t5", dict(num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8, num_heads=4,
                                 d_ff=64, decoder_start_token_id=0)),
    "bart": ("seq2seq", "bart", dict(_BART, decoder_start_token_id=2)),
}
WIDER = {
    "gemma2": ("causal", "gemma2", dict(_LLAMA, head_dim=8, sliding_window=4, query_pre_attn_scalar=8)),
    "gemma3_text": ("causal", "gemma3_text", dict(_LLAMA, head_dim=8, sliding_window=4,
                                                  query_pre_attn_scalar=8)),
    "qwen3": ("causal", "qwen3", dict(_LLAMA, head_dim=8)),
    "olmo": ("causal", "olmo", _LLAMA),
    "olmo2": ("causal", "olmo2", _LLAMA),
    "stablelm": ("causal", "stablelm", _LLAMA),
    "starcoder2": ("causal", "starcoder2", _LLAMA),
    "granite": ("causal", "granite", _LLAMA),
    "phi": ("causal", "phi", _LLAMA),
    "gptj": ("causal", "gptj", dict(_GPT2, rotary_dim=4)),
    "codegen": ("causal", "codegen", dict(_GPT2, n_ctx=64, rotary_dim=4)),
    "gpt_neo": ("causal", "gpt_neo", dict(num_layers=2, hidden_size=32, num_heads=4,
                                          max_position_embeddings=64, window_size=4,
                                          attention_types=[[["global", "local"], 1]])),
    "gpt_bigcode": ("causal", "gpt_bigcode", _GPT2),
    "mixtral": ("causal", "mixtral", dict(_LLAMA, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("causal", "qwen2_moe", dict(_LLAMA, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32,
                                              shared_expert_intermediate_size=32)),
    "electra": ("masked", "electra", dict(_BERT, embedding_size=32)),
    "albert": ("masked", "albert", dict(_BERT, embedding_size=16)),
    "deberta-v2": ("masked", "deberta-v2", dict(_BERT, relative_attention=True,
                                                pos_att_type=["p2c", "c2p"], position_buckets=16)),
    "xlm-roberta": ("masked", "xlm-roberta", dict(_BERT, max_position_embeddings=64 + 2,
                                                  pad_token_id=1, bos_token_id=0, eos_token_id=2)),
    "mbart": ("seq2seq", "mbart", dict(_BART, decoder_start_token_id=2)),
    "pegasus": ("seq2seq", "pegasus", dict(_BART, decoder_start_token_id=0)),
    "marian": ("seq2seq", "marian", dict(_BART, decoder_start_token_id=0, decoder_vocab_size=VOCAB)),
    "qwen3_moe": ("causal", "qwen3_moe", dict(_LLAMA, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32)),
    "olmoe": ("causal", "olmoe", dict(_LLAMA, num_experts=4, num_experts_per_tok=2)),
    "gpt_oss": ("causal", "gpt_oss", dict(_LLAMA, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=4)),
    "deepseek_v3": ("causal", "deepseek_v3", dict(_LLAMA, num_key_value_heads=4, moe_intermediate_size=32,
                                                  n_shared_experts=1, n_routed_experts=4,
                                                  num_experts_per_tok=2, n_group=1, topk_group=1,
                                                  first_k_dense_replace=1, kv_lora_rank=16,
                                                  q_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8,
                                                  qk_nope_head_dim=4)),
    "modernbert": ("masked", "modernbert", dict(_BERT, global_attn_every_n_layers=2, local_attention=4,
                                                pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                cls_token_id=1, sep_token_id=2)),
    "whisper": ("speech2seq", "whisper", dict(encoder_layers=2, decoder_layers=2, d_model=32,
                                              encoder_attention_heads=4, decoder_attention_heads=4,
                                              encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                                              max_source_positions=SEQ, max_target_positions=64,
                                              decoder_start_token_id=1, suppress_tokens=[],
                                              begin_suppress_tokens=[])),
}
ARCHS = {**CORE, **WIDER}


def config(name, attn="eager"):
    from transformers import AutoConfig
    kind, model_type, kwargs = ARCHS[name]
    cfg = AutoConfig.for_model(model_type, **{**TOKENS, **kwargs})
    cfg._attn_implementation = attn
    return cfg


def build(name, attn="eager"):
    """The CPU model, in eval mode (no dropout), seeded."""
    import transformers
    kind = ARCHS[name][0]
    auto = {"causal": transformers.AutoModelForCausalLM, "masked": transformers.AutoModelForMaskedLM,
            "seq2seq": transformers.AutoModelForSeq2SeqLM,
            "speech2seq": transformers.AutoModelForSpeechSeq2Seq}[kind]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = auto.from_config(config(name, attn), attn_implementation=attn)
    return model.eval()


def to_tpu(model):
    return copy.deepcopy(model).to("tpu")


def inputs(name):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())
    kind = ARCHS[name][0]
    if kind in ("seq2seq", "speech2seq"):
        batch["labels"] = torch.randint(3, VOCAB, (BATCH, SEQ - 2), generator=g)
    if kind == "speech2seq":  # log-mel features: the encoder's two convolutions halve 2*SEQ frames
        del batch["input_ids"], batch["attention_mask"]
        batch["input_features"] = torch.randn(BATCH, ARCHS[name][2]["num_mel_bins"], 2 * SEQ, generator=g)
    return batch


def _prompt(batch):
    """generate()'s inputs from a batch: the token prompt and its mask, or speech features."""
    if "input_features" in batch:
        return dict(input_features=batch["input_features"])
    return dict(inputs=batch["input_ids"], attention_mask=batch["attention_mask"])


def _dev(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


@functools.lru_cache(maxsize=None)
def cpu_reference(name, attn="eager"):
    """(model, batch, logits, loss, grads by parameter name) on CPU."""
    model = build(name, attn)
    batch = inputs(name)
    out = model(**batch)
    out.loss.backward()
    grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return model, batch, out.logits.detach(), out.loss.detach(), grads


def fallbacks():
    return dict(deferfuse.metrics()["cpu_fallbacks"])


def check_forward_backward(name, attn="eager", stages=None):
    """tpu forward (logits, loss) and backward (every gradient) match CPU; ``stages`` (a dict) gets
    'fwd' / 'bwd' set to True as each passes. Returns the tpu model."""
    model, batch, logits, loss, grads = cpu_reference(name, attn)
    stages = {} if stages is None else stages
    tm = to_tpu(model)
    out = tm(**_dev(batch, "tpu"))
    assert_same(out.logits, logits, ATOL, RTOL, f"{name} logits")
    assert_same(out.loss, loss, ATOL, RTOL, f"{name} loss")
    stages["fwd"] = True
    out.loss.backward()
    tgrads = dict(tm.named_parameters())
    assert sorted(tgrads) == sorted(grads), f"{name}: parameter names differ"
    for n, g in grads.items():
        tg = tgrads[n].grad
        if g is None:
            assert tg is None, f"{name} {n}: gradient on tpu, none on CPU"
        else:
            assert tg is not None, f"{name} {n}: no gradient on tpu"
            assert_same(tg, g, ATOL, RTOL, f"{name} grad {n}")
    stages["bwd"] = True
    return tm


def _cache_kwargs(cache):
    # With a static cache, generate() torch.compiles the decode step on device types cuda/xpu/tpu
    # (backend "tpu" for tpu, which nothing registers, and dynamo can't trace TpuTensor yet), so
    # the static path runs with disable_compile=True: the cache itself, not torch.compile.
    return {} if cache is None else dict(cache_implementation=cache, disable_compile=True)


def _gen_kwargs(**kw):
    return dict(max_new_tokens=NEW_TOKENS, pad_token_id=0, **kw)


@functools.lru_cache(maxsize=None)
def cpu_generate(name, cache=None, attn="eager"):
    model, batch = cpu_reference(name, attn)[:2]
    kw = _cache_kwargs(cache)
    with torch.no_grad():
        return model.generate(**_prompt(batch), **_gen_kwargs(do_sample=False, **kw))


def check_generate(name, cache=None, attn="eager", tm=None):
    """Greedy generation on tpu gives CPU's tokens (``cache``: None for the default dynamic cache,
    or a ``cache_implementation`` such as 'static')."""
    want = cpu_generate(name, cache, attn)
    tm = to_tpu(cpu_reference(name, attn)[0]) if tm is None else tm
    batch = _dev(cpu_reference(name, attn)[1], "tpu")
    kw = _cache_kwargs(cache)
    with torch.no_grad():
        got = tm.generate(**_prompt(batch), **_gen_kwargs(do_sample=False, **kw))
    assert_same(got, want, 0, 0, f"{name} greedy tokens (cache={cache})")


def check_sample(name, attn="eager", tm=None, cache=None):
    """Sampled generation gives valid tokens of CPU's shape (values differ by design: JAX RNG)."""
    model, batch = cpu_reference(name, attn)[:2]
    tm = to_tpu(model) if tm is None else tm
    tb = _dev(batch, "tpu")
    torch.manual_seed(0)
    with torch.no_grad():
        got = tm.generate(**_prompt(tb), **_gen_kwargs(do_sample=True, top_k=20, top_p=0.9,
                                                        temperature=0.8, **_cache_kwargs(cache)))
    assert got.device.type == "tpu" and got.dtype == torch.int64, (got.device, got.dtype)
    got = got.cpu()
    assert got.shape[0] == BATCH and got.shape[1] <= SEQ + NEW_TOKENS + 1, got.shape
    assert int(got.min()) >= 0 and int(got.max()) < VOCAB, got
    if ARCHS[name][0] == "causal":
        assert torch.equal(got[:, :SEQ], batch["input_ids"]), "prompt not kept"


# ---------------------------------------------------------------- the standalone table

def _first_line(e):
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:160] if text else type(e).__name__


def run_one(name, mode, gen=True, attn="eager"):
    """One row of the table: {'fwd','bwd','gen','static','sample': True/False/None, 'fallbacks',
    'error', 'seconds'}. None: not run (an earlier stage failed, or not applicable)."""
    kind = ARCHS[name][0]
    row = dict(fwd=False, bwd=False, gen=None, static=None, sample=None, error="", errors={}, stage_cpu={})
    t0, c0 = time.time(), time.process_time()
    deferfuse.reset_metrics()
    fb = {}

    def stage(key, fn):
        deferfuse.reset_metrics()
        s0 = time.process_time()
        try:
            with deferfuse.mode(mode):
                fn()
            row[key] = True if key not in ("fwd", "bwd") else row[key]
        except Exception as e:  # noqa: BLE001 - every failure is reported in the table
            row[key] = False if key not in ("fwd", "bwd") else row[key]
            row["errors"][key] = _first_line(e)
            row["error"] = row["error"] or f"[{key}] {_first_line(e)}"
            if os.environ.get("HF_MATRIX_TRACE"):
                traceback.print_exc()
        for k, v in fallbacks().items():
            fb[k] = fb.get(k, 0) + v
        m = deferfuse.metrics()
        row["stage_cpu"][key] = (round(time.process_time() - s0, 1), m["compiles"])

    try:
        cpu_reference(name, attn)
    except Exception as e:  # noqa: BLE001
        row["error"] = f"[cpu] {_first_line(e)}"
        row.update(seconds=time.time() - t0, cpu_seconds=time.process_time() - c0, fallbacks=fb)
        return row
    holder = {}

    def fb_stage():
        holder["tm"] = check_forward_backward(name, attn, row)
    stage("fwd", fb_stage)
    if gen and kind != "masked":
        tm = holder.get("tm")
        if tm is not None:
            tm.zero_grad(set_to_none=True)
        stage("gen", lambda: check_generate(name, None, attn, tm))
        try:  # the static cache, for decoder-only and encoder-decoder models alike
            cpu_generate(name, "static", attn)
        except Exception as e:  # noqa: BLE001 - static cache unsupported on CPU too
            row["errors"]["static"] = f"n/a on CPU: {_first_line(e)}"
        else:
            stage("static", lambda: check_generate(name, "static", attn, tm))
        stage("sample", lambda: check_sample(name, attn, tm))
    row.update(seconds=time.time() - t0, cpu_seconds=time.process_time() - c0, fallbacks=fb)
    return row


def _mark(v):
    return {True: "ok", False: "FAIL", None: "-"}[v]


def print_table(rows, file=sys.stdout):
    head = f"{'arch':<12} {'mode':<6} {'fwd':<4} {'bwd':<4} {'gen':<4} {'static':<6} {'sample':<6} {'wall':>5} {'cpu':>5}  fallbacks / first error"
    print(head, file=file)
    print("-" * len(head), file=file)
    for (name, mode), r in rows.items():
        fb = ",".join(f"{k}x{v}" for k, v in sorted(r["fallbacks"].items())) or "none"
        print(f"{name:<12} {mode:<6} {_mark(r['fwd']):<4} {_mark(r['bwd']):<4} {_mark(r['gen']):<4} "
              f"{_mark(r['static']):<6} {_mark(r['sample']):<6} {r['seconds']:5.0f} {r['cpu_seconds']:5.0f}  fallbacks: {fb}"
              + (f"\n{'':<12} {'':<6} error {r['error']}" if r["error"] else ""), file=file)
    n = len(rows)
    ok = sum(1 for r in rows.values() if _row_ok(r))
    print(f"\n{ok}/{n} architecture-mode rows pass every stage they run", file=file)


def _md_cell(r, key):
    return {True: "ok", False: "**FAIL**", None: "–"}[r[key]] if not (
        key == "static" and r[key] is None and "static" in r["errors"]) else "n/a"


def write_markdown(rows, path, command):
    """The table as markdown (bench/results/hf_models.md): one row per architecture and mode."""
    import datetime
    import platform

    import jax
    import transformers
    lines = ["# Hugging Face models on tpu", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             f"- command: `{command}`",
             f"- versions: torch {torch.__version__}, transformers {transformers.__version__}, "
             f"jax {jax.__version__}, python {platform.python_version()}; deferfuse on "
             f"{deferfuse.platform()}",
             f"- models: tiny configs (2 layers, hidden 32, vocab {VOCAB}), random weights, batch "
             f"{BATCH} x {SEQ} tokens; {NEW_TOKENS} new tokens per generate",
             "- fwd: logits and loss match CPU eager (atol=rtol=1e-4); bwd: every parameter's "
             "gradient matches; greedy: generate(do_sample=False) gives CPU's tokens with the "
             "default dynamic cache; static: the same with cache_implementation='static'; "
             "sampled: do_sample=True (top-k, top-p, temperature) gives valid tokens (values come "
             "from JAX's RNG). –: not applicable (masked LMs do not generate).",
             "- seconds: wall / process CPU for the row on a shared 2-core machine (defer-mode "
             "generation recompiles for each new sequence length).", "",
             "| arch | kind | mode | fwd | bwd | greedy | static | sampled | wall s | cpu s | CPU fallbacks | first error |",
             "|---|---|---|---|---|---|---|---|---:|---:|---|---|"]
    for (name, mode), r in rows.items():
        fb = ", ".join(f"{k} x{v}" if v else k for k, v in sorted(r["fallbacks"].items())) or "none"
        err = r["error"].replace("|", "\\|")
        lines.append(f"| {name} | {ARCHS[name][0]} | {mode} | {_md_cell(r, 'fwd')} | {_md_cell(r, 'bwd')} | "
                     f"{_md_cell(r, 'gen')} | {_md_cell(r, 'static')} | {_md_cell(r, 'sample')} | "
                     f"{r['seconds']:.0f} | {r['cpu_seconds']:.0f} | {fb} | {err} |")
    ok = sum(1 for r in rows.values() if _row_ok(r))
    archs = {n for n, _ in rows}
    ok_archs = sum(1 for n in archs if all(_row_ok(r) for (m, _), r in rows.items() if m == n))
    lines += ["", f"**{ok}/{len(rows)} architecture-mode rows pass every stage they run; "
              f"{ok_archs}/{len(archs)} architectures pass in every mode.**", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _row_ok(r):
    return bool(r["fwd"] and r["bwd"] and r["gen"] is not False and r["static"] is not False
                and r["sample"] is not False)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", default="all", help="comma list, 'core', 'wider' or 'all'")
    p.add_argument("--modes", default="strict,defer")
    p.add_argument("--no-gen", action="store_true", help="forward/backward only")
    p.add_argument("--attn", default="eager", help="attn_implementation: eager or sdpa")
    p.add_argument("--md", metavar="PATH", help="also write the table as markdown to PATH")
    a = p.parse_args(argv)
    names = {"all": list(ARCHS), "core": list(CORE), "wider": list(WIDER)}.get(a.archs)
    names = names or a.archs.split(",")
    import transformers
    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"deferfuse on {deferfuse.platform()}, attn={a.attn}", flush=True)
    rows = {}
    for name in names:
        for mode in a.modes.split(","):
            with contextlib.redirect_stderr(sys.stderr):
                r = run_one(name, mode, gen=not a.no_gen, attn=a.attn)
            rows[(name, mode)] = r
            fb = ",".join(sorted(r["fallbacks"])) or "none"
            print(f"{name} {mode}: fwd={_mark(r['fwd'])} bwd={_mark(r['bwd'])} gen={_mark(r['gen'])} "
                  f"static={_mark(r['static'])} sample={_mark(r['sample'])} "
                  f"{r['seconds']:.0f}s wall {r['cpu_seconds']:.0f}s cpu "
                  f"fallbacks={fb} {r['error']}", flush=True)
            print("    stage cpu seconds, compiles:", r["stage_cpu"], flush=True)
            for k, e in r["errors"].items():
                if f"[{k}]" not in r["error"]:
                    print(f"    [{k}] {e}", flush=True)
    print(flush=True)
    print_table(rows)
    if a.md:
        cmd = " ".join(["python", "tests/hf_matrix.py", *(sys.argv[1:] if argv is None else argv)])
        write_markdown(rows, a.md, cmd)
    return rows


if __name__ == "__main__":
    main()
