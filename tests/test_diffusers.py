"""Hugging Face Diffusers pipelines on tpu give CPU's images (float32, within 1e-3).

Tiny models built from configs here, random weights, no hub access: a Stable Diffusion pipeline
(``UNet2DConditionModel`` with cross-attention, DDIM, classifier-free guidance, a VAE decoder) fed
prompt embeddings directly, and a DiT pipeline (``DiTTransformer2DModel``, class labels). Each runs
in defer mode, with the denoiser under ``torch.compile(backend="tpu")``, and split over two devices
with ``device_map="balanced"`` (a fresh process with two forced host devices); the UNet's compiled
and split runs, and a Flux transformer's flow-matching loop, are slow tests (``-m slow``). Both pipelines start
from the same latents on both devices, since CPU's and tpu's generators draw different numbers:
Stable Diffusion's drawn by a seeded ``torch.Generator("tpu")`` (and copied to CPU), DiT's by a CPU
generator (the pipeline moves them to tpu).
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
diffusers = pytest.importorskip("diffusers", reason="diffusers is optional (pip install -e '.[diffusers]')")

import deferfuse  # noqa: E402
from util import assert_same  # noqa: E402

diffusers.utils.logging.set_verbosity_error()

STEPS = 4
TOL = dict(atol=1e-3, rtol=1e-3)

# The builders, as source: the split test runs them again in a process of its own.
BUILDERS = textwrap.dedent("""
    import torch
    from diffusers import (AutoencoderKL, DDIMScheduler, DiTPipeline, DiTTransformer2DModel,
                           StableDiffusionPipeline, UNet2DConditionModel)

    def ddim():
        return DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                             clip_sample=False, set_alpha_to_one=False, steps_offset=1)

    def vae():
        torch.manual_seed(10)
        return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, sample_size=16,
                             down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                             norm_num_groups=4, layers_per_block=1).eval()

    def unet():
        torch.manual_seed(11)
        return UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
            attention_head_dim=2, norm_num_groups=4).eval()

    def sd_pipe(unet_model=None, vae_model=None):
        p = StableDiffusionPipeline(vae=vae_model or vae(), unet=unet_model or unet(),
                                    scheduler=ddim(), text_encoder=None, tokenizer=None,
                                    safety_checker=None, feature_extractor=None,
                                    requires_safety_checker=False)
        p.set_progress_bar_config(disable=True)
        return p

    def tpu_latents(seed=3):
        # What a pipeline does with generator=torch.Generator("tpu") (diffusers' randn_tensor).
        from diffusers.utils.torch_utils import randn_tensor
        return randn_tensor((2, 4, 8, 8), generator=torch.Generator("tpu").manual_seed(seed),
                            device=torch.device("tpu"))

    def sd_run(p, device, steps, latents=None, **kw):
        g = torch.Generator().manual_seed(1)
        x = dict(prompt_embeds=torch.randn(2, 5, 16, generator=g),
                 negative_prompt_embeds=torch.randn(2, 5, 16, generator=g))
        x = {k: v.to(device) for k, v in x.items()}
        latents = tpu_latents() if latents is None else latents
        with torch.no_grad():
            out = p(**x, latents=latents.to(device), num_inference_steps=steps, guidance_scale=5.0,
                    height=16, width=16, output_type="pt", **kw).images
        return out

    def dit_pipe():
        torch.manual_seed(12)
        tr = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                   out_channels=8, num_layers=2, sample_size=8, patch_size=2).eval()
        p = DiTPipeline(transformer=tr, vae=vae(), scheduler=ddim())
        p.set_progress_bar_config(disable=True)
        return p

    def dit_run(p, steps, generator=None):
        generator = generator or torch.Generator().manual_seed(2)
        with torch.no_grad():
            out = p(class_labels=[1, 7], generator=generator, num_inference_steps=steps,
                    guidance_scale=4.0, output_type="pt").images
        return out
""")
B = type(sys)("diffusers_builders")
exec(BUILDERS, B.__dict__)

pytestmark = pytest.mark.modes("defer")


@pytest.fixture(scope="module")
def sd_ref():
    return B.sd_run(B.sd_pipe(), "cpu", STEPS, B.tpu_latents().cpu())


@pytest.fixture(scope="module")
def dit_ref():
    return B.dit_run(B.dit_pipe(), STEPS)


def _no_fallbacks():
    deferfuse.sync()
    assert dict(deferfuse.metrics()["cpu_fallbacks"]) == {}


def test_unet_pipeline_matches_cpu_and_each_step_is_one_cached_program(sd_ref):
    """Stable Diffusion (UNet, DDIM, guidance, VAE decode) from latents a seeded
    ``torch.Generator("tpu")`` drew: CPU's images from the same latents; from the third step on the
    denoising loop compiles nothing (the first step's programs carry the loop's prologue), every
    step runs the same programs (one for the UNet and the step, and DDIM's own ``.item()`` reads),
    and a second call compiles nothing at all. The generator draws the same latents again under the
    same seed, and others under another."""
    a, b, c = B.tpu_latents(3), B.tpu_latents(3), B.tpu_latents(4)
    assert a.device.type == "tpu" and a.shape == (2, 4, 8, 8)
    assert torch.equal(a.cpu(), b.cpu()) and not torch.equal(a.cpu(), c.cpu())
    p = B.sd_pipe().to("tpu")
    per_step = []

    def on_step(pipe, i, t, kw):
        m = deferfuse.metrics()
        per_step.append((m["compiles"], m["regions_run"]))
        return {}

    got = B.sd_run(p, "tpu", STEPS, callback_on_step_end=on_step)
    assert got.shape == sd_ref.shape == (2, 3, 16, 16)
    assert_same(got, sd_ref, **TOL)
    compiles = [c for c, _ in per_step]
    assert compiles[1] == compiles[-1], compiles
    runs = [b - a for (_, a), (_, b) in zip(per_step, per_step[1:])]
    assert len(set(runs)) == 1, runs        # the same programs every step
    deferfuse.reset_metrics()
    per_step.clear()
    assert_same(B.sd_run(p, "tpu", STEPS, callback_on_step_end=on_step), sd_ref, **TOL)
    m = deferfuse.metrics()
    assert m["compiles"] == 0 and m["recompiles"] == 0, m["miss_reasons"]
    _no_fallbacks()


def test_dit_pipeline_matches_cpu(dit_ref):
    """DiT (class labels, guidance, learned sigma, VAE decode): CPU's images from a CPU generator's
    latents (the pipeline moves them to tpu); a second call compiles nothing."""
    p = B.dit_pipe().to("tpu")
    got = B.dit_run(p, STEPS)
    assert got.shape == dit_ref.shape == (2, 3, 16, 16)
    assert_same(got, dit_ref, **TOL)
    deferfuse.reset_metrics()
    assert_same(B.dit_run(p, STEPS), dit_ref, **TOL)
    assert deferfuse.metrics()["compiles"] == 0, deferfuse.metrics()["miss_reasons"]
    _no_fallbacks()


@pytest.mark.parametrize("which", ["dit", pytest.param("unet", marks=pytest.mark.slow)])
def test_compiled_denoiser_matches_cpu(which, request):
    """``torch.compile(denoiser, backend="tpu")`` (DiT's transformer; the UNet, slow): graphs with
    none run eagerly, CPU's images; a second call compiles no graph and no program."""
    if which == "dit":
        ref, p = request.getfixturevalue("dit_ref"), B.dit_pipe().to("tpu")
        p.transformer = torch.compile(p.transformer, backend="tpu")
        run = lambda: B.dit_run(p, STEPS)  # noqa: E731
    else:
        ref, p = request.getfixturevalue("sd_ref"), B.sd_pipe().to("tpu")
        p.unet = torch.compile(p.unet, backend="tpu")
        run = lambda: B.sd_run(p, "tpu", STEPS)  # noqa: E731
    assert_same(run(), ref, **TOL)
    m = deferfuse.metrics()
    assert m["compiled_graphs"] >= 1 and m["graphs_run_eagerly"] == 0, m["graph_fallback_reasons"]
    deferfuse.reset_metrics()
    assert_same(run(), ref, **TOL)
    m = deferfuse.metrics()
    assert m["graph_compiles"] == 0 and m["compiles"] == 0, (m["graph_recompiles"], m["miss_reasons"])
    _no_fallbacks()


SPLIT = BUILDERS + textwrap.dedent("""
    import sys, tempfile
    import deferfuse
    from diffusers.utils import logging
    logging.set_verbosity_error()
    STEPS, which, d = int(sys.argv[1]), sys.argv[2], tempfile.mkdtemp()
    assert torch.tpu.device_count() == 2
    if which == "dit":
        # A pipeline's components on two devices: the transformer on one, the VAE on the other.
        # accelerate counts one chip per process for "tpu" unless max_memory names the devices.
        dit_pipe().save_pretrained(d)
        want = dit_run(dit_pipe(), STEPS)
        p = DiTPipeline.from_pretrained(d, device_map="balanced", max_memory={0: "1GB", 1: "1GB"})
        p.set_progress_bar_config(disable=True)
        assert sorted(p.hf_device_map.values()) == [0, 1], p.hf_device_map
        assert {str(p.transformer.device), str(p.vae.device)} == {"tpu:0", "tpu:1"}
        got = dit_run(p, STEPS).cpu()
    else:
        # One model's blocks on two devices (accelerate's hooks move activations between them).
        u = unet()
        u.save_pretrained(d)
        size = sum(t.numel() * 4 for t in u.parameters())
        u = UNet2DConditionModel.from_pretrained(d, device_map="balanced",
                                                 max_memory={0: size // 2, 1: size})
        assert set(u.hf_device_map.values()) == {0, 1}, u.hf_device_map
        lat = tpu_latents()
        want = sd_run(sd_pipe(), "cpu", STEPS, lat.cpu())
        got = sd_run(sd_pipe(unet_model=u, vae_model=vae().to("tpu")), "tpu", STEPS, lat).cpu()
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-3, rtol=1e-3), \\
        (got - want).abs().max()
    assert dict(deferfuse.metrics()["cpu_fallbacks"]) == {}
    print("ok")
""")


@pytest.mark.parametrize("which", ["dit", pytest.param("unet", marks=pytest.mark.slow)])
def test_split_over_two_devices_with_balanced_device_map(which):
    """``device_map="balanced"``: DiT's pipeline with its transformer and VAE on tpu:0 and tpu:1;
    (slow) a UNet whose blocks are split over both: CPU's images (a fresh process, two forced host
    devices)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "HF_HUB_OFFLINE": "1", "TORCHTPU_MODE": "defer"}
    out = subprocess.run([sys.executable, "-c", SPLIT, "2", which], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.slow
def test_flux_transformer_loop_matches_cpu():
    """A tiny ``FluxTransformer2DModel`` (one double-stream and one single-stream block, rotary
    position ids) denoised by flow matching (``FlowMatchEulerDiscreteScheduler``), written as
    Flux's pipeline loops: CPU's latents in defer mode and compiled; a second compiled loop compiles
    nothing."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    torch.manual_seed(13)
    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2,
                                   joint_attention_dim=32, pooled_projection_dim=32,
                                   axes_dims_rope=(4, 4, 8)).eval()
    x, text, pooled = torch.randn(2, 16, 8), torch.randn(2, 5, 32), torch.randn(2, 32)
    img_ids = torch.stack([torch.zeros(16), torch.arange(16.) // 4, torch.arange(16.) % 4], 1)
    txt_ids = torch.zeros(5, 3)

    def loop(m, dev):
        s = FlowMatchEulerDiscreteScheduler()
        s.set_timesteps(STEPS, device=dev)
        lat = x.to(dev)
        with torch.no_grad():
            for t in s.timesteps:
                out = m(hidden_states=lat, encoder_hidden_states=text.to(dev),
                        pooled_projections=pooled.to(dev), timestep=(t / 1000).expand(2),
                        img_ids=img_ids.to(dev), txt_ids=txt_ids.to(dev)).sample
                lat = s.step(out, t, lat).prev_sample
        return lat

    want = loop(model, "cpu")
    model.to("tpu")
    assert_same(loop(model, "tpu"), want, **TOL)
    compiled = torch.compile(model, backend="tpu")
    assert_same(loop(compiled, "tpu"), want, **TOL)
    deferfuse.reset_metrics()
    assert_same(loop(compiled, "tpu"), want, **TOL)
    m = deferfuse.metrics()
    assert m["graph_compiles"] == 0 and m["compiles"] == 0, (m["graph_recompiles"], m["miss_reasons"])
    assert m["graphs_run_eagerly"] == 0
    _no_fallbacks()
