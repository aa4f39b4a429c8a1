"""The persistent on-disk compile caches: JAX's own, pointed at deferfuse's cache folder, and
deferfuse's store of whole compiled programs (``ProgramStore``).

JAX keeps its setting process-wide, so turning it on also caches a user's own JAX compiles in that
folder; if the user already set ``jax_compilation_cache_dir``, deferfuse uses theirs and changes
nothing. ``DEFERFUSE_PERSISTENT_CACHE=0`` leaves JAX's configuration alone and stores nothing.

NOTE [program store]: JAX's persistent cache answers ``compile()`` of a lowered program: tracing our
lowerings into a JAX function and lowering that to StableHLO still run in every new process, and
for a region of a thousand ops they cost seconds (a generate() loop recorded as one 1,400-op region:
12 s of tracing and lowering in a second process, for a cache hit). So deferfuse also keeps each
compiled executable itself (``jax.experimental.serialize_executable``), found by a process-stable
structural key: every op's name, static arguments with their types, input shapes, dtypes and views
(signatures spelled out, never their per-process ids), the wiring, outputs, donation, scalar types,
the device, and the environment (jax, jaxlib, torch and deferfuse versions, a digest of deferfuse's
own source, XLA flags, the platform). A hit loads the program without tracing anything; the key is
stored in the entry and compared on load (a hash is a bucket). Anything whose description is not
stable across processes (an object printed with its address) is not stored. The store is bounded:
past ``max_bytes`` the least recently used entries are removed.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import pickle
import sys
import tempfile

import jax

from . import stats
from ..scheduler.records import sig_id


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in its folder (made if missing) and a
    rename: a reader never sees half a file. Errors propagate (each store counts or ignores them)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        stats.S["disk_cache_hits"] += 1
        stats.S["jax_disk_hits"] += 1


def _init_custom_calls(platform: str) -> None:
    """NOTE [loaded programs and LAPACK]: on CPU, jaxlib's LAPACK custom calls (svd, eigh, qr, lu,
    geqrf ...) take their LAPACK routines from a table that JAX fills the first time it *lowers*
    such an op. A program loaded from the store skips lowering, so in a new process it called
    through an empty table: a segmentation fault (strict ``torch.linalg.svd`` in a second
    process). Filling the table is idempotent and cheap; done before every load on CPU."""
    if platform != "cpu":
        return
    try:
        from jax._src.lib import lapack
        lapack._lapack.initialize()
    except Exception:       # another jaxlib layout: loading still works where it did
        pass


def _calls_lapack(compiled) -> bool:
    """Whether a program calls LAPACK (NOTE [loaded programs and LAPACK]): filling the table
    imports jaxlib's LAPACK module and SciPy with it, 0.2-0.4 s of a second process that loads
    programs with no LAPACK call in them (nanoGPT sampling's)."""
    try:
        return "lapack" in compiled.as_text().lower()
    except Exception:
        return True


def enable(cache_dir: str) -> str | None:
    """Turn JAX's persistent cache on (once); returns the folder in use, or None if unavailable."""
    current = jax.config.jax_compilation_cache_dir
    if not current:
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError:
            return None
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        # Cache every program: deferfuse's regions are often small and quick to compile, but a
        # second run of a script should still compile nothing.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        current = cache_dir
    jax.monitoring.register_event_listener(_on_event)
    return current


@contextlib.contextmanager
def fresh_compiles():
    """Compiles in this block neither read nor write JAX's persistent cache. An executable JAX
    loaded from its cache cannot be serialized again (XLA's CPU executables come back without
    their code: "Function ... not found" when run), so a program for the program store compiles
    fresh; being stored there, JAX's copy would be a second one. Yields whether that holds (a JAX
    without this hook: the caller stores only what JAX did not load)."""
    try:
        from jax._src import compilation_cache as cc
        used = cc.is_cache_used
    except (ImportError, AttributeError):
        yield False
        return
    cc.is_cache_used = lambda backend: False
    try:
        yield True
    finally:
        cc.is_cache_used = used


# --------------------------------------------------------------------------- stable keys
class Unstable(Exception):
    """A key part whose description differs between processes (it is not stored)."""


_LEAF = (int, float, complex, bool, str, type(None), bytes)


def describe(x) -> str:
    """A description of ``x`` that is the same in every process, with types (``2``, ``2.0`` and
    ``True`` differ); raises ``Unstable`` for anything printed with its address."""
    t = type(x)
    if t in _LEAF:
        return f"{t.__name__}:{x!r}"
    if t is tuple or t is list:
        return ("(" if t is tuple else "[") + ",".join(describe(y) for y in x) + \
            (")" if t is tuple else "]")
    if t is dict:
        return "{" + ",".join(describe(k) + ":" + describe(v) for k, v in x.items()) + "}"
    if t is type:
        return f"type:{x.__module__}.{x.__qualname__}"
    r = repr(x)
    if " at 0x" in r or "object at" in r:
        raise Unstable(r)
    return f"{t.__module__}.{t.__qualname__}:{r}"


def entry_key(entry) -> str:
    """The stable description of one op entry (``dispatch.Entry``: its key is (OpInfo, argument
    template, keyword template, input signature ids, device)), cached on the entry."""
    s = entry.skey
    if s is None:
        info, targs, tkw, sigs, dev = entry.key
        of = sig_id.of
        spelled = []
        for i in sigs:
            sig = of.get(i)
            if sig is None:         # the signature table started afresh: not describable now
                raise Unstable(f"signature {i}")
            spelled.append(sig)
        s = entry.skey = describe((info, targs, tkw, tuple(spelled), dev))
    return s


def _avals(arrays) -> str:
    return ";".join("-" if a is None else f"{a.shape}{a.dtype}{'w' if a.weak_type else ''}"
                    for a in arrays)


def region_key(entries, wirings, out_sig, donate, don, keep, is_float, device: int) -> str | None:
    """The stable key of a fused region (None: not describable, so not stored)."""
    try:
        parts = ["region", str(device), _avals(don), _avals(keep), describe(tuple(donate)),
                 describe(tuple(is_float)), describe(tuple(out_sig)), describe(tuple(wirings))]
        parts.extend(entry_key(e) for e in entries)
    except (Unstable, AttributeError):
        return None
    return "\n".join(parts)


def op_key(entry, arrays, scalars, device: int) -> str | None:
    """The stable key of one op's own program (strict and debug mode, op-by-op replays)."""
    try:
        return "\n".join(["op", str(device), _avals(arrays),
                          describe(tuple(type(s) for s in scalars)), entry_key(entry)])
    except (Unstable, AttributeError):
        return None


# --------------------------------------------------------------------------- the store
# The front-end modules whose code shapes a program beyond what its key spells out (how an op's
# arguments become a lowering's, its output dtypes); the whole runtime is read too.
_FRONT = ("dispatch.py", "opkey.py", "meta.py", "metarules.py", "opinfo.py", "attention.py",
          "views.py")


def _source_digest() -> str:
    """A digest of the source that turns a structural key into a program (the runtime with its
    lowerings, and the front end's ``_FRONT``): a lowering that changes makes another program under
    the same key, so a program stored by other code is never loaded."""
    h = hashlib.sha256()
    files = []
    for m in ("deferfuse.runtime", "deferfuse.runtime.lowering"):
        if m in sys.modules:
            d = os.path.dirname(sys.modules[m].__file__)
            files += [os.path.join(d, n) for n in sorted(os.listdir(d)) if n.endswith(".py")]
    if "deferfuse" in sys.modules:
        d = os.path.dirname(sys.modules["deferfuse"].__file__)
        files += [os.path.join(d, n) for n in _FRONT]
    for path in files:
        h.update(os.path.basename(path).encode())
        try:
            with open(path, "rb") as f:
                h.update(f.read())
        except OSError:
            h.update(b"?")
    return h.hexdigest()


class ProgramStore:
    """Compiled programs on disk (NOTE [program store]). Off until ``enable``."""

    def __init__(self, max_bytes: int = 4 << 30):
        self.dir = None
        self.max_bytes = max_bytes
        self.extra = ()
        self._env = None
        self.loads = self.writes = self.misses = self.errors = self.evictions = 0
        self.written = 0        # bytes written since the last trim

    def enable(self, folder: str, extra=()) -> None:
        """Store programs under ``folder``; ``extra``: what else shapes the programs (the torch
        version, the settings in the compile-cache key)."""
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            return
        self.dir = folder
        self.extra = tuple(extra)

    @property
    def on(self) -> bool:
        return self.dir is not None

    def stats(self) -> dict:
        return {"name": "programs on disk", "loads": self.loads, "writes": self.writes,
                "misses": self.misses, "errors": self.errors, "evictions": self.evictions}

    def env(self) -> str:
        if self._env is None:
            import jaxlib
            from .platform import choose
            name, devs = choose()
            self._env = describe((jax.__version__, jaxlib.__version__, self.extra,
                                  _source_digest(), os.environ.get("XLA_FLAGS", ""),
                                  os.environ.get("LIBTPU_INIT_ARGS", ""), name,
                                  devs[0].device_kind, len(devs),
                                  str(jax.config.jax_default_matmul_precision)))
        return self._env

    def _path(self, key: str) -> str:
        h = hashlib.sha256((self.env() + "\n" + key).encode()).hexdigest()
        return os.path.join(self.dir, h[:40] + ".prog")

    def load(self, key: str | None, device: int):
        """(compiled program, extra data saved with it), or None."""
        if key is None or self.dir is None:
            return None
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                blob = pickle.load(f)
        except FileNotFoundError:
            self.misses += 1
            return None
        except Exception:
            self.errors += 1
            return None
        if blob.get("env") != self.env() or blob.get("key") != key:
            self.misses += 1        # another program in the same bucket
            return None
        try:
            from jax.experimental.serialize_executable import deserialize_and_load
            from .transfer import devices
            dev = devices()[device]
            if blob.get("lapack", True):    # (stored before the flag: assume it does)
                _init_custom_calls(dev.platform)
            compiled = deserialize_and_load(blob["exe"], blob["in_tree"], blob["out_tree"],
                                            dev.client, [dev])
            extra = _load_extra(blob["extra"])
        except Exception:
            self.errors += 1
            return None
        try:
            os.utime(path)          # recently used (the store trims the least recently used)
        except OSError:
            pass
        self.loads += 1
        stats.S["disk_cache_hits"] += 1
        stats.S["program_disk_hits"] += 1
        return compiled, extra

    def save(self, key: str | None, compiled, extra) -> None:
        if key is None or self.dir is None:
            return
        try:
            from jax.experimental.serialize_executable import serialize
            exe, in_tree, out_tree = serialize(compiled)
            data = pickle.dumps({"env": self.env(), "key": key, "exe": exe, "in_tree": in_tree,
                                 "out_tree": out_tree, "extra": _save_extra(extra),
                                 "lapack": _calls_lapack(compiled)},
                                protocol=pickle.HIGHEST_PROTOCOL)
            write_atomic(self._path(key), data)
        except Exception:
            self.errors += 1
            return
        self.writes += 1
        self.written += len(data)
        if self.written > self.max_bytes // 16:
            self.trim()

    def trim(self) -> None:
        """Remove the least recently used entries past ``max_bytes``."""
        self.written = 0
        try:
            ents = []
            for e in os.scandir(self.dir):
                if e.name.endswith(".prog"):
                    st = e.stat()
                    ents.append((st.st_mtime, st.st_size, e.path))
        except OSError:
            return
        total = sum(s for _, s, _ in ents)
        for _, size, path in sorted(ents):
            if total <= self.max_bytes:
                break
            try:
                os.remove(path)
                self.evictions += 1
                total -= size
            except OSError:
                pass


def _save_extra(extra):
    """Index-check messages hold exception types: saved by name."""
    out = {}
    for k, v in extra.items():
        if k == "msgs":
            v = [tuple(m[:-2]) + (f"{m[-2].__module__}:{m[-2].__qualname__}", m[-1]) for m in v]
        out[k] = v
    return out


def _load_extra(extra):
    out = {}
    for k, v in extra.items():
        if k == "msgs":
            msgs = []
            for m in v:
                mod, _, qual = m[-2].partition(":")
                exc = importlib.import_module(mod)
                for part in qual.split("."):
                    exc = getattr(exc, part)
                msgs.append(tuple(m[:-2]) + (exc, m[-1]))
            v = msgs
        out[k] = v
    return out
