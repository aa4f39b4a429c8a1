"""Which side rounds: tpu's and CPU's bfloat16 errors against float64, per tensor, for sweep rows.

``python tests/hf_bf16_rows.py [--only a,b] [--timeout S] [--out FILE]`` (default: every row of
bench/results/hf-sweep.json whose bfloat16 stage fails the OpInfo rule) runs each model_type in its
own process as ``tests/hf_sweep.py``'s bf16 stage does (the same build, inputs and copies), and also
computes the same bfloat16 weights and inputs in float64 on CPU. For every tensor that fails the
OpInfo rule (loss, logits, each parameter's gradient, in the sweep's order) it reports tpu's and CPU
bfloat16's max abs error and RMSE from the float64 result, and how many elements fail the OpInfo
rule's "no farther than CPU's bfloat16" clause measured against the float32 result (as the sweep
does) and against the float64 one. A row is (a) when tpu is no farther from float64 than CPU is on
every failing tensor, by max abs error and by RMSE, else (b). JSON lines go to ``--out``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_sweep  # noqa: E402


def _stats(x, r):
    d = (x.double() - r).abs()
    fin = d.isfinite()
    return (float(d[fin].max()) if bool(fin.any()) else float("nan"),
            float(d[fin].pow(2).mean().sqrt()) if bool(fin.any()) else float("nan"), int((~fin).sum()))


def _farther(g, w, r, tol):
    """Elements of ``g`` farther from ``r`` than ``w`` is, beyond the OpInfo tolerance (the clause)."""
    scale = max(1.0, float(w.double().abs().nan_to_num(0, 0, 0).max())) if w.numel() else 1.0
    atol, rtol = tol[0] * scale, tol[1]
    g, w, r = g.double(), w.double(), r.double()
    slack = (w - r).abs() + atol + rtol * r.abs()
    return int((~((g - r).abs() <= slack) & ~(g.isnan() & r.isnan())).sum())


def measure(model_type):
    import torch
    import deferfuse
    t0 = time.time()
    kind, model, cfg = hf_sweep.build(model_type)
    pristine = copy.deepcopy(model)
    for batch in hf_sweep.candidates(kind, model, cfg):
        try:
            hf_sweep.run_model(model, batch, "cpu")
            break
        except Exception:  # noqa: BLE001 - the next layout, as the sweep does
            model.zero_grad(set_to_none=True)
    hf_sweep._copy_placeholders(model.config, pristine.config)
    cm = copy.deepcopy(pristine).to(torch.bfloat16)

    def cast(dt):
        return {k: (v.to(torch.bfloat16).to(dt) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                for k, v in batch.items()}
    ref32 = hf_sweep.run_model(copy.deepcopy(cm).float(), cast(torch.float32), "cpu")
    cw = hf_sweep.run_model(copy.deepcopy(cm), batch, "cpu")
    try:
        r64, ref_kind = hf_sweep.run_model(copy.deepcopy(cm).double(), cast(torch.float64), "cpu"), "float64"
    except Exception as e:  # noqa: BLE001 - the model refuses float64 on CPU: the float32 result, as the sweep
        r64, ref_kind = ref32, "float32 (" + hf_sweep._first_line(e)[:80] + ")"
    tm = copy.deepcopy(cm).to("tpu")
    tm.zero_grad(set_to_none=True)
    with deferfuse.mode("defer"):
        got = hf_sweep.run_model(tm, batch, "tpu")

    def flat(res):
        return dict(zip(["loss", "logits"], res[0]), **res[1])
    g_all, w_all, r32_all, r64_all = flat(got), flat(cw), flat(ref32), flat(r64)
    tensors = []
    for name, w in w_all.items():
        g = g_all[name]
        if w is None or g is None:
            continue
        if hf_sweep._close(g, w, hf_sweep.BF16_TOL, r32_all[name]) is None:
            continue
        r = r64_all[name].double()
        tmax, trmse, tnonfin = _stats(g, r)
        cmax, crmse, cnonfin = _stats(w, r)
        tensors.append(dict(
            name=name, numel=w.numel(), scale=float(r.abs().max()),
            tpu_max=tmax, tpu_rmse=trmse, cpu_max=cmax, cpu_rmse=crmse, tpu_nonfinite=tnonfin,
            cpu_nonfinite=cnonfin,
            f32_max=_stats(r32_all[name], r)[0],
            farther_vs_f32=_farther(g, w, r32_all[name], hf_sweep.BF16_TOL),
            farther_vs_f64=_farther(g, w, r, hf_sweep.BF16_TOL),
            tpu_closer=bool(tmax <= cmax and trmse <= crmse)))
    cls = "a" if all(t["tpu_closer"] for t in tensors) else "b"
    return dict(model_type=model_type, cls=cls, ref=ref_kind, failing=len(tensors), tensors=tensors,
                seconds=round(time.time() - t0, 1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one")
    p.add_argument("--only")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--out", default="/tmp/hf_bf16_rows.jsonl")
    a = p.parse_args(argv)
    if a.one:
        import warnings
        import torch  # noqa: F401
        import transformers
        transformers.logging.set_verbosity_error()
        warnings.simplefilter("ignore")
        print("BF16ROWS " + json.dumps(measure(a.one)), flush=True)
        return
    if a.only:
        names = a.only.split(",")
    else:
        rows = hf_sweep.load_results()["rows"]
        names = sorted(m for m, r in rows.items() if r.get("built") and r.get("bf16") is not None
                       and (r.get("bf16") is False or r.get("bf16_scale_rule")))
    for mt in names:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", mt]
        try:
            pr = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, cwd=hf_sweep.ROOT)
            line = next((ln[9:] for ln in reversed(pr.stdout.splitlines()) if ln.startswith("BF16ROWS ")), None)
            res = json.loads(line) if line else dict(model_type=mt, error=(pr.stderr.strip().splitlines()
                                                                          or ["(no output)"])[-1][:300])
        except subprocess.TimeoutExpired:
            res = dict(model_type=mt, error=f"timed out after {a.timeout} s")
        with open(a.out, "a") as f:
            f.write(json.dumps(res) + "\n")
        first = (res.get("tensors") or [{}])[0]
        print(mt, res.get("cls"), res.get("failing"), first.get("name"), res.get("seconds"), res.get("error", ""),
              flush=True)


if __name__ == "__main__":
    main()
