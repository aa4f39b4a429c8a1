"""A bounded cache with visible counters: every in-process cache of deferfuse is one of these.

Pure Python (no torch, no jax), so every layer can own some.

NOTE [two generations]: a hit on the hot path must cost one dict lookup, so there is no per-hit
bookkeeping (an LRU's move-to-end costs as much again). Entries go into the young generation;
when it is full it becomes the old one and the previous old generation is dropped (counted as
evictions). A hit in the old generation moves the entry back to the young one, so what a steady
loop uses survives every turnover, and what it stopped using is gone after two.
"""
from __future__ import annotations


class Cache:
    """``get``/``[]=``/``pop``/``clear`` over two generations of at most ``capacity // 2``
    entries each (see NOTE [two generations])."""

    __slots__ = ("name", "capacity", "young", "old", "inserts", "evictions", "get")

    def __init__(self, name: str, capacity: int):
        self.name = name
        self.capacity = max(int(capacity), 2)
        self.young: dict = {}
        self.old: dict = {}
        self.inserts = 0        # entries added (a miss each, where the caller fills on a miss)
        self.evictions = 0      # entries dropped to stay within capacity
        self._rebind()

    def _get(self, key, default=None):
        v = self.young.get(key, _ABSENT)
        if v is not _ABSENT:
            return v
        if self.old:
            v = self.old.pop(key, _ABSENT)
            if v is not _ABSENT:
                self._put(key, v)
                return v
        return default

    def __setitem__(self, key, value) -> None:
        if key not in self.young:
            self.inserts += 1
        self._put(key, value)

    def _put(self, key, value) -> None:
        young = self.young
        if len(young) >= self.capacity // 2 and key not in young:
            self.evictions += len(self.old)
            self.old = young
            self.young = young = {}
            self._rebind()
        young[key] = value

    def _rebind(self) -> None:
        # The hot path calls ``cache.get`` (this bound method); with no old generation a lookup is
        # the young dict's own get.
        self.get = self.young.get if not self.old else self._get

    def __contains__(self, key) -> bool:
        return key in self.young or key in self.old

    def __len__(self) -> int:
        return len(self.young) + len(self.old)

    def pop(self, key, default=None):
        v = self.young.pop(key, _ABSENT)
        if v is _ABSENT:
            v = self.old.pop(key, default)
        return v

    def values(self):
        return list(self.young.values()) + list(self.old.values())

    def items(self):
        return list(self.young.items()) + list(self.old.items())

    def clear(self) -> None:
        self.young = {}
        self.old = {}
        self._rebind()

    def stats(self) -> dict:
        return {"size": len(self), "capacity": self.capacity, "inserts": self.inserts,
                "evictions": self.evictions}


_ABSENT = object()
