"""Diffusers pipelines (issue 36): seconds per denoising step on tpu (defer, compiled) beside CPU eager.

    python bench/diffusers_bench.py [--quick] [--steps N] [--calls N]

Two small pipelines built from configs (random weights, no downloads), float32, batch 2 with
classifier-free guidance (so the denoiser sees a batch of 4):

- ``sd``: Stable Diffusion's pipeline (``UNet2DConditionModel`` with cross-attention, DDIM), fed
  prompt embeddings directly, latents 4x32x32;
- ``dit``: DiT's pipeline (``DiTTransformer2DModel``, DDIM), class labels, latents 4x16x16
  (this pipeline always decodes: each call includes one small VAE decode).

Each (pipeline, system) runs in a fresh process with an empty program cache: a first call (compiles
included), then ``--calls`` timed calls of ``--steps`` steps each, ``output_type="latent"`` for
``sd`` (the VAE left out: the denoising loop alone), ending at a read of the latents. A row gives the best
timed call divided by its steps, the first call's wall time, and what the timed calls compiled
(0: each step reuses its programs). Systems: ``cpu`` (CPU eager PyTorch), ``defer`` (tpu,
DeferAndFuse), ``cpu1`` (CPU eager on one thread: on a busy machine PyTorch's thread pool
slows down far more than one thread), ``compiled`` (tpu, the denoiser under ``torch.compile(backend="tpu")``). Every tpu row's
latents are checked against the CPU row's (max abs difference). Results: bench/results/diffusers.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "diffusers")
PIPELINES = ("sd", "dit")
SYSTEMS = ("cpu", "cpu1", "defer", "compiled")


def build(which: str):
    import torch
    from diffusers import (DDIMScheduler, DiTPipeline, DiTTransformer2DModel, StableDiffusionPipeline,
                           UNet2DConditionModel, AutoencoderKL)
    sched = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                          clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32),
                        norm_num_groups=8, layers_per_block=1).eval()
    if which == "sd":
        unet = UNet2DConditionModel(
            sample_size=32, in_channels=4, out_channels=4, layers_per_block=2,
            block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64,
            attention_head_dim=8, norm_num_groups=8).eval()
        p = StableDiffusionPipeline(vae=vae, unet=unet, scheduler=sched, text_encoder=None,
                                    tokenizer=None, safety_checker=None, feature_extractor=None,
                                    requires_safety_checker=False)
    else:
        tr = DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=32, in_channels=4,
                                   out_channels=8, num_layers=6, sample_size=16, patch_size=2).eval()
        p = DiTPipeline(transformer=tr, vae=vae, scheduler=sched)
    p.set_progress_bar_config(disable=True)
    return p


def call(p, which: str, device: str, steps: int):
    import torch
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        if which == "sd":
            emb, neg = torch.randn(2, 7, 64, generator=g), torch.randn(2, 7, 64, generator=g)
            lat = torch.randn(2, 4, 32, 32, generator=g)
            out = p(prompt_embeds=emb.to(device), negative_prompt_embeds=neg.to(device),
                    latents=lat.to(device), num_inference_steps=steps, guidance_scale=5.0,
                    height=256, width=256, output_type="latent").images
        else:
            # DiT's pipeline always decodes: its calls include one VAE decode (32x32 images)
            out = p(class_labels=[1, 7], generator=g, num_inference_steps=steps, guidance_scale=4.0,
                    output_type="pt").images
    return out.cpu()        # the read that waits for the device


def child(a) -> None:
    import torch
    from diffusers.utils import logging
    logging.set_verbosity_error()
    p = build(a.pipeline)
    device = "cpu" if a.system.startswith("cpu") else "tpu"
    if a.system == "cpu1":
        torch.set_num_threads(1)
    df = None
    if device == "tpu":
        import deferfuse as df
        p.to("tpu")
        if a.system == "compiled":
            name = "unet" if a.pipeline == "sd" else "transformer"
            setattr(p, name, torch.compile(getattr(p, name), backend="tpu"))
    t0 = time.perf_counter()
    out = call(p, a.pipeline, device, a.steps)
    first = time.perf_counter() - t0
    if df is not None:
        df.reset_metrics()
    times = []
    for _ in range(a.calls):
        t0 = time.perf_counter()
        out = call(p, a.pipeline, device, a.steps)
        times.append(time.perf_counter() - t0)
    res = dict(first_s=first, step_s=min(times) / a.steps, steps=a.steps, calls=a.calls,
               compiles=None if df is None else df.metrics()["compiles"])
    torch.save(out, a.out)
    print("RESULT " + json.dumps(res))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 steps, 2 timed calls")
    ap.add_argument("--steps", type=int, help="denoising steps per call (default 10, quick 4)")
    ap.add_argument("--calls", type=int, help="timed calls per cell (default 3, quick 2)")
    ap.add_argument("--pipelines", default=",".join(PIPELINES))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--results", default=RESULTS)
    ap.add_argument("--merge", action="store_true", help="keep the other rows of the results file")
    ap.add_argument("--cell", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.steps = a.steps or (4 if a.quick else 10)
    a.calls = a.calls or (2 if a.quick else 3)
    if a.cell:
        a.pipeline, a.system = a.cell
        child(a)
        return 0
    import torch
    rows = []
    tmp = tempfile.mkdtemp(prefix="diffusers-bench-")
    for pipeline in a.pipelines.split(","):
        ref = None
        for system in a.systems.split(","):
            out = os.path.join(tmp, f"{pipeline}-{system}.pt")
            env = {**os.environ, "DEFERFUSE_CACHE_DIR": tempfile.mkdtemp(dir=tmp), "HF_HUB_OFFLINE": "1"}
            cmd = [sys.executable, __file__, "--cell", pipeline, system, "--out", out,
                   "--steps", str(a.steps), "--calls", str(a.calls)]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if r.returncode != 0 or not line:
                row = dict(pipeline=pipeline, system=system, error=r.stderr[-500:])
            else:
                row = dict(pipeline=pipeline, system=system, **json.loads(line[0][7:]))
                lat = torch.load(out)
                if system.startswith("cpu"):
                    ref = lat if ref is None else ref
                elif ref is not None:
                    row["max_abs_diff"] = float((lat - ref).abs().max())
            rows.append(row)
            print(json.dumps(row), flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    meta = dict(steps=a.steps, calls=a.calls, load_avg_1min=load, cpus=os.cpu_count(),
                torch=torch.__version__)
    if a.merge and os.path.exists(a.results + ".json"):
        with open(a.results + ".json") as f:
            old = json.load(f)
        done = {(r["pipeline"], r["system"]) for r in rows}
        rows = [r for r in old["rows"] if (r["pipeline"], r["system"]) not in done] + rows
        rows.sort(key=lambda r: (PIPELINES.index(r["pipeline"]), SYSTEMS.index(r["system"])))
        meta = dict(old["meta"], merged=meta)
    os.makedirs(os.path.dirname(a.results), exist_ok=True)
    with open(a.results + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(a.results + ".md", "w") as f:
        f.write(render(meta, rows))
    print(render(meta, rows))
    return 0


def render(meta, rows) -> str:
    names = {"cpu": "CPU eager", "cpu1": "CPU eager, 1 thread", "defer": "tpu defer",
             "compiled": "tpu compiled"}
    out = ["# Diffusers: seconds per denoising step", "",
           f"`python bench/diffusers_bench.py` ({meta['steps']} steps a call, best of "
           f"{meta['calls']} timed calls after a first call; float32, batch 2 with guidance; "
           f"{meta['cpus']} CPUs, 1-minute load average {meta['load_avg_1min']:.1f} at the end; "
           f"torch {meta['torch']}). The tpu device here is XLA's CPU backend.",
           *([f"Rows merged from a later run (load average {meta['merged']['load_avg_1min']:.1f} at "
              f"its end)."] if "merged" in meta else []), "",
           "| pipeline | system | ms per step | vs CPU eager | first call (s) | compiles in timed calls | max abs diff vs CPU |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    cpu = {r["pipeline"]: r.get("step_s") for r in rows if r["system"] == "cpu"}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['pipeline']} | {names[r['system']]} | failed | | | | |")
            continue
        base = cpu.get(r["pipeline"])
        rel = f"{base / r['step_s']:.2f}x" if base else ""
        comp = "" if r["compiles"] is None else str(r["compiles"])
        diff = f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else ""
        out.append(f"| {r['pipeline']} | {names[r['system']]} | {1000 * r['step_s']:.1f} | {rel} | "
                   f"{r['first_s']:.1f} | {comp} | {diff} |")
    out += ["", "vs CPU eager: CPU eager's time per step divided by this row's (above 1: faster).", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
