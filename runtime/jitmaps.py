"""The process's memory mappings, which compiled programs use up.

NOTE [JIT mappings]: every program XLA:CPU compiles (or loads from a disk cache) holds three memory
mappings of its JIT (code, data, unwind tables) for as long as it lives, and Linux caps the number
of mappings a process may have (``vm.max_map_count``, 65,530 by default). A process that keeps
about 20,000 programs alive reaches that cap: the JIT's next ``mmap`` fails, XLA reuses memory whose
unwind tables are still registered with libgcc, and the next C++ exception thrown anywhere in the
process (XLA reports a failed serialization with one) crashes in libgcc's unwinder. A full test run
did exactly that (a segfault inside ``serialize_executable``, 19,000 live programs, measured with
an ``LD_PRELOAD`` probe of ``__register_frame``). deferfuse's caches are bounded one by one, but
their sum (per-op programs, regions, view reads, bucket programs, JAX's own jit caches) was not.

``MapGuard`` watches the total: every ``every`` compiles or program loads it counts the process's
mappings, and past ``fraction`` of the cap it answers True, and the engine drops every compiled
program it holds and JAX's caches (``Runner.evict``); the disk caches make what comes back cheap.
Where ``/proc`` is missing it counts programs instead (``fallback_programs`` since the last drop).
"""
from __future__ import annotations

from . import stats

_MAPS = "/proc/self/maps"
_CAP = "/proc/sys/vm/max_map_count"


def mappings() -> int | None:
    """The number of memory mappings of this process, or None where ``/proc`` has no answer."""
    try:
        with open(_MAPS, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


def map_cap() -> int:
    try:
        with open(_CAP) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 65530


class MapGuard:
    """Says when the compiled programs alive come close to the mapping cap (NOTE [JIT mappings])."""

    def __init__(self, every: int = 256, fraction: float = 0.5, fallback_programs: int = 8192):
        self.every = every
        self.limit = int(map_cap() * fraction)
        self.fallback_programs = fallback_programs
        self.last = 0           # programs made (compiled or loaded) when last checked
        self.since_drop = 0     # programs made since the last drop (where /proc is missing)
        self.checks = self.drops = 0

    def pressed(self) -> bool:
        """Whether to drop every compiled program now. Cheap unless ``every`` programs were made
        since the last check (metrics() resets restart the count)."""
        n = stats.S["compiles"] + stats.S["disk_cache_hits"]
        if n < self.last:               # the counters were reset
            self.last = 0
        made = n - self.last
        if made < self.every:
            return False
        self.last = n
        self.since_drop += made
        self.checks += 1
        m = mappings()
        over = self.since_drop > self.fallback_programs if m is None else m > self.limit
        if over:
            self.drops += 1
            self.since_drop = 0
        return over

    def stats(self) -> dict:
        return {"name": "memory mappings", "limit": self.limit, "checks": self.checks,
                "drops": self.drops, "mappings": mappings()}
