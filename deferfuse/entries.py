"""What each op entry learned (its outputs' metadata, its random draws), kept on disk for the next
process (NOTE [entries on disk]).

NOTE [entries on disk]: the first time a process meets an op key (the op, its argument template,
its inputs' signatures, the device: ``opkey.op_key``) it makes the op's entry: its outputs'
sizes, strides and dtypes from the meta kernels (``meta.infer``, whose answers the meta memo
already keeps on disk, but which still checks the arguments and describes them to find them),
and, for a random op, how far its generator moves (``prng.draws``, a JAX trace). A loop whose
length grows makes one entry per op and length: nanoGPT's sampling loop makes 710, which a second
process made again before it could find its programs in the store. This store keeps, per op key
spelled out stably (the op by the program store's ``describe``, the rest by ``repr``, whose
text has the type: ``2``, ``2.0`` and ``True`` differ; with the default dtype), the answer ``infer`` gave and the draws, and a second process takes them from
here: no meta kernel, no memo lookup, no argument check (as for a key met again in one process:
only what once succeeded is kept, never an error).

It is one more instance of the learned stores' mechanism (``runtime.learned.LearnedStore``: a
file named by the program store's environment, a digest of its contents, merged and replaced
atomically at exit, bounded and counted), not a copy of it. Nothing read is trusted as it stands:
an entry of another form counts as corrupt and is made again, a file that does not match its
digest is ignored whole, and in debug mode or under ``DEFERFUSE_CROSS_CHECK=1`` every answer taken
from here is compared with the meta kernels' (``stale`` would mean the key missed a difference).
``metrics()['caches']['op entries on disk']`` counts hits, misses (entries made by the meta
kernels), corrupt entries and writes; ``DEFERFUSE_LEARNED_ENTRIES=0`` turns it off.
"""
from __future__ import annotations

import torch

from .runtime.diskcache import Unstable, describe
from .runtime.learned import LearnedStore
from .scheduler.records import sig_id

_STRUCTURES = ("one", "tuple", "list", "none", None)


def _ints(x) -> bool:
    return type(x) is tuple and all(type(i) is int for i in x)


def _valid(v) -> bool:
    """An entry's kept value: ((structure, metas), draws), metas a tuple of (size, stride, dtype)
    or None."""
    (structure, metas), draws = v
    return (structure in _STRUCTURES and type(metas) is tuple and type(draws) is int
            and draws >= 0 and all(m is None or (type(m) is tuple and len(m) == 3 and _ints(m[0])
                                                 and _ints(m[1]) and isinstance(m[2], torch.dtype))
                                   for m in metas))


def kept_form(out):
    """``infer``'s answer as kept: tuples throughout (None if it has another form)."""
    structure, metas = out
    try:
        metas = tuple(None if m is None else (tuple(m[0]), tuple(m[1]), m[2]) for m in metas)
    except TypeError:
        return None
    return structure, metas


class EntryStore:
    """Op entries' metadata on disk (NOTE [entries on disk]); off until ``enable``."""

    def __init__(self, capacity: int = 1 << 15):
        self.store = LearnedStore(capacity, kinds=("entries",), prefix="entries",
                                  name="op entries on disk")
        self.infos: dict = {}       # OpInfo -> its description (one per op: bounded by the op set)
        self.stale = 0

    def enable(self, folder: str, env_of) -> None:
        self.store.enable(folder, env_of)

    @property
    def on(self) -> bool:
        return self.store.on

    def key(self, key) -> str | None:
        """The op key ``(info, targs, tkw, sigs, dev)`` and the default dtype, spelled out the
        same in every process (None: a part is printed with an address, or a signature is no
        longer in the table).
        The op's description is made once."""
        info, targs, tkw, sigs, dev = key
        try:
            d = self.infos.get(info)
            if d is None:
                d = self.infos[info] = describe(info)
        except Unstable:
            return None
        of = sig_id.of
        spelled = []
        for i in sigs:
            sig = of.get(i)
            if sig is None:
                return None
            spelled.append(sig)
        # The templates and signatures hold strs, ints, floats, bools, None, types, dtypes and
        # view steps: their repr has the type in it (2, 2.0, True, '2'); anything printed with an
        # address is not kept. Factories without a dtype make the default dtype's (aten.zeros
        # receives none): it is part of the key.
        t = repr((targs, tkw, dev, spelled, torch.get_default_dtype()))
        if " at 0x" in t:
            return None
        return d + "\n" + t

    def get(self, skey: str):
        """(infer's answer, draws) kept for ``skey``, or None."""
        return self.store.get("entries", skey, _valid)

    def put(self, skey: str, out, draws: int) -> None:
        kept = kept_form(out)
        if kept is not None and _valid((kept, draws)):
            self.store.put("entries", skey, (kept, draws))

    def save(self) -> None:
        self.store.save()

    def stats(self) -> dict:
        s = self.store.stats()
        s["stale"] = self.stale
        return s

    def clear(self) -> None:
        """Forget the descriptions made here (the kept entries stay on disk)."""
        self.infos.clear()
