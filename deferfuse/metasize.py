"""NOTE [sizes by rule]: an op's output metadata for a new length, derived instead of inferred.

A loop whose sequence grows records the same ops again with one length changed, and each new
length is a new op signature whose outputs' sizes and strides PyTorch's meta kernel is asked for
again (nanoGPT's sampling loop: 757 meta kernel calls for 9 ops and 50 lengths, about a quarter of
its first call). Along such a loop every integer an op sees (its tensors' sizes, strides and
offsets, its int arguments) is an affine function of the one length, and so is every integer of
its answer: the output sizes and strides of broadcasting, matrix products, reductions, norms,
attention, embedding, indexing and concatenation are sums and copies of input sizes, and their
products with constants.

So the answers are kept by a *size-free* key: the op, the default dtype, the arguments with every
int taken out (dtypes, ranks, views' kinds, floats, bools and strings kept, with their types), and
the **order pattern** of those ints together with 0 and 1 (which are equal, which smaller). Under
one key, two answers for different ints give a line; a third call whose ints lie on that line
(each int ``x1 + t * (x2 - x1)`` for one ``t``) gets ``y1 + t * (y2 - y1)``, provided every
derived int is a whole number and not negative. A rule is used only after it predicted one
answer exactly (the meta kernel ran too and agreed), and a key whose prediction was ever wrong
runs the meta kernel from then on.

Why this is safe:
- Two ints equal at two points of a line are equal on all of it, and the order pattern is part
  of the key, so every equality a meta kernel checks (broadcasting, matching dims, a dim being 1)
  and every comparison it branches on (``min``/``max`` of sizes, an index below a size, which
  stride is largest when a layout is chosen) comes out as it did for the two answers; a call that
  crosses another int gets a new key and its own meta kernel.
- A size that is not affine (a square of the length, a floor division) fails the check on the
  third call, or gives a fraction (run the meta kernel), never a wrong rule.
- Only op families whose shape functions are known to be such sums and copies are ruled (a
  product of two lengths, divisibility checks, linear algebra and data-dependent shapes are not);
  their dim arguments are kept whole in the key (which dim is no size: its range check compares
  it with the tensor's rank, which is no int of the pattern);
  arguments with values a meta kernel may read (CPU tensors, generators) are never ruled; errors
  are never learned (a call that raises has no answer to keep).
- ``DEFERFUSE_CROSS_CHECK=1`` and debug mode run the meta kernel for every derived answer as well
  and raise an internal error if they differ.

``DEFERFUSE_META_RULES=0`` turns it off.
"""
from __future__ import annotations

import torch

from .scheduler.cache import Cache
from .tensor import TpuTensor

aten = torch.ops.aten

# Ops (by overload packet) whose output sizes and strides are sums and copies of their inputs'
# ints, besides every op tagged pointwise.
_RULED_NAMES = (
    "linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "mv", "addmv", "embedding",
    "native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm", "_softmax", "_log_softmax",
    "softmax", "log_softmax", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_attention_math", "scaled_dot_product_attention",
    "_scaled_dot_product_efficient_attention", "cat", "stack", "index", "index_select", "gather",
    "take_along_dim", "arange", "zeros", "ones", "full", "empty", "empty_strided", "zeros_like",
    "ones_like", "full_like", "empty_like", "new_zeros", "new_ones", "new_full", "new_empty",
    "clone", "_to_copy", "copy", "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin",
    "prod", "any", "all", "cumsum", "cumprod", "topk", "where", "masked_fill", "index_put",
    "scatter", "scatter_add", "index_add", "index_copy", "tril", "triu", "embedding_dense_backward",
    "_softmax_backward_data", "_log_softmax_backward_data", "native_layer_norm_backward",
    "gelu_backward", "threshold_backward", "silu_backward", "mse_loss", "nll_loss_forward",
    "nll_loss_backward", "logsumexp", "var_mean", "var", "std", "norm", "linalg_vector_norm",
)
_NAMES = frozenset(_RULED_NAMES)
_PLAIN = (float, bool, str, complex, type(None))
_NAMED = (torch.dtype, torch.device, torch.layout, torch.memory_format)


class _Unruled(Exception):
    pass


def ruled(func) -> bool:
    return (torch.Tag.pointwise in func.tags and torch.Tag.nondeterministic_seeded not in func.tags
            ) or func.overloadpacket.__name__ in _NAMES


def _flat(x, ints: list):
    """``x`` with its ints moved to ``ints`` (the size-free skeleton)."""
    t = type(x)
    if t is int:
        ints.append(x)
        return "\0i"
    if t is TpuTensor:
        ints.extend(x.shape)
        ints.extend(x.stride())
        ints.append(x.storage_offset())
        base = x._s.val.shape
        ints.extend(base)
        return ("T", x.dim(), x.dtype, len(base), bool(x._chain), x.is_conj(), x.is_neg())
    if t in _PLAIN:
        return (t, x)
    if t is tuple or t is list:
        return (t,) + tuple(_flat(y, ints) for y in x)
    if t is dict:
        return ("dict",) + tuple((k, _flat(v, ints)) for k, v in sorted(x.items()))
    if isinstance(x, _NAMED):
        return (t, x)
    raise _Unruled(t.__name__)


def _exact_args(func) -> frozenset:
    """Positions and names of ``func``'s dim arguments: kept whole in the key (which dim is
    reduced or concatenated is no size, and its range check compares it with the rank)."""
    out = _EXACT.get(func)
    if out is None:
        out = _EXACT[func] = frozenset(
            x for i, a in enumerate(func._schema.arguments)
            if "dim" in a.name or a.name == "axis" for x in (i, a.name))
    return out


_EXACT: dict = {}


def _exact(x):
    t = type(x)
    if t is tuple or t is list:
        return (t,) + tuple(_exact(y) for y in x)
    if t in (int, float, bool, str, type(None)) or isinstance(x, _NAMED):
        return (t, x)
    raise _Unruled(t.__name__)


def _pattern(ints) -> tuple:
    """Each int's rank among the distinct values of ``ints``, 0 and 1: equalities and order."""
    rank = {v: i for i, v in enumerate(sorted(set(ints) | {0, 1}))}
    return tuple(rank[v] for v in ints)


def _out_flat(r):
    structure, descs = r
    skel, ints = [structure], []
    for d in descs:
        if d is None:
            skel.append(None)
        else:
            skel.append((len(d[0]), d[2]))
            ints.extend(d[0])
            ints.extend(d[1])
    return tuple(skel), tuple(ints)


def _out_build(skel, ints):
    descs, i = [], 0
    for s in skel[1:]:
        if s is None:
            descs.append(None)
            continue
        n, dtype = s
        descs.append((tuple(ints[i:i + n]), tuple(ints[i + n:i + 2 * n]), dtype))
        i += 2 * n
    return skel[0], tuple(descs)


def _on_line(x1, x2, x3):
    """(num, den) with x3 == x1 + num/den * (x2 - x1) for every int, or None."""
    num = den = 0
    for a, b, c in zip(x1, x2, x3):
        if a != b:
            num, den = c - a, b - a
            break
    if den == 0:
        return None
    for a, b, c in zip(x1, x2, x3):
        if (c - a) * den != num * (b - a):
            return None
    return num, den


def _along(y1, y2, num, den):
    out = []
    for a, b in zip(y1, y2):
        q, r = divmod(num * (b - a), den)
        if r:
            return None
        v = a + q
        if v < 0:
            return None
        out.append(v)
    return tuple(out)


class _Rule:
    """The answers kept under one size-free key: up to ``LIMIT`` examples (ints in, ints out), the
    pairs of them whose line predicted an answer exactly, and whether a prediction ever failed."""

    __slots__ = ("examples", "checked", "bad")
    LIMIT = 8

    def __init__(self):
        self.examples: list = []
        self.checked: list = []
        self.bad = False

    def line(self, x, only_checked: bool):
        """(pair, derived answer or None) of the first pair whose line holds ``x``, or None."""
        ex = self.examples
        pairs = self.checked if only_checked else [
            (i, j) for j in range(len(ex)) for i in range(j)]
        for i, j in pairs:
            t = _on_line(ex[i][0], ex[j][0], x)
            if t is None:
                continue
            y1, y2 = ex[i][1], ex[j][1]
            ints = _along(y1[1], y2[1], *t) if y1[0] == y2[0] else None
            return (i, j), (None if ints is None else _out_build(y1[0], ints))
        return None


class SizeRules:
    """NOTE [sizes by rule]: answers of meta kernels by size-free key, and the lines they give."""

    def __init__(self, capacity: int = 8192):
        self.rules = Cache("meta size rules", capacity)
        self.derived = 0        # answers derived by a rule (no meta kernel ran)
        self.refuted = 0        # keys whose rule the meta kernel contradicted

    def key(self, func, args, kwargs):
        """(size-free key, the ints taken out), or None for an op or argument never ruled."""
        if not ruled(func):
            return None
        ints: list = []
        exact = _exact_args(func)
        try:
            skel = (func, torch.get_default_dtype(),
                    tuple(_exact(a) if i in exact else _flat(a, ints) for i, a in enumerate(args)),
                    tuple((k, _exact(v) if k in exact else _flat(v, ints))
                          for k, v in kwargs.items()))
        except _Unruled:
            return None
        return (skel, _pattern(ints)), tuple(ints)

    def derive(self, k):
        """The answer a checked line gives for ``k`` (from ``key``), or None."""
        key, x = k
        e = self.rules.get(key)
        if e is None or e.bad or not e.checked:
            return None
        hit = e.line(x, True)
        return None if hit is None else hit[1]

    def learn(self, k, r) -> None:
        """Keep the meta kernel's answer ``r`` for ``k``, or check a line's prediction against it
        (a line is used only once it predicted an answer exactly)."""
        key, x = k
        e = self.rules.get(key)
        if e is None:
            e = self.rules[key] = _Rule()
        if e.bad:
            return
        hit = e.line(x, False)
        if hit is not None and hit[1] is not None:
            if hit[1] == r:
                if hit[0] not in e.checked:
                    e.checked.append(hit[0])
                return
            self.refuted += 1
            e.bad = True
            return
        if len(e.examples) < _Rule.LIMIT and all(x != ex[0] for ex in e.examples):
            e.examples.append((x, _out_flat(r)))

    def stats(self) -> dict:
        s = self.rules.stats()
        s.update(derived=self.derived, refuted=self.refuted)
        return s

    def clear(self) -> None:
        self.rules.clear()
