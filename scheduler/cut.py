"""Where to cut a region into pieces that run one after another: pure Python over trace records.

Four reasons to cut:

- memory budget: cut where the fewest bytes are live (``budget_cut``, from ``liveness.simulate``);
- shape churn: a structure that keeps coming back with new shapes is cut between the ops whose keys
  changed and those that never did (``churn_cuts``), so the unchanging runs compile once;
- a sync that reads one value (``.item()``): the ops it needs run first and the rest after, so the
  host waits for the first piece only (``needed_first``; see NOTE [needed first] in flush.py);
- tensors made before a computation and kept (or carried: a loop's initial state): they run
  first, on their own (``setup_first``).

A cut list is the end index of each piece, the last one being the trace length.
"""
from __future__ import annotations

from . import liveness


def budget_cut(wiring: list, out_bytes: list, ext_bytes: list, held: list, live_outs: set) -> tuple:
    """Split at the op after which the fewest bytes are live, within the middle half (each half is
    checked again when it compiles)."""
    live = liveness.simulate(wiring, out_bytes, ext_bytes, held, live_outs)
    n = len(wiring)
    lo, hi = max(1, n // 4), max(2, (3 * n) // 4)
    cut = min(range(lo, min(hi, n)), key=lambda q: (live[q - 1], q)) if n > 1 else n
    return (cut, n) if 0 < cut < n else (n,)


def churn_cuts(first: list, keys: list, vary: set) -> tuple | None:
    """Cuts between runs of ops whose keys changed since ``first`` (accumulated into ``vary``) and
    runs that never did; None when every op changed (nothing stable to keep fused) or none did."""
    vary.update(i for i, (a, b) in enumerate(zip(first, keys)) if a != b)
    n = len(keys)
    cuts = [i for i in range(1, n) if (i in vary) != (i - 1 in vary)]
    if len(vary) >= n or not cuts:
        return None
    return tuple(cuts) + (n,)


# A trace is split for a sync that reads one value only when the ops the value does not need are
# at least this share of it (and this many): the backward pass and optimizer step of a training
# step whose loss is read, not the few bookkeeping ops after a generate step's logits.
NEEDED_FIRST_MIN_SHARE = 0.25
NEEDED_FIRST_MIN_OPS = 8


def needed_first(wiring: list, want, min_ops: int = NEEDED_FIRST_MIN_OPS) -> tuple | None:
    """A topological order that puts the ops ``want`` (node positions) depend on first, each part
    in trace order, and the length of that first part; None when the rest is too small to be worth
    a program of its own (fewer than ``min_ops`` ops, or under a quarter of the trace)."""
    n = len(wiring)
    need = [False] * n
    stack = list(want)
    for p in stack:
        need[p] = True
    while stack:
        for w in wiring[stack.pop()]:
            if w.__class__ is tuple and not need[w[0]]:
                need[w[0]] = True
                stack.append(w[0])
    first = [i for i in range(n) if need[i]]
    rest = n - len(first)
    if rest < min_ops or rest < NEEDED_FIRST_MIN_SHARE * n:
        return None
    return tuple(first + [i for i in range(n) if not need[i]]), len(first)


# Ops whose results depend on no tensor's values (only on sizes, dtypes and scalars): what a script
# makes once before a loop or a call (``mask = torch.ones_like(ids)``). Random factories are not
# among them (they draw from the generator: their order is part of the program).
SETUP_OPS = frozenset(("ones_like", "zeros_like", "full_like", "empty_like", "new_ones",
                       "new_zeros", "new_full", "new_empty", "ones", "zeros", "full", "empty",
                       "empty_strided", "scalar_tensor", "arange"))


def setup_first(entries, wiring: list, outs) -> int:
    """NOTE [setup first]: a tensor made before a call and kept (``mask = torch.ones_like(ids)``
    before ``model.generate(ids, attention_mask=mask)``) is recorded lazily, so it joins the first
    trace of the call, and that trace's structure (the factory, then the call's first ops) is one
    the second call never records: its mask is computed already, so it records the call's ops
    alone and compiled them again (HF ``generate()``'s right-padding check, a 2-op region). The
    leading ops of a trace that only make values (``SETUP_OPS``), read no value of the trace and
    leave it, or are *carried* (below), run first as a region of their own; the rest runs as the
    trace the second call records, so it finds that call's programs. Returns how many leading
    ops run first (0: none; never the whole trace). ``entries``: the ops (their ``name``,
    ``aten.<op>.<overload>``, and ``res_avals``: (shape, dtype, ...) per output); ``outs``: the
    (position, output index) of the values tensors hold after the sync.

    NOTE [carried setup]: whether a tensor "leaves" a trace is Python liveness, and that depends
    on where the user's code sits, not on what it computes. A loop's initial state
    (``h = model.init_hidden(b)``, then ``out, h = model(x, h)`` per chunk) is dead at the
    chunk's ``loss.item()`` when the step is written inline (``h`` was rebound to the new state),
    and alive when the step is a helper or a method (its caller still holds the ``h`` it passed).
    Both are the same loop, and the next chunk reads the carried state in place of the zeros
    either way, so a leading factory counts as kept also when a value the rest of the trace
    makes and leaves has its shape and dtype: the state that replaces it. The same regions then
    run whether the step is inline, in a helper or in a method (``tests/test_vary.py``)."""
    n = len(wiring)
    live = {p for p, _ in outs}
    made = None
    k = 0
    while k < n - 1 and is_setup(entries[k].name) and \
            all(w is None or w.__class__ is int for w in wiring[k]):
        if k not in live:
            if made is None:        # the shapes and dtypes of what the rest leaves
                made = set()
                for p, i in outs:
                    if not is_setup(entries[p].name):
                        a = entries[p].res_avals[i]
                        if a is not None:
                            made.add((a[0], a[1]))
            a = entries[k].res_avals
            if len(a) != 1 or a[0] is None or (a[0][0], a[0][1]) not in made:
                break
        k += 1
    return k


def is_setup(name: str) -> bool:
    """Whether the op named ``name`` (``aten.<op>.<overload>``) only makes a value
    (``SETUP_OPS``)."""
    parts = name.split(".")
    return len(parts) == 3 and parts[0] == "aten" and parts[1] in SETUP_OPS
