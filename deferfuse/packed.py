"""Varlen attention over packed batches, one program for every number of sequences in a bucket.

NOTE [packed boundaries]: ``torch.nn.attention.varlen.varlen_attn`` (TorchTitan's varlen
attention) takes a packed batch's sequence boundaries (``cu_seq_q``, ``cu_seq_k``: N + 1
cumulative lengths) and its longest sequences (``max_q``, ``max_k``). Both change from batch to
batch (the number of documents a batch packs, the longest of them), and each made a program of its
own: the boundaries' length is a shape, the longest lengths are static integers of the flash ops
(in compiled graphs: a dynamic size and an integer input, both in the program's key). Neither
needs to:

- Boundaries padded at their end with copies of their last entry describe the same batch with
  empty sequences after it: the lowering (``_varlen`` in runtime/lowering/attention.py) places
  every token in the same sequence as before, so outputs, log-sum-exps and gradients are the
  same. The boundaries are padded to the bucket of their length (``bucket_of``: the next power of
  two, at least 32), so batches of 1 to 31 sequences share one program, 32 to 63 another.
- No lowering reads the longest lengths: eager calls pass the total lengths instead (an upper
  bound, valid for any kernel), and compiled graphs leave those integer inputs out of their key
  (``GraphPlan.free_ints``, runtime/graph.py).

Where: in eager modes, ``varlen_attn``'s custom ops (``torch_attn::_varlen_attn``, its backward,
and ``varlen_attn_out``'s ``_varlen_attn_out``) run their own kernel with the padded boundaries
(``handlers``: registered the first time such an op reaches ``tpu``, so that ``import
deferfuse`` never imports the varlen module, which imports Dynamo); in compiled graphs, ``CompiledGraph`` pads the inputs that are only such
boundaries (``GraphPlan.boundaries``). A ready boundary tensor is padded where it is
(``pad_edge``: through the host on a CPU device, a small program per length elsewhere); a pending
one is computed first, without waiting for it (``Cut.PACKED``). ``DEFERFUSE_BUCKETS=0`` turns the
padding off, with the other buckets.
"""
from __future__ import annotations

import torch

from .config import config
from .engine import engine
from .runtime import stats
from .runtime.bucket_fit import bucket_of
from .runtime.bucket_region import pad_edge
from .scheduler.policy import Cut
from .scheduler.records import Value
from .tensor import TpuTensor, new_tensor

_CEA = torch._C.DispatchKey.CompositeExplicitAutograd


def padded_value(v: Value, device: int) -> Value | None:
    """The boundaries ``v`` (a 1-D value) padded to their bucket, or None where they are left as
    they are (already a bucket's length, empty, failed)."""
    n = v.shape[0]
    b = bucket_of(n)
    if n == 0 or b == n:
        return None
    if v.array is None and v.node is not None:
        try:
            engine.ready(v, device, Cut.PACKED, check=False)
        except Exception:
            return None         # a failed value: the op reading it raises its error
    if v.array is None:
        return None
    arr = pad_edge(v.exact(), b, engine.runner.buckets.moves)
    out = Value((b,), arr.dtype, arr.nbytes, array=arr)
    out.chk = v.chk
    stats.S["packed_padded"] += 1
    return out


def _padded(t):
    """The boundary tensor ``t`` padded to its bucket (``t`` itself where it is not padded)."""
    if not isinstance(t, TpuTensor) or "_s" not in t.__dict__ or t.dim() != 1 or t._chain:
        return t
    v = padded_value(t._s.val, t._s.device)
    if v is None:
        return t
    return new_tensor(v, t._s.device, t.dtype, (v.shape[0],), (1,))


def _bind(func, args, kwargs) -> dict:
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _call(func, bound: dict):
    """``func``'s kernel for every backend (varlen's own Python body) on ``bound``."""
    args = []
    for a in func._schema.arguments:
        if a.name in bound:
            args.append(bound[a.name])
        elif a.has_default_value():
            args.append(a.default_value)
        else:
            break           # (missing: the kernel raises PyTorch's error)
    return func._op_dk(_CEA, *args)


def _h_varlen(func, args, kwargs):
    """``torch_attn::_varlen_attn``, ``_varlen_attn_out`` (``varlen_attn_out``: the same into a
    given output) and ``_varlen_attn_backward``: NOTE [packed boundaries]."""
    bound = _bind(func, args, kwargs)
    if config.buckets and bound.get("seqused_k") is None and bound.get("block_table") is None:
        cq, ck = bound.get("cu_seq_q"), bound.get("cu_seq_k")
        q, k = bound.get("query"), bound.get("key")
        if isinstance(cq, TpuTensor) and isinstance(q, TpuTensor) and isinstance(k, TpuTensor):
            pq = _padded(cq)
            bound["cu_seq_q"] = pq
            if ck is cq:
                bound["cu_seq_k"] = pq
            elif ck is not None:
                bound["cu_seq_k"] = _padded(ck)
            bound["max_q"], bound["max_k"] = q.shape[0], k.shape[0]
    return _call(func, bound)


def handlers() -> dict:
    """``{OpOverload: handler}`` for varlen attention's custom ops (defined in this process)."""
    ops = torch.ops.torch_attn
    return {getattr(ops, name).default: _h_varlen
            for name in ("_varlen_attn", "_varlen_attn_out", "_varlen_attn_backward")
            if hasattr(ops, name)}
