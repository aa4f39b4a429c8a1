"""A trace split into pieces that run one after another as regions of their own (memory budget,
shape churn, needed first: see cut.py for where to cut): pure Python over trace records.

``plan`` works out, once per trace structure and cut, what each piece reads and leaves;
``PieceNodes`` gives a piece's nodes renumbered, built only when something needs them whole.
"""
from __future__ import annotations

from .records import Node


class Piece:
    """One piece of a split trace, worked out once per trace structure and cut: which original
    nodes it runs (``pos``, in order), their wiring renumbered within the piece, its structural
    hash, where each of its inputs comes from (an external input index, or (pos, idx): an output
    of an earlier piece) and whether a later piece reads that input too, and the outputs later
    pieces read."""
    __slots__ = ("pos", "wiring", "h", "src", "later", "needed")


def plan(nodes, order, cuts) -> list:
    """[Piece] for ``nodes`` run in ``order`` (a topological order) and cut at ``cuts`` (the end
    index of each piece in that order)."""
    n = len(nodes)
    piece_of, local = [0] * n, [0] * n
    start = 0
    for k, stop in enumerate(cuts):
        for j in range(start, stop):
            piece_of[order[j]], local[order[j]] = k, j - start
        start = stop
    last_read: dict = {}    # input source -> the last piece that reads it
    for p in order:
        for w in nodes[p].wiring:
            if w is not None:
                last_read[w] = piece_of[p]
    out, start = [], 0
    for k, stop in enumerate(cuts):
        pc = Piece()
        pc.pos = order[start:stop]
        pc.wiring, pc.src, pc.later, idx, h = [], [], [], {}, 0
        for p in pc.pos:
            wiring = []
            for w in nodes[p].wiring:
                if w is None:
                    wiring.append(None)
                elif w.__class__ is tuple and piece_of[w[0]] == k:
                    wiring.append((local[w[0]], w[1]))
                else:
                    j = idx.get(w)
                    if j is None:
                        j = idx[w] = len(pc.src)
                        pc.src.append(w)
                        pc.later.append(last_read[w] > k)
                    wiring.append(j)
            wiring = tuple(wiring)
            pc.wiring.append(wiring)
            h = hash((h, nodes[p].key.khash, wiring, len(nodes[p].scalars)))
        pc.h = h
        pc.needed = [(j, i) for j, p in enumerate(pc.pos) for i, o in enumerate(nodes[p].outs)
                     if o is not None and last_read.get((p, i), -1) > k]     # (local pos, idx)
        out.append(pc)
        start = stop
    return out


class PieceNodes:
    """A piece's nodes, renumbered, built only when something needs them whole (a compile-cache
    miss, an error, debug output): a cache hit needs only their count. Indexing before that gives
    the original node (its name and source line are the same)."""
    __slots__ = ("orig", "pc", "built")

    def __init__(self, orig, pc):
        self.orig, self.pc, self.built = orig, pc, None

    def __len__(self):
        return len(self.pc.pos)

    def __getitem__(self, i):
        if self.built is not None:
            return self.built[i]
        return self.orig[self.pc.pos[i]]

    def __iter__(self):
        if self.built is None:
            built, s0 = [], 0
            for j, (p, wiring) in enumerate(zip(self.pc.pos, self.pc.wiring)):
                n = self.orig[p]
                m = Node(n.key, n.ins, wiring, s0, n.scalars, n.outs, n.src, j)
                s0 += len(n.scalars)
                for o in n.outs or ():
                    if o is not None and o.array is None:
                        o.node = m
                built.append(m)
            self.built = built
        return iter(self.built)

    def release(self):
        if self.built is not None:      # break Value <-> Node cycles (see deferfuse/record.py)
            for m in self.built:
                m.ins = m.outs = None
