"""Where does a Hugging Face model in bfloat16 first differ from CPU? Module by module, in isolation.

``python tests/hf_firstdiff.py MODEL_TYPE [...]`` builds the model as ``tests/hf_sweep.py`` does,
runs it in bfloat16 on CPU once with hooks that record every module's first call (its inputs and
the gradient reaching its outputs), then reruns each module alone on CPU and on ``tpu`` from those
same inputs and output gradients, and compares the outputs, input gradients and parameter
gradients bit for bit. Differences upstream cannot leak in: a module is listed only when it
differs on identical inputs. The innermost such modules (no listed child) are the causes.

``--f64`` also reruns each listed innermost module in float64 on CPU from the same inputs (cast; float32
where the module refuses float64) and
prints, for each tensor that differs, tpu's and CPU's max abs error and RMSE from that result:
which side rounds farther from the exact result of the same computation.
"""
from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_sweep  # noqa: E402


def _tensors(x):
    import torch
    from torch.utils._pytree import tree_leaves
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _outs(x):
    import torch
    if hasattr(x, "to_tuple"):
        x = x.to_tuple()
    return [t for t in _tensors(x) if t.is_floating_point()]


def record(model, batch):
    """{module name: (args, kwargs, [output grads or None])} of each module's first call on CPU."""
    import torch
    from torch.utils._pytree import tree_map
    calls, handles = {}, []

    def hook(name):
        def fn(mod, args, kwargs, out):
            if name in calls:
                return
            det = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
            grads = []
            for i, o in enumerate(_outs(out)):
                grads.append(None)
                if o.requires_grad:
                    def save(g, i=i, grads=grads):
                        grads[i] = g.detach().clone()
                    o.register_hook(save)
            calls[name] = (tree_map(det, args), tree_map(det, kwargs), grads)
        return fn

    for name, mod in model.named_modules():
        if name:
            handles.append(mod.register_forward_hook(hook(name), with_kwargs=True))
    try:
        hf_sweep.run_model(model, batch, "cpu")
    finally:
        for h in handles:
            h.remove()
    return calls


def run_alone(mod, args, kwargs, grads, device, dtype=None):
    """(outputs, input grads, param grads) of one module on ``device`` from recorded inputs
    (module, floating inputs and output gradients cast to ``dtype`` when given)."""
    import torch
    from torch.utils._pytree import tree_map
    m = copy.deepcopy(mod).to(device)
    if dtype is not None:
        m = m.to(dtype)
        cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        args, kwargs, grads = tree_map(cast, args), tree_map(cast, kwargs), [cast(g) for g in grads]
    m.zero_grad(set_to_none=True)
    leaves = []

    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        t = t.to(device).detach()
        if t.is_floating_point():
            t.requires_grad_(True)
            leaves.append(t)
        return t
    a, k = tree_map(move, args), tree_map(move, kwargs)
    torch.manual_seed(5)
    outs = _outs(m(*a, **k))
    pairs = [(o, g.to(device)) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
    return ([cpu(o) for o in outs], [cpu(t.grad) for t in leaves],
            {n: cpu(p.grad) for n, p in m.named_parameters()})


def _diff(a, b):
    """(elements that differ, max abs difference) of two tensors (None: equal)."""
    if a is None or b is None:
        return None if a is None and b is None else (-1, float("nan"))
    if a.shape != b.shape or a.dtype != b.dtype:
        return (-1, float("nan"))
    bad = ~((a == b) | (a.isnan() & b.isnan()))
    n = int(bad.sum())
    return None if n == 0 else (n, float((a.double() - b.double()).abs()[bad].max()))


def _err(x, r):
    """(max abs, RMSE) of ``x`` from ``r`` over the finite differences."""
    d = (x.double() - r.double()).abs()
    d = d[d.isfinite()]
    return (float(d.max()), float(d.pow(2).mean().sqrt())) if d.numel() else (float("nan"), float("nan"))


def against_f64(mod, call, got, want):
    """["what: tpu max/rmse, CPU max/rmse"] for each tensor where tpu and CPU differ, both measured
    from the module run alone in float64 on CPU from the same inputs."""
    import torch
    try:
        ref, kind = run_alone(mod, *call, "cpu", torch.float64), ""
    except Exception as e:  # noqa: BLE001 - the module refuses float64 on CPU (grouped mm): float32
        ref, kind = run_alone(mod, *call, "cpu", torch.float32), f" (float32: {hf_sweep._first_line(e)[:60]})"
    out = []
    named = ([(f"out{i}", g, w, r) for i, (g, w, r) in enumerate(zip(got[0], want[0], ref[0]))]
             + [(f"dx{i}", g, w, r) for i, (g, w, r) in enumerate(zip(got[1], want[1], ref[1]))]
             + [(f"d.{n}", got[2][n], w, ref[2][n]) for n, w in want[2].items()])
    for what, g, w, r in named:
        if _diff(g, w) is None or g is None or w is None or r is None or g.shape != r.shape:
            continue
        (tm, tr), (cm, cr) = _err(g, r), _err(w, r)
        out.append(f"{what}: tpu {tm:.3g}/{tr:.3g} CPU {cm:.3g}/{cr:.3g}"
                   + (" tpu farther" if tm > cm or tr > cr else "") + kind)
    return out


def compare_model(model_type, verbose=True, f64=False):
    import torch
    import deferfuse
    # the sweep's own build: its tiny config's passes (the fallback where the first builds nothing
    # that runs) and the first input layout that runs on CPU
    kind, model, cfg, _, batch, _ = hf_sweep._build_and_run(model_type, {})
    cm = copy.deepcopy(model).to(torch.bfloat16)
    cm.zero_grad(set_to_none=True)
    calls = record(cm, batch)
    mods = dict(cm.named_modules())
    found, results = {}, {}
    for name, (args, kwargs, grads) in calls.items():
        mod = mods[name]
        try:
            want = run_alone(mod, args, kwargs, grads, "cpu")
            with deferfuse.mode("defer"):
                got = run_alone(mod, args, kwargs, grads, "tpu")
        except Exception as e:  # noqa: BLE001 - reported, the next module
            found[name] = f"error: {hf_sweep._first_line(e)}"
            continue
        what = []
        for i, (g, w) in enumerate(zip(got[0], want[0])):
            d = _diff(g, w)
            if d:
                what.append(f"out{i} {d[0]}/{w.numel()} ({d[1]:.3g})")
        for i, (g, w) in enumerate(zip(got[1], want[1])):
            d = _diff(g, w)
            if d:
                what.append(f"dx{i} {d[0]}/{-1 if w is None else w.numel()} ({d[1]:.3g})")
        for n, w in want[2].items():
            d = _diff(got[2][n], w)
            if d:
                what.append(f"d.{n} {d[0]}/{-1 if w is None else w.numel()} ({d[1]:.3g})")
        if what:
            found[name] = "; ".join(what)
            results[name] = ((args, kwargs, grads), got, want)
    inner = [n for n in found if not any(o != n and o.startswith(n + ".") for o in found)]
    if verbose:
        for n in inner:
            print(f"{model_type}\t{n}\t{type(mods[n]).__name__}\t{found[n]}", flush=True)
            if f64 and n in results:
                try:
                    for line in against_f64(mods[n], *results[n]):
                        print(f"  vs float64 {line}", flush=True)
                except Exception as e:  # noqa: BLE001 - the module refuses float64 on CPU
                    print(f"  vs float64: {hf_sweep._first_line(e)}", flush=True)
    return {n: (type(mods[n]).__name__, found[n]) for n in inner}


if __name__ == "__main__":
    f64 = "--f64" in sys.argv[1:]
    for mt in sys.argv[1:]:
        if mt != "--f64":
            compare_model(mt, f64=f64)
