"""What bucketing learned, kept on disk for the next process (NOTE [learned on disk]).

NOTE [learned on disk]: a second process of a script finds its programs in the store (NOTE
[program store] in diskcache.py) but had to learn its buckets again: the first length of a growing
loop ran in its own exact program (one more program to load), the second length made the bucket
plan (tracing each view step's shape with ``jax.eval_shape``), and only then did lengths run in the
bucket programs loaded from disk. This store keeps, per region family (its ops, wiring and the
skeletons of their keys, spelled out stably: NOTE [bucket families] in buckets.py), the ints of the
two versions its fit came from, and the shapes of view steps at the probe lengths. A second process
fits its first version against them and runs it in its bucket at once.

Nothing here is trusted as it stands: the fit is made again from the two versions by the same code
(``buckets.fit``) and must take the version at hand, or the entry is dropped (``stale``); the
plan is made from it and checked by the rules as in the first process; the file carries a digest of
its contents (a file that does not match it, or does not load, is ignored whole: ``corrupt``), and
its name and contents carry the environment of the program store (jax, jaxlib, torch and deferfuse
versions, a digest of deferfuse's source, XLA flags, the platform), so another version's file is
another file. Written once at exit (merged with what another process wrote meanwhile, replaced
atomically), at most ``capacity`` entries of each kind.
"""
from __future__ import annotations

import hashlib
import os
import pickle

from .diskcache import write_atomic


class LearnedStore:
    """Tables of what one process learned, on disk for the next (NOTE [learned on disk]); off
    until ``enable``. ``kinds``: the tables' names (the bucket store's: fits and view-step
    shapes); ``prefix``: the file's name before the environment's digest; ``name``: what
    ``metrics()['caches']`` calls it. The one mechanism for such stores: the op entries' store
    (NOTE [entries on disk] in deferfuse/entries.py) is another instance."""

    def __init__(self, capacity: int = 4096, kinds=("fits", "steps"), prefix: str = "buckets",
                 name: str = "bucket fits on disk"):
        self.capacity = capacity
        self.kinds, self.prefix, self.name = tuple(kinds), prefix, name
        self.folder = None
        self.env_of = None          # () -> the environment's description (computed when first read)
        self.path = None
        self.env = ""
        self.tables = None          # {kind: {...}}, loaded on first use
        self.new = {k: {} for k in self.kinds}
        self.hits = self.misses = self.stale = self.corrupt = self.writes = 0

    def enable(self, folder: str, env_of) -> None:
        """Keep the tables in ``folder`` for the environment ``env_of()`` (a description of what
        shapes programs: the program store's; asked when the tables are first read, so that
        importing deferfuse starts no JAX backend)."""
        self.folder, self.env_of = folder, env_of
        import atexit
        atexit.register(self.save)

    @property
    def on(self) -> bool:
        return self.folder is not None

    def _locate(self) -> None:
        self.env = self.env_of()
        h = hashlib.sha256(self.env.encode()).hexdigest()[:24]
        self.path = os.path.join(self.folder, f"{self.prefix}-{h}.pkl")

    def has_fits(self) -> bool:
        return self.folder is not None and bool(self._table("fits"))

    def stats(self) -> dict:
        n = 0 if self.tables is None else sum(len(t) for t in self.tables.values())
        return {"name": self.name, "entries": n, "hits": self.hits,
                "misses": self.misses, "stale": self.stale, "corrupt": self.corrupt,
                "writes": self.writes}

    # ------------------------------------------------------------------------------ reading
    def _read(self, count: bool = True) -> dict:
        """The tables in the file, or empty ones (no file, another environment, a digest that does
        not match, anything that does not load as two dicts of str keys)."""
        empty = {k: {} for k in self.kinds}
        try:
            with open(self.path, "rb") as f:
                blob = f.read()
        except OSError:
            return empty
        try:
            digest, body = blob[:32], blob[32:]
            if hashlib.sha256(body).digest() != digest:
                raise ValueError("digest")
            env, tables = pickle.loads(body)
            if env != self.env or type(tables) is not dict:
                raise ValueError("environment")
            out = {}
            for kind in self.kinds:
                t = tables.get(kind)
                if type(t) is not dict or not all(type(k) is str for k in t):
                    raise ValueError(kind)
                out[kind] = t
            return out
        except Exception:
            self.corrupt += count
            return empty

    def _table(self, kind: str) -> dict:
        if self.tables is None:
            self._locate()
            self.tables = self._read()
        return self.tables[kind]

    def get(self, kind: str, key: str, valid):
        """The value kept under ``key`` in the table ``kind`` if ``valid(value)`` holds (counted
        as a hit), else None: a miss, or an entry of another form (counted as corrupt, dropped)."""
        if self.folder is None:
            return None
        t = self._table(kind)
        v = t.get(key)
        if v is None:
            self.misses += 1
            return None
        try:
            ok = valid(v)
        except Exception:
            ok = False
        if not ok:
            self.corrupt += 1
            t.pop(key, None)
            return None
        self.hits += 1
        return v

    def fit_versions(self, key: str):
        """The two versions' ints (two tuples of ints of one length) kept for the family ``key``,
        or None; an entry of any other form counts as corrupt and is dropped."""
        if self.folder is None:
            return None
        t = self._table("fits")
        v = t.get(key)
        if v is None:
            self.misses += 1
            return None
        if not (type(v) is tuple and len(v) == 2 and all(type(x) is tuple for x in v)
                and len(v[0]) == len(v[1]) and all(type(i) is int for x in v for i in x)):
            self.corrupt += 1
            t.pop(key, None)
            return None
        self.hits += 1
        return v

    def drop_fit(self, key: str) -> None:
        """A kept fit that did not take the version at hand (or whose plan failed): forgotten here
        and on disk at the next save."""
        self.stale += 1
        if self.tables is not None:
            self.tables["fits"].pop(key, None)
        self.new["fits"][key] = None

    def step(self, key: str):
        """A view step's output shapes at the probe lengths (a tuple of two tuples of ints)."""
        if self.folder is None:
            return None
        t = self._table("steps")
        v = t.get(key)
        if v is None:
            return None
        if not (type(v) is tuple and len(v) == 2 and all(type(x) is tuple for x in v)
                and all(type(i) is int for x in v for i in x)):
            self.corrupt += 1
            t.pop(key, None)
            return None
        return v

    # ------------------------------------------------------------------------------ writing
    def put(self, kind: str, key: str, value) -> None:
        """Keep ``value`` for the next process (read here, it is what earlier processes kept: a
        process that cleared its caches learns again as it did)."""
        if self.folder is None:
            return
        t, new = self._table(kind), self.new[kind]
        if t.get(key) != value and len(new) < self.capacity:
            new[key] = value

    def save(self) -> None:
        if self.path is None or not any(self.new.values()):
            return          # (path: set when the tables were first read)
        try:
            tables = self._read(count=False)
            for kind, new in self.new.items():
                t = tables[kind]
                for k, v in new.items():
                    if v is None:
                        t.pop(k, None)
                    elif len(t) < self.capacity:
                        t[k] = v
            body = pickle.dumps((self.env, tables), protocol=pickle.HIGHEST_PROTOCOL)
            write_atomic(self.path, hashlib.sha256(body).digest() + body)
            self.new = {k: {} for k in self.kinds}
            self.writes += 1
        except Exception:
            pass
