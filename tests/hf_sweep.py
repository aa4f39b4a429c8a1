"""Every Hugging Face architecture on tpu: forward, backward and greedy generate against CPU eager.

``make sweep-hf`` (``python tests/hf_sweep.py [--part K/N] [--only a,b] [--timeout S]``) enumerates
every ``model_type`` in transformers' auto mappings, picks one model class for it (causal LM, else
masked LM, seq2seq LM, speech seq2seq, sequence classification, image classification, else the base
model), builds it from a tiny config derived from the default one (``tiny_config``: sizes shrunk
consistently, nested text/vision/audio configs too) and runs, each architecture in its own process
with a timeout:

- f32: forward and backward of the loss in defer mode; the loss (and logits) and every parameter's
  gradient against the same model on CPU (``F32_TOL``, scaled by each tensor's largest magnitude).
  Where that fails, tpu still passes when, element by element, it is no farther from the same model
  computed in float64 on CPU than CPU's float32 result is (the bfloat16 stage's "no less accurate"
  rule one precision up: a gradient summed with cancellation rounds differently in CPU's float32
  kernels; the row records ``f32_f64_rule``).
- bf16: the same with the model in bfloat16, against CPU in bfloat16 with the OpInfo sweep's
  bfloat16 backward tolerance (``BF16_TOL``); where that fails, tpu still passes when, element by
  element, it is no farther from the float32 result than CPU's bfloat16 result is (the OpInfo
  sweep's "no less accurate" rule: CPU's own bfloat16 kernels round differently by machine).
  A tensor that fails both is checked by two model-level rules, counted apart in the table: the
  scale rule (``BF16_SCALE``) and PyTorch's own accuracy rule for its Hugging Face benchmark
  (``torch._dynamo.utils.same`` as benchmarks/dynamo/huggingface.py calls it for training:
  ``DYNAMO_TOL``, against the same model computed in float64).
- In both stages, where CPU's own result depends on the order of equal values its ``topk`` or
  ``sort`` select (an order PyTorch leaves unspecified: a detector's top-k query selection over
  scores that tie in bfloat16, a router's top-1), tpu is compared with CPU computing the same model
  with those ties in index order, the order ``sort(stable=True)`` defines (``_stable_ties``; the row
  records ``bf16_stable_ties`` / ``f32_stable_ties``). The tolerances are unchanged.
- gen: one greedy ``generate(max_new_tokens=5)`` for generative models, tokens equal to CPU's.

Results accumulate in ``bench/results/hf-sweep.json`` (one entry per model_type, a run updates the
entries it ran) and ``bench/results/hf-sweep.md`` is written from it. ``tests/test_hf_sweep.py`` runs a
fixed sample of 20 architectures in the default suite.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import inspect
import json
import os
import subprocess
import sys
import time
import traceback
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(ROOT, "bench", "results")

BATCH, SEQ, NEW_TOKENS = 2, 8, 5
VOCAB = 128
HIDDEN, HEADS, HEAD_DIM, INTER, LAYERS = 32, 4, 8, 64, 2
IMAGE, PATCH = 32, 8
# The fallback pass's image side (``_fallback``): backbones that stride a 32-pixel image down to
# nothing (text recognisers striding 32 in height, mobilevitv2's unfold of a 1 x 1 map).
FALLBACK_IMAGE = 128
# (atol, rtol), each atol scaled by max(1, the CPU tensor's largest magnitude).
F32_TOL = (1e-4, 1e-4)
# The OpInfo sweep's bfloat16 backward tolerance (opinfo_sweep.BACKWARD_TOL).
BF16_TOL = (1e-3, 1.6e-2)
# A whole model in bfloat16 rounds at each op on CPU, and once per fused chain of ops on tpu (XLA
# computes a fused elementwise chain in float32), so an element computed by cancellation can differ
# by a few bfloat16 units of the tensor's largest magnitude. Where a tensor fails BF16_TOL and the
# no-less-accurate rule, it still passes within BF16_SCALE x max(1, |CPU| max) (two bfloat16 eps),
# and the table counts those passes apart ("bf16, scale rule").
BF16_SCALE = 1.6e-2
# PyTorch's accuracy check of a whole model in bfloat16 (the Inductor benchmarks' HF suite, training:
# tolerance 1e-2): allclose(CPU, tpu, atol=rtol=1e-2), or tpu's RMSE from the float64 result at most
# 3x CPU bfloat16's + 1e-3 (torch._dynamo.utils.same, called as is).
DYNAMO_TOL = 1e-2

# One model class per model_type: the first mapping (in this order) that names the model_type.
KINDS = (("causal", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
         ("masked", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
         ("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
         ("speech2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
         ("seqcls", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
         ("imgcls", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
         ("base", "MODEL_MAPPING_NAMES"))


def enumerate_archs() -> dict:
    """{model_type: (kind, class name)} over every auto mapping that names a model class."""
    from transformers.models.auto import modeling_auto as ma
    every = set()
    for n in dir(ma):
        if n.startswith("MODEL_") and n.endswith("MAPPING_NAMES"):
            every |= set(getattr(ma, n))
    out = {}
    for mt in sorted(every):
        for kind, mapping in KINDS:
            cls = getattr(ma, mapping).get(mt)
            if cls:
                out[mt] = (kind, cls[0] if isinstance(cls, (tuple, list)) else cls)
                break
        else:  # only in a task mapping outside KINDS (detection, segmentation, ...): its first one
            for n in sorted(dir(ma)):
                if n.startswith("MODEL_FOR_") and n.endswith("MAPPING_NAMES"):
                    cls = getattr(ma, n).get(mt)
                    if cls:
                        out[mt] = ("other:" + n[10:-14].lower(), cls[0] if isinstance(cls, (tuple, list)) else cls)
                        break
    return out


# ---------------------------------------------------------------- tiny configs

_HIDDEN = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "embedding_size", "word_embed_proj_dim",
           "projection_dim", "text_embed_dim", "vision_embed_dim", "hidden_dim_model", "d_embed", "emb_dim",
           "projection_size", "proj_dim", "query_dim", "output_hidden_size", "classifier_proj_size",
           "kv_channels", "embed_size", "n_embed", "hidden_size_per_head",
           # widths of another tower that this one reads (cross attention, projectors)
           "encoder_hidden_size", "cross_attention_hidden_size", "mm_hidden_size", "vision_hidden_size",
           "text_hidden_size", "audio_hidden_size", "image_hidden_size",
           # the width the quantizer of an audio codec compares the encoder's output with (encodec)
           "codebook_dim",
           # a vision tower's output projected to the text width (glm4v, qwen3-vl), a predictor's
           # width (vjepa2), a codec decoder's first width (dac)
           "out_hidden_size", "pred_hidden_size", "decoder_hidden_size",
           # a decoder's cross attention over the encoder (dia), a pooled vision output read by a
           # projection (vision-text-dual-encoder), the global model of a byte-level one (blt)
           "cross_hidden_size", "pooler_output_size", "hidden_size_global")
_INTER = ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner",
          "moe_intermediate_size", "shared_expert_intermediate_size", "hidden_dim", "ffn_hidden_size",
          "expert_intermediate_size", "decoder_intermediate_size", "encoder_intermediate_size",
          "intermediate_size_mlp", "dense_intermediate_size", "mlp_dim", "ff_dim", "linear_units")
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
           "num_decoder_layers", "num_encoder_layers", "decoder_num_layers", "encoder_num_layers",
           "text_layers", "vision_layers", "num_blocks", "pred_num_hidden_layers")
_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
          "decoder_attention_heads", "decoder_num_attention_heads", "encoder_num_attention_heads",
          "pred_num_attention_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
_HEAD_DIM = ("head_dim", "d_kv", "attention_head_dim", "kv_head_dim", "v_head_dim", "qk_head_dim",
             "cross_head_dim")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_POSITIONS = ("max_position_embeddings", "n_positions", "max_target_positions", "max_source_positions",
              "n_ctx", "max_seq_len", "seq_length", "max_sequence_length", "max_length")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
              "cls_token_id", "mask_token_id", "unk_token_id")


def _get(cfg, name):
    try:
        return getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 - a per-layer attribute read globally raises its own error
        return None


def _set(cfg, name, value):
    try:
        setattr(cfg, name, value)
    except Exception:  # noqa: BLE001 - read-only property of some configs
        pass


def tiny_config(cfg, depth=0, fallback=False, widths=None):
    """Shrink ``cfg`` (a PretrainedConfig) in place, and the configs nested in it; returns it.
    ``fallback``: the second pass (``_fallback``), for a model the first pass does not build;
    ``widths``: the default hidden widths of the whole config tree (the fallback reads them)."""
    from transformers import PretrainedConfig
    _untimm(cfg, fallback)
    d = cfg.to_dict()
    if widths is None:
        widths = _tree_widths(d)
    # Nested configs first (text_config, vision_config, audio_config, encoder, decoder, ...).
    for k in list(d):
        v = _get(cfg, k)
        if isinstance(v, PretrainedConfig) and depth < 3:
            tiny_config(v, depth + 1, fallback, widths)
    old_layers = {k: d[k] for k in _LAYERS if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)}
    if isinstance(d.get("depths"), list):   # a stage count (swin's num_layers), not a layer count
        old_layers = {k: v for k, v in old_layers.items() if v != len(d["depths"])}
    old_heads = next((d[k] for k in _HEADS if isinstance(d.get(k), int)), None)

    def ints(names):
        return [k for k in names if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)]
    for k in ints(_HIDDEN):
        _set(cfg, k, HIDDEN)
    for k in ints(_INTER):
        _set(cfg, k, INTER)
    for k in old_layers:
        _set(cfg, k, min(d[k], LAYERS))
    for k in ints(_HEADS):
        _set(cfg, k, HEADS)
    # Fields some default configs leave None that their model reads as numbers (ministral's and
    # hunyuan's head_dim, nemotron's key/value heads, deepseek_v2's experts per token): the default
    # config does not build either, so they get the values the rest of the tiny config implies.
    if "head_dim" in d and d["head_dim"] is None and old_heads is not None:
        _set(cfg, "head_dim", HEAD_DIM)
    if "num_key_value_heads" in d and d["num_key_value_heads"] is None and old_heads is not None:
        _set(cfg, "num_key_value_heads", HEADS)
    if "num_experts_per_tok" in d and d["num_experts_per_tok"] is None and ints(_EXPERTS):
        _set(cfg, "num_experts_per_tok", 2)
    for k in _HEADS:        # per-stage head counts of vision backbones, for stages 8, 16, 32, ... wide
        if isinstance(d.get(k), list) and d[k] and all(isinstance(x, int) for x in d[k]):
            _set(cfg, k, [min(2 ** i, 8) for i in range(len(d[k]))])
    for k in ints(_KV_HEADS):
        _set(cfg, k, HEADS if old_heads is None or d[k] >= old_heads else 2)
    # Widths the default config makes equal to the transformer's (oneformer's pixel decoder
    # conv_dim and mask_dim = hidden_dim) stay equal to it: where they differ, oneformer projects
    # each feature level with a Conv2d kept in a plain Python list, not registered, so
    # ``model.to(device)`` leaves it on CPU (a transformers bug; any device, CUDA too, then
    # refuses the mixed conv2d). Equal, that projection is the identity, as in the default model.
    if isinstance(d.get("hidden_dim"), int):
        for k in ints(("conv_dim", "mask_dim")):
            if d[k] == d["hidden_dim"]:
                _set(cfg, k, cfg.hidden_dim)
    for k in ints(_HEAD_DIM):
        _set(cfg, k, HEAD_DIM)
    for k in ints(_EXPERTS):
        _set(cfg, k, 4)
    for k in ints(("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k",
                   "num_experts_per_token")):
        _set(cfg, k, min(d[k], 2))
    for k in ints(("n_group", "topk_group")):
        _set(cfg, k, 1)
    for k in ints(("kv_lora_rank", "q_lora_rank")):
        _set(cfg, k, 16)
    for k in ints(("qk_rope_head_dim", "qk_nope_head_dim")):
        _set(cfg, k, 4)
    if isinstance(d.get("qk_rope_head_dim"), int) and d.get("head_dim") == d["qk_rope_head_dim"]:
        _set(cfg, "head_dim", 4)    # multi-head latent attention: rotary over the rope part
    for k, v in (("index_head_dim", HEAD_DIM), ("index_n_heads", HEADS)):
        if isinstance(d.get(k), int):
            _set(cfg, k, v)
    for k in ints(("first_k_dense_replace",)):
        _set(cfg, k, min(d[k], 1))
    # The scale of noise a model draws at run time on its own device (vits: randn_like of its
    # latents; the detectors' denoising queries in training: rand_like boxes and labels; a sigma-VAE's
    # latent noise, ``vae_std`` x randn: the vibevoice tokenizers): tpu's generator is not CPU's,
    # so the draws differ; at 0 both compute the same deterministic function, which is what the
    # comparison can check.
    for k in d:
        if k.endswith(("noise_scale", "noise_ratio", "vae_std")) and type(d[k]) is float:
            _set(cfg, k, 0.0)
    # State-space mixers (mamba2, bamba): heads x head dim = expand x hidden size.
    for heads, dim, expand in (("num_heads", "head_dim", "expand"), ("mamba_n_heads", "mamba_d_head", "mamba_expand")):
        if all(isinstance(d.get(k), int) for k in (heads, dim, expand)) and "hidden_size" in d:
            _set(cfg, dim, HEAD_DIM)
            _set(cfg, heads, d[expand] * HIDDEN // HEAD_DIM)
            for k in ints(("n_groups", "mamba_n_groups")):
                _set(cfg, k, 1)
    if isinstance(d.get("window_size"), int) and isinstance(d.get("spatial_merge_size"), int) \
            and isinstance(d.get("patch_size"), int):
        # a window in pixels (qwen2.5-vl's vision tower): two merged patches a side
        _set(cfg, "window_size", 2 * d["spatial_merge_size"] * d["patch_size"])
    elif isinstance(d.get("window_size"), int) and d["window_size"] > 4:
        _set(cfg, "window_size", 4)   # attention windows (swin's divide the 8 x 8 patch grid)
    for k in ints(_POSITIONS):
        if d[k] > 128:
            _set(cfg, k, 128)
    if isinstance(d.get("vocab_size"), int) and d["vocab_size"] > VOCAB:
        _set(cfg, "vocab_size", VOCAB)
        for k in ints(("decoder_vocab_size", "target_vocab_size", "output_vocab_size")):
            _set(cfg, k, VOCAB)
    vocab = getattr(cfg, "vocab_size", None)
    if isinstance(vocab, int):
        for k in _TOKEN_IDS:
            v = d.get(k)
            if isinstance(v, int) and v >= vocab:
                _set(cfg, k, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.get(k, 2))
            elif isinstance(v, list):
                _set(cfg, k, [x for x in v if x < vocab] or [2])
    image = FALLBACK_IMAGE if fallback else IMAGE
    if isinstance(d.get("crop_size"), int) and d["crop_size"] > IMAGE:
        _set(cfg, "crop_size", IMAGE)       # vjepa2's clip frames
    if isinstance(d.get("image_size"), int) and d["image_size"] > image:
        _set(cfg, "image_size", image)
        if isinstance(d.get("patch_size"), int) and d["patch_size"] > PATCH:
            _set(cfg, "patch_size", PATCH)
    elif isinstance(d.get("image_size"), (list, tuple)) and len(d["image_size"]) == 2:
        _set(cfg, "image_size", [image, image])
        if isinstance(d.get("patch_size"), int) and d["patch_size"] > PATCH:
            _set(cfg, "patch_size", PATCH)
    img, patch = getattr(cfg, "image_size", None), getattr(cfg, "patch_size", None)
    if isinstance(img, int) and isinstance(patch, int) and patch and (img, patch) != (d.get("image_size"), d.get("patch_size")):
        if isinstance(d.get("num_patches"), int):
            _set(cfg, "num_patches", (img // patch) ** 2)     # siglip2's position grid
        ch = d.get("num_channels") if isinstance(d.get("num_channels"), int) else 3
        if isinstance(d.get("patch_dim"), int) and d["patch_dim"] == ch * d["patch_size"] ** 2:
            _set(cfg, "patch_dim", ch * patch ** 2)           # radio's flattened patch
    if isinstance(d.get("depths"), list) and isinstance(d.get("window_size"), int) and \
            isinstance(getattr(cfg, "patch_size", None), int) and isinstance(d.get("image_size"), int):
        # windowed stages (swin): each stage's grid at least one window of 2, halving per stage
        _set(cfg, "window_size", 2)
        _set(cfg, "image_size", cfg.patch_size * 2 ** len(d["depths"]))
    # Per-stage lists of vision backbones: one block per stage, narrow stages.
    if isinstance(d.get("depths"), list) and all(isinstance(x, int) for x in d["depths"]):
        _set(cfg, "depths", [1] * len(d["depths"]))
    chans = [k for k, v in d.items() if _CHANNELS(k) and isinstance(v, list) and v
             and all(isinstance(x, int) and not isinstance(x, bool) for x in v)]
    if any(max(d[k]) > 64 for k in chans if k != "hidden_sizes") and any(
            k == "hidden_sizes" or "in_channels" in k or k == "downsample_channels" for k in chans):
        # (not the PP-LCNet family's stem/stage lists: their blocks scale widths by their own factor)
        # Channel widths given stage by stage in several lists that must agree with each other and
        # with the configs nested around them (hgnet_v2's stage in/mid/out channels and hidden_sizes,
        # d_fine's encoder_in_channels = its backbone's stage outputs): every width divided by 8 alike,
        # input channels (<= 8) kept.
        for k in chans:
            _set(cfg, k, [_narrow(x) for x in d[k]])
        for k, v in d.items():
            if isinstance(v, int) and not isinstance(v, bool) and v > 64 and k.endswith(
                    ("_channels", "_hidden_dim")) and k not in _INTER:
                _set(cfg, k, _narrow(v))
    elif isinstance(d.get("hidden_sizes"), list) and all(isinstance(x, int) for x in d["hidden_sizes"]):
        _set(cfg, "hidden_sizes", [32 * 2 ** i for i in range(len(d["hidden_sizes"]))])
    # Per-layer lists as long as the old layer count: keep the first entries.
    for n_old in set(old_layers.values()):
        for k, v in d.items():
            if isinstance(v, list) and len(v) == n_old and n_old > LAYERS and k not in ("depths", "hidden_sizes"):
                _set(cfg, k, v[:LAYERS])
    # A backbone's outputs (out_indices, stage numbers counted in layers) past the tiny depth: each
    # index scaled to the new depth (vit-style backbones of lw_detr, rf_detr, vitpose; stage 12 of 12
    # becomes stage 2 of 2), so the backbone still returns feature maps.
    n_old = next((v for k, v in old_layers.items() if k in ("num_hidden_layers", "num_layers")), None)
    if isinstance(d.get("out_indices"), list) and d["out_indices"] and n_old and n_old > LAYERS and \
            all(isinstance(i, int) and 0 <= i <= n_old for i in d["out_indices"]) and \
            max(d["out_indices"]) > LAYERS:
        idx = sorted({max(1, -(-i * LAYERS // n_old)) if i else 0 for i in d["out_indices"]})
        depth_new = LAYERS
        k = len(set(d["out_indices"]))
        if depth and k > len(idx):
            # a backbone nested in a model that reads each of its k feature maps (depth_anything's
            # neck reads 4): k layers, one map each, the last k stages as before
            depth_new = max(LAYERS, k)
            idx = list(range(depth_new - k + 1, depth_new + 1))
            for name in old_layers:
                if name in ("num_hidden_layers", "num_layers"):
                    _set(cfg, name, depth_new)
        _set(cfg, "stage_names", ["stem"] + [f"stage{i}" for i in range(1, depth_new + 1)])
        try:
            cfg.set_output_features_output_indices(None, idx)
        except Exception:  # noqa: BLE001 - not a BackboneConfigMixin: the plain fields
            _set(cfg, "out_indices", idx)
            _set(cfg, "out_features", [f"stage{i}" if i else "stem" for i in idx])
    if d.get("is_encoder_decoder") and getattr(cfg, "decoder_start_token_id", None) is None:
        _set(cfg, "decoder_start_token_id", d.get("pad_token_id") or 0)
    if isinstance(d.get("num_queries"), int) and d["num_queries"] > 8:
        _set(cfg, "num_queries", 8)     # detection queries: rt_detr picks them by top-k over 21 anchors
    if isinstance(d.get("rotary_dim"), int) and d["rotary_dim"] > HEAD_DIM // 2:
        _set(cfg, "rotary_dim", HEAD_DIM // 2)     # partial rotary (codegen, gptj) within the tiny head
    if isinstance(d.get("upsample_groups"), int) and d["upsample_groups"] == next(
            (d[k] for k in ("hidden_size", "d_model") if isinstance(d.get(k), int)), None):
        _set(cfg, "upsample_groups", HIDDEN)   # a depthwise upsampling (mimi): one group per channel
    for k in ints(("num_frames", "frames_per_clip")):
        if d[k] > 4:
            _set(cfg, k, 4)    # video models: 4 frames, two tubelets of 2
    if isinstance(d.get("num_groups"), int) and d["num_groups"] > 4:
        _set(cfg, "num_groups", 4)     # group norms over the narrowed channels
    if isinstance(d.get("num_labels"), int):
        _set(cfg, "num_labels", 3)
    if "prediction_length" in d and d["prediction_length"] is None and isinstance(d.get("lags_sequence"), list):
        # a forecaster's horizon, which the default config leaves to the checkpoint (the model
        # refuses None); the context defaults to it, as the config's own __init__ does
        _set(cfg, "prediction_length", 4)
        if d.get("context_length") is None:
            _set(cfg, "context_length", 4)
        if isinstance(d.get("label_length"), int) and d["label_length"] > 4:
            _set(cfg, "label_length", 4)    # autoformer's decoder start: the context's last steps
    if fallback:
        _fallback(cfg, d, widths, fallback)
    return cfg


def _tree_widths(d, depth=0):
    """{hidden width: head width} of a config's default dict and of the dicts nested in it: the
    widths ``_HIDDEN`` names, each with its attention heads' width (hidden // heads) where the
    same config has a head count; under "image", the largest default image side above
    ``FALLBACK_IMAGE``; under "patch", where some config of the tree has fixed ``*feature_sizes``,
    the smallest default patch size of the tree."""
    out = {}
    heads = next((d[k] for k in _HEADS if isinstance(d.get(k), int) and d[k] > 0), None)
    for k in _HIDDEN:
        v = d.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > HIDDEN:
            out.setdefault(v, v // heads if heads and v % heads == 0 else None)
    img = d.get("image_size")
    img = img[0] if isinstance(img, (list, tuple)) and img else img
    if isinstance(img, int) and not isinstance(img, bool) and img > FALLBACK_IMAGE:
        out["image"] = max(out.get("image") or 0, img)
    if any(isinstance(k, str) and k.endswith("feature_sizes") for k in d):
        out["patch"] = 0    # the smallest default patch of the tree, filled below
    for v in d.values():
        if isinstance(v, dict) and depth < 3:
            for w, h in _tree_widths(v, depth + 1).items():
                out[w] = max(out.get(w) or 0, h) if w == "image" else out.get(w, h)
    if depth == 0 and "patch" in out:
        out["patch"] = min(_patches(d)) if _patches(d) else None
    return out


def _patches(d, depth=0):
    """The default patch sizes (ints up to 16) of a config dict and of the dicts nested in it."""
    out = [d["patch_size"]] if isinstance(d.get("patch_size"), int) and 0 < d["patch_size"] <= 16 else []
    for v in d.values():
        if isinstance(v, dict) and depth < 3:
            out += _patches(v, depth + 1)
    return out


def _CHANNELS(name):
    """A per-stage list of channel widths (``stage_out_channels``, ``encoder_in_channels``,
    ``backbone_channel_list``, ``hidden_sizes``, ...)."""
    return name != "num_channels" and ("channels" in name or name in (
        "hidden_sizes", "backbone_channel_list", "embed_dim_per_stage"))


def _narrow(v):
    return v if v <= 8 else max(8, v // 8)


def _untimm(cfg, fallback=False):
    """A timm backbone (detr and its family by default) becomes transformers' own ResNet backbone
    with the same four stages out: timm needs torchvision, which the test extras do not install
    (PyPI's torchvision wheel links CUDA torch). In the fallback pass, the keyword arguments the
    model passes to timm's constructor (omdet-turbo's ``timm_kwargs``) go too."""
    from transformers import PretrainedConfig, ResNetConfig
    for k in list(_get(cfg, "sub_configs") or {}):
        v = _get(cfg, k)
        if isinstance(v, PretrainedConfig) and getattr(v, "model_type", None) == "timm_backbone":
            n = len(getattr(v, "out_indices", None) or (1, 2, 3, 4))
            _set(cfg, k, ResNetConfig(out_features=[f"stage{i}" for i in range(5 - n, 5)],
                                      num_channels=getattr(v, "num_channels", 3)))
            _set(cfg, "use_timm_backbone", False)
            if fallback and isinstance(_get(cfg, "timm_kwargs"), dict):
                _set(cfg, "timm_kwargs", {})


def _fallback(cfg, d, widths=None, level=1):
    """The second pass of ``tiny_config``, for a model its first pass does not build (``check``
    builds with it only then, so no row the first pass builds changes): ``d`` is the config's
    default dict, ``cfg`` the config after the first pass.

    - fields the default config leaves None that its model reads as sizes (esm's vocabulary and
      padding id, diffusion_gemma's and dots1's experts and experts per token, an intermediate
      size): the tiny values; reformer's axial position widths sum to the tiny hidden size;
    - token ids past the text vocabulary (audio or image ids indexed after the text ones, kyutai's
      audio padding row) keep their distance from the vocabulary's end;
    - key/value sharing across the last layers (gemma3n) needs more layers than the tiny two: off;
    - images: ``FALLBACK_IMAGE`` pixels a side, for a vision config without an image size too
      (``inputs`` reads the config's);
    - widths a model computes from other fields or reads from another tower under a name of its own
      (``widths``: the default hidden widths of the whole tree): a width field whose default is one
      of those hidden widths gets the tiny one (SAM's 256-wide neck and mask decoder beside its
      768-wide encoder, superpoint's descriptors read by superglue and lightglue), one whose default
      is half of one and names features gets half the tiny one (SAM's positional features,
      pp_doclayout_v3's ``x4_feat_dim``); a width that is a head's width (bros's box projection,
      hidden // heads) gets ``HEAD_DIM``; grids of patches computed
      once from the default image (SAM's prompt encoder: image size // patch size) are recomputed;
    - per-stage width lists that run from a hidden width up (sam2's hiera ``embed_dim_per_stage``
      and its neck's ``backbone_channel_list``): the same multiples of the tiny width; a stem's
      width that feeds the first stage (textnet's ``stem_out_channels``): the first stage's new
      width; ``*feature_sizes`` fixed in the config (sam2's, sam3's necks): the same multiples of
      the fallback image's grid of patches, whose patch sizes keep their defaults;
    - head and layer counts under prefixed names (moonshine's ``encoder_num_key_value_heads``,
      dia's ``cross_num_attention_heads``): as the plain ones; a ``_HIDDEN`` name whose default is
      a count of at most 8 (grounding-dino's ``query_dim``, a box's 4 numbers) keeps it, and so
      does an expert count below the tiny 4 (vitpose's one expert);
    - an image size under another name (tvp's ``max_img_size``): the fallback image, a prompt
      border inside it (``*prompt_size``) scaled alike;
    - per-layer kinds (``layer_types``) whose first tiny layers miss a kind: one layer of each, in
      the default order; per-layer head counts above the tiny heads: at most ``HEADS``; a mixer's
      width that is heads x head width (falcon_h1's ``mamba_d_ssm``) stays their product.

    ``level`` 2, tried only where level 1 builds nothing that runs either: every patch size up to
    16 keeps its default (on the 128-pixel fallback image: a stem whose strides are fixed in code,
    levit's 16; depth_anything's neck reading its dinov2 backbone's 14-pixel grid)."""
    def none(names):
        return [k for k in names if k in d and d[k] is None]
    for k in none(("vocab_size",)):
        _set(cfg, k, VOCAB)
    for k in none(_EXPERTS):
        _set(cfg, k, 4)
    for k in none(_INTER):
        _set(cfg, k, INTER)
    if none(_EXPERTS):
        for k in none(("num_experts_per_tok", "top_k_experts", "num_experts_per_token")):
            _set(cfg, k, 2)
        for k in none(("n_shared_experts", "num_shared_experts")):
            _set(cfg, k, 1)
    for k in none(("pad_token_id",)):
        if "vocab_size" in none(("vocab_size",)):
            _set(cfg, k, 0)     # esm: no vocabulary and no padding id by default
    if isinstance(d.get("axial_pos_embds_dim"), list) and sum(d["axial_pos_embds_dim"]) == d.get("hidden_size"):
        # reformer's axial position embedding: its two widths sum to the hidden size
        _set(cfg, "axial_pos_embds_dim", [HIDDEN // 2, HIDDEN // 2])
    old_vocab, vocab = d.get("vocab_size"), _get(cfg, "vocab_size")
    if isinstance(old_vocab, int) and isinstance(vocab, int) and vocab < old_vocab:
        for k, v in d.items():
            if k.endswith(("token_id", "token_index")) and k not in _TOKEN_IDS and isinstance(v, int) \
                    and not isinstance(v, bool) and v >= old_vocab:
                _set(cfg, k, v - old_vocab + vocab)
    if isinstance(d.get("num_kv_shared_layers"), int):
        _set(cfg, "num_kv_shared_layers", 0)
    if isinstance(d.get("num_channels"), int) and "image_size" not in d:
        _set(cfg, "image_size", FALLBACK_IMAGE)
    widths = widths or {}
    heads = {h for w, h in widths.items() if h and isinstance(w, int)}
    for k in _HIDDEN:
        if isinstance(d.get(k), int) and not isinstance(d[k], bool) and 0 < d[k] <= 8:
            _set(cfg, k, d[k])  # a count, not a width (grounding-dino's ``query_dim``: a box's 4 numbers)
    for k, v in d.items():
        now = _get(cfg, k) if isinstance(k, str) else None
        if now is None:
            continue
        if k.endswith("layer_types") and isinstance(v, list) and isinstance(now, list) and \
                set(v) - set(now) and all(isinstance(x, str) for x in v):
            # per-layer kinds whose first tiny layers hold only some of them (granitemoehybrid's
            # linear-attention layers first, its attention layers later): one layer of each kind,
            # in the default order
            kinds = list(dict.fromkeys(v))
            _set(cfg, k, kinds)
            for n in ("num_hidden_layers", "num_layers"):
                if isinstance(_get(cfg, n), int) and _get(cfg, n) == len(now):
                    _set(cfg, n, len(kinds))
        elif "heads" in k and isinstance(v, list) and isinstance(now, list) and now and \
                all(isinstance(x, int) and not isinstance(x, bool) for x in now) and max(now) > HEADS:
            _set(cfg, k, [min(x, HEADS) for x in now])   # per-layer head counts (sapiens2's kv heads)
    for nh, hd in (("mamba_n_heads", "mamba_d_head"), ("num_heads", "head_dim")):
        if all(isinstance(d.get(n), int) for n in (nh, hd)) and \
                all(isinstance(_get(cfg, n), int) for n in (nh, hd)):
            for k, v in d.items():
                if isinstance(k, str) and k.endswith("_ssm") and v == d[nh] * d[hd]:
                    # a mixer's width as heads x head width (falcon_h1's ``mamba_d_ssm``)
                    _set(cfg, k, _get(cfg, nh) * _get(cfg, hd))
    for k in _EXPERTS:
        if isinstance(d.get(k), int) and not isinstance(d[k], bool) and 0 < d[k] < 4:
            _set(cfg, k, d[k])  # fewer experts than the tiny 4 (vitpose's one: no expert split)
    for k, v in d.items():
        if k.endswith("img_size") and isinstance(v, int) and v > FALLBACK_IMAGE:
            # an image size under another name (tvp's ``max_img_size``), with the prompt border
            # drawn inside it scaled alike; ``inputs`` reads ``image_size``
            _set(cfg, k, FALLBACK_IMAGE)
            for b, w in d.items():
                if b.endswith("prompt_size") and isinstance(w, int) and w < v:
                    _set(cfg, b, w * FALLBACK_IMAGE // v)
            if "image_size" not in d:
                _set(cfg, "image_size", FALLBACK_IMAGE)
    shrunk = {k for k in d if _get(cfg, k) != d[k]}
    for k, v in d.items():
        if not isinstance(v, int) or isinstance(v, bool) or k in shrunk:
            continue
        if v > HIDDEN and (k.endswith(("_dim", "_channels", "_size", "_feats", "_dimension")) or k.startswith("dim_")) \
                and not k.startswith(("max_", "image_")) and k not in _POSITIONS:
            if v in widths:
                _set(cfg, k, HIDDEN)
            elif 2 * v in widths and "feat" in k:
                _set(cfg, k, HIDDEN // 2)
            elif v in heads:
                _set(cfg, k, HEAD_DIM)
        elif k.endswith("_num_key_value_heads"):
            _set(cfg, k, min(v, HEADS))
        elif k.endswith("_num_attention_heads"):
            _set(cfg, k, HEADS)
        elif k.endswith("_num_hidden_layers"):
            _set(cfg, k, min(v, LAYERS))
    for k, v in d.items():
        if _CHANNELS(k) and isinstance(v, list) and v and all(isinstance(x, int) and x > 0 for x in v):
            w = next((x for x in sorted(v) if x in widths), None)
            if w is not None and all(x % w == 0 for x in v):
                # per-stage widths from the hidden width up (sam2's hiera stages and the neck's
                # list of them): the same multiples of the tiny width
                _set(cfg, k, [x // w * HIDDEN for x in v])
        elif k.endswith("feature_sizes") and isinstance(v, list) and v and all(
                isinstance(x, list) and len(x) == 2 and v[-1][0] and x[0] % v[-1][0] == 0 for x in v) \
                and widths.get("patch"):
            # feature map sizes computed once from the default image (sam2's and sam3's necks):
            # the same multiples of the fallback image's grid of patches
            grid = FALLBACK_IMAGE // widths["patch"]
            _set(cfg, k, [[x[0] // v[-1][0] * grid] * 2 for x in v])
    if (widths.get("patch") or level == 2) and isinstance(d.get("patch_size"), int) and d["patch_size"] <= 16:
        # the default patches, so that every tower's grid is the fallback image's: where a neck reads
        # feature sizes fixed in the config (above: sam2's prompt encoder beside hiera's stride of
        # 16), and in the second level everywhere (a stem whose strides are fixed in code: levit's
        # 16, depth_anything's neck reading its dinov2 backbone's 14-pixel patches)
        _set(cfg, "patch_size", d["patch_size"])
    for k, v in d.items():
        if _CHANNELS(k) and isinstance(v, list) and v and isinstance(v[0], int) and \
                isinstance(_get(cfg, k), list) and _get(cfg, k) and _get(cfg, k)[0] != v[0]:
            # a stem's width that feeds the first stage (textnet's ``stem_out_channels``, the
            # first of ``hidden_sizes``): the first stage's new width
            for s, w in d.items():
                if s != k and s.endswith("_channels") and w == v[0] and _get(cfg, s) == w:
                    _set(cfg, s, _get(cfg, k)[0])
    depths, hid = d.get("depths"), d.get("hidden_size")
    if isinstance(depths, list) and depths and isinstance(hid, int) and isinstance(_get(cfg, "hidden_size"), int):
        # a Swin tower whose stages double a patch-embedding width in code (clap's audio tower:
        # ``patch_embeds_hidden_size`` x 2^(stages - 1) = ``hidden_size``, read by its projection):
        # the embedding width whose last stage is the tiny hidden width
        n = 2 ** (len(depths) - 1)
        for k, v in d.items():
            if k.endswith("embeds_hidden_size") and isinstance(v, int) and v * n == hid and \
                    _get(cfg, "hidden_size") % n == 0:
                _set(cfg, k, _get(cfg, "hidden_size") // n)
    wc = d.get("width_coefficient")
    if isinstance(wc, float) and wc > 0 and isinstance(d.get("in_channels"), list) and d["in_channels"] and \
            isinstance(_get(cfg, "in_channels"), list):
        # widths a multiplier scales in code (efficientnet's and align's stem of 32 and head of 1280
        # channels, ``round_filters``) beside stage widths from the config: multipliers of 1, the
        # first stage fed the stem's default width, the head's width the default's at 1x
        _set(cfg, "width_coefficient", 1.0)
        if isinstance(d.get("depth_coefficient"), float):
            _set(cfg, "depth_coefficient", 1.0)
        _set(cfg, "in_channels", [d["in_channels"][0]] + list(_get(cfg, "in_channels"))[1:])
        if isinstance(d.get("hidden_dim"), int):
            _set(cfg, "hidden_dim", int(d["hidden_dim"] / wc))
    img, patch = _get(cfg, "image_size"), _get(cfg, "patch_size")
    if isinstance(d.get("image_embedding_size"), int) and isinstance(img, int) and isinstance(patch, int) \
            and d["image_embedding_size"] == d.get("image_size", 0) // max(d.get("patch_size") or 1, 1):
        _set(cfg, "image_embedding_size", img // patch)


def _sixths(d):
    """Width fields of a config dict that are a sixth of its hidden width (layoutlmv3's
    ``coordinate_size`` and ``shape_size``)."""
    hidden = d.get("hidden_size")
    return [k for k, v in d.items() if isinstance(hidden, int) and isinstance(v, int) and
            not isinstance(v, bool) and k.endswith("_size") and 6 * v == hidden]


def _six(cfg, d):
    """A layout model's box embeddings (four coordinates and two shape widths, each a sixth of the
    hidden width: layoutlmv3's sizes, lilt's ``hidden_size // 6``) concatenate to its hidden
    width, which the tiny 32 does not divide into: the fallback's hidden width is 48, each of them
    8 wide (``d``: the default config's dict)."""
    for k in _HIDDEN:
        if _get(cfg, k) == HIDDEN:
            _set(cfg, k, 48)
    for k in _sixths(d):
        _set(cfg, k, 8)


def _mrope(cfg, depth=0):
    """Multimodal rotary sections (qwen2-vl, glm4v): the model defaults them (to [16, 24, 24] or
    [8, 12, 12]) for a 128-wide head when the config has none; the tiny head's rotary half gets three
    sections that sum to it."""
    from transformers import PretrainedConfig
    for k in list(_get(cfg, "sub_configs") or {}):
        v = _get(cfg, k)
        if isinstance(v, PretrainedConfig) and depth < 3:
            _mrope(v, depth + 1)
    rp = _get(cfg, "rope_parameters")
    heads = _get(cfg, "num_attention_heads")
    if not isinstance(rp, dict) or "mrope_section" in rp or not isinstance(heads, int):
        return
    head = _get(cfg, "head_dim") or _get(cfg, "hidden_size") // heads
    half = int(head * rp.get("partial_rotary_factor", _get(cfg, "partial_rotary_factor") or 1.0)) // 2
    _set(cfg, "rope_parameters", {**rp, "mrope_section": [half - 2 * (half // 3)] + [half // 3] * 2})


def _sources(cls, cfg, depth=0):
    """The source of ``cls``'s module, then of the modeling modules of ``cfg``'s nested configs (a
    retrieval or composite model over a qwen2-vl or glm4v part: colqwen2, glm46v)."""
    import importlib
    from transformers import PretrainedConfig
    if cls is not None:
        yield inspect.getsource(sys.modules[cls.__module__])
    for k in list(_get(cfg, "sub_configs") or {}):
        v = _get(cfg, k)
        if isinstance(v, PretrainedConfig) and depth < 3:
            try:
                yield inspect.getsource(importlib.import_module(
                    type(v).__module__.replace(".configuration_", ".modeling_")))
            except Exception:  # noqa: BLE001 - no modeling module beside that config
                pass
            yield from _sources(None, v, depth + 1)


def _tiny(model_type, fallback=False):
    """The tiny config ``build`` starts from: ``tiny_config``'s, and in the fallback pass a layout
    model's hidden width in sixths (``_six``)."""
    import transformers
    from transformers import AutoConfig
    cfg = tiny_config(AutoConfig.for_model(model_type), fallback=fallback)
    if fallback:
        d = AutoConfig.for_model(model_type).to_dict()
        cls = getattr(transformers, enumerate_archs()[model_type][1])
        if _sixths(d) or any("hidden_size // 6" in src for src in _sources(cls, None)):
            _six(cfg, d)
    return cfg


def build(model_type: str, dtype=None, fallback=False):
    """(kind, CPU model in eval mode seeded, config) for ``model_type``; ``fallback``: the tiny
    config's second pass (``_fallback``)."""
    import torch
    import transformers
    kind, cls_name = enumerate_archs()[model_type]
    cfg = _tiny(model_type, fallback)
    if fallback and kind == "causal" and _get(cfg, "is_decoder") is False:
        _set(cfg, "is_decoder", True)   # an LM head that asserts it (reformer's default is an encoder)
    if hasattr(cfg, "num_labels") and kind in ("seqcls", "imgcls"):
        cfg.num_labels = 3
    if kind in ("seq2seq", "speech2seq") and _get(cfg, "is_encoder_decoder") and _get(cfg, "pad_token_id") is None:
        # labels are shifted right into decoder inputs with the pad id as the first token
        # (encoder-decoder, moonshine leave it None; a checkpoint's tokenizer sets it)
        _set(cfg, "pad_token_id", 0)
        if _get(cfg, "decoder_start_token_id") is None:
            _set(cfg, "decoder_start_token_id", 0)
    cls = getattr(transformers, cls_name)
    want = getattr(cls, "config_class", None)
    if isinstance(want, type) and not isinstance(cfg, want):
        # a text-only class mapped from a composite model_type (qwen3_5 -> Qwen3_5ForCausalLM,
        # llama4 -> Llama4ForCausalLM): it is built from the composite config's text part
        cfg = next((_get(cfg, k) for k in (_get(cfg, "sub_configs") or {}) if isinstance(_get(cfg, k), want)), cfg)
    if any("mrope_section" in src for src in _sources(cls, cfg)):
        _mrope(cfg)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = cls._from_config(cfg, attn_implementation="eager")
        except Exception:  # noqa: BLE001 - models without an eager attention switch
            model = cls._from_config(cfg)
    # Parameters initialised to all zeros (MoE routers, gates, biases) get small random values:
    # a zero router ties every expert for every token, and which of equal scores CPU's topk returns
    # is its sort kernel's order, not the model's (tpu's topk breaks ties by the lower index).
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() and not bool(p.any()):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
        # A vector quantizer's codebook (an all-zero buffer until k-means or a checkpoint fills
        # it): with every code zero, every input maps to code 0 and the decoder sees a constant
        # signal, whose group norm (rstd = 1/sqrt(eps), 1000) turns float32 rounding into the
        # result: CPU's own float32 gradients were then 2.5% from the float64 ones (wavtokenizer).
        # A codebook whose ``embed`` is a property over buffers (mimi's ``embed_sum / cluster_usage``,
        # cached in a plain attribute that ``model.to()`` does not move): the buffer it is computed
        # from is filled, and the property is never read here, so no CPU cache is left behind.
        for m in model.modules():
            own = dict(m.named_buffers(recurse=False))
            if type(m).__name__.endswith("Codebook") and "embed" not in own and \
                    isinstance(own.get("embed_sum"), torch.Tensor) and not bool(own["embed_sum"].any()):
                own["embed_sum"].copy_(torch.randn(own["embed_sum"].shape, generator=g))
                if getattr(m, "_embed", None) is not None:
                    m._embed = None
        for m in model.modules():
            if type(m).__name__.endswith("Codebook") and "embed" not in dict(m.named_buffers(recurse=False)) \
                    and "embed_sum" in dict(m.named_buffers(recurse=False)):
                continue
            emb = getattr(m, "embed", None)
            if type(m).__name__.endswith("Codebook") and isinstance(emb, torch.Tensor) and \
                    emb.is_floating_point() and emb.numel() and not bool(emb.any()):
                emb.copy_(torch.randn(emb.shape, generator=g))
        # A batch norm's scale initialised near zero (rt_detr's and mobilevit's N(0, 0.01)): each
        # feature map after it is its bias, constant across space up to rounding, and rt_detr's
        # top-k query selection then picks among exactly equal scores, whose order is CPU's sort
        # kernel's (as with a zero router, above). A checkpoint's scales are near 1: set to 1.
        for m in model.modules():
            w = getattr(m, "weight", None)
            if "BatchNorm" in type(m).__name__ and isinstance(w, torch.Tensor) and w.numel() and \
                    float(w.abs().max()) < 0.1:
                w.fill_(1.0)
    return kind, model.eval(), cfg


def _sub(cfg, *names):
    """The first of ``names`` found on cfg or on its nested configs."""
    for c in (cfg, *(_get(cfg, k) for k in (_get(cfg, "sub_configs") or {}) if _get(cfg, k) is not None)):
        for n in names:
            v = _get(c, n)
            if v is not None:
                return v
    return None


def inputs(kind, model, cfg, name=None) -> dict:
    """Dummy inputs for ``name`` (the model's ``main_input_name``), and labels for a loss where the
    head has one."""
    import torch
    g = torch.Generator().manual_seed(1)
    name = name or getattr(model, "main_input_name", "input_ids")
    vocab = _sub(cfg, "vocab_size") or VOCAB
    batch = {}
    if name == "input_ids":
        ids = torch.randint(3, min(vocab, VOCAB), (BATCH, SEQ), generator=g)
        batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    elif name == "pixel_values":
        size = _sub(cfg, "image_size") or IMAGE
        size = size if isinstance(size, int) else size[0]
        ch = _sub(cfg, "num_channels") or 3
        batch = dict(pixel_values=torch.randn(BATCH, ch, size, size, generator=g))
    elif name == "input_features":
        bins = _sub(cfg, "num_mel_bins", "feature_size", "input_feat_per_channel") or 80
        frames = 2 * (_sub(cfg, "max_source_positions") or SEQ)
        batch = dict(input_features=torch.randn(BATCH, bins, min(frames, 64), generator=g))
    elif name == "input_values" and _sub(cfg, "num_mel_bins") and _sub(cfg, "max_length"):
        # a spectrogram (audio-spectrogram-transformer): (batch, frames, mel bins)
        batch = dict(input_values=torch.randn(BATCH, _sub(cfg, "max_length"), _sub(cfg, "num_mel_bins"),
                                              generator=g))
    elif name == "input_values":   # a waveform
        batch = dict(input_values=torch.randn(BATCH, 1600, generator=g))
    elif name == "pixel_values_videos":     # a clip: (batch, frames, channels, height, width)
        size = _sub(cfg, "image_size", "crop_size") or IMAGE
        size = size if isinstance(size, int) else size[0]
        batch = {name: torch.randn(BATCH, _sub(cfg, "num_frames", "frames_per_clip") or 4,
                                   _sub(cfg, "num_channels", "in_chans") or 3, size, size, generator=g)}
    elif name == "past_values":    # a time series (patchtst, timesfm): (batch, context[, channels])
        ctx = _sub(cfg, "context_length") or 32
        ch = _sub(cfg, "num_input_channels")
        batch = dict(past_values=torch.randn(BATCH, ctx, *([ch] if isinstance(ch, int) else []), generator=g))
    elif name.endswith("_embeds"):
        # embeddings its caller computes (a speculative draft model's ``noise_embeds``: its block of
        # mask-token embeddings, ``block_size`` long): (batch, block, hidden)
        block = _sub(cfg, "block_size")
        n = block if isinstance(block, int) and not isinstance(block, bool) and 0 < block <= 64 else SEQ
        batch = {name: torch.randn(BATCH, n, _sub(cfg, "hidden_size") or HIDDEN, generator=g)}
    else:
        raise NotImplementedError(f"main_input_name {name!r}: no dummy input for it")
    if name == "pixel_values" and "noise" in inspect.signature(model.forward).parameters:
        # random patch masking (vit_mae) draws on the model's device: the noise is given instead
        size, patch = batch["pixel_values"].shape[-1], _sub(cfg, "patch_size") or PATCH
        batch["noise"] = torch.rand(BATCH, (size // patch) ** 2, generator=g)
    canvas = _sub(cfg, "canvas_length")
    if isinstance(canvas, int) and "decoder_input_ids" in inspect.signature(model.forward).parameters:
        # a diffusion decoder's canvas, which forward draws with randint on the model's device when
        # none is given (diffusion_gemma): tpu's generator is not CPU's, so it is given
        batch["decoder_input_ids"] = torch.randint(0, min(vocab, VOCAB), (BATCH, canvas), generator=g)
    if kind in ("causal", "masked") and "input_ids" in batch:
        batch["labels"] = batch["input_ids"].clone()
    elif kind in ("seq2seq", "speech2seq"):
        batch["labels"] = torch.randint(3, min(vocab, VOCAB), (BATCH, SEQ - 2), generator=g)
    elif kind in ("seqcls", "imgcls"):
        batch["labels"] = torch.randint(0, 3, (BATCH,), generator=g)
    return batch


def candidates(kind, model, cfg):
    """``_layouts``'s batches, then each again with the inputs its forward requires and it lacks
    filled in (``_required``: a features mask, the Q-Former's own ids, ...)."""
    seen, unknown = [], None
    try:
        for b in _layouts(kind, model, cfg):
            seen.append(b)
            yield b
    except NotImplementedError as e:    # no plain dummy input: only the processor's layouts below
        unknown = e
    if unknown is not None:
        made = False
        for b in _processor_layouts(kind, model, cfg, {}):
            made = True
            yield b
        if not made:
            raise unknown
        return
    for b in seen:
        full = _required(model, cfg, b)
        if full is not None:
            yield full
    width = _sub(cfg, "feature_projection_input_dim")
    if seen and isinstance(width, int) and "input_features" in seen[0]:
        # features stacked by the processor before the projection (wav2vec2-bert: 2 x 80 mel bins)
        import torch
        yield {**seen[0], "input_features": torch.randn(BATCH, 2 * SEQ, width,
                                                        generator=torch.Generator().manual_seed(11))}
    f = seen[0].get("input_features") if seen else None
    if f is not None and f.dim() == 3:
        # mel bins fixed in the model's code, not in its config (gemma4_audio: 128), or frames the
        # processor stacks 4 by 4 (granite_speech5: 4 x 80): (batch, frames, bins) and (batch, bins,
        # frames)
        import torch
        g = torch.Generator().manual_seed(12)
        for bins in (128, 4 * f.shape[1]):
            x = torch.randn(BATCH, 2 * SEQ, bins, generator=g)
            yield {**seen[0], "input_features": x}
            yield {**seen[0], "input_features": x.transpose(1, 2).contiguous()}
    nc = _sub(cfg, "num_codebooks")
    if seen and isinstance(nc, int) and nc > 1 and "input_ids" in seen[0] and kind == "causal":
        # a decoder over several audio codebooks (musicgen): ids (batch x codebooks, seq), labels
        # (batch, seq, codebooks)
        import torch
        ids = torch.randint(3, VOCAB, (BATCH * nc, SEQ), generator=torch.Generator().manual_seed(10))
        yield {"input_ids": ids, "labels": ids.reshape(BATCH, nc, SEQ).transpose(1, 2).contiguous()}
    yield from _processor_layouts(kind, model, cfg, seen[0] if seen else {})


# ---------------------------------------------------------------- inputs a processor makes
#
# Models whose inputs are not their main input alone: a text with as many image placeholder tokens
# as the vision tower gives features, layout boxes beside the tokens, a time series with its lags
# and time features, an agent's states and actions, image pairs, flattened patches with their grid.
# Their processors (which need downloaded files) are not run: each rule below builds the tensors a
# processor would, from the tiny config's own fields and the model's forward signature, one rule
# per kind of input, keyed by the parameter's name. Tried after every other layout, so a row that
# built before keeps its batch.

def _processor_layouts(kind, model, cfg, base):
    """Batches as processors make them: ``base`` plus every forward parameter a rule of
    ``_Made`` knows (required ones, and the companions a processor adds), then variants."""
    import torch
    params = inspect.signature(model.forward).parameters
    required = [n for n, q in params.items() if q.default is inspect.Parameter.empty
                and q.kind not in (q.VAR_KEYWORD, q.VAR_POSITIONAL)]
    main = getattr(model, "main_input_name", None)
    main = [main] if isinstance(main, str) else list(main or [])
    for variant in range(len(_VARIANTS)):
        g = torch.Generator().manual_seed(13)
        batch = {k: v for k, v in base.items() if k in params}
        made = _Made(model, cfg, kind, batch, g, _VARIANTS[variant])
        names = [n for n in (*main, *required, *_COMPANIONS) if n in params]
        for n in dict.fromkeys(names):
            if n not in batch or made.replaces(n):
                v = made(n)
                if v is not None:
                    batch[n] = v
        if made.used and batch and (variant == 0 or made.framed):
            made.finish(batch)
            yield batch


# Parameters a processor fills beside the main input, where the model takes them (in this order:
# the token ids before the masks that follow them).
_COMPANIONS = ("input_ids", "pixel_values", "flattened_patches", "bbox", "qformer_input_ids",
               "image_embeds_position_mask", "image_attention_mask", "visual_feats", "visual_pos", "past_values",
               "past_time_features", "past_observed_mask", "future_values", "future_time_features", "static_categorical_features",
               "static_real_features", "past_values_padding", "freq", "states", "actions", "rewards",
               "returns_to_go", "timesteps", "task_inputs", "prompt_pixel_values", "prompt_masks",
               "pixel_attention_mask", "spatial_shapes", "pixel_position_ids", "audio_mel_mask",
               "decoder_input_ids", "encoder_hidden_states", "input_values", "input_features", "is_longer",
               "grid_thw", "image_grid_thw", "merge_sizes", "input_features_mask", "latents", "lang_ids")
# Variants tried in turn: pixel inputs as images, then as clips of frames (the config's
# ``num_frames``, else an image pair: keypoint matchers), then as lists of one image (idefics). The
# second variant is also where an input takes its other layout: a waveform or spectrogram with a
# channel dimension, a codec decoder's latents instead of a waveform, patches as pixel rows.
_VARIANTS = (dict(frames=None), dict(frames="clip"), dict(frames=1))


_PLACEHOLDERS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def _copy_placeholders(src, dst, depth=0):
    """The placeholder ids ``_Made`` gave ``src`` (a config the layouts ran with), onto ``dst``
    (the config of the copy taken before any run, which every stage copies)."""
    from transformers import PretrainedConfig
    for k in _PLACEHOLDERS:
        if _get(src, k) is not None and hasattr(dst, k):
            _set(dst, k, _get(src, k))
    for k in list(_get(src, "sub_configs") or {}):
        a, b = _get(src, k), _get(dst, k)
        if isinstance(a, PretrainedConfig) and isinstance(b, PretrainedConfig) and depth < 3:
            _copy_placeholders(a, b, depth + 1)


class _Made:
    """Maker of the processor-made inputs of one batch (``__call__(name)``: a tensor or None)."""

    def __init__(self, model, cfg, kind, batch, g, variant):
        self.model, self.cfg, self.kind, self.batch, self.g, self.v = model, cfg, kind, batch, g, variant
        self.used = False   # a rule of this class made something: the batch is new
        self.framed = False     # the variant's frame count was used
        self.params = inspect.signature(model.forward).parameters

    def replaces(self, name):
        """Names whose base value a processor makes differently (the ids get placeholders)."""
        if name == "input_ids" and "inputs" in self.params:
            self.batch.pop("input_ids", None)
            self.batch.pop("attention_mask", None)
            return False
        if name == "input_values" and self.v["frames"] is not None:
            return True     # remade with its channel dimension
        if name == "input_features" and isinstance(self.sub("n_window"), int):
            return True     # padded to its window
        return name in ("input_ids", "pixel_values", "past_values", "bbox", "grid_thw", "image_grid_thw") \
            and self._wants(name)

    def _wants(self, name):
        return name in self.__class__.__dict__ and name not in ("replaces", "finish")

    def __call__(self, name):
        fn = getattr(self, name, None) if self._wants(name) else None
        out = fn() if fn is not None else None
        if out is None:
            fn = self._generic(name)
            out = fn() if fn is not None else None
        if out is not None:
            self.used = True
        return out

    # -- shared sizes
    def sub(self, *names):
        return _sub(self.cfg, *names)

    def vocab(self):
        v = self.sub("vocab_size")
        return min(v, VOCAB) if isinstance(v, int) and v > 4 else VOCAB

    def image_size(self):
        # (deeper where no config a level down has one: pi0's vision tower inside its vlm_config)
        s = self.sub("image_size") or self._deep("image_size") or IMAGE
        return s if isinstance(s, int) else s[0]

    def randn(self, *shape):
        import torch
        return torch.randn(*shape, generator=self.g)

    def ids(self, n, hi=None):
        import torch
        return torch.randint(3, hi or self.vocab(), (BATCH, n), generator=self.g)

    # -- text with image placeholders
    def _placeholders(self):
        """(token id, count) of the image placeholders a processor puts in the text, or None: the
        count from the config (query tokens of a Q-Former, kosmos-2's latent queries, an image
        sequence length), the id the config names, else the last id of the vocabulary (a
        tokenizer appends the token; the text around it is drawn below it)."""
        if "pixel_values" not in self.params or "input_ids" not in self.params:
            return None
        n = self.sub("num_query_tokens", "latent_query_num", "image_seq_length", "mm_tokens_per_image")
        tok = None
        for c in (self.cfg, self.sub("text_config")):
            for k in _PLACEHOLDERS:
                if c is not None and hasattr(c, k):
                    if _get(c, k) is None or _get(c, k) >= self.vocab():
                        _set(c, k, self.vocab() - 1)
                    tok = tok if tok is not None else _get(c, k)
        if not isinstance(n, int) and tok is not None:
            n = self._features_per_image()
        return (tok, n) if isinstance(n, int) and n > 0 else None

    def _features_per_image(self):
        """How many features the model's own ``get_image_features`` gives one image (a processor
        knows it from the image size; the config names no count)."""
        import torch
        pv = self.batch.get("pixel_values")
        fn = getattr(self.model, "get_image_features", None) or getattr(
            getattr(self.model, "model", None), "get_image_features", None)
        if pv is None or fn is None:
            return None
        try:
            with torch.no_grad():
                out = fn(pixel_values=pv)
        except Exception:  # noqa: BLE001 - no count: the placeholder layout is not made
            return None
        out = getattr(out, "pooler_output", None) if not isinstance(out, (torch.Tensor, list, tuple)) else out
        if isinstance(out, (list, tuple)) and len(out) == pv.shape[0] and isinstance(out[0], torch.Tensor):
            return out[0].shape[-2]     # one (features, width) tensor per image
        if isinstance(out, torch.Tensor):
            return out.shape[1] if out.dim() == 3 else out.shape[0] // pv.shape[0]
        return None

    def input_ids(self):
        import torch
        ph = self._placeholders()
        if "inputs" in self.batch:      # a generic main input already holds the ids (perceiver)
            return None
        if ph is None:
            return None if "input_ids" in self.batch else self.ids(SEQ)
        tok, n = ph
        pv = self.batch.get("pixel_values")
        if pv is not None and pv.dim() == 5 and self.v["frames"] == "clip":
            n *= pv.shape[1]    # a video Q-Former's queries, once per frame (instructblipvideo)
        text = self.ids(SEQ, self.vocab() - 1)
        if tok is None:     # positions marked by a mask instead (kosmos-2)
            return torch.cat([text[:, :1].expand(-1, n), text], 1)
        return torch.cat([torch.full((BATCH, n), tok), text], 1)

    def frames(self):
        f = self.v["frames"]
        if f is None:
            return None
        self.framed = True
        if f == "clip":
            f = self.sub("num_frames", "frames_per_clip")
            return f if isinstance(f, int) else 2
        return f

    # -- patches of a grid of merged patches (qwen2-vl's kin): each image a 4 x 4 grid (2 x 2 merges
    # of 2 x 2 patches), each patch as the patch embedding reads it, the grid (t, h, w) beside
    def _grid_name(self):
        return next((n for n in ("grid_thw", "image_grid_thw") if n in self.params), None)

    def _merge(self):
        m = self.sub("spatial_merge_size", "merge_size", "merge_kernel_size")
        m = m[0] if isinstance(m, (list, tuple)) else m
        return m if isinstance(m, int) else 1

    def _grid_patches(self):
        import torch
        side = 2 * self._merge() if self._merge() > 1 else 4
        n = BATCH * side * side
        for name, m in self.model.named_modules():
            if isinstance(m, torch.nn.Linear) and "patch" in name.lower():
                if self.frames() is not None:
                    # pixel rows (inkling2): each patch's pixels one row of channels
                    p = self.sub("patch_size")
                    ch = self.sub("num_channels", "in_channels") or 3
                    if isinstance(p, int) and m.in_features == ch * p * p:
                        return self.randn(n * p * p, ch)
                    return None
                return self.randn(n, m.in_features)
            if isinstance(m, torch.nn.Conv2d) and "patch" in name.lower():
                return self.randn(n, m.in_channels, *m.kernel_size)
            if isinstance(m, torch.nn.Conv3d) and "patch" in name.lower():
                return self.randn(n, m.in_channels * m.kernel_size[0] * m.kernel_size[1] * m.kernel_size[2])
        return None

    def grid_thw(self):
        import torch
        side = 2 * self._merge() if self._merge() > 1 else 4
        return torch.tensor([[1, side, side]] * BATCH)

    image_grid_thw = grid_thw

    def merge_sizes(self):
        import torch
        return torch.tensor([self._merge()] * BATCH)

    def pixel_values(self):
        if self._grid_name():
            return self._grid_patches()
        if any(n in self.params for n in ("spatial_shapes", "pixel_position_ids")):
            return self._flat_pixels()
        size = self.image_size()
        ch = self.sub("num_channels", "in_chans") or 3
        f = self.frames()
        if f is None and "prompt_pixel_values" in self.params:
            # an image and its in-context prompt, stacked on the height the config gives (seggpt)
            return self.randn(BATCH, ch, size // 2, size)
        if f is None:
            return None if "pixel_values" in self.batch else self.randn(BATCH, ch, size, size)
        return self.randn(BATCH, f, ch, size, size)

    def image_attention_mask(self):
        """Which images each token attends to (idefics): every image, every token."""
        import torch
        ids, pv = self.batch.get("input_ids"), self.batch.get("pixel_values")
        if ids is None or pv is None or pv.dim() != 5:
            return None
        return torch.ones(BATCH, ids.shape[1], pv.shape[1], dtype=torch.long)

    def image_embeds_position_mask(self):
        import torch
        ids, ph = self.batch.get("input_ids"), self._placeholders()
        if ids is None or ph is None:
            return None
        m = torch.zeros(ids.shape, dtype=torch.long)
        m[:, :ph[1]] = 1
        return m

    def qformer_input_ids(self):
        return self.ids(SEQ) if "qformer_input_ids" not in self.batch else None

    # -- layout boxes: (x0, y0, x1, y1) on a 0-1000 page, each box's corners in order
    def bbox(self):
        import torch
        n = self.batch["input_ids"].shape[1] if "input_ids" in self.batch else SEQ
        lo = torch.randint(0, 500, (BATCH, n, 2), generator=self.g)
        box = torch.cat([lo, lo + torch.randint(1, 500, (BATCH, n, 2), generator=self.g)], -1)
        if self.sub("dim_bbox") == 8:
            # a quadrilateral's four corners, normalised to the page (bros)
            x0, y0, x1, y1 = (box[..., i].float() / 1000 for i in range(4))
            return torch.stack([x0, y0, x1, y0, x1, y1, x0, y1], -1)
        return box

    # -- region features beside the text (lxmert): features and boxes in [0, 1]
    def visual_feats(self):
        d = self.sub("visual_feat_dim")
        return self.randn(BATCH, 4, d) if isinstance(d, int) else None

    def visual_pos(self):
        import torch
        d = self.sub("visual_pos_dim")
        if not isinstance(d, int):
            return None
        lo = torch.rand(BATCH, 4, d // 2, generator=self.g) / 2
        return torch.cat([lo, lo + torch.rand(BATCH, 4, d - d // 2, generator=self.g) / 2], -1)

    # -- a time series with lags and time features (time_series_transformer, informer, autoformer):
    # the past is the context plus the largest lag, the future the prediction length
    def _series(self):
        ctx, pred = self.sub("context_length"), self.sub("prediction_length")
        lags = self.sub("lags_sequence")
        if not isinstance(pred, int) or not isinstance(ctx, int):
            return None
        return ctx + (max(lags) if lags else 0), pred

    def _values(self, n):
        k = self.sub("input_size")
        return self.randn(BATCH, n, *([k] if isinstance(k, int) and k > 1 else []))

    def _time_features(self, n):
        k = (self.sub("num_time_features") or 0) + (self.sub("num_dynamic_real_features") or 0)
        return self.randn(BATCH, n, k)

    def past_values(self):
        ts = self._series()
        if ts is not None:
            return self._values(ts[0])
        ctx = self.sub("context_length")    # a plain series (timesfm): the context
        return None if "past_values" in self.batch or not isinstance(ctx, int) else self.randn(BATCH, ctx)

    def past_time_features(self):
        ts = self._series()
        return None if ts is None else self._time_features(ts[0])

    def past_observed_mask(self):
        import torch
        pv = self.batch.get("past_values")
        return None if pv is None else torch.ones_like(pv)

    def future_values(self):
        ts = self._series()
        return None if ts is None else self._values(ts[1])

    def future_time_features(self):
        ts = self._series()
        return None if ts is None else self._time_features(ts[1])

    def static_categorical_features(self):
        import torch
        n, card = self.sub("num_static_categorical_features"), self.sub("cardinality")
        if not n:
            return None
        return torch.stack([torch.randint(0, c, (BATCH,), generator=self.g) for c in card[:n]], 1)

    def static_real_features(self):
        n = self.sub("num_static_real_features")
        return self.randn(BATCH, n) if n else None

    def past_values_padding(self):
        import torch
        pv = self.batch.get("past_values")
        return None if pv is None else torch.zeros_like(pv)

    def freq(self):
        import torch
        return torch.zeros(BATCH, 1, dtype=torch.long)     # the high-frequency class

    # -- an agent's trajectory (decision_transformer): states, actions, rewards, returns, steps
    def states(self):
        d = self.sub("state_dim")
        return self.randn(BATCH, SEQ, d) if isinstance(d, int) else None

    def actions(self):
        d = self.sub("act_dim")
        return self.randn(BATCH, SEQ, d) if isinstance(d, int) else None

    def rewards(self):
        return self.randn(BATCH, SEQ, 1) if "states" in self.batch else None

    def returns_to_go(self):
        return self.randn(BATCH, SEQ, 1) if "states" in self.batch else None

    def timesteps(self):
        import torch
        return torch.arange(SEQ).expand(BATCH, SEQ).contiguous() if "states" in self.batch else None

    # -- a task prompt's tokens (oneformer: "the task is semantic"), as long as the config says
    def task_inputs(self):
        n = self.sub("task_seq_len")
        return self.ids(n) if isinstance(n, int) else None

    # -- an in-context segmentation prompt (seggpt): a prompt image and its mask, as the image
    def prompt_pixel_values(self):
        pv = self.batch.get("pixel_values")
        return None if pv is None else self.randn(*pv.shape)

    def prompt_masks(self):
        pv = self.batch.get("pixel_values")
        return None if pv is None else self.randn(*pv.shape)

    # -- flattened patches with their grid (siglip2, gemma4's vision tower, pix2struct): a 4 x 4
    # grid of patches, each as wide as the patch embedding reads
    def _patch_width(self):
        import torch
        for n, m in self.model.named_modules():
            if isinstance(m, torch.nn.Linear) and "patch" in n.lower():
                return m.in_features
        p, ch = self.sub("patch_size"), self.sub("num_channels") or 3
        return ch * p * p if isinstance(p, int) else None

    def _grid(self):
        n = self.sub("num_patches")
        side = int(round(n ** 0.5)) if isinstance(n, int) and n <= 64 else 4
        return side

    def flattened_patches(self):
        import torch
        w, side = self._patch_width(), self._grid()
        if w is None:
            return None
        rows = torch.arange(1, side + 1).repeat_interleave(side).float()
        cols = torch.arange(1, side + 1).repeat(side).float()
        pos = torch.stack([rows, cols], -1).expand(BATCH, -1, -1)
        return torch.cat([pos, self.randn(BATCH, side * side, w)], -1)

    def _flat_pixels(self):
        w, side = self._patch_width(), self._grid()
        return None if w is None else self.randn(BATCH, side * side, w)

    def spatial_shapes(self):
        import torch
        side = self._grid()
        return torch.tensor([[side, side]] * BATCH)

    def pixel_attention_mask(self):
        import torch
        pv = self.batch.get("pixel_values")
        if pv is not None and pv.dim() == 5 and "action_embeds" in self.params:
            # an agent's camera views (pi0: (batch, cameras, channels, height, width)): every
            # camera present
            return torch.ones(pv.shape[:2], dtype=torch.bool)
        if pv is None or pv.dim() != 3:
            return None
        return torch.ones(pv.shape[:2], dtype=torch.long)

    def pixel_position_ids(self):
        import torch
        side = self._grid()
        xy = torch.stack([torch.arange(side).repeat(side), torch.arange(side).repeat_interleave(side)], -1)
        return xy.expand(BATCH, -1, -1).contiguous()

    # -- audio beside another input (a text and audio tower, a codec's semantic features): a
    # waveform, or features (batch, bins, frames); with the variant's leading dimension, a channel:
    # (batch, 1, samples), or a spectrogram as a one-channel image (batch, 1, frames, bins), clap
    def _deep(self, name, cfg=None, depth=0):
        """``name`` in the config or any config nested in it (pe_audio's codec in its audio tower)."""
        from transformers import PretrainedConfig
        cfg = self.cfg if cfg is None else cfg
        v = _get(cfg, name)
        if v is not None or depth > 3:
            return v
        for k in list(_get(cfg, "sub_configs") or {}):
            c = _get(cfg, k)
            if isinstance(c, PretrainedConfig):
                v = self._deep(name, c, depth + 1)
                if v is not None:
                    return v
        return None

    def _hop(self):
        """A codec's encoder downsamples by the product of its ratios."""
        hop = 1
        for r in self._deep("downsampling_ratios") or []:
            hop *= r if isinstance(r, int) else 1
        return hop

    def hidden_states(self):
        """A codec's half alone (vibevoice's acoustic encoder and decoder): a mono waveform for the
        encoder, latents (batch, channels, frames) for the decoder (the variant)."""
        if getattr(self.model, "main_input_name", None) != "input_values":
            return None     # the generic rule: (batch, seq, hidden)
        f = self.frames()
        return self.randn(BATCH, 1, max(1600, 8 * self._hop())) if f is None else self.randn(BATCH, HIDDEN, SEQ)

    def latents(self):
        """A codec decoder alone (mimi's, pocket_tts's): continuous latents (batch, hidden, frames)."""
        return self.randn(BATCH, self.sub("hidden_size") or HIDDEN, SEQ)

    def lang_ids(self):
        """A per-language adapter's choice (xmod): the first language for every sample."""
        import torch
        return torch.zeros(BATCH, dtype=torch.long)

    def input_values(self):
        if "input_values" in self.batch and self.v["frames"] is None:
            return None
        n = max(1600, 8 * self._hop())     # 8 frames' worth of samples
        f = self.frames()
        return self.randn(BATCH, n) if f is None else self.randn(BATCH, 1, n)

    def input_features(self):
        win = self.sub("n_window")
        if isinstance(win, int) and self.v["frames"] is None:
            # padded by the processor to a multiple of the encoder's window pair (qwen3_asr)
            return self.randn(BATCH, self.sub("num_mel_bins") or 80, 2 * win)
        if "input_features" in self.batch:
            return None
        width = self._deep("feature_projection_input_dim")
        if isinstance(width, int):
            # features stacked by the processor (a w2v-bert semantic tower), one frame per frame of
            # the codec's waveform beside them (xcodec2 adds the two)
            wave, hop = self.batch.get("input_values"), self._hop()
            n = wave.shape[-1] // hop if wave is not None and hop > 1 else 4 * SEQ
            return self.randn(BATCH, n, width)
        bins = self.sub("num_mel_bins", "feature_size", "n_mels") or 80
        f = self.frames()
        return self.randn(BATCH, bins, 4 * SEQ) if f is None else self.randn(BATCH, 1, 4 * SEQ, bins)

    def input_features_mask(self):
        import torch
        f = self.batch.get("input_features")
        return None if f is None else torch.ones(f.shape[0], f.shape[-1], dtype=torch.long)

    def is_longer(self):
        import torch
        return torch.zeros(BATCH, 1, dtype=torch.bool) if "input_features" in self.batch else None

    # -- a mel spectrogram with its padding mask (gemma3n's audio tower: True marks padding)
    def audio_mel(self):
        bins = self.sub("input_feat_size", "num_mel_bins", "feature_size")
        return self.randn(BATCH, 4 * SEQ, bins) if isinstance(bins, int) else None

    def audio_mel_mask(self):
        import torch
        mel = self.batch.get("audio_mel")
        return None if mel is None else torch.zeros(mel.shape[:2], dtype=torch.bool)

    # -- a generic main input (perceiver, speech-encoder-decoder): what its encoder reads
    def inputs(self):
        enc = _get(self.model, "encoder")
        name = getattr(enc, "main_input_name", None) if enc is not None else None
        if name == "input_values":
            return self.randn(BATCH, 1600)
        if name == "input_features":
            bins = self.sub("num_mel_bins", "feature_size") or 80
            return self.randn(BATCH, bins, 2 * SEQ)
        return self.ids(SEQ)

    def _generic(self, name):
        """Rules by the form of the name alone."""
        import torch
        if name.endswith("attention_mask"):
            return None     # made in finish, after the ids they follow
        if name.endswith("_embeds") or name in ("hidden_states", "context_hidden_states", "encoder_hidden_states"):
            # embeddings or states a model's other half makes (a word-timestamp head's inputs, the
            # Q-Former's vision states): the tiny width every hidden size was set to
            return lambda: self.randn(BATCH, SEQ, HIDDEN)
        if name == "decoder_input_ids" and _get(self.cfg, "is_encoder_decoder") is not False and \
                "labels" not in self.batch:
            return lambda: self.ids(SEQ - 2)
        return None

    def finish(self, batch):
        """Masks that follow the final shapes (ids' attention mask, qformer's)."""
        import torch
        for ids_name, mask_name in (("input_ids", "attention_mask"), ("qformer_input_ids", "qformer_attention_mask")):
            ids = batch.get(ids_name)
            if ids is not None and mask_name in self.params:
                batch[mask_name] = torch.ones_like(ids)
        ids = batch.get("input_ids")
        if ids is not None and isinstance(batch.get("labels"), torch.Tensor) and self.kind in ("causal", "masked"):
            batch["labels"] = ids.clone()
        for n in ("image_embeds_position_mask",):
            if n in batch and ids is not None and batch[n].shape != ids.shape:
                batch[n] = self.image_embeds_position_mask()


def _required(model, cfg, batch):
    """``batch`` with the inputs ``model.forward`` requires (no default), or uses beside its main
    input to know the batch's layout, filled in where a rule knows them; None if it adds nothing."""
    import torch
    params = inspect.signature(model.forward).parameters
    g = torch.Generator().manual_seed(9)
    add = {}
    feats = batch.get("input_features")
    for n in ("input_features_mask", "feature_attention_mask"):
        if n in params and n not in batch and isinstance(feats, torch.Tensor):
            # every frame valid; frames are the last dimension of (batch, bins, frames)
            add[n] = torch.ones(feats.shape[0], feats.shape[-1], dtype=torch.long)
    ids = batch.get("input_ids")
    if "qformer_input_ids" in params and "qformer_input_ids" not in batch and isinstance(ids, torch.Tensor):
        add["qformer_input_ids"] = ids.clone()      # instructblip: the Q-Former reads the prompt too
        add["qformer_attention_mask"] = torch.ones_like(ids)
    if "query_embeds" in params and params["query_embeds"].default is inspect.Parameter.empty:
        width = _sub(cfg, "hidden_size") or HIDDEN       # blip-2's Q-Former alone: its query tokens
        add["query_embeds"] = torch.randn(BATCH, _sub(cfg, "num_query_tokens") or 8, width, generator=g)
    for n, p in params.items():
        if n.endswith("context_hidden_states") and p.default is inspect.Parameter.empty and n not in batch:
            # a draft model's context: its target's hidden states at ``target_layer_ids``,
            # concatenated on the last dim (muse_glimmer_assistant), as running the target gives them
            layers = _sub(cfg, "target_layer_ids")
            width = (_sub(cfg, "hidden_size") or HIDDEN) * (len(layers) if isinstance(layers, list) and layers else 1)
            add[n] = torch.randn(BATCH, SEQ, width, generator=g)
    if "decoder_input_ids" in params and "decoder_input_ids" not in batch and "labels" not in batch and (
            "input_features" in batch or "input_values" in batch):
        # a transducer's prediction network reads the previous tokens (parakeet_rnnt, parakeet_tdt)
        vocab = _sub(cfg, "vocab_size") or VOCAB
        add["decoder_input_ids"] = torch.randint(3, min(vocab, VOCAB), (BATCH, SEQ - 2), generator=g)
    return {**batch, **add} if add else None


def _layouts(kind, model, cfg):
    """Dummy batches to try in order, the first that runs on CPU is the one compared: ``inputs``'s,
    then the other layouts models of the same main input take (features as (batch, frames, bins):
    parakeet, lasr; a waveform with a channel dimension: codecs, dac, encodec), labels as long as
    the input ids (a "seq2seq" class that is a decoder over text and audio, fsmt without decoder
    ids), token boxes where forward takes ``bbox`` (bros), and both towers of a two-tower model."""
    import torch
    params = inspect.signature(model.forward).parameters
    try:
        base = inputs(kind, model, cfg)
    except NotImplementedError:
        base = {}
    else:
        yield base
    grid = next((n for n in ("grid_thw", "image_grid_thw") if n in params), None)
    if grid and grid not in base:
        # a vision tower over flattened patches (qwen2-vl's and its kin's): each image a 4 x 4 grid of
        # patches of channels x temporal patch x patch x patch, the grid (t, h, w) per image beside it
        g = torch.Generator().manual_seed(6)
        p = _sub(cfg, "patch_size") or 14
        p = p if isinstance(p, int) else p[0]
        t = _sub(cfg, "temporal_patch_size") or 1
        ch = _sub(cfg, "in_channels", "num_channels", "in_chans") or 3
        side = 2 * (_sub(cfg, "spatial_merge_size", "merge_size") or 2)
        first = next(n for n in params if n not in ("self", grid))
        yield {first: torch.randn(BATCH * side * side, ch * t * p * p, generator=g),
               grid: torch.tensor([[1, side, side]] * BATCH)}
    if not base and grid:
        return
    if not base:
        raise NotImplementedError(f"main_input_name {getattr(model, 'main_input_name', None)!r}: "
                                  "no dummy input for it")
    if "pixel_values" in base and base["pixel_values"].dim() == 4 and _sub(cfg, "num_frames", "frames_per_clip"):
        pv = base["pixel_values"]       # a video model (videomae, timesformer): frames of the image
        yield {**base, "pixel_values": pv.unsqueeze(1).expand(-1, _sub(cfg, "num_frames", "frames_per_clip"),
                                                             -1, -1, -1).contiguous()}
    if "input_features" in base:
        yield {**base, "input_features": base["input_features"].transpose(1, 2).contiguous()}
    mel = _sub(cfg, "max_source_positions")
    if "input_features" in base and isinstance(mel, int) and 2 * mel != base["input_features"].shape[-1] \
            and mel <= 128:
        # an audio encoder that takes exactly 2 x max_source_positions frames (qwen2-audio, voxtral)
        f = base["input_features"]
        yield {**base, "input_features": torch.randn(*f.shape[:-1], 2 * mel, generator=torch.Generator().manual_seed(7))}
    if "input_values" in base and base["input_values"].dim() == 2:
        yield {**base, "input_values": base["input_values"].unsqueeze(1)}
        # a codec whose encoder downsamples by the product of its ratios (mimi 960, vibevoice 3200,
        # muse_spark 1920, which wants a multiple of it): 8 frames' worth of samples, mono
        hop = 1
        for r in (_sub(cfg, "downsampling_ratios", "upsampling_ratios", "patch_sizes", "strides") or []):
            hop *= r if isinstance(r, int) else 1
        n = 8 * hop if hop > 1 else 16000
        wave = torch.randn(BATCH, 1, n, generator=torch.Generator().manual_seed(8))
        yield {**base, "input_values": wave[:, 0]}
        yield {**base, "input_values": wave}
    if "labels" in base and "input_ids" in base and base["labels"].shape != base["input_ids"].shape \
            and base["labels"].dim() == 2:
        yield {**base, "labels": base["input_ids"].clone()}
    if "bbox" in params and "input_ids" in base:
        g = torch.Generator().manual_seed(4)
        lo = torch.randint(0, 500, (BATCH, SEQ, 2), generator=g)
        yield {**base, "bbox": torch.cat([lo, lo + torch.randint(1, 500, (BATCH, SEQ, 2), generator=g)], -1)}
    other = {"input_ids": "pixel_values", "pixel_values": "input_ids", "pixel_values_videos": "input_ids"}.get(
        getattr(model, "main_input_name", None))
    if other in params:
        both = {**inputs(kind, model, cfg, other), **base}
        if "return_loss" in params:
            both["return_loss"] = True
        yield both


def _floats(out):
    """The floating tensors of a model output, in order (tuples and ModelOutputs flattened)."""
    import torch
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _floats(o)]
    if hasattr(out, "to_tuple"):
        return _floats(out.to_tuple())
    return []


def loss_of(out):
    """The head's loss, else a fixed random-weighted mean of every floating output (a base model;
    a plain mean square of layer-normed outputs is nearly constant, its gradients rounding noise)."""
    import torch
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() > 1:
        return loss.float().mean()      # a loss per sample or per codebook (dac): their mean
    if loss is not None:
        return loss
    fl = _floats(out)
    if not fl:
        raise RuntimeError("the model returns no floating tensor to take a loss of")
    total = 0
    for i, t in enumerate(fl):
        w = torch.randn(t.shape, generator=torch.Generator().manual_seed(2 + i)).to(t.device)
        total = total + (t.float() * w).mean()
    return total


def run_model(model, batch, device):
    """(loss, [compared outputs], {param name: grad}) of one forward and backward on ``device``."""
    import torch
    dt = next(model.parameters()).dtype
    b = {k: (v.to(device, dt) if v.is_floating_point() else v.to(device)) if isinstance(v, torch.Tensor) else v
         for k, v in batch.items()}
    import inspect
    if "use_cache" in inspect.signature(model.forward).parameters:
        b["use_cache"] = False      # a training step: no cache (hybrid models' caches refuse it)
    # The same CPU generator state for each run: a model that draws on CPU in its forward (vilt's
    # patch sampling, torch.multinomial over a CPU tensor) draws the same on both sides.
    torch.manual_seed(5)
    out = model(**b)
    loss = loss_of(out)
    logits = getattr(out, "logits", None)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    keep = [loss] + ([logits] if isinstance(logits, torch.Tensor) else [])
    return [t.detach().cpu() for t in keep], {n: (None if g is None else g.detach().cpu()) for n, g in grads.items()}


def _close(got, want, tol, ref=None, loose=None, name=""):
    """None when ``got`` matches ``want`` within ``tol`` (atol scaled by want's magnitude), or
    no farther from ``ref`` than ``want`` is, or (``loose``, a list) left to the model-level rules:
    ``(name, got, want, within BF16_SCALE of want's largest magnitude)`` appended; else a message."""
    import torch
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"dtype/shape {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
    scale = max(1.0, float(want.detach().double().abs().nan_to_num(0, 0, 0).max())) if want.numel() else 1.0
    atol, rtol = tol[0] * scale, tol[1]
    g, w = got.double(), want.double()
    bad = ~((g - w).abs() <= atol + rtol * w.abs()) & ~(g.isnan() & w.isnan())
    if not bool(bad.any()):
        return None
    if ref is not None:
        r = ref.double()
        slack = (w - r).abs() + atol + rtol * r.abs()
        if bool(((g - r).abs() <= slack).logical_or(g.isnan() & r.isnan()).all()):
            return None
    if loose is not None:       # left to the model-level rules (check's bf16 stage)
        loose.append((name, got, want, bool(((g - w).abs() <= BF16_SCALE * scale).logical_or(
            g.isnan() & w.isnan()).all())))
        return None
    i = int(bad.flatten().nonzero()[0])
    return (f"{int(bad.sum())}/{bad.numel()} elements differ, first at {i}: {float(g.flatten()[i]):.6g} vs "
            f"{float(w.flatten()[i]):.6g} (atol {atol:.2g}, rtol {rtol:.2g})")


def compare(got, want, tol, ref=None, loose=None):
    """Raise AssertionError at the first output or gradient that differs."""
    outs_g, grads_g = got
    outs_w, grads_w = want
    names = ["loss", "logits"]
    for i, (g, w) in enumerate(zip(outs_g, outs_w)):
        msg = _close(g, w, tol, None if ref is None else ref[0][i], loose, names[i])
        if msg:
            raise AssertionError(f"{names[i]}: {msg}")
    if sorted(grads_g) != sorted(grads_w):
        raise AssertionError("parameter names differ")
    for n, w in grads_w.items():
        g = grads_g[n]
        if (g is None) != (w is None):
            raise AssertionError(f"grad {n}: {'none' if g is None else 'a gradient'} on tpu, "
                                 f"{'none' if w is None else 'a gradient'} on CPU")
        if w is None:
            continue
        msg = _close(g, w, tol, None if ref is None else ref[1][n], loose, n)
        if msg:
            raise AssertionError(f"grad {n}: {msg}")


def compare_bf16(row, got, cm, batch, cw, ref, ref_batch):
    """The bfloat16 stage's verdict on tpu's result ``got`` (AssertionError where it fails): the
    OpInfo rule against CPU bfloat16's result ``cw`` and the float32 run ``ref`` of the same
    bfloat16 weights (``cm``, never run; ``ref_batch``: the inputs rounded to bfloat16), else, where
    CPU's result depends on the order of equal values its ``topk``/``sort`` select, the same against
    CPU in the defined order (``_stable_ties``, recorded as ``bf16_stable_ties``), else the
    model-level rules for the tensors still failing."""
    loose = []
    compare(got, cw, BF16_TOL, ref, loose)
    ties = None
    if loose:
        stable = _tie_reference(lambda: run_model(copy.deepcopy(cm), batch, "cpu"), cw)
        if stable is not None:
            ties = _stable_ties
            row["bf16_stable_ties"] = True
            with ties():
                ref = run_model(copy.deepcopy(cm).float(), ref_batch, "cpu")
            loose = []
            compare(got, stable, BF16_TOL, ref, loose)
    if loose:
        model_rules(row, loose, cm, batch, ref, ties)


def model_rules(row, loose, cm, batch, ref=None, ties=None):
    """The tensors that failed the OpInfo rule (``loose``: (name, tpu, CPU, within the scale rule))
    under the model-level rules: row's ``bf16_scale_rule`` (their first names), ``bf16_scale_ok``
    and ``bf16_dynamo_ok`` (every one passes that rule); AssertionError where one passes neither.
    ``ties``: the context the float64 run takes (``_stable_ties`` where the CPU reference did)."""
    import torch
    from torch._dynamo.utils import same
    row["bf16_scale_rule"] = [n for n, *_ in loose[:5]]
    row["bf16_scale_ok"] = all(ok for *_, ok in loose)
    why = None
    try:    # the same bfloat16 weights and inputs, computed in float64 on CPU
        with (ties or contextlib.nullcontext)():
            outs, grads = run_model(copy.deepcopy(cm).double(), {k: (v.to(torch.bfloat16).double() if isinstance(
                v, torch.Tensor) and v.is_floating_point() else v) for k, v in batch.items()}, "cpu")
        r64 = dict(zip(["loss", "logits"], outs), **grads)
    except Exception as e:  # noqa: BLE001 - the model refuses float64 on CPU: its float32 result
        r64, why = None, _first_line(e)
        if ref is not None:
            r64 = {n: (None if t is None else t.double()) for n, t in
                   dict(zip(["loss", "logits"], ref[0]), **ref[1]).items()}
    bad = []
    for name, g, w, scale_ok in loose:
        ok = r64 is not None and r64.get(name) is not None and same(
            w, g, fp64_ref=r64[name], tol=DYNAMO_TOL, log_error=lambda *a, **k: None)
        if not ok and not scale_ok:
            bad.append(name)
        row["bf16_dynamo_ok"] = row.get("bf16_dynamo_ok", True) and bool(ok)
    if bad:
        g, w = next((g, w) for n, g, w, _ in loose if n == bad[0])
        i = int(((g.double() - w.double()).abs()).flatten().argmax())
        raise AssertionError(
            f"{'' if bad[0] in ('loss', 'logits') else 'grad '}{bad[0]}: fails the OpInfo, scale and "
            f"dynamo rules ({len(bad)} tensors), largest difference at {i}: {float(g.flatten()[i]):.6g} vs "
            f"{float(w.flatten()[i]):.6g}" + ("" if why is None else f"; against float32, no float64 run: {why}"))


def _first_line(e):
    if isinstance(e, ImportError) and not str(e).split("\n", 1)[0].strip():
        # transformers' requires_backends raises an empty ImportError: name the missing packages
        tb, missing = e.__traceback__, None
        while tb is not None:
            if tb.tb_frame.f_code.co_name == "requires_backends":
                missing = tb.tb_frame.f_locals.get("backends")
            tb = tb.tb_next
        if missing:
            names = [getattr(b, "package_name", None) or str(b) for b in
                     (missing if isinstance(missing, (list, tuple)) else [missing])]
            return f"ImportError: needs {', '.join(names)} (not installed)"
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


# Why a row is not built tiny on CPU, by the kind of its failure: (text in the first error line,
# the argument). ``unbuilt_reason`` tries these, then whether the default config builds at all.
_TIMM = ("needs timm, whose models need torchvision: PyPI's torchvision wheel for torch 2.13 links "
         "CUDA torch (libtorch_cuda), so it does not load beside the CPU build, and PyTorch's CPU wheel "
         "index is not reachable from the development machine")
_UNBUILT_RULES = (
    ("needs vision, timm", _TIMM),
    ("needs timm", _TIMM),
    ("needs natten", "needs natten (neighbourhood-attention kernels), which no package index reachable from "
                     "the development machine has"),
    ("needs torchaudio", "needs torchaudio, which no package index reachable from the development machine "
                         "has for torch 2.13 CPU"),
    ("needs detectron2", "needs detectron2 (its visual backbone), which is not on PyPI: built from source "
                         "against a matching torch"),
    ("needs pytesseract", "needs pytesseract and the tesseract OCR binary"),
    ("argument: 'inference_session'", "a video tracker: forward reads an `inference_session` (the frames, "
     "prompts and memory bank its processor keeps across a video), not a batch of tensors"),
    ("timed out after", "no error to argue: the row timed out on the shared machine (each stage compiles, "
     "and a row shares two cores with the load); rerun it alone with a longer --timeout"),
    ("exit -9", "no error to argue: the row's process was killed (signal 9: out of memory on the shared "
     "machine); rerun it alone"),
    ("_forward_unimplemented()", "the class defines no forward: it runs through `generate` or its "
     "sub-models (bark's three stages, a VQ tokenizer's encode/decode), so there is no one forward "
     "with a loss to compare"),
)


def unbuilt_reason(model_type, error):
    """A one-line argument for why ``model_type`` is not built tiny on CPU (``error``: its first
    error line), or None where no rule knows one: a missing package or input by ``_UNBUILT_RULES``,
    else the default config's own failure where it does not build either (on the meta device, so
    a full-size model costs no memory), else ``UNBUILT``'s argument for that model."""
    import re
    for text, why in _UNBUILT_RULES:
        if text in error:
            return why
    m = re.search(r"forward\(\) missing \d+ required positional arguments?: (.*)", error)
    if m:
        return (f"forward requires {m.group(1)}: inputs only its own processor makes, which no rule of "
                "`_Made` knows how to build")
    default = _default_error(model_type)
    if default is not None and default.split(":", 1)[0] == error.split(":", 1)[0]:
        return f"the default config does not build either (a transformers bug): {default[:160]}"
    return UNBUILT.get(model_type)


def _default_error(model_type):
    """The first error line of building ``model_type``'s class from its untouched default config
    on the meta device, or None where it builds."""
    import torch
    import transformers
    from transformers import AutoConfig
    try:
        cls = getattr(transformers, enumerate_archs()[model_type][1])
        cfg = AutoConfig.for_model(model_type)
        want = getattr(cls, "config_class", None)
        if isinstance(want, type) and not isinstance(cfg, want):
            cfg = next((_get(cfg, k) for k in (_get(cfg, "sub_configs") or {}) if isinstance(_get(cfg, k), want)), cfg)
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            cls._from_config(cfg)
    except Exception as e:  # noqa: BLE001 - the default's own failure is the answer
        return _first_line(e)
    return None


# Rows no rule builds, with the argument for each (checked against the row's error by the sweep:
# a row's reason is given only while it is not built).
UNBUILT = {
    "bridgetower": "its vision blocks take hidden_size // 64 attention heads (hard-coded): the 32-wide tiny "
                   "config has none, and nn.MultiheadAttention refuses 0 heads",
    "depth_pro": "each of its three image scales (the smallest 0.25) must hold a whole 384-pixel patch "
                 "(`patch_size`, the size its patch encoder is built for): images of 1536 px, too slow on CPU",
    "neomme": "its value embeddings sit on the first and the last global-attention layer, and the tiny "
              "model's two layers hold none",
    "align": "its EfficientNet tower's stem (32) and head (1280) widths are constants in its code, "
             "scaled by `width_coefficient` and rounded to `depth_divisor`, while its stage widths "
             "come from the config: narrowed stages no longer meet the stem (a 16-group depthwise "
             "convolution fed 64 channels), and the default stages with the 3.1x depth multiplier are "
             "no tiny model",
    "blt": "a byte-level model of four configs (patcher, local encoder and decoder, global model) "
           "whose widths meet through fields the rules do not pair: after shrinking, a 64-wide "
           "RMSNorm meets a 32-wide state",
    "clvp": "forward needs the mel features its processor makes, and with them the conditioning "
            "encoder's rotary embedding (built for another config's width) meets the 8-wide tiny "
            "heads (8 vs 32 at the rotary step)",
    "dia": "its decoder predicts `num_channels` (9) codebooks per step with a delay pattern: labels "
           "are (batch x channels, steps) as its processor lays them out, which no plain labels "
           "layout gives (18 vs 16 rows)",
    "doge": "transformers' doge forward tests `isinstance(mask, BlockMask)`, a name it imports only "
            "where flex attention is available (not in torch 2.13's CPU build here): a NameError in "
            "any config, a transformers bug",
    "dory": "its layer kinds (`layer_types`: sliding attention, mlp, full attention) are laid out by "
            "`n_input_layers`/`n_recurrent_layers`/`n_output_layers` and read by kind from "
            "`rope_parameters`, which has no entry for its `mlp` layers once the tiny layout keeps "
            "one (KeyError 'mlp')",
    "efficientloftr": "its matcher's 2-D rotary embedding is sized by the coarse feature map its backbone "
                      "computes from the image and a fixed stride, against `hidden_size`: the tiny width meets "
                      "16 where 8 is expected",
    "ernie4_5_vl_moe": "its vision patches, image grid and placeholder tokens (a merged 2 x 2 grid per image, "
                       "counted in the text by its processor) disagree under every layout the rules make (2 "
                       "placeholder tokens for 8 features)",
    "gemma4_unified_assistant": "a draft model for speculative decoding: forward reads its target model's "
                                "`shared_kv_states` and embeddings, made by running the target, not by a processor",
    "granitemoehybrid": "every layer of its default config is linear attention (mamba), and its forward asks the "
                        "cache for an attention layer's length (`get_seq_length`): no layout of those layers has "
                        "one, a transformers bug",
    "kyutai_speech_to_text": "its audio codes are ids past the text vocabulary, in `num_codebooks` streams beside the "
                             "text, padded with an audio padding row the tiny vocabulary must keep: the ids and codes "
                             "its processor interleaves (8 vs 33 streams) no rule makes",
    "lw_detr": "the default config leaves its projector's `projector_scale_factors` and "
               "`projector_in_channels` empty (a checkpoint fills them): no feature map reaches the "
               "projector (an empty torch.cat), whatever the size",
    "minicpm_ocr_vision": "a vision tower alone whose forward needs `target_sizes` (each image's patch grid, made "
                          "by its processor's slicing of the image, which sets its nearest position ids) and no "
                          "rule knows that slicing",
    "minicpmv4_7_vision": "a vision tower alone whose forward needs `target_sizes` (each image's patch grid, made "
                          "by its processor's slicing of the image, which sets its nearest position ids) and no "
                          "rule knows that slicing",
    "pp_doclayout_v2": "its post-processing in forward reads `class_thresholds`, one per class, which the "
                       "default config leaves None (a checkpoint fills it): None in any size",
    "pp_ocrv5_mobile_rec": "a text-line recogniser whose backbone strides the height by 32 and then pools 3 x 2: "
                           "images at least 96 px high and wider than they are high, the lines its processor crops; "
                           "square images of 32 or 128 px reach a 1 x 1 map",
    "pp_ocrv6_small_det": "its neck's input widths are the backbone's stage widths scaled by a factor fixed in code "
                          "(PP-LCNetV4's `scale`), so narrowed stages meet 384 channels where 12 are expected",
    "qwen2_5_omni_thinker": "a thinker over text, images, video and audio: forward needs the audio feature lengths "
                            "and position ids its processor computes beside the interleaved placeholders, which no "
                            "rule of `_Made` makes",
    "qwen3_omni_moe_thinker": "a thinker over text, images, video and audio: forward needs the audio feature lengths "
                              "and position ids its processor computes beside the interleaved placeholders, which no "
                              "rule of `_Made` makes",
    "shieldgemma2": "an image classifier that scores the yes/no tokens of a policy prompt: its labels are "
                    "over the prompt's token positions its processor builds around the image placeholders, "
                    "not one class per image",
    "step3p7": "its image placeholders are laid out by the processor per image crop and patch (the "
               "features outnumber any placeholder count the config names: 2 tokens for 32 features)",
    "tvp": "its visual prompt pads frames to `max_img_size` and its grid position embeddings read "
           "the backbone's feature grid at a stride fixed in code; with the fallback image the grid "
           "rows and columns disagree",
    "uvdoc": "its bridge convolutions read the backbone's last stage widths fixed in code (768) beside "
             "the config's `bridge_connector`: narrowed stages meet 768 where 128 are given",
    "voxtral_realtime": "its audio encoder's frames are added to the text embeddings position by position, so the "
                        "audio features must be exactly as long as the text its processor aligns (8 tokens vs 4 "
                        "audio frames)",
    "wavtokenizer_encoder": "a codec's encoder half: forward returns only the integer codes (no floating tensor to "
                            "take a loss of), so there is nothing to compare by gradients",
    "xcodec": "its quantizer compares the acoustic and semantic towers' concatenated outputs (twice the "
              "width: 64) with a codebook of the tiny width (32); the widths are summed in code, not in "
              "the config",
}


def _build_and_run(model_type, row, verbose=False):
    """(kind, model, cfg, pristine copy, batch, CPU result) of the first tiny config and input
    layout that runs on CPU: the first pass of ``tiny_config`` with every layout of ``candidates``,
    then, only if none runs, its fallback pass, then only if that runs neither, the fallback's
    second level (``row["fallback"]``: true or 2 says which built it); the error of the fullest
    attempt (the last pass's last layout) is raised where none runs."""
    err = None
    for fallback in (False, True, 2):
        if fallback and err is not None and not isinstance(err, _BuildError) and (
                _tiny(model_type, fallback - 1 if fallback == 2 else False).to_dict()
                == _tiny(model_type, fallback).to_dict()):
            continue    # this pass changes nothing in the config: the same model again
        try:
            try:
                kind, model, cfg = build(model_type, fallback=fallback)
            except Exception as e:  # noqa: BLE001 - the fallback pass, or reported
                raise _BuildError(_first_line(e)) from e
            row.update(kind=kind, cls=type(model).__name__, params=sum(p.numel() for p in model.parameters()))
            # Every other copy is taken from this one, made before any run: each device starts from
            # the state CPU started from, and a model that keeps its forward's tensors in plain
            # attributes (recurrent_gemma's recurrent and convolution states, non-leaf after a
            # forward with grad) cannot be deep-copied once it has run.
            pristine = copy.deepcopy(model)
            first = None
            for batch in candidates(kind, model, cfg):
                try:
                    want = run_model(model, batch, "cpu")
                    break
                except Exception as e:  # noqa: BLE001 - the next layout; the last error is reported
                    first = e   # (the last layout is the fullest: a first one often just lacks an input)
                    model.zero_grad(set_to_none=True)
                    if verbose:
                        traceback.print_exc()
            else:
                raise first
        except Exception as e:  # noqa: BLE001 - the fallback pass, or reported
            err = e
            if verbose:
                traceback.print_exc()
            continue
        model.zero_grad(set_to_none=True)
        _copy_placeholders(model.config, pristine.config)
        row["built"] = True
        if fallback:
            row["fallback"] = fallback
        return kind, model, cfg, pristine, batch, want
    raise err.__cause__ if isinstance(err, _BuildError) and err.__cause__ is not None else err


def _stable_ties():
    """A ``TorchFunctionMode`` under which CPU's ``topk``, ``sort`` and ``argsort`` give equal values
    in index order, the order ``sort(stable=True)`` defines (entered while a CPU reference runs).

    PyTorch leaves the order of equal values unspecified for ``topk`` and for an unstable ``sort``:
    CPU's kernels leave them as libstdc++'s ``nth_element``/``partial_sort``/introsort does
    (``topk(zeros(21), 8)`` is [16, 11, 12, 13, 14, 15, 18, 20]), CUDA's radix select as its own, and
    tpu's sort is stable (lower index first). Where a model selects among scores that tie exactly
    (a detector's top-k query selection over bfloat16 scores, a router's top-1), CPU's result depends
    on that unspecified order; this reference computes the same model with the one order PyTorch
    defines. ``check`` uses it only where the CPU result depends on it (``_tie_reference``)."""
    import torch
    from torch.overrides import TorchFunctionMode

    class StableTies(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in (torch.topk, torch.Tensor.topk):
                return _stable_topk(*args, **kwargs)
            if func in (torch.sort, torch.Tensor.sort, torch.argsort, torch.Tensor.argsort) and (
                    "out" not in kwargs):
                if len(args) > 1 and isinstance(args[1], bool):     # sort(input, stable, ...)
                    args = (args[0],) + args[2:]
                kwargs["stable"] = True
            return func(*args, **kwargs)
    return StableTies()


def _stable_topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):
    """``topk`` as the first ``k`` of a stable sort (NaN the largest on both, as topk has it)."""
    import torch
    if out is not None:
        raise TypeError("topk(out=) is not replayed with stable ties")
    s = torch.sort(input, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((s.values.narrow(dim, 0, k), s.indices.narrow(dim, 0, k)))


def _same_result(a, b):
    """Whether two ``run_model`` results are bit for bit the same (NaNs alike)."""
    import torch
    (oa, ga), (ob, gb) = a, b
    pairs = list(zip(oa, ob)) + [(ga[n], gb.get(n)) for n in ga]
    return len(oa) == len(ob) and sorted(ga) == sorted(gb) and all(
        (x is None) == (y is None) and (x is None or (x.shape == y.shape and bool(
            torch.equal(x, y) or ((x == y) | (x.isnan() & y.isnan())).all()))) for x, y in pairs)


def _tie_reference(run, plain):
    """``run()`` under ``_stable_ties``, or None where it gives ``plain`` (CPU's result without the
    mode) bit for bit: then no tie among equal values decided anything and the plain result stands."""
    with _stable_ties():
        stable = run()
    return None if _same_result(stable, plain) else stable


def _float64_result(pristine, batch):
    """``run_model`` of the model in float64 on CPU (floating inputs cast alike), or None where
    the model refuses float64: the reference the float32 stage's "no less accurate" rule reads."""
    try:
        return run_model(copy.deepcopy(pristine).double(), batch, "cpu")
    except Exception:  # noqa: BLE001 - no float64 reference: the float32 rule alone decides
        return None


class _BuildError(Exception):
    """The model's constructor failed (not a forward): the fallback pass may build it."""


def check(model_type: str, stages=("f32", "bf16", "gen"), verbose=False) -> dict:
    """One architecture: {'kind','cls','params','built','f32','bf16','gen': True/False/None, 'errors'}."""
    import torch
    import deferfuse
    row = dict(model_type=model_type, kind=None, cls=None, params=None, built=False,
               f32=None, bf16=None, gen=None, errors={}, fallbacks={})
    t0 = time.time()
    try:
        kind, model, cfg, pristine, batch, want = _build_and_run(model_type, row, verbose)
    except Exception as e:  # noqa: BLE001 - reported: cannot be built tiny on CPU
        row["errors"]["build"] = _first_line(e)
        why = unbuilt_reason(model_type, row["errors"]["build"])
        if why:
            row["reason"] = why
        if verbose:
            traceback.print_exc()
        row["seconds"] = round(time.time() - t0, 1)
        return row

    def stage(key, fn):
        deferfuse.reset_metrics()
        try:
            with deferfuse.mode("defer"):
                fn()
            row[key] = True
        except Exception as e:  # noqa: BLE001 - every failure is reported in the table
            row[key] = False
            row["errors"][key] = _first_line(e)
            if verbose:
                traceback.print_exc()
        for k, v in deferfuse.metrics()["cpu_fallbacks"].items():
            row["fallbacks"][k] = row["fallbacks"].get(k, 0) + v

    if "f32" in stages:
        def f32():
            tm = copy.deepcopy(pristine).to("tpu")
            got = run_model(tm, batch, "tpu")
            cpu, ties = want, contextlib.nullcontext
            try:
                compare(got, cpu, F32_TOL)
                return
            except AssertionError:
                stable = _tie_reference(lambda: run_model(copy.deepcopy(pristine), batch, "cpu"), want)
                if stable is None:
                    raise
                # CPU's result depends on the order of equal values it selects: the defined order's
                row["f32_stable_ties"], cpu, ties = True, stable, _stable_ties
            try:
                compare(got, cpu, F32_TOL)
            except AssertionError:
                with ties():
                    ref = _float64_result(pristine, batch)
                if ref is None:
                    raise
                compare(got, cpu, F32_TOL, ref)    # raises where tpu is farther than CPU
                row["f32_f64_rule"] = True
        stage("f32", f32)
    if "bf16" in stages:
        cm = copy.deepcopy(pristine).to(torch.bfloat16)     # copied from, never run
        try:
            ref_model = copy.deepcopy(cm).float()   # the same bfloat16 weights, computed in float32
            ref_batch = {k: (v.to(torch.bfloat16).float() if isinstance(v, torch.Tensor)
                             and v.is_floating_point() else v) for k, v in batch.items()}
            ref = run_model(ref_model, ref_batch, "cpu")
            cw = run_model(copy.deepcopy(cm), batch, "cpu")
        except Exception as e:  # noqa: BLE001 - the model refuses bfloat16 on CPU too: not a tpu failure
            row["errors"]["bf16"] = "n/a, fails on CPU: " + _first_line(e)
        else:
            def bf16():
                tm = copy.deepcopy(cm).to("tpu")
                tm.zero_grad(set_to_none=True)
                compare_bf16(row, run_model(tm, batch, "tpu"), cm, batch, cw, ref, ref_batch)
            stage("bf16", bf16)
    if "gen" in stages and kind in ("causal", "seq2seq", "speech2seq") and model.can_generate():
        gen_in = {k: v for k, v in batch.items() if k not in ("labels", "return_loss")}
        kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
        pad = _sub(cfg, "pad_token_id")
        kw["pad_token_id"] = pad if isinstance(pad, int) else 0
        try:
            with torch.no_grad():
                want_tokens = copy.deepcopy(pristine).generate(**gen_in, **kw)
        except Exception as e:  # noqa: BLE001 - generate fails on CPU too: not a tpu failure
            row["errors"]["gen"] = "n/a, fails on CPU: " + _first_line(e)
        else:
            def gen():
                tm = copy.deepcopy(pristine).to("tpu")
                with torch.no_grad():
                    got = tm.generate(**{k: v.to("tpu") for k, v in gen_in.items()}, **kw).cpu()
                if got.shape != want_tokens.shape or not torch.equal(got, want_tokens):
                    raise AssertionError(f"tokens differ: {got.tolist()} vs {want_tokens.tolist()}")
            stage("gen", gen)
    row["seconds"] = round(time.time() - t0, 1)
    return row


# ---------------------------------------------------------------- the driver

ALL_STAGES = ("f32", "bf16", "gen")


def _json_path():
    return os.path.join(RESULTS, "hf-sweep.json")


def load_results():
    try:
        with open(_json_path()) as f:
            return json.load(f)
    except FileNotFoundError:
        return {"rows": {}}


def run_subprocess(model_type, timeout, stages):
    cmd = [sys.executable, os.path.abspath(__file__), "--one", model_type, "--stages", ",".join(stages)]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return dict(model_type=model_type, built=None, f32=None, bf16=None, gen=None,
                    errors={"timeout": f"timed out after {timeout} s"}, seconds=round(time.time() - t0, 1))
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("HFSWEEP "):
            return json.loads(line[8:])
    tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
    return dict(model_type=model_type, built=None, f32=None, bf16=None, gen=None,
                errors={"crash": f"exit {p.returncode}: {tail}"}, seconds=round(time.time() - t0, 1))


def summary(rows: dict, enumerated: int) -> dict:
    built = [r for r in rows.values() if r.get("built")]
    gen = [r for r in built if r.get("gen") is not None]
    return dict(enumerated=enumerated, run=len(rows), built=len(built),
                f32=sum(1 for r in built if r.get("f32")), bf16=sum(1 for r in built if r.get("bf16")),
                bf16_opinfo=sum(1 for r in built if r.get("bf16") and not r.get("bf16_scale_rule")),
                # rows from before the dynamo rule passed every OpInfo-failing tensor by the scale rule
                bf16_scale=sum(1 for r in built if r.get("bf16") and (
                    not r.get("bf16_scale_rule") or r.get("bf16_scale_ok", True))),
                bf16_dynamo=sum(1 for r in built if r.get("bf16") and (
                    not r.get("bf16_scale_rule") or r.get("bf16_dynamo_ok"))),
                bf16_run=sum(1 for r in built if r.get("bf16") is not None),
                gen_run=len(gen), gen=sum(1 for r in gen if r.get("gen")))


def _pct(a, b):
    return f"{100 * a / b:.1f}%" if b else "-"


def causes(rows) -> list:
    """[((stage, cause), count)], most common first: each failure's first error line with its
    numbers and quoted names blanked, so one cause in several models counts once per model."""
    import collections
    import re
    tally = collections.Counter()
    for r in rows.values():
        for stage, e in r.get("errors", {}).items():
            if stage in ("f32", "bf16", "gen") and r.get(stage) is not False:
                continue
            if stage == "gen" and e.startswith("n/a"):
                continue
            key = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", re.sub(r"'[^']*'|`[^`]*`", "'..'", e))[:110]
            tally[("tpu " + stage if stage in ("f32", "bf16", "gen") else stage, key)] += 1
    return tally.most_common()


DOCS = os.path.join(ROOT, "docs", "coverage.md")
DOCS_MARKS = ("<!-- hf-sweep table -->", "<!-- /hf-sweep table -->")


def docs_table() -> str:
    """The table now between the marks in docs/coverage.md."""
    with open(DOCS) as f:
        text = f.read()
    return text.split(DOCS_MARKS[0], 1)[1].split(DOCS_MARKS[1], 1)[0].strip()


def update_docs():
    with open(DOCS) as f:
        text = f.read()
    head, rest = text.split(DOCS_MARKS[0], 1)
    tail = rest.split(DOCS_MARKS[1], 1)[1]
    with open(DOCS, "w") as f:
        f.write(head + DOCS_MARKS[0] + "\n" + "\n".join(summary_table(load_results())) + "\n"
                + DOCS_MARKS[1] + tail)


def summary_table(data) -> list:
    """The figures as markdown table lines (bench/results/hf-sweep.md and docs/coverage.md)."""
    s = summary(data["rows"], data.get("enumerated", len(data["rows"])))
    return ["| enumerated | run | built | f32 fwd+bwd pass | bf16 pass, OpInfo rule | bf16 pass, with scale rule "
            "| bf16 pass, with dynamo rule | bf16 pass, either | generative | generate pass |",
            # bf16 % over the models CPU runs in bfloat16
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| {s['enumerated']} | {s['run']} | {s['built']} | {s['f32']} ({_pct(s['f32'], s['built'])}) | "
            f"{s['bf16_opinfo']} ({_pct(s['bf16_opinfo'], s['bf16_run'])}) | "
            f"{s['bf16_scale']} ({_pct(s['bf16_scale'], s['bf16_run'])}) | "
            f"{s['bf16_dynamo']} ({_pct(s['bf16_dynamo'], s['bf16_run'])}) | "
            f"{s['bf16']} ({_pct(s['bf16'], s['bf16_run'])}) | {s['gen_run']} | {s['gen']} "
            f"({_pct(s['gen'], s['gen_run'])}) |"]


def _tie_rows(rows, stage):
    """'N rows passing (names)' compared with CPU's ties in index order in ``stage``."""
    names = sorted(mt for mt, r in rows.items() if r.get("built") and r.get(stage) and r.get(f"{stage}_stable_ties"))
    return f"{len(names)} rows passing" + (f" ({', '.join(names)})" if names else "")


def write_markdown(data, path):
    rows = data["rows"]
    mark = {True: "ok", False: "**FAIL**", None: "–"}
    lines = ["# Every Hugging Face architecture on tpu (`make sweep-hf`)", "",
             f"- date: {data.get('date', '')}; versions: {data.get('versions', '')}",
             "- each model_type of transformers' auto mappings, one class (causal LM, masked LM, seq2seq, "
             "speech seq2seq, sequence/image classification, else base model), a tiny config derived from "
             "the default one (tests/hf_sweep.py `tiny_config`), random weights, batch "
             f"{BATCH} x {SEQ}; each in its own process with a timeout; defer mode.",
             "- f32: loss, logits and every gradient against CPU (atol 1e-4 x max(1, |CPU|max), rtol 1e-4, or "
             "no farther from the float64 result than CPU's float32: rows marked \"f32 by the float64 rule\"); "
             "bf16: the model in bfloat16 against CPU bfloat16 (the OpInfo rule: atol 1e-3 x scale, rtol 1.6e-2, or "
             "no farther from the float32 result than CPU's bfloat16; the scale rule: within 1.6e-2 x scale, "
             "scale = max(1, |CPU|max), for tensors that fail the OpInfo rule; the dynamo rule: PyTorch's accuracy "
             "check of its Hugging Face benchmark in training, torch._dynamo.utils.same(CPU, tpu, fp64_ref, tol=1e-2): "
             "allclose at 1e-2, or tpu's RMSE from the float64 result at most 3x CPU bfloat16's + 1e-3, for the "
             "tensors that fail the OpInfo rule; rows run before the dynamo rule count as failing it); "
             "gen: greedy generate(max_new_tokens=5) tokens equal to CPU's.",
             "- ties: where CPU's own result depends on the order of equal values its topk/sort select "
             "(PyTorch leaves it unspecified; CPU's is libstdc++'s nth_element/partial_sort order), tpu is "
             "compared with CPU computing the same model with ties in index order, sort(stable=True)'s "
             "(rows marked \"ties in index order\"; tolerances unchanged): "
             f"{_tie_rows(rows, 'bf16')} in bf16, {_tie_rows(rows, 'f32')} in f32.", "",
             *summary_table(data), "",
             "## Failures (built, a stage fails)", "",
             "| model_type | class | f32 | bf16 | gen | first error |", "|---|---|---|---|---|---|"]
    for mt, r in sorted(rows.items()):
        if r.get("built") and (r.get("f32") is False or r.get("bf16") is False or r.get("gen") is False):
            errs = "; ".join(f"[{k}] {v}" for k, v in r["errors"].items() if k in ("f32", "bf16", "gen")
                             and r.get(k) is False)
            lines.append(f"| {mt} | {r.get('cls')} | {mark[r.get('f32')]} | {mark[r.get('bf16')]} | "
                         f"{mark[r.get('gen')]} | {errs.replace('|', '/')} |")
    lines += ["", "## Most common causes", "", "| count | stage | cause |", "|---:|---|---|"]
    for (stage, cause), n in causes(rows)[:15]:
        lines.append(f"| {n} | {stage} | {cause.replace('|', '/')} |")
    unbuilt = [(mt, r) for mt, r in sorted(rows.items()) if not r.get("built")]
    lines += ["", "## Not built tiny on CPU (or timed out / crashed)", "",
              f"{len(unbuilt)} rows, {sum(1 for _, r in unbuilt if r.get('reason'))} with an argued reason "
              "(`unbuilt_reason`: a missing package or input, a default config that does not build either, "
              "or `UNBUILT`'s argument).", "", "| model_type | class | reason | first error |", "|---|---|---|---|"]
    for mt, r in unbuilt:
        err = "; ".join(f"[{k}] {v}" for k, v in r["errors"].items())
        lines.append(f"| {mt} | {r.get('cls') or data.get('classes', {}).get(mt, '')} | "
                     f"{(r.get('reason') or '').replace('|', '/')} | {err.replace('|', '/')} |")
    lines += ["", "## Passing", "", ", ".join(
        f"{mt}" + ("" if r.get("bf16") else " (f32 only)")
        + (" (f32 by the float64 rule)" if r.get("f32_f64_rule") else "")
        + (" (ties in index order)" if r.get("bf16_stable_ties") or r.get("f32_stable_ties") else "")
        for mt, r in sorted(rows.items())
        if r.get("built") and r.get("f32") and r.get("gen") is not False and r.get("bf16") is not False) , ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def fill_reasons(names=None):
    """Give every row of the json not built (of ``names``, if given) its argued reason
    (``unbuilt_reason``, from its stored first error; no model is run) and rewrite the markdown
    table."""
    import fcntl
    import transformers
    transformers.logging.set_verbosity_error()
    with open(_json_path() + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = load_results()
        for mt, r in sorted(data["rows"].items()):
            if not r.get("built") and (names is None or mt in names):
                err = r.get("errors", {}).get("build") or next(iter(r.get("errors", {}).values()), "")
                why = unbuilt_reason(mt, err)
                r.pop("reason", None)
                if why:
                    r["reason"] = why
        with open(_json_path() + ".tmp", "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(_json_path() + ".tmp", _json_path())
        write_markdown(data, os.path.join(RESULTS, "hf-sweep.md"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one", help="run one model_type in this process and print its row as JSON")
    p.add_argument("--only", help="comma list of model_types")
    p.add_argument("--part", default="1/1", help="K/N: the K-th of N interleaved slices")
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--stages", default="f32,bf16,gen")
    p.add_argument("--skip-done", action="store_true",
                   help="skip model_types the json has built (rerun the others)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--table", action="store_true", help="print the figures table of the json and exit")
    p.add_argument("--docs", action="store_true", help="put the figures table into docs/coverage.md and exit")
    p.add_argument("--reasons", action="store_true",
                   help="give every row not built its argued reason (unbuilt_reason, from its stored error; "
                        "no model run) and rewrite the table")
    p.add_argument("-v", action="store_true")
    a = p.parse_args(argv)
    stages = tuple(a.stages.split(","))
    if a.one:
        import torch  # noqa: F401
        import transformers
        transformers.logging.set_verbosity_error()
        warnings.simplefilter("ignore")
        row = check(a.one, stages, verbose=a.v)
        print("HFSWEEP " + json.dumps(row), flush=True)
        return row
    if a.table:
        print("\n".join(summary_table(load_results())))
        return None
    if a.docs:
        update_docs()
        return None
    if a.reasons:
        fill_reasons(a.only.split(",") if a.only else None)
        return None
    archs = enumerate_archs()
    if a.list:
        for mt, (k, c) in archs.items():
            print(mt, k, c)
        return None
    names = a.only.split(",") if a.only else list(archs)
    k, n = (int(x) for x in a.part.split("/"))
    names = names[k - 1::n]
    data = load_results()
    if a.skip_done:     # rows already there, except those that timed out or crashed
        names = [m for m in names if not data["rows"].get(m, {}).get("built")]
    os.makedirs(RESULTS, exist_ok=True)
    for i, mt in enumerate(names):
        row = run_subprocess(mt, a.timeout, stages)
        row["kind"] = row.get("kind") or archs.get(mt, (None, None))[0]
        row["cls"] = row.get("cls") or archs.get(mt, (None, None))[1]
        print(f"[{i + 1}/{len(names)}] {mt}: built={row.get('built')} f32={row.get('f32')} "
              f"bf16={row.get('bf16')} gen={row.get('gen')} {row.get('seconds')}s "
              f"{json.dumps(row.get('errors'))[:300]}", flush=True)
        import fcntl
        with open(_json_path() + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # parts run side by side update one file
            _store(mt, row, archs, stages)
    print(json.dumps(load_results().get("summary")), flush=True)


def _store(mt, row, archs, stages=ALL_STAGES):
    import jax
    import torch
    import transformers
    data = load_results()   # another part may have written meanwhile
    old = data["rows"].get(mt)
    if stages != ALL_STAGES and old and old.get("built") and not row.get("built"):
        return      # a rerun of some stages timed out or crashed: the row stays as it was
    if stages != ALL_STAGES and old and old.get("built") and row.get("built"):
        # a rerun of some stages: the others' results stay
        keep = {k: v for k, v in old.items() if k not in (*stages, "errors", "seconds", "fallbacks")
                and not (k.startswith("bf16_") and "bf16" in stages)
                and not (k.startswith("f32_") and "f32" in stages)}
        errors = {k: v for k, v in old.get("errors", {}).items() if k not in stages}
        row = {**keep, **{k: row[k] for k in (*stages, "seconds", "fallbacks") if k in row},
               **{k: v for k, v in row.items() if k.startswith(("bf16_", "f32_"))},
               "errors": {**errors, **row.get("errors", {})}}
    data["rows"][mt] = row
    data.update(enumerated=len(archs), date=datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), versions=f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"jax {jax.__version__}")
    data["summary"] = summary(data["rows"], len(archs))
    with open(_json_path() + ".tmp", "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(_json_path() + ".tmp", _json_path())
    write_markdown(data, os.path.join(RESULTS, "hf-sweep.md"))


if __name__ == "__main__":
    main()
