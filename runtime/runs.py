"""The records a flush passes between its stages: ``Flush`` (what a trace hands over at a sync),
``Settings`` (the config it runs under), ``Run`` (one region to run: the whole trace, or a piece of
it) and ``Ctx`` (one flush in progress). Kept apart from ``flush.Runner`` so that the region hit
path (hits.py) and the runner read them without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Flush:
    """A consumed trace (see deferfuse/record.py): its nodes, external inputs and how often nodes
    read each, scalars, structural hash, the values that leave it (held by live storages), each
    output's storage's previous value (NOTE [alias order]), the positions a sync reads (NOTE
    [needed first]), its device, and the storages it tracked."""
    nodes: list
    ext: list
    ext_uses: list
    scalars: list
    h: int
    outs: list
    partner: dict
    want: tuple | None
    device: int
    storages: list
    whole: bool = False     # within an outer loop's body: never split at an inner loop


@dataclass(frozen=True, slots=True)
class Settings:
    """The settings a flush runs under (deferfuse's config, read once per flush)."""
    debug: int = 0
    cross_check: bool = False
    planner: bool = True
    shape_limit: int = 2
    budget: int = 0
    loop_split: bool = True
    buckets: bool = True
    setup_first: bool = True
    buckets_ahead: bool = True
    dispatch: bool = False      # regions nobody waits for run on the dispatch thread
    lazy_cuts: bool = True      # bucket runs' outputs left padded (NOTE [lazy cuts])


@dataclass(slots=True)
class Run:
    """One region to run: the whole trace or a piece. ``nodes[j]`` has its name, source line and
    scalars; ``entries[j]`` and ``wirings[j]`` are its structure in this run (a piece's wiring is
    renumbered); ``pos[j]`` its position in the trace; ``held[i]``: external input i is read after
    this run (never donated); ``out_sig``: (node, output) of each value in ``outs``."""
    nodes: object
    entries: list
    wirings: list
    pos: object
    ext: list
    held: list
    scalars: list
    h: int
    outs: list
    out_sig: tuple
    later: bool


@dataclass(slots=True)
class Ctx:
    """One flush in progress."""
    fl: Flush
    reason: str
    src: str
    cfg: Settings
    done: set | range = field(default_factory=set)  # trace positions whose program ran
    errors: list = field(default_factory=list)  # errors to raise once every region has run
    whole: Run | None = None    # the whole trace as one run (NOTE [region hits])
    single: tuple | None = None     # (Region, MemoryPlan): ``whole`` ran as that one region
    rec: list | None = None     # what ran, region by region (NOTE [piece hits] in hits.py)
    counts0: tuple = ()         # the split counters when recording began
    old: list | None = None     # the previous trace's Runner.last, freed with the flush
