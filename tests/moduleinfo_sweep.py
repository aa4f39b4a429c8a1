"""The ModuleInfo sweep: PyTorch's ``module_db`` on the ``tpu`` device against CPU eager PyTorch.

For every ModuleInfo, mode (``strict``, ``defer``) and dtype (``float32``, ``bfloat16`` by default),
each of its module inputs (``module_inputs_func``, training mode; forward, also the error inputs of
``module_error_inputs_func`` that raise in the forward pass: ``error_inputs``) builds the module on CPU under a
fixed seed, converts it to the dtype, and deep-copies it to tpu; then, on both devices:

  forward   the module's outputs, and afterwards its buffers (BatchNorm's running statistics and
            ``num_batches_tracked`` ...), are compared (dtype, shape, values)
  backward  the gradients of a fixed random-weighted sum of the float outputs with respect to the
            inputs that require grad and to every parameter are compared

Lazy modules are materialized on CPU first (their initialization draws random numbers), then
copied. Modules whose training-mode output is random (``RANDOM``, dropout with p > 0) are compared
by shape and dtype only, and not differentiated. ``CPU_BROKEN`` modules (CPU sums a gradient in
bfloat16 one term at a time) are compared backward with CPU's float32 gradients, rounded. Tolerances are the OpInfo sweep's
(``opinfo_sweep.DEFAULT_TOL`` / ``BACKWARD_TOL``), the contraction tolerance for modules built on
products (``CONTRACTION``). Where CPU raises, tpu must raise the same exception, type and message
(``opinfo_sweep._same_error``). Classification per (module, mode, dtype, direction) as in the
OpInfo sweep: pass / fallback / fail (first failure's group) / skip / hollow (every module input
raised CPU's exception on both sides); dtypes the module cannot be built or
run in on CPU are not counted.

Run from the repository root (or ``make module-sweep ARGS=...``)::

    .venv/bin/python tests/moduleinfo_sweep.py [--modes strict,defer] [--dtypes float32,bfloat16]
        [--modules nn.Linear,nn.BatchNorm2d] [--limit-samples N] [--timeout S]
        [--out bench/results/moduleinfo.json] [--md bench/results/moduleinfo.md]
    .venv/bin/python tests/moduleinfo_sweep.py --merge a.json,b.json --out ... --md ...

Each module runs in a worker process (a crash or a hang costs one cell; see opinfo_sweep.py).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import deferfuse  # noqa: E402
import opinfo_sweep as ow  # noqa: E402  (the OpInfo sweep: comparison, snapshots, timeouts, worker isolation)

DEFAULT_OUT = os.path.join("bench", "results", "moduleinfo.json")
DTYPES = ow.DTYPES
DTYPE_NAMES = ow.DTYPE_NAMES

# Training-mode outputs that are random: shape and dtype only.
RANDOM = {"nn.FractionalMaxPool2d", "nn.FractionalMaxPool3d"}
_DROPOUT = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
            torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)
# Modules built on products (matmul, convolution): the OpInfo sweep's contraction tolerance.
CONTRACTION = ("Conv", "Linear", "Bilinear", "Transformer", "MultiheadAttention", "RNN", "LSTM",
               "GRU")
CONTRACTION_TOL = {torch.float32: (1e-4, 1e-5)}
# Modules not swept, one reason each.
SKIP: dict = {}

# Modules whose CPU backward is wrong in a dtype (a gradient summed in that dtype, one term at a
# time, stalls): those gradients (BROKEN_GRADS) are compared with CPU's in float32 (the module and
# the inputs converted to float32, the output weights the same rounded values), rounded.
# {module: {dtype: reason}}
_SUM_BF16 = ("CPU adds {what} in bfloat16 one term at a time, rounding the running sum after each "
             "term ({ex}); tpu accumulates in float32 and rounds once{cuda}")
CPU_BROKEN = {
    "nn.ReplicationPad3d": {torch.bfloat16: _SUM_BF16.format(
        what="the padded border's gradient into each edge element", ex="an edge gradient of "
        "91.57 (float64) is 88 on CPU, 91.5 on tpu and on CPU in float32", cuda="")},
}
# The gradients CPU_BROKEN applies to (the others, computed without the broken sum, are CPU's own).
BROKEN_GRADS = {"nn.ReplicationPad3d": {"input[0]"}}

# Why the known failures fail (for the table; the sweep does not use it).
CAUSES: dict = {}


def load_modules() -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_modules import module_db
    return {m.name: m for m in module_db}


def _is_random(name: str, m) -> bool:
    if name in RANDOM:
        return True
    for sub in m.modules():
        if isinstance(sub, _DROPOUT) and sub.p > 0:
            return True
        if isinstance(sub, torch.nn.MultiheadAttention) and sub.dropout > 0:
            return True
    return False


def tolerance(name: str, dtype, backward: bool):
    if any(k in name for k in CONTRACTION) and dtype in CONTRACTION_TOL:
        return CONTRACTION_TOL[dtype]
    return ow.tolerance("", dtype, backward)


def _build(mi, inp, dtype):
    """The CPU module (dtype, training mode, lazy ones materialized), or raises."""
    args, kwargs = inp.constructor_input.args, inp.constructor_input.kwargs
    torch.manual_seed(0)
    m = mi.module_cls(*args, **kwargs)
    m = m.to(dtype)
    m.train(True)
    if mi.is_lazy:
        f_args, f_kwargs = ow.clone_cpu((inp.forward_input.args, inp.forward_input.kwargs), {})
        with torch.no_grad():
            m(*f_args, **f_kwargs)      # materializes the parameters (no buffers to disturb)
    return m


def _snap_buffers(m):
    return {n: ow.Snap(b) for n, b in m.named_buffers()}


def _cpu_buffers(m):
    return {n: b.detach().clone() for n, b in m.named_buffers()}


def _diff_outputs(out):
    return [t for t in ow._tensors(out, []) if t.is_floating_point() and t.requires_grad]


def run_sample(mi, name, inp, dtype, mode, direction):
    """None when the sample matches, "n/a" when it does not apply, "raised" when both sides
    raised the same exception (type and message), else (group, message)."""
    if inp.forward_input is None:
        return "n/a"
    try:
        with torch.random.fork_rng(devices=[]):
            m_cpu = _build(mi, inp, dtype)
    except Exception:
        return "n/a"            # CPU cannot build it in this dtype: not counted
    random = _is_random(name, m_cpu)
    if direction == "backward" and random:
        return "n/a"
    m_ref = copy.deepcopy(m_cpu)
    tol_of = lambda dt: tolerance(name, dt, direction == "backward")   # noqa: E731
    cmemo, tmemo = {}, {}
    f_in = (inp.forward_input.args, inp.forward_input.kwargs)
    c_args, c_kw = ow.clone_cpu(f_in, cmemo)
    # CPU first: only what CPU can run is compared.
    try:
        with torch.random.fork_rng(devices=[]):
            c_out = m_cpu(*c_args, **c_kw)
            c_outs = _diff_outputs(c_out)
            if direction == "backward":
                leaves = [t for t in ow._tensors((c_args, c_kw), []) if t.requires_grad and t.is_leaf]
                leaves = list({id(t): t for t in leaves}.values())
                params = [p for p in m_cpu.parameters() if p.requires_grad]
                if not c_outs or not (leaves or params):
                    return "n/a"
                ws = ow._weights(c_outs, 0)
                loss = sum((t * w).sum() for t, w in zip(c_outs, ws))
                c_grads = torch.autograd.grad(loss, leaves + params, allow_unused=True)
                if dtype in CPU_BROKEN.get(name, {}):
                    g32 = _float32_grads(m_ref, f_in, dtype, ws)
                    c_grads = [w if _grad_name(m_cpu, len(leaves), i) in BROKEN_GRADS[name]
                               else g for i, (g, w) in enumerate(zip(c_grads, g32))]
    except ow.SweepTimeout:
        raise
    except Exception as e:
        c_err = e
    else:
        c_err = None
    t_err = None
    try:
        with deferfuse.mode(mode):
            m_tpu = copy.deepcopy(m_ref).to("tpu")
            t_args, t_kw = ow.to_tpu(f_in, tmemo)
            if random:
                torch.manual_seed(1234)
            out = m_tpu(*t_args, **t_kw)
            if direction == "forward":
                got = ow.snapshot(out)
                got_buf = _snap_buffers(m_tpu)
            else:
                orig = {id(v): k for k, v in cmemo.items()}
                t_leaves = [tmemo[orig[id(t)]] for t in leaves]
                t_outs = _diff_outputs(out)
                if len(t_outs) != len(c_outs):
                    return ("structure mismatch",
                            f"{len(t_outs)} differentiable outputs on tpu, {len(c_outs)} on CPU")
                loss = sum((t * w.to("tpu")).sum() for t, w in zip(t_outs, ws))
                t_params = [p for p in m_tpu.parameters() if p.requires_grad]
                t_grads = torch.autograd.grad(loss, t_leaves + t_params, allow_unused=True)
                got = [None if g is None else ow.Snap(g) for g in t_grads]
    except ow.SweepTimeout:
        raise
    except Exception as e:
        t_err = e
    if c_err is not None:
        if direction == "backward" or (isinstance(c_err, NotImplementedError)
                                       and "not implemented for" in str(c_err)):
            return "n/a"        # CPU has no kernel for this dtype (bfloat16 avg_pool3d): not counted
        if t_err is None:
            return "error not raised", f"CPU raised {ow._err_text(c_err)}; tpu did not"
        # The OpInfo sweep's rule: CPU's exception type and message (device names one word).
        return ow._same_error(t_err, c_err) or "raised"
    if t_err is not None:
        return ow._classify_error(t_err), ow._err_text(t_err)
    try:
        if direction == "forward":
            ow.compare(got, c_out, tol_of, "out", values=not random)
            ow.compare(got_buf, _cpu_buffers(m_cpu), tol_of, "buffers", values=not random)
        else:
            names = [f"input[{i}]" for i in range(len(leaves))] + \
                [f"{n}.grad" for n, p in m_cpu.named_parameters() if p.requires_grad]
            scaled = False
            for nm, g, w in zip(names, got, c_grads):
                if w is None and g is None:
                    continue
                if w is None or g is None:
                    raise ow.Mismatch("structure mismatch", f"{nm}: None on one side only")
                try:
                    ow.compare(g, w, tol_of, nm)
                except ow.Mismatch:
                    if w.dtype not in SCALED_EPS:
                        raise
                    ow.compare(g, w, _scaled_tol(tol_of, w), nm)
                    scaled = True
            if scaled:
                return "scaled"
    except ow.Mismatch as mm:
        return mm.group, str(mm)
    return None


def _grad_name(m, n_leaves: int, i: int) -> str:
    """The name the comparison gives the i-th gradient (input[k] or a parameter's name)."""
    if i < n_leaves:
        return f"input[{i}]"
    return [n for n, p in m.named_parameters() if p.requires_grad][i - n_leaves]


def _float32_grads(m_ref, f_in, dtype, ws):
    """The ``CPU_BROKEN`` reference: the gradients of the module input's leaves and of the
    parameters, computed on CPU in float32 (copies of the module and inputs) and rounded to dtype."""
    up = lambda t: (t.detach().float().requires_grad_(t.requires_grad)    # noqa: E731
                    if isinstance(t, torch.Tensor) and t.dtype == dtype else t)
    memo = {}
    args, kw = ow._map(ow.clone_cpu(f_in, memo), lambda t: memo.setdefault(("up", id(t)), up(t))
                       if isinstance(t, torch.Tensor) else t)
    m = copy.deepcopy(m_ref).float()
    with torch.random.fork_rng(devices=[]):
        outs = _diff_outputs(m(*args, **kw))
    leaves = [t for t in ow._tensors((args, kw), []) if t.requires_grad and t.is_leaf]
    leaves = list({id(t): t for t in leaves}.values())
    params = [p for p in m.parameters() if p.requires_grad]
    loss = sum((t * w.float()).sum() for t, w in zip(outs, ws))
    grads = torch.autograd.grad(loss, leaves + params, allow_unused=True)
    return [None if g is None else g.to(dtype) for g in grads]


# A half-precision gradient sums many rounded products (a weight's gradient over batch and
# sequence): where the sweep's tolerance fails, it is compared again with an atol of two ulps of
# its largest entry (the rounding of the terms it sums), counted apart ("scaled").
SCALED_EPS = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _scaled_tol(tol_of, want):
    big = float(want.detach().abs().max()) if want.numel() else 0.0

    def tol(dt):
        atol, rtol = tol_of(dt)
        return max(atol, SCALED_EPS[dt] * big), rtol
    return tol


def error_inputs(mi, dtype, direction) -> list:
    """module_db's error inputs that raise in the forward pass (``module_error_inputs_func``,
    ``ModuleErrorEnum.FORWARD_ERROR``: a wrong input shape, an out-of-range class index...), as
    module inputs: CPU raises, and tpu must raise the same exception, type and message. Inputs
    that fail at construction raise before any tpu tensor exists: not swept."""
    fn = getattr(mi, "module_error_inputs_func", None)
    if fn is None or direction != "forward":
        return []
    from torch.testing._internal.common_modules import ModuleErrorEnum
    errs = fn(mi, device="cpu", dtype=dtype, requires_grad=True, training=True)
    return [e.module_error_input for e in errs if e.error_on == ModuleErrorEnum.FORWARD_ERROR]


def check_module(mi, mode, dtype, direction="forward", limit=None, timeout=120.0) -> dict:
    name = mi.name
    rec = {"status": None, "samples": 0, "passed": 0}
    if name in SKIP:
        rec.update(status="skip", reason=SKIP[name])
        return rec
    failures = []
    fallbacks: dict = {}
    t0 = time.perf_counter()
    n = 0
    try:
        with ow.alarm(timeout):
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                inputs = list(mi.module_inputs_func(mi, device="cpu", dtype=dtype,
                                                    requires_grad=True, training=True))
            if limit:
                inputs = inputs[:limit]
            inputs += error_inputs(mi, dtype, direction)
            for i, inp in enumerate(inputs):
                deferfuse.reset_metrics()
                r = run_sample(mi, name, inp, dtype, mode, direction)
                if r == "n/a":
                    continue        # (its CPU fallbacks, if any, are not counted either)
                for aten_op, k in deferfuse.metrics()["cpu_fallbacks"].items():
                    fallbacks[aten_op] = fallbacks.get(aten_op, 0) + k
                n += 1
                if r == "scaled":
                    rec["scaled_tolerance"] = rec.get("scaled_tolerance", 0) + 1
                    r = None
                elif r == "raised":
                    rec["raised"] = rec.get("raised", 0) + 1
                    r = None
                if r is None:
                    rec["passed"] += 1
                else:
                    failures.append((i, r[0], r[1], inp.desc))
    except ow.SweepTimeout:
        ow._reset_defer()
        failures.append((None, "timeout", f"no result within {timeout:g}s", ""))
        n = rec["passed"] + 1
    except Exception as e:
        failures.append((None, "other", "sweep: " + ow._err_text(e), ""))
        n = rec["passed"] + 1
    rec["samples"] = n
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    fb = fallbacks
    if fb:
        rec["fallbacks"] = dict(fb)
    if failures:
        i, group, msg, desc = failures[0]
        rec.update(status="fail", group=group, error=msg)
        if i is not None:
            rec["sample"] = f"#{i} {desc}".strip()
    elif n == 0:
        rec.update(status="n/a", reason=f"no module input runs on CPU in {dtype} ({direction})")
    elif rec.get("raised", 0) == n:
        # Every input raised CPU's exception on both sides: nothing compared (the OpInfo sweep's
        # ``hollow``), counted apart from pass.
        rec.update(status="hollow", reason=f"{n} module inputs raised the same error on both sides")
    elif fb:
        rec["status"] = "fallback"
    else:
        rec["status"] = "pass"
    return rec


def sweep(mods: dict, modes, dtypes, directions=("forward", "backward"), limit=None,
          timeout=120.0, progress=print, emit=None, skip_cells=frozenset(), index0=0, total=None,
          elapsed0=0.0):
    """{module: {mode: {dtype: {direction: record}}}} (the OpInfo sweep's layout and protocol)."""
    results: dict = {}
    n = total or len(mods)
    t_start = time.perf_counter() - elapsed0
    emit = emit or (lambda kind, payload: None)
    for k, (name, mi) in enumerate(mods.items()):
        t0 = time.perf_counter()
        r = results[name] = {}
        cells = []
        for dt in dtypes:
            dname = DTYPE_NAMES[dt]
            for d in directions:
                for m in modes:
                    if (name, m, dname, d) in skip_cells:
                        continue
                    emit("start", [name, m, dname, d])
                    rec = check_module(mi, m, dt, d, limit, timeout)
                    r.setdefault(m, {}).setdefault(dname, {})[d] = rec
                    emit("cell", {"op": name, "mode": m, "dtype": dname, "direction": d,
                                  "rec": rec})
                    cells.append(f"{m[0]}{dname}{'.bwd' if d == 'backward' else ''}:"
                                 f"{ow._ABBR[rec['status']]}")
        emit("op", name)
        if progress:
            el = time.perf_counter() - t_start
            progress(f"[{index0 + k + 1:4d}/{n}] {name[:30]:30s} {' '.join(cells)}  "
                     f"{time.perf_counter() - t0:5.1f}s  (total {el / 60:.1f} min)", flush=True)
    return results


def _broken_json() -> dict:
    return {n: {DTYPE_NAMES[d]: why for d, why in per.items()} for n, per in CPU_BROKEN.items()}


def render_md(results: dict, summ: dict, runs: list) -> str:
    L = ["# ModuleInfo sweep: deferfuse `tpu` vs CPU eager PyTorch", "",
         "Generated by `tests/moduleinfo_sweep.py` (see its docstring); data in `moduleinfo.json`. "
         "Training mode; `fwd`: outputs and buffers (running statistics) after the forward pass; "
         "`bwd`: gradients of the inputs and of every parameter. `pass`: every module input "
         "matches CPU and nothing ran on CPU; `fallback`: matches, but some aten op ran on CPU; "
         "`fail`: a module input differs or raises (where CPU raises, tpu must raise CPU's "
         "exception, type and message, device names made one word); `hollow`: every module "
         "input raised CPU's exception on both sides (nothing compared; not counted as tested). "
         "Random modules (shape and dtype only) are "
         "excluded from the `non-random pass` rate.", "", "Runs:", ""]
    L += [f"- `{r['command']}` ({r['date']}, {r['seconds'] / 60:.0f} min, limit "
          f"{r.get('limit_samples') or 'all'} module inputs)" for r in runs]
    L += ["", "| mode | dtype | dir | modules | tested | pass | fail | fallback | skip | hollow | "
          "non-random pass | of which at the OpInfo tolerance | correct |", "|" + "---|" * 13]
    for m, per in summ["summary"].items():
        for dname, perd in per.items():
            for d, c in perd.items():
                nr = [r.get(m, {}).get(dname, {}).get(d) for n, r in results.items()
                      if n not in RANDOM]
                nr = [x for x in nr if x and x["status"] not in ("n/a", "skip", "hollow")]
                npass = sum(x["status"] == "pass" for x in nr)
                strict = sum(x["status"] == "pass" and not x.get("scaled_tolerance") for x in nr)
                L.append(f"| {m} | {dname} | {ow._DIR[d]} | {c['ops']} | {c['tested']} | "
                         f"{c['pass']} | {c['fail']} | {c['fallback']} | {c['skip']} | "
                         f"{c.get('hollow', 0)} | {ow._rate(npass, len(nr))} ({npass}/{len(nr)}) | "
                         f"{ow._rate(strict, len(nr))} ({strict}/{len(nr)}) | "
                         f"{ow._rate(c['pass'] + c['fallback'], c['tested'])} |")
    scaled = sorted({f"{n} [{dn}]" for n, r in results.items() for per in r.values()
                     for dn, perd in per.items() for d, rec in perd.items()
                     if rec.get("scaled_tolerance")})
    L += ["", "Tolerances: the OpInfo sweep's (forward: assert_close's defaults for the dtype; "
          "backward: float32 atol = rtol = 1e-5, half precision atol 1e-3 and two ulps of rtol; "
          "contraction modules (1e-4, 1e-5) in float32). A half-precision gradient that fails "
          "them is compared again with an atol of two ulps of its largest entry (it sums many "
          "rounded terms); those passes are counted apart (the column before last): "
          + (", ".join(scaled) or "none") + "."]
    broken = [f"{n} ({', '.join(DTYPE_NAMES[d] for d in per)}; "
              f"{', '.join(sorted(BROKEN_GRADS[n]))}): {next(iter(per.values()))}"
              for n, per in CPU_BROKEN.items()]
    L += ["", "Gradients compared against CPU in float32, rounded (`CPU_BROKEN`: the module and "
          "its inputs converted to float32 on CPU, the named gradients rounded to the dtype; the "
          "module's other gradients against CPU's own): " + "; ".join(broken) + "."]
    L += ["", "PyTorch's own module tests compare a device with CPU (`TestModule."
          "test_cpu_gpu_parity`) in float32 and float64 only (module_db's default dtypes), and "
          "module_db has no half-precision tolerance override for `TestModule` on CPU or CUDA "
          "for the modules above: no looser tolerance of PyTorch's own applies to these cells."]
    L += ["", "## Causes", ""] + [f"- {n}: {c}" for n, c in CAUSES.items()]
    L += ["", "## Failures, fallbacks and hollow cells", ""]
    for n, r in results.items():
        for m, per in r.items():
            for dname, perd in per.items():
                for d, rec in perd.items():
                    if rec["status"] in ("fail", "fallback", "hollow"):
                        what = (rec.get("error") or rec.get("reason") if rec["status"] != "fallback"
                                else f"CPU fallbacks: {rec.get('fallbacks')}")
                        L.append(f"- {n} [{m} {dname} {ow._DIR[d]}] {rec['status']}"
                                 f"{' (' + rec['group'] + ')' if rec.get('group') else ''}: "
                                 f"{what[:300]} {rec.get('sample', '')}")
    L.append("")
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="strict,defer")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--directions", default="forward,backward")
    ap.add_argument("--modules", default="", help="comma-separated module_db names")
    ap.add_argument("--limit-samples", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--merge", default="", metavar="A.json,B.json")
    ap.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return ow.run_worker(a.worker, load_modules, sweep)
    if a.merge:
        docs = [json.load(open(p)) for p in a.merge.split(",") if p]
        results, modes, dnames, dirs = ow.merge_results(docs)
        summ = ow.summarize(results, modes, [DTYPES[d] for d in dnames], dirs)
        runs = [r for d in docs for r in (d["meta"].get("runs") or [d["meta"]])]
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "merged": True, "runs": runs}
        out = a.out or DEFAULT_OUT
        ow.write_json({"meta": meta, **summ, "cpu_broken": _broken_json(), "ops": results}, out)
        if a.md:
            ow._write(render_md(results, summ, runs) + "\n", a.md)
        print(ow.render(results, summ, modes, [DTYPES[d] for d in dnames], dirs))
        return 0
    modes = [m for m in a.modes.split(",") if m]
    dtypes = [DTYPES[d] for d in a.dtypes.split(",") if d]
    directions = tuple(d for d in a.directions.split(",") if d)
    warnings.simplefilter("ignore")
    t0 = time.time()
    allm = load_modules()
    names = [n for n in a.modules.split(",") if n] or list(allm)
    unknown = [n for n in names if n not in allm]
    if unknown:
        print(f"unknown modules: {', '.join(unknown)}", file=sys.stderr)
        return 2
    out = a.out if a.out is not None else (None if a.modules else DEFAULT_OUT)
    print(f"ModuleInfo sweep: {len(names)} modules, modes {','.join(modes)}, dtypes "
          f"{','.join(DTYPE_NAMES[d] for d in dtypes)}, {'+'.join(directions)}, limit "
          f"{a.limit_samples or 'all'} inputs", flush=True)

    def write(results, partial):
        summ = ow.summarize(results, modes, dtypes, directions)
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.time() - t0, 1),
                "partial": partial, "command": " ".join(["tests/moduleinfo_sweep.py"] + list(
                    argv if argv is not None else sys.argv[1:])), "torch": torch.__version__,
                "modes": modes, "dtypes": [DTYPE_NAMES[d] for d in dtypes],
                "directions": list(directions), "limit_samples": a.limit_samples or None}
        ow.write_json({"meta": meta, **summ, "random": sorted(RANDOM),
                       "cpu_broken": _broken_json(), "ops": results}, out)
        if a.md:
            ow._write(render_md(results, summ, [meta]) + "\n", a.md)
        return summ

    results = ow.sweep_isolated(names, modes, dtypes, directions, a.limit_samples or None,
                                a.timeout, progress=print,
                                checkpoint=(lambda r: write(r, True)) if out else None,
                                script=os.path.abspath(__file__))
    summ = ow.summarize(results, modes, dtypes, directions)
    print(ow.render(results, summ, modes, dtypes, directions))
    print(f"done in {(time.time() - t0) / 60:.1f} min")
    if out:
        write(results, False)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
