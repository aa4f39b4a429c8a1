"""Padding rules: what an op does along a padded dim, stated next to its lowering.

NOTE [padding rules]: a region whose sizes keep changing runs padded in a bucket (NOTE [buckets] in
runtime/buckets.py): every dim whose size follows the length is padded at its end, and the padding
must never reach a valid position. Each lowering says how its op keeps it away with ``pad=`` on
``@op(...)``: a small record below, or ``Refuse("why")``. ``plan_node`` (runtime/bucket_node.py)
reads the rule of each op of a region and plans what the rule needs (masks, checks against the
exact length); an op whose rule is ``Refuse`` (or that has none) refuses the whole region, which
then compiles per shape, its reason counted in ``metrics()['bucket_refusals']``.

Where ``pad=`` is not given, an op PyTorch tags ``pointwise`` is ``Pointwise()``, and any other op
takes its family module's ``PAD`` (a ``Refuse`` naming why that family has no rule); a test walks
the whole table (``tests/test_vary.py``): every lowering has a rule or a stated reason.

``sizes`` (every rule): the static arguments that are sizes (positions in the op's arguments, or
keyword names): the only ints of an op's arguments that may change with the length (a dim, a
baked number or an offset must stay the same).

These are records, with no JAX and no planning in them: the planner and the padded program are in
runtime/bucket_node.py and runtime/bucket_fn.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Pad:
    """A padding rule (the base of the records below)."""
    sizes: tuple = field(default=(), kw_only=True)


@dataclass(frozen=True, slots=True)
class Pointwise(Pad):
    """Elementwise: each output position reads the same position of its inputs (broadcasting
    alike), so padding stays padding."""


@dataclass(frozen=True, slots=True)
class Factory(Pad):
    """Values that depend on the index alone (``arange(P)``'s first T values are ``arange(T)``'s),
    or copies of one input; no broadcasting check."""


@dataclass(frozen=True, slots=True)
class Scan(Pad):
    """A prefix scan (``cumsum``): each position depends on the positions before it only."""


@dataclass(frozen=True, slots=True)
class MoveDims(Pad):
    """A view that moves dims (transpose, permute, unsqueeze, expand): admitted in a view chain;
    with ``sizes`` every int of its arguments is a size there."""


@dataclass(frozen=True, slots=True)
class Reshape(Pad):
    """A reshape: a plain one where each padded dim stays the first of its group of merged or
    split dims (``(T, C) -> (T * C)``), else compacted (``(T, B) -> (T * B)`` with ``B`` padded:
    NOTE [compacting reshapes] in runtime/bucket_reshape.py); in a view chain every int of its
    arguments is a size."""


@dataclass(frozen=True, slots=True)
class Slice(Pad):
    """A fixed slice or select: admitted along dims that are not padded (along a padded dim the
    window would be the padded tensor's, not the exact one's)."""


@dataclass(frozen=True, slots=True)
class Reduce(Pad):
    """A reduction over the dims of argument ``dims`` (None: every dim), the padding masked with
    ``identity`` (0, True, False, ``"-inf"``, ``"+inf"``, or ``"mean"``: 0 and the exact count);
    ``index``: it returns positions (``argmax``), so over every dim of a padded tensor (a flat
    index, counting padding) it refuses."""
    dims: int | None = 1
    identity: object = 0
    index: bool = False


@dataclass(frozen=True, slots=True)
class Normalize(Pad):
    """A layer norm over the trailing dims named by argument ``shape``: refused when one of them
    is padded."""
    shape: int = 1


@dataclass(frozen=True, slots=True)
class Contract(Pad):
    """A matrix product: ``operands`` are (input, contracted dim) pairs; a padded contracted dim is
    masked to 0 in both operands."""
    operands: tuple = ()


@dataclass(frozen=True, slots=True)
class Attention(Pad):
    """Fused attention (query, key, value first): padded keys get a key mask, padded values 0; a
    padded head dim refuses."""


@dataclass(frozen=True, slots=True)
class Embedding(Pad):
    """A table lookup: input ``index`` holds the indices (padded entries masked to 0, so the index
    check sees only real ones); a padded ``table`` refuses."""
    index: int = 1
    table: int = 0


@dataclass(frozen=True, slots=True)
class Along(Pad):
    """``gather``/``index_select`` (input 0 indexed by input 1 along argument 1): padded index
    entries masked to 0; an index into a padded dim checked against its exact length."""


@dataclass(frozen=True, slots=True)
class Index(Pad):
    """Advanced indexing with integer index tensors (``x[:, [-1]]``): padded index entries masked
    to 0; an index into a padded dim checked against, and wrapped by, the exact length."""


@dataclass(frozen=True, slots=True)
class TopK(Pad):
    """``topk``: elementwise across other dims; along a padded dim the padding is filled with
    what is never selected and ``k`` is checked against the exact length."""


@dataclass(frozen=True, slots=True)
class Multinomial(Pad):
    """Sampling rows of the last dim (not padded): padded rows get a valid distribution (ones)
    and their samples are cut off."""


@dataclass(frozen=True, slots=True)
class Cat(Pad):
    """``cat``: along a padded dim each input is written at its exact offset."""


@dataclass(frozen=True, slots=True)
class IndexPut(Pad):
    """``x[i] = v`` (``index_put``). With one boolean mask over leading dims and one value
    (``logits[logits < v] = -inf``): elementwise, so what is written into the padding stays
    padding. With integer index tensors (not padded themselves): an index into a padded dim
    checked against, and wrapped by, the exact length (as ``Index``); the values padded only
    where the indexed view of ``x`` is, so their padding is written into ``x``'s."""


@dataclass(frozen=True, slots=True)
class Scatter(Pad):
    """``scatter``/``scatter_add`` (input 0 written at input 1 along argument 1, from input 2):
    padded index entries masked to 0 (a position of the padding along the other dims, where
    they write padding), and with ``add`` their sources to 0 along the dim written (they add
    nothing; a ``scatter`` whose index is padded along that dim refuses); an index into a padded
    dim checked against its exact length."""
    add: bool = False


@dataclass(frozen=True, slots=True)
class ZeroPadded(Pad):
    """Valid outputs read padded positions only through sums of terms that vanish where the
    ``inputs`` are 0 (a weight's gradient: ``embedding_dense_backward``, a layer norm's backward,
    softmax's backward): every padded dim of those inputs is set to 0 first. ``unless``: an
    argument (position, keyword) that refuses when true (``scale_grad_by_freq`` counts padded
    indices); ``normalized``: an argument (position, keyword) naming trailing dims of input 1
    that must not be padded (a layer norm's backward)."""
    inputs: tuple = ()
    unless: tuple | None = None
    normalized: tuple | None = None


@dataclass(frozen=True, slots=True)
class Targets(Pad):
    """A loss over rows with a target each (``nll_loss``): padded entries of input ``target``
    become the ``ignore_index`` (argument ``ignore``), so they count neither in the loss nor in
    its mean's total weight; the inputs ``zero`` set to 0 in their padding (a padded row's NaN
    would reach the sum through ``0 * NaN``); a padded class dim of input ``probs`` refuses."""
    target: int = 1
    ignore: int = 4
    zero: tuple = (0,)
    probs: int = 0


@dataclass(frozen=True, slots=True)
class Batched(Pad):
    """Independent along a batch (the batch and heads of an attention backward, the batch of a
    recurrent layer): every padded dim of every tensor, input or output, is one of ``dims`` (dim
    numbers, negative from the end), and the inputs at ``fixed`` (weights, a mask) are not padded,
    so padding reaches only padded outputs. ``zero``: inputs' padding is set to 0 first (a weight
    gradient summed over the batch then adds nothing from it). ``steps``: the dim (of the first
    input) along which the op is a recurrence over time; where it is padded, the lowering is
    called with ``_steps``, the exact count of steps, and keeps its state past them as it was."""
    dims: tuple = (0,)
    fixed: tuple = ()
    zero: bool = False
    steps: int | None = None


@dataclass(frozen=True, slots=True)
class Refuse(Pad):
    """No rule: a region where this op touches a padded dim runs exactly; ``why`` says why."""
    why: str = ""
