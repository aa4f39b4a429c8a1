"""A fixed sample of 20 Hugging Face architectures from the sweep over every architecture
(tests/hf_sweep.py, ``make sweep-hf``; latest table bench/results/hf-sweep.md): each built from a
tiny config derived from its default one, forward and backward of its loss on tpu in defer mode
against CPU (loss, logits and every gradient), in float32 and bfloat16, and greedy generation for a
few generative ones. The default run takes float32 for two of them (an image classifier and a
masked LM; gpt2 and llama are in test_hf_models.py); the rest are marked slow, and ``make
test-hf-sample`` (run by CI) runs the whole sample."""
import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="the Hugging Face sweep needs transformers")

import hf_sweep as hs  # noqa: E402

transformers.logging.set_verbosity_error()

SAMPLE = ["vit", "distilbert", "llama", "gpt2", "bert", "albert", "roberta", "electra", "t5", "bart",
          "mistral", "qwen2", "gemma", "opt", "gpt_neox", "apertus", "biogpt", "convnext", "deit",
          "whisper"]
FAST = {"vit", "distilbert"}
GENERATE = ["gpt2", "t5", "biogpt"]


def _params(names, fast=()):
    return [pytest.param(n, id=n, marks=() if n in fast else (pytest.mark.slow,)) for n in names]


def _check(model_type, stage):
    row = hs.check(model_type, (stage,))
    assert row["built"], f"{model_type}: not built: {row['errors']}"
    assert row[stage] is True, f"{model_type} {stage}: {row['errors'].get(stage)}"
    return row


@pytest.mark.modes("strict")     # no device work: once
def test_sample_is_twenty_enumerated_architectures():
    every = hs.enumerate_archs()
    assert len(SAMPLE) == len(set(SAMPLE)) == 20
    assert set(SAMPLE) <= set(every), set(SAMPLE) - set(every)
    assert len(every) > 500     # every model_type of transformers' auto mappings


@pytest.mark.modes("defer")
@pytest.mark.parametrize("model_type", _params(SAMPLE, FAST))
def test_forward_backward_float32(model_type, tpu_mode):
    _check(model_type, "f32")


@pytest.mark.modes("defer")
@pytest.mark.parametrize("model_type", _params(SAMPLE))
def test_forward_backward_bfloat16(model_type, tpu_mode):
    _check(model_type, "bf16")


@pytest.mark.modes("defer")
@pytest.mark.parametrize("model_type", _params(GENERATE))
def test_greedy_generate(model_type, tpu_mode):
    row = _check(model_type, "gen")
    assert row["kind"] in ("causal", "seq2seq", "speech2seq")


@pytest.mark.modes("defer")
def test_swiftformer_float32(tpu_mode):
    """The sweep's swiftformer: its trace splits into a loop's repetitions and a piece as long as
    one holding other ops, which the flush once asked for a repetition's outputs (an IndexError at
    the first read; the row had only ever timed out under load)."""
    _check("swiftformer", "f32")


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_recurrent_gemma_float32(tpu_mode):
    """recurrent_gemma keeps its forward's states (non-leaf tensors) in plain module attributes,
    so its model cannot be deep-copied once it has run: the sweep's copies come from the model as
    built (the row failed in the harness's deepcopy after CPU's run)."""
    _check("recurrent_gemma", "f32")


@pytest.mark.modes("strict")     # no device work: once
def test_tiny_config_shrinks_nested_configs():
    """Sizes shrink consistently, nested text and vision configs too (no model built)."""
    cfg = hs.tiny_config(transformers.AutoConfig.for_model("clip"))
    for sub in (cfg.text_config, cfg.vision_config):
        assert sub.hidden_size == hs.HIDDEN and sub.num_hidden_layers == hs.LAYERS
        assert sub.num_attention_heads == hs.HEADS and sub.intermediate_size == hs.INTER
    assert cfg.vision_config.image_size == hs.IMAGE and cfg.text_config.vocab_size == hs.VOCAB
    g = hs.tiny_config(transformers.AutoConfig.for_model("gemma3_text"))
    assert len(g.layer_types) == g.num_hidden_layers == hs.LAYERS


@pytest.mark.modes("strict")     # no device work: once
def test_docs_show_the_latest_sweep():
    """docs/coverage.md shows the figures of bench/results/hf-sweep.json (``hf_sweep.py --docs``)."""
    assert hs.docs_table() == "\n".join(hs.summary_table(hs.load_results()))


@pytest.mark.modes("strict")     # no device work: once
def test_float32_rule_reads_a_float64_result():
    """The float32 stage's "no less accurate" clause: a gradient outside F32_TOL of CPU's passes
    when, element by element, it is no farther from the float64 result than CPU's float32 result
    (pp_doclayout_v3's box head: tpu 0.0021963, CPU 0.0023232, float64 0.0021779), and fails when
    it is farther; ``_float64_result`` runs the model in float64 on CPU (CPU tensors stand in)."""
    import torch

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 4)
    batch = {"input": torch.randn(8, 16)}
    ref = hs._float64_result(lin, batch)
    assert ref[1]["weight"].dtype == torch.float64 and ref[1]["bias"].dtype == torch.float64
    want = ([torch.tensor(1.0)], {"w": torch.tensor([0.0023232, 0.5])})
    f64 = ([torch.tensor(1.0, dtype=torch.float64)],
           {"w": torch.tensor([0.0021779, 0.5], dtype=torch.float64)})
    closer = ([torch.tensor(1.0)], {"w": torch.tensor([0.0021963, 0.5])})
    with pytest.raises(AssertionError, match="grad w: 1/2 elements differ"):
        hs.compare(closer, want, hs.F32_TOL)
    hs.compare(closer, want, hs.F32_TOL, f64)
    farther = ([torch.tensor(1.0)], {"w": torch.tensor([0.0025, 0.5])})
    with pytest.raises(AssertionError, match="grad w"):
        hs.compare(farther, want, hs.F32_TOL, f64)


@pytest.mark.modes("strict")     # no device work: once
def test_model_rules():
    """A tensor failing the OpInfo rule passes the dynamo rule (torch._dynamo.utils.same) when it is
    no more than 3x as far from the float64 result as CPU's bfloat16 is; else check's bf16 stage
    fails with the tensor's name (CPU tensors stand in for tpu's: the rule reads values only)."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x):
            return (self.lin(x),)

    torch.manual_seed(0)
    cm = Tiny().to(torch.bfloat16)
    batch = {"x": torch.randn(8, 64)}
    outs, grads = hs.run_model(copy.deepcopy(cm), batch, "cpu")
    w = grads["lin.weight"]
    ulp = w.abs().float() * 2 ** -8     # one bfloat16 unit of each element
    near = (w.float() + ulp * torch.sign(torch.randn(w.shape))).to(torch.bfloat16)
    row = {}
    hs.model_rules(row, [("lin.weight", near, w, False)], cm, batch)
    assert row["bf16_dynamo_ok"] is True and row["bf16_scale_ok"] is False
    assert row["bf16_scale_rule"] == ["lin.weight"]
    far = (w.float() + 0.5).to(torch.bfloat16)
    with pytest.raises(AssertionError, match="grad lin.weight: fails the OpInfo, scale and dynamo rules"):
        hs.model_rules({}, [("lin.weight", far, w, False)], cm, batch)
    row = {}
    hs.model_rules(row, [("lin.weight", far, w, True)], cm, batch)     # the scale rule passes it
    assert row["bf16_dynamo_ok"] is False and row["bf16_scale_ok"] is True


def _select_model(tie):
    """A detector's query selection in small: scores from the features, the top 3 of 21 positions,
    then each selected position's own anchor (so which of equal scores is taken changes the
    result, as rt_detr's proposals do); ``tie``: 20 of the positions have equal features."""
    import torch

    class Select(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.score = torch.nn.Linear(4, 1)
            self.head = torch.nn.Linear(4, 3)
            self.anchor = torch.nn.Parameter(torch.randn(21, 4))

        def forward(self, x):
            s = self.score(x).squeeze(-1)
            top, idx = torch.topk(s, 3, dim=1)
            sel = torch.gather(x + self.anchor, 1, idx[..., None].expand(-1, -1, 4))
            return (self.head(sel), top)

    torch.manual_seed(0)
    model, x = Select(), torch.randn(2, 21, 4)
    if tie:
        x[:, :] = x[:, :1].clone()
        x[:, 5] += 1
    return model, {"x": x}


def _bf16_stage(model, batch, tpu_result=True):
    """The pieces ``check``'s bfloat16 stage gives ``compare_bf16``: (the model in bfloat16, CPU's
    bfloat16 result, the float32 run of the same weights, its inputs, tpu's result)."""
    import torch
    cm = model.to(torch.bfloat16)
    ref_batch = {k: v.to(torch.bfloat16).float() for k, v in batch.items()}
    ref = hs.run_model(copy.deepcopy(cm).float(), ref_batch, "cpu")
    cw = hs.run_model(copy.deepcopy(cm), batch, "cpu")
    got = hs.run_model(copy.deepcopy(cm).to("tpu"), batch, "tpu") if tpu_result else None
    return cm, cw, ref, ref_batch, got


@pytest.mark.modes("strict")     # no device work: once
def test_stable_ties_reference_is_the_defined_order():
    """``_stable_ties``: CPU's topk, sort and argsort give equal values in index order (what
    ``sort(stable=True)`` defines and tpu gives), where CPU's own kernels give libstdc++'s order;
    the values and gradients are topk's."""
    import torch
    z = torch.zeros(21)
    assert torch.topk(z, 8).indices.tolist() != list(range(8))       # CPU: [16, 11, 12, ...]
    with hs._stable_ties():
        assert torch.topk(z, 8).indices.tolist() == list(range(8))
        assert z.topk(3, largest=False).indices.tolist() == [0, 1, 2]
        assert torch.sort(z, descending=True).indices[:8].tolist() == list(range(8))
        assert z.argsort(dim=0, descending=True)[:8].tolist() == list(range(8))
        x = torch.tensor([1.0, float("nan"), 3.0, 3.0, 2.0], requires_grad=True)
        v, i = torch.topk(x, 3)
        (v[1:] * torch.tensor([2.0, 3.0])).sum().backward()
    assert i.tolist() == [1, 2, 3] and x.grad.tolist() == [0.0, 0.0, 2.0, 3.0, 0.0]
    y = torch.tensor([1.0, 5.0, 3.0, 4.0])
    with hs._stable_ties():
        assert torch.topk(y, 2).indices.tolist() == [1, 3]      # no tie: topk's own result


@pytest.mark.modes("defer")
def test_bf16_tie_reference_only_where_a_tie_decides(tpu_mode):
    """A top-k over 20 equal bfloat16 scores: CPU's result depends on libstdc++'s tie order, so tpu
    (index order) fails against it and passes against CPU in the defined order, recorded as
    ``bf16_stable_ties``; without a tie the plain reference decides and nothing is recorded. What
    tpu computes is still checked: other indices among the ties (the last first) and a wrong sign
    on a gradient fail, and an element 8 bfloat16 units off is no pass by the OpInfo rule (CPU
    tensors stand in for the mutants: the rules read values only)."""
    import torch
    from torch.overrides import TorchFunctionMode

    model, batch = _select_model(tie=True)
    cm, cw, ref, ref_batch, got = _bf16_stage(model, batch)
    with pytest.raises(AssertionError):
        hs.compare(got, cw, hs.BF16_TOL, ref)       # CPU's tie order is not tpu's
    row = {}
    hs.compare_bf16(row, got, cm, batch, cw, ref, ref_batch)
    assert row == {"bf16_stable_ties": True}        # the OpInfo rule, no model-level rule

    class LastFirst(TorchFunctionMode):     # a lowering that breaks ties the other way
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.topk:
                x, k = args[0], args[1]
                r = torch.topk(x.flip(-1), k, **(kwargs or {}))
                return torch.return_types.topk((r.values, x.shape[-1] - 1 - r.indices))
            return func(*args, **(kwargs or {}))
    with hs._stable_ties(), LastFirst():
        other = hs.run_model(copy.deepcopy(cm), batch, "cpu")
    outs, grads = got
    sign = (outs, {**grads, "head.weight": -grads["head.weight"]})
    for mutant in (other, sign):
        with pytest.raises(AssertionError, match="fails the OpInfo, scale and dynamo rules"):
            hs.compare_bf16({}, mutant, cm, batch, cw, ref, ref_batch)
    w = grads["head.weight"].clone()
    i = int(w.abs().argmax())
    w.view(-1)[i] *= 1 + 8 * 2 ** -8        # its largest element 8 bfloat16 units off
    row = {}
    try:
        hs.compare_bf16(row, (outs, {**grads, "head.weight": w}), cm, batch, cw, ref, ref_batch)
    except AssertionError:
        pass
    assert row.get("bf16_scale_rule") == ["head.weight"]      # not a pass by the OpInfo rule

    model, batch = _select_model(tie=False)
    cm, cw, ref, ref_batch, got = _bf16_stage(model, batch)
    row = {}
    hs.compare_bf16(row, got, cm, batch, cw, ref, ref_batch)
    assert row == {}
    assert hs._tie_reference(lambda: hs.run_model(copy.deepcopy(cm), batch, "cpu"), cw) is None


@pytest.mark.modes("strict")     # no device work: once
def test_build_rules_for_default_configs_that_do_not_build():
    """The rules that took rows off the "not built" list (no model run): a default config's None
    head_dim / key-value heads filled (ministral, nemotron), a timm backbone swapped for transformers' ResNet
    (detr), rotary sections summing to the tiny head's rotary half (qwen2-vl), a text class built from
    its composite config's text part (llama4), the empty ImportError naming the missing package."""
    assert hs.tiny_config(transformers.AutoConfig.for_model("ministral")).head_dim == hs.HEAD_DIM
    assert hs.tiny_config(transformers.AutoConfig.for_model("nemotron")).num_key_value_heads == hs.HEADS
    d = hs.tiny_config(transformers.AutoConfig.for_model("detr"))
    assert d.backbone_config.model_type == "resnet" and not getattr(d, "use_timm_backbone", False)
    q = hs.tiny_config(transformers.AutoConfig.for_model("qwen2_vl_text"))
    hs._mrope(q)
    assert sum(q.rope_parameters["mrope_section"]) == hs.HEAD_DIM // 2
    kind, model, cfg = hs.build("llama4")
    assert type(model).__name__ == "Llama4ForCausalLM" and type(cfg).__name__ == "Llama4TextConfig"
    try:
        transformers.utils.import_utils.requires_backends("x", ["natten"])
    except ImportError as e:
        if transformers.utils.is_natten_available():
            pytest.skip("natten is installed here")
        assert hs._first_line(e) == "ImportError: needs natten (not installed)"
    else:
        pytest.skip("natten is installed here")


@pytest.mark.modes("strict")     # no device work: once
def test_batch_norm_scales_initialised_near_zero_are_set_to_one():
    """rt_detr initialises its batch norms' scales from N(0, 0.01): every feature map after one was
    its bias, its detection scores exactly equal, and which of them top-k picked was CPU's sort
    kernel's order (the row's float32 loss differed). ``build`` sets such scales to 1, as a
    checkpoint's would be (no model run)."""
    import torch
    _, model, _ = hs.build("rt_detr")
    norms = [m for m in model.modules() if type(m) is torch.nn.BatchNorm2d]
    assert norms and all(bool((m.weight == 1).all()) for m in norms)


@pytest.mark.modes("strict")     # no device work: once
def test_oneformer_pixel_decoder_width_follows_its_hidden_width():
    """oneformer's default config has conv_dim = mask_dim = hidden_dim; where the tiny config
    made them differ, its transformer module projected each level with a Conv2d held in a plain
    list, which ``model.to("tpu")`` leaves on CPU (the row's "tpu:0 and cpu" error). Config only."""
    c = hs.tiny_config(transformers.AutoConfig.for_model("oneformer"))
    assert c.conv_dim == c.mask_dim == c.hidden_dim < 256


@pytest.mark.modes("strict")     # no device work: once
def test_build_rules_for_widths_and_inputs():
    """The rules of the second pass over the "not built" list (configs only, no model built): a
    backbone's out_indices scaled to the tiny depth (lw_detr_vit's stage 12 of 12 is stage 2 of 2),
    stage channel lists narrowed alike across nested configs (d_fine's encoder reads its hgnet
    backbone's stage outputs), a flattened patch's width following the tiny patch (radio),
    multimodal rotary sections found through a nested config's model (colqwen2 over qwen2-vl), and
    a features mask filled in where forward requires one."""
    import torch
    b = hs.tiny_config(transformers.AutoConfig.for_model("lw_detr_vit"))
    assert b.out_indices == [hs.LAYERS] and b.out_features == [f"stage{hs.LAYERS}"]
    d = hs.tiny_config(transformers.AutoConfig.for_model("d_fine"))
    assert d.encoder_in_channels == d.backbone_config.stage_out_channels[1:]
    assert d.backbone_config.stage_in_channels[1:] == d.backbone_config.stage_out_channels[:-1]
    r = hs.tiny_config(transformers.AutoConfig.for_model("radio"))
    assert r.patch_dim == 3 * r.patch_size ** 2
    c = hs.tiny_config(transformers.AutoConfig.for_model("colqwen2"))
    assert any("mrope_section" in s for s in hs._sources(transformers.ColQwen2ForRetrieval, c))

    class Enc(torch.nn.Module):
        def forward(self, input_features, input_features_mask):
            return input_features * input_features_mask[:, None]

    feats = torch.randn(2, 5, 7)
    full = hs._required(Enc(), c, {"input_features": feats})
    assert full["input_features_mask"].shape == (2, 7) and bool(full["input_features_mask"].all())
    assert hs._required(Enc(), c, full) is None


@pytest.mark.modes("strict")     # no device work: once
def test_processor_made_inputs_follow_the_config():
    """The inputs a processor makes, built by the harness from the tiny config (no model run): a
    time series as long as its context plus its largest lag, with its time features and a future as
    long as the prediction; layout boxes on the 0-1000 page with each box's corners in order."""
    kind, model, cfg = hs.build("time_series_transformer")
    batch = next(b for b in hs.candidates(kind, model, cfg) if "past_time_features" in b)
    assert batch["past_values"].shape == (hs.BATCH, cfg.context_length + max(cfg.lags_sequence))
    assert batch["past_time_features"].shape[:2] == batch["past_values"].shape
    assert batch["past_observed_mask"].shape == batch["past_values"].shape
    assert batch["future_values"].shape == (hs.BATCH, cfg.prediction_length)
    kind, model, cfg = hs.build("udop")
    box = next(b for b in hs.candidates(kind, model, cfg) if "bbox" in b)["bbox"]
    assert box.shape[-1] == 4 and int(box.min()) >= 0 and int(box.max()) <= 1000
    assert bool((box[..., 2] >= box[..., 0]).all() and (box[..., 3] >= box[..., 1]).all())


@pytest.mark.modes("defer")
@pytest.mark.parametrize("model_type", _params(["blip-2", "informer", "decision_transformer",
                                                "siglip2_vision_model"]))
def test_processor_made_inputs_float32(model_type, tpu_mode):
    """Rows built from the inputs a processor makes (image placeholders counted from the Q-Former's
    queries, a time series with its lags, an agent's trajectory, flattened patches with their grid):
    forward and backward against CPU."""
    _check(model_type, "f32")


@pytest.mark.modes("strict")     # no device work: once
def test_fallback_pass_only_where_the_first_does_not_build():
    """The tiny config's fallback pass (``_fallback``), used by ``check`` only for a model its first
    pass does not build, so no row that built changes (configs only, no model run): fields the
    default config leaves None get the tiny sizes (esm's vocabulary and padding id, dots1's experts),
    the first pass leaves them; key/value sharing over more layers than the tiny two is off
    (gemma3n); a token id past the text vocabulary keeps its distance from the vocabulary's end
    (kyutai's audio padding row); a vision config without an image size gets FALLBACK_IMAGE."""
    cfg = transformers.AutoConfig.for_model
    assert hs.tiny_config(cfg("esm")).vocab_size is None
    e = hs.tiny_config(cfg("esm"), fallback=True)
    assert e.vocab_size == hs.VOCAB and e.pad_token_id == 0
    d = hs.tiny_config(cfg("dots1"), fallback=True)
    assert d.n_routed_experts == 4 and d.num_experts_per_tok == 2 and d.n_shared_experts == 1
    assert hs.tiny_config(cfg("dots1")).n_routed_experts is None
    assert hs.tiny_config(cfg("gemma3n_text"), fallback=True).num_kv_shared_layers == 0
    old, k = cfg("kyutai_speech_to_text"), hs.tiny_config(cfg("kyutai_speech_to_text"), fallback=True)
    assert k.audio_pad_token_id - k.vocab_size == old.audio_pad_token_id - old.vocab_size
    assert hs._sub(hs.tiny_config(cfg("pp_ocrv5_server_rec"), fallback=True), "image_size") == hs.FALLBACK_IMAGE
    assert hs.tiny_config(cfg("mobilevitv2"), fallback=True).image_size == hs.FALLBACK_IMAGE
    assert hs.tiny_config(cfg("mobilevitv2")).image_size == hs.IMAGE


@pytest.mark.modes("strict")     # no device work: once
def test_fallback_widths_a_model_computes():
    """The fallback pass's width rules (configs only, no model run), none of which the first pass
    applies: a width field whose default is a hidden width of the config tree gets the tiny one
    (SAM's neck and mask decoder, superpoint's descriptors), half of one for positional features;
    a head's width gets HEAD_DIM (bros); per-stage widths from the hidden width up keep their
    multiples and fixed feature sizes follow the fallback image's grid (sam2); a stem feeds the
    first stage (textnet); a layout model's hidden width is 48 in sixths (layoutlmv3); a count
    under a hidden name keeps its default (grounding-dino's query_dim); per-layer kinds keep one of
    each (granitemoehybrid's defaults are all linear: unchanged); the second level keeps patches."""
    sam = hs._tiny("sam", True)
    assert sam.vision_config.output_channels == hs.HIDDEN == sam.mask_decoder_config.iou_head_hidden_dim
    assert sam.vision_config.num_pos_feats == hs.HIDDEN // 2
    assert hs._tiny("sam").vision_config.output_channels == 256        # the first pass leaves it
    assert hs._tiny("superglue", True).keypoint_detector_config.descriptor_decoder_dim == hs.HIDDEN
    assert hs._tiny("bros", True).dim_bbox_projection == hs.HEAD_DIM
    s2 = hs._tiny("sam2", True).vision_config
    assert s2.backbone_config.embed_dim_per_stage == [32, 64, 128, 256]
    assert s2.backbone_channel_list == [256, 128, 64, 32]
    grid = hs.FALLBACK_IMAGE // 16      # the prompt encoder's default 16-pixel patches
    assert s2.backbone_feature_sizes == [[4 * grid] * 2, [2 * grid] * 2, [grid] * 2]
    t = hs._tiny("textnet", True)
    assert t.stem_out_channels == t.hidden_sizes[0]
    lv3 = hs._tiny("layoutlmv3", True)
    assert lv3.hidden_size == 48 and 4 * lv3.coordinate_size + 2 * lv3.shape_size == 48
    assert hs._tiny("layoutlmv3").hidden_size == hs.HIDDEN
    assert hs._tiny("grounding-dino", True).query_dim == 4
    assert hs._tiny("grounding-dino").query_dim == hs.HIDDEN
    f = hs._tiny("falcon_h1", True)
    assert f.mamba_d_ssm == f.mamba_n_heads * f.mamba_d_head
    assert hs._tiny("vitpose", True).backbone_config.num_experts == 1
    assert hs._tiny("levit", True).patch_size == hs.PATCH and hs._tiny("levit", 2).patch_size == 16


@pytest.mark.modes("strict")     # no device work: once
def test_fallback_widths_scaled_in_code_and_draft_inputs():
    """Widths a model computes in code from constants or other fields (configs and dummy inputs
    only, no model run), none of which the first pass applies: clap's audio Swin doubles
    ``patch_embeds_hidden_size`` per stage up to its hidden width; efficientnet scales its stem of
    32 and head of 1280 channels by ``width_coefficient`` (multipliers of 1, the first stage fed
    32, the head 1280 wide); a sigma-VAE's latent noise scale is 0 (the noise is drawn on the model's
    device); a draft model's context is its target's states at ``target_layer_ids`` concatenated."""
    import inspect

    import transformers
    a = hs._tiny("clap", True).audio_config
    assert a.patch_embeds_hidden_size * 2 ** (len(a.depths) - 1) == a.hidden_size == hs.HIDDEN
    assert hs._tiny("clap").audio_config.patch_embeds_hidden_size == 96   # the first pass leaves it
    e, e1 = hs._tiny("efficientnet", True), hs._tiny("efficientnet")
    assert (e.width_coefficient, e.depth_coefficient, e.in_channels[0], e.hidden_dim) == (1.0, 1.0, 32, 1280)
    assert e.in_channels[1:] == e1.in_channels[1:] and e1.width_coefficient == 2.0
    assert hs._tiny("vibevoice_acoustic_tokenizer").vae_std == 0.0
    cfg = hs._tiny("muse_glimmer_assistant")
    model = transformers.MuseGlimmerAssistantModel(cfg)
    batch = next(hs.candidates("base", model, cfg))
    full = hs._required(model, cfg, batch)
    assert batch["noise_embeds"].shape == (hs.BATCH, cfg.block_size, cfg.hidden_size)
    assert full["context_hidden_states"].shape == (hs.BATCH, hs.SEQ, len(cfg.target_layer_ids) * cfg.hidden_size)
    assert "context_hidden_states" in inspect.signature(model.forward).parameters


@pytest.mark.modes("strict")     # no device work: once
def test_unbuilt_rows_get_an_argued_reason():
    """A row not built gets a one-line argument: a missing package or input by the kind of its
    error, or the default config's own failure where it does not build either (built on the meta
    device: cohere_compass's rotary parameters lack its layer types' keys)."""
    assert "torchvision" in hs.unbuilt_reason("timm_wrapper", "ImportError: needs vision, timm (not installed)")
    assert "inference_session" in hs.unbuilt_reason(
        "sam2_video", "TypeError: Sam2VideoModel.forward() missing 1 required positional argument: "
        "'inference_session'")
    assert hs.unbuilt_reason("kimi_linear", "timed out after 400 s").startswith("no error to argue")
    assert "'marks'" in hs.unbuilt_reason(
        "jev", "TypeError: JevForDecision.forward() missing 3 required positional arguments: 'marks', "
        "'num_options', and 'question_type_ids'")
    why = hs.unbuilt_reason("cohere_compass", "KeyError: 'full_attention'")
    assert why.startswith("the default config does not build either") and "KeyError" in why
    assert hs._default_error("llama") is None
