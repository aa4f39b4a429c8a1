"""The memory plan of a region: which inputs to donate, which values become buffers, the peak.

Pure Python over small records (no jax): unit-testable on synthetic traces.

NOTE [donation safety]: an input buffer may be donated only when nothing outside the region can
read it afterwards: no live storage holds its value (its tensor was overwritten in place or
dropped), and it is not also a region output. A view or a tensor saved for backward holds the
storage, so it keeps the buffer from being donated. Cached constants (0-dim CPU numbers moved to
the device) are fresh values per call, never shared, so donating them is safe.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    donate: tuple[bool, ...]      # per external input
    donated_bytes: int
    output_bytes: int
    elided_bytes: int             # node outputs that never become buffers
    peak_estimate: int            # inputs kept + outputs + XLA temporaries (when known)


def plan(in_bytes: list[int], held: list[bool], out_bytes: list[int], all_node_out_bytes: int,
         temp_bytes: int | None = None, enabled: bool = True) -> MemoryPlan:
    """Decide donation for one region run (it runs at every sync: plain lists, no records).

    ``in_bytes`` and ``held``: per external input, its bytes and whether a live storage (or
    anything outside the trace) still holds it; ``out_bytes``: bytes of the values the region
    must return (held by live tensors); ``all_node_out_bytes``: bytes of every value the region's
    ops produce.
    """
    if enabled:
        donate = tuple([not h and n > 0 for n, h in zip(in_bytes, held)])
    else:
        donate = (False,) * len(in_bytes)
    donated = sum([n for n, d in zip(in_bytes, donate) if d])
    outs = sum(out_bytes)
    ins = sum(in_bytes)
    # Donated inputs are reused for outputs (when shapes allow); the estimate counts them once.
    peak = ins + max(outs - donated, 0) + (temp_bytes or 0)
    return MemoryPlan(donate, donated, outs, max(all_node_out_bytes - outs, 0), peak)
