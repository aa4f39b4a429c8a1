"""``deferfuse.report()`` and ``dump_trace()``: what ran, compiled and synced, in words."""
from __future__ import annotations

import os
import shutil
import subprocess

from .engine import engine
from .runtime import stats
from .scheduler.policy import Cut, is_async
from .runtime.memory import COUNTERS as memory


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


_CUT_WORDS = {
    Cut.LOOP_BOUNDARY: "a loop's repeated body was found; the trace is dispatched at every "
                       "repetition (or every few), each piece one cached region",
    Cut.TRACE_LIMIT: "the trace reached DEFERFUSE_TRACE_LIMIT ops and was dispatched",
    Cut.BACKWARD: "backward() dispatched the forward pass, which computes while the backward pass "
                  "is recorded",
    Cut.DEVICE_SWITCH: "an op ran on another tpu device; a region runs on one device, so the "
                       "trace was dispatched",
    Cut.FENCE: "a library ended a region there (vLLM's compiled model: a program of its own, "
               "whatever sizes the step's other ops have)",
    Cut.PACKED: "varlen attention's sequence boundaries were still pending: the trace was "
                "dispatched so they could be padded to their bucket (NOTE [packed boundaries])",
}


def render() -> str:
    S = stats.S
    lines = ["deferfuse report", "================"]
    nsync = sum(S["syncs"].values())
    lines.append(f"ops: {S['ops_recorded']} recorded (defer), {S['ops_eager']} run one by one "
                 f"(strict/debug); {S['regions_run']} fused regions run.")
    lines.append(f"compiles: {S['compiles']} ({S['region_compiles']} fused regions, {S['op_compiles']} "
                 f"single-op programs); {S['cache_hits']} region cache hits; "
                 f"{S['recompiles']} recompiles of a known region structure with new shapes or "
                 f"constants.")
    if S["disk_cache_hits"]:
        lines.append(f"disk: {S['disk_cache_hits']} programs came from the on-disk cache instead of "
                     f"compiling: {S['program_disk_hits']} loaded from disk whole (nothing traced), "
                     f"{S['jax_disk_hits']} compiled by XLA from its own cache.")
    lines.append(f"time: compiling {S['compile_seconds']:.2f} s, executing (dispatch, asynchronous) "
                 f"{S['execute_seconds']:.2f} s.")
    lines.append("")
    cuts = {r: n for r, n in S["syncs"].items() if is_async(r)}
    waits = {r: n for r, n in S["syncs"].items() if not is_async(r)}
    lines.append(f"syncs: {nsync}" + ("" if nsync else " (nothing forced the trace to run)")
                 + (f": {sum(waits.values())} where the host waited for the device, "
                    f"{sum(cuts.values())} cuts that waited for nothing" if cuts else ""))
    for reason, n in sorted(waits.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {n:6d}  {reason}")
    for reason, n in sorted(cuts.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {n:6d}  {reason}: {_CUT_WORDS[reason]}")
    sites = [(k, n) for k, n in S["sync_sites"].most_common() if not is_async(k[0])]
    if sites:
        lines.append("top sync sites (where your code made the device wait):")
        for (reason, src), n in sites[:8]:
            lines.append(f"  {n:6d}  {reason:22s} {src}")
    cut_sites = [(k, n) for k, n in S["sync_sites"].most_common() if is_async(k[0])]
    if cut_sites:
        lines.append("top cut sites (your line running when the trace was dispatched):")
        for (reason, src), n in cut_sites[:4]:
            lines.append(f"  {n:6d}  {reason:22s} {src}")
    lines.append("")
    if S["miss_reasons"]:
        lines.append("what compiled and why (latest 8):")
        for summary, why, dt in S["miss_reasons"][-8:]:
            lines.append(f"  {dt * 1e3:8.1f} ms  {summary}")
            lines.append(f"              because: {why}")
        lines.append("")
    if S["cpu_fallbacks"]:
        lines.append("ops that ran on CPU (no lowering to JAX yet; each costs a sync and two copies):")
        for name, n in S["cpu_fallbacks"].most_common():
            lines.append(f"  {n:6d}  {name}")
        lines.append("")
    if S["shape_splits"]:
        lines.append(f"regions split because some of their ops kept changing shape: "
                     f"{S['shape_splits']} (the rest stays fused and cached)")
    if S["loop_splits"]:
        lines.append(f"traces holding many iterations of a loop, run as one cached region per "
                     f"iteration instead of one long program: {S['loop_splits']}")
    if S["setup_splits"]:
        lines.append(f"traces whose leading tensors made before a call and kept ran first, on "
                     f"their own (the rest as the next call records it): {S['setup_splits']}")
    if S["needed_first_splits"]:
        lines.append(f"syncs that waited only for the ops their value needed (the rest of the trace "
                     f"ran as a second region behind them): {S['needed_first_splits']}")
    if S["shape_fallbacks"]:
        lines.append(f"regions run op by op because their shapes kept changing: {S['shape_fallbacks']}")
    if S["bucketed_runs"] or S["bucket_refusals"] or S["bucket_misfits"]:
        lines.append(f"buckets (a region whose sizes keep changing runs padded to the next power of "
                     f"two, one program per bucket; see docs/recompiles.md): {S['bucketed_runs']} "
                     f"regions ran padded, {S['bucket_programs']} bucket programs made or loaded"
                     + (f", {S['bucket_misfits']} versions whose sizes did not fit their structure's "
                        f"buckets (compiled exactly)" if S["bucket_misfits"] else ""))
        for why, n in S["bucket_refusals"].most_common(4):
            lines.append(f"  {n:6d}  region structure that cannot run padded: {why}")
    lines += _compiled_lines(S)
    lines.append("memory:")
    lines.append(f"  live device buffers now {_mb(memory.allocated)}, peak {_mb(memory.peak)}"
                 + (f" (in {S['peak_region']})" if S["peak_region"] else ""))
    lines.append(f"  saved by donation {_mb(S['donated_bytes'])}; intermediates never materialised "
                 f"{_mb(S['elided_bytes'])}")
    return "\n".join(lines)


def _compiled_lines(S) -> list:
    """torch.compile on tpu: the graphs, their compiles and calls, Dynamo's graph breaks and
    recompiles, with their reasons (Dynamo's own counters)."""
    if not S["dynamo_graphs"]:
        return []
    import sys
    lines = [f"compiled mode (torch.compile): {S['dynamo_graphs']} graphs from Dynamo, "
             f"{S['compiled_graphs']} forward/backward/inference graphs, {S['graph_compiles']} "
             f"program compiles (one per graph and input shapes), {S['compiled_calls']} calls"]
    if S["graphs_with_collectives"]:
        lines.append(f"  graphs with collectives, each run as one program over a process group: "
                     f"{S['graphs_with_collectives']}" + (
                         f" ({S['graph_calls_op_by_op']} calls run op by op: the ranks' input "
                         "shapes differed)" if S["graph_calls_op_by_op"] else ""))
    if S["graphs_run_eagerly"]:
        lines.append(f"  graphs run op by op in the eager mode (an op with no lowering): "
                     f"{S['graphs_run_eagerly']}: " + "; ".join(S["graph_fallback_reasons"][-3:]))
    dyn = sys.modules.get("torch._dynamo.utils")
    counters = getattr(dyn, "counters", {}) if dyn else {}
    breaks = counters.get("graph_break", {})
    if breaks:
        lines.append(f"  graph breaks (the code between runs in the eager mode in force): "
                     f"{sum(breaks.values())}")
        for why, n in sorted(breaks.items(), key=lambda kv: -kv[1])[:5]:
            lines.append(f"  {n:6d}  {why.strip().splitlines()[0][:110]}")
    if S["graph_recompiles"]:
        lines.append(f"  recompiles (a guard failed: a new shape, dtype or Python value; "
                     f"TORCH_LOGS=recompiles names it): {len(S['graph_recompiles'])}")
        for why in S["graph_recompiles"][-3:]:
            lines.append(f"          {why}")
    lines.append("")
    return lines


def dump_trace(path: str) -> str:
    """Write the last fused trace as Graphviz DOT (networkx), plus a PNG when `dot` exists."""
    import networkx as nx
    last = engine.runner.last
    if last is None:
        raise RuntimeError("no trace has run yet; run something in defer mode first")
    nodes, reason, src, pieces = last
    region = {}
    for k, pos in enumerate(pieces or ()):
        region.update((p, k) for p in pos)
    label = f"trace of {len(nodes)} ops, synced by {reason} at {src}"
    if pieces:
        label += f", run as {len(pieces)} regions in order (r0, r1, ...)"
    g = nx.DiGraph(label=label)
    for pos, n in enumerate(nodes):
        name, wiring, nsrc = n.name, n.wiring, n.src
        r = f"r{region[pos]} " if pos in region else ""
        g.add_node(f"n{pos}", label=f"{r}{pos}: {name}\\n{os.path.basename(nsrc or '')}",
                   shape="box")
        for w in wiring:
            if w is None:
                continue
            if type(w) is int:
                g.add_node(f"in{w}", label=f"input {w}", shape="ellipse")
                g.add_edge(f"in{w}", f"n{pos}")
            else:
                g.add_edge(f"n{w[0]}", f"n{pos}", label=str(w[1]) if w[1] else "")
    if not path.endswith(".dot"):
        path = path + ".dot"
    with open(path, "w") as f:
        f.write(f'digraph trace {{\n  label="{g.graph["label"]}";\n')
        for n, d in g.nodes(data=True):
            f.write(f'  {n} [label="{d["label"]}", shape={d["shape"]}];\n')
        for a, b, d in g.edges(data=True):
            f.write(f'  {a} -> {b}' + (f' [label="{d["label"]}"]' if d.get("label") else "") + ";\n")
        f.write("}\n")
    if shutil.which("dot"):
        subprocess.run(["dot", "-Tpng", path, "-o", path[:-4] + ".png"], check=False)
    return path
