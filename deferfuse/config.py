"""Every setting in one place: a name, a default, an environment variable and a context override.

Settings that change generated code carry ``in_key=True``; their values are part of every
compile-cache key (see ``codegen_key``).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable

MODES = ("defer", "strict", "debug")

# Frames inside these folders are never "the user's line" (torch, deferfuse, jax, contextlib).
def _skip_prefixes() -> tuple:
    import jax
    import torch
    here = os.path.dirname(os.path.abspath(__file__))
    return tuple({os.path.dirname(torch.__file__), here, os.path.dirname(jax.__file__),
                  os.path.join(os.path.dirname(os.__file__), "contextlib")})


SKIP_PREFIXES = _skip_prefixes()


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    env: str
    default: Any
    parse: Callable[[str], Any]
    doc: str
    in_key: bool = False


def _bool(s: str) -> bool:
    return s.strip().lower() not in ("", "0", "false", "no", "off")


def _mode(s: str) -> str:
    s = s.strip().lower()
    if s not in MODES:
        raise ValueError(f"TORCHTPU_MODE={s!r} is not a mode; expected one of {', '.join(MODES)}")
    return s


def _removed_tensor_choice() -> None:
    """``DEFERFUSE_TENSOR`` chose between the plain tensor and the ``TpuTensor`` wrapper subclass
    while the plain tensor was new; the wrapper is gone, so the setting is too. ``plain`` (the only
    representation) and an empty value are accepted; any other value stops the import (a
    ValueError, as a bad ``TORCHTPU_MODE`` does): a program that asked for the wrapper would
    otherwise get another kind of tensor with nothing to tell it. Read at import."""
    raw = os.environ.get("DEFERFUSE_TENSOR")
    if raw is None or raw.strip().lower() in ("", "plain"):
        return
    raise ValueError(
        f"DEFERFUSE_TENSOR={raw!r}: the setting was removed with the TpuTensor wrapper subclass it "
        "selected; a tpu tensor is always the plain PrivateUse1 tensor of deferfuse's C++ "
        "extension. Unset DEFERFUSE_TENSOR. If you set it because the extension was not built, "
        "build it: in a clone, `make` (or `python setup.py build_ext --inplace`); an installed "
        "deferfuse, reinstall it with a C++ compiler present (docs/troubleshooting.md)")


def _bytes(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


SETTINGS = {s.name: s for s in [
    Setting("mode", "TORCHTPU_MODE", "defer", _mode, "execution mode: defer, strict or debug"),
    Setting("debug", "DEFERFUSE_DEBUG", 0, int,
            "debug ladder: 1 a line per sync, 2 per-region time and cache hit/miss, "
            "3 the trace and its cuts, 4 the lowered program"),
    Setting("trace_limit", "DEFERFUSE_TRACE_LIMIT", 20000, int,
            "recorded ops after which defer mode cuts the trace (with loop detection)"),
    Setting("step_detection", "DEFERFUSE_STEP_DETECTION", True, _bool,
            "detect a repeated loop body in a trace that never syncs and cut at its boundary"),
    Setting("cache_dir", "DEFERFUSE_CACHE_DIR",
            os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                         "deferfuse", "xla"), str,
            "folder of the persistent on-disk compile cache"),
    Setting("persistent_cache", "DEFERFUSE_PERSISTENT_CACHE", True, _bool,
            "use the persistent on-disk compile cache"),
    Setting("cross_check", "DEFERFUSE_CROSS_CHECK", False, _bool,
            "run every fused region also op by op and raise at the first op that differs"),
    Setting("c_record", "DEFERFUSE_C_RECORD", True, _bool,
            "record the common ops through the C record path (deferfuse/_fastpath.c); 0: Python only"),
    Setting("functional_direct", "DEFERFUSE_FUNCTIONAL_DIRECT", True, _bool,
            "the functional overloads of the common structured ops (add.Tensor, mm, sum.dim_IntList "
            "...) reach the C++ fallback whole, not as PyTorch's meta function, an empty output and "
            "the .out op (NOTE [functional direct] in deferfuse/plain.py); read at import"),
    Setting("source_lines", "DEFERFUSE_SOURCE_LINES", True, _bool,
            "remember the user's source line of every recorded op (for error messages)"),
    Setting("cpu_fallback", "DEFERFUSE_CPU_FALLBACK", True, _bool,
            "run ops with no lowering on CPU (copy in, run, copy out) instead of raising"),
    Setting("memory_planner", "DEFERFUSE_NO_MEMORY_PLANNER", True, lambda s: not _bool(s),
            "memory planner on (DEFERFUSE_NO_MEMORY_PLANNER=1 turns it off)", in_key=True),
    Setting("needed_first", "DEFERFUSE_NEEDED_FIRST", True, _bool,
            "at a sync that reads one value (.item(), .cpu()), run the ops it needs first and the "
            "rest as a second region the host does not wait for"),
    Setting("dispatch_thread", "DEFERFUSE_DISPATCH_THREAD", False, _bool,
            "call the regions the host does not wait for (the rest of a step after its loss, a "
            "cut at backward()) on a dispatch thread, so the host records the next ops meanwhile "
            "(NOTE [in flight] in runtime/execute.py)"),
    Setting("setup_first", "DEFERFUSE_SETUP_FIRST", True, _bool,
            "run a trace's leading factories whose tensors are kept (a mask made before a call) as "
            "a region of their own, so the rest compiles as the next call records it"),
    Setting("backward_cut", "DEFERFUSE_BACKWARD_CUT", True, _bool,
            "dispatch the pending trace (the forward pass) when backward() starts, without waiting "
            "for it, and what is pending when a read finds its value computed"),
    Setting("backward_thread", "DEFERFUSE_BACKWARD_THREAD", False, _bool,
            "run tpu backward passes on PyTorch's autograd device thread (its default for an "
            "accelerator) instead of the thread that calls backward()"),
    Setting("memory_budget", "DEFERFUSE_MEMORY_BUDGET", 0, _bytes,
            "bytes a fused region may use at its peak before it is split (0: no limit)"),
    Setting("max_regions", "DEFERFUSE_MAX_REGIONS", 4096, int,
            "compiled regions kept in process; past it all are dropped (with JAX's own caches) so "
            "a long-running process does not exhaust the CPU JIT's memory mappings"),
    Setting("shape_recompile_limit", "DEFERFUSE_SHAPE_RECOMPILE_LIMIT", 2, int,
            "versions of one region structure compiled before its shape-changing ops are split "
            "off (and, if every op changes, before it runs op by op)"),
    Setting("meta_rules", "DEFERFUSE_META_RULES", True, _bool,
            "derive a new length's output sizes from a checked rule instead of running the meta "
            "kernel again (NOTE [sizes by rule] in deferfuse/metasize.py)"),
    Setting("buckets", "DEFERFUSE_BUCKETS", True, _bool,
            "run a region whose sizes keep changing (a growing sequence) padded to buckets of "
            "lengths, one program per bucket (see docs/recompiles.md)"),
    Setting("buckets_ahead", "DEFERFUSE_BUCKETS_AHEAD", True, _bool,
            "plan a growing loop's bucket from the first two repetitions its first trace holds, "
            "so its first length runs in the bucket too (NOTE [buckets ahead] in "
            "runtime/flush.py)"),
    Setting("lazy_cuts", "DEFERFUSE_LAZY_CUTS", True, _bool,
            "leave a bucket run's outputs at their bucket's shape, cut to their exact shape only "
            "where something else reads them (NOTE [lazy cuts] in runtime/buckets.py)"),
    Setting("meta_plain", "DEFERFUSE_META_PLAIN", True, _bool,
            "answer elementwise and a few decomposed ops' output metadata without the Python meta "
            "kernels' Dynamo wrapper, so torch._dynamo is not imported (NOTE [meta without "
            "dynamo] in deferfuse/metaplain.py)"),
    Setting("learned_buckets", "DEFERFUSE_LEARNED_BUCKETS", True, _bool,
            "keep what bucketing learned (each growing region's fit) in the cache folder, so a "
            "later process runs its first length in the bucket (NOTE [learned on disk]); read at "
            "import"),
    Setting("learned_entries", "DEFERFUSE_LEARNED_ENTRIES", True, _bool,
            "keep each op entry's output metadata and random draws in the cache folder, so a "
            "later process makes its entries without the meta kernels (NOTE [entries on disk] in "
            "deferfuse/entries.py); read at import"),
    Setting("distributed", "DEFERFUSE_DISTRIBUTED", "auto", str,
            "start JAX's distributed runtime at import: auto (when torchrun's WORLD_SIZE > 1), "
            "1 (also JAX's own cluster discovery, e.g. a TPU pod), 0 (never); read at import"),
    Setting("coordinator", "DEFERFUSE_COORDINATOR", "", str,
            "host:port of JAX's coordination service (default MASTER_ADDR:MASTER_PORT+1)"),
    Setting("dist_timeout", "DEFERFUSE_DIST_TIMEOUT", 60.0, float,
            "seconds a collective waits for the other ranks before raising DistributedError "
            "(a timeout given to init_process_group wins)"),
    Setting("dist_check", "DEFERFUSE_DIST_CHECK", True, _bool,
            "before each collective, check that every rank runs the same one (NOTE [collective "
            "check] in deferfuse/distributed/coord.py)"),
    Setting("dist_wait", "DEFERFUSE_DIST_WAIT", "block", str,
            "block: a collective waits for its results (a failing rank is named at the call); "
            "async: it returns at once and later ops wait on the device"),
    Setting("compiled_collectives", "DEFERFUSE_COMPILED_COLLECTIVES", True, _bool,
            "a compiled graph with functional collectives runs as one program over their group "
            "(0: op by op in the eager mode, as a graph with an op no lowering covers)"),
    Setting("gc_threshold", "DEFERFUSE_GC_THRESHOLD", 20000, int,
            "Python's young-generation garbage-collection threshold in defer mode, read at import "
            "and used when the threshold is still Python's default of 700 (0: leave it); see "
            "NOTE [gc threshold] in __init__.py"),
]}


class _Config:
    """Current values; read the environment once, at import.

    ``mode`` is the calling thread's mode (NOTE [threads] in engine.py): reading and setting it
    go to the engine, which installs itself with ``bind_mode``; ``TORCHTPU_MODE`` is the mode a
    thread starts in (``initial_mode``)."""

    def __init__(self):
        _removed_tensor_choice()
        for s in SETTINGS.values():
            raw = os.environ.get(s.env)
            object.__setattr__(self, s.name, s.default if raw is None else s.parse(raw))
        object.__setattr__(self, "initial_mode", self.__dict__.pop("mode"))
        object.__setattr__(self, "_mode_io", None)

    def bind_mode(self, get, set_) -> None:
        object.__setattr__(self, "_mode_io", (get, set_))

    def __getattr__(self, name):
        if name == "mode":
            io = self._mode_io
            return io[0]() if io is not None else self.initial_mode
        raise AttributeError(f"deferfuse has no setting {name!r}; settings: {', '.join(SETTINGS)}")

    def __setattr__(self, name, value):
        if name not in SETTINGS:
            raise AttributeError(f"deferfuse has no setting {name!r}; settings: {', '.join(SETTINGS)}")
        if name == "mode":
            value = _mode(value)
            if self._mode_io is not None:
                self._mode_io[1](value)
                return
            name = "initial_mode"
        object.__setattr__(self, name, value)


config = _Config()


@contextlib.contextmanager
def override(**kw):
    """Change settings for a block: ``with deferfuse.override(cross_check=True): ...``;
    ``mode=`` changes the calling thread's mode, as ``deferfuse.mode()`` does."""
    old = {k: getattr(config, k) for k in kw}
    try:
        for k, v in kw.items():
            setattr(config, k, v)
        yield config
    finally:
        for k, v in old.items():
            setattr(config, k, v)


def codegen_key() -> tuple:
    """The settings that change generated code, for compile-cache keys."""
    return tuple(getattr(config, n) for n, s in SETTINGS.items() if s.in_key)
