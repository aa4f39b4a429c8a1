"""``tpu`` tensors as PyTorch's compiler sees them: a traceable wrapper subclass over an inner tensor.

NOTE [inner tensor]: Dynamo fakeifies a tensor subclass, and AOTAutograd traces through it, only
when it is a traceable wrapper (``__tensor_flatten__`` / ``__tensor_unflatten__``, as DTensor is
over its local tensor). A ``TpuTensor``'s inner tensor is a plain PrivateUse1 tensor of the same
size and dtype (``torch._C._acc.create_empty_tensor``: no data, no kernels), made on first use and
kept: compiled graphs are graphs of aten ops over inner tensors, faked while they are traced
(FakeTensorMode runs them on meta kernels) and never run eagerly. An inner tensor holds a storage
and a view, as a ``TpuTensor`` does: an input's, the storage and view of the tensor it stands for;
an output's, a storage of its own holding the value the graph computes (pending until it runs:
NOTE [graphs are ops] in compiled.py), which AOTAutograd wraps back into a ``TpuTensor``.

While a graph is traced, the ``TpuTensor``s Dynamo and AOTAutograd make hold fake inner tensors and
no storage; an op on them runs on the inner tensors (``traced_dispatch``) and wraps the results, as
any traceable subclass does. ``route.torch_dispatch`` sends an op there when a FakeTensorMode is
active, so eager ops pay nothing for it.
"""
from __future__ import annotations

import sys

import torch
import torch.utils._pytree as pytree

from .tensor import Storage, TpuTensor, make

_empty_inner = torch._C._acc.create_empty_tensor
FAKE = torch._C._TorchDispatchModeKey.FAKE
_AS_STRIDED = torch.ops.aten.as_strided.default
_META = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)


def _inner(self):
    """The inner tensor (NOTE [inner tensor]), made once per tensor. It holds the tensor's storage
    and view (not the tensor: AOTAutograd keeps inner tensors saved for backward after the outer
    ones are gone), so it always reads the tensor's current value."""
    d = self.__dict__
    i = d.get("_inner_t")
    if "_s" not in d:
        return i                # a tensor being traced: its inner tensor is fake
    if (i is None or i._s is not self._s or i._chain is not self._chain
            or i.__dict__.get("_dyn", ()) != self._dyn):
        size, stride, offset = tuple(self.shape), tuple(self.stride()), self.storage_offset()
        i = _empty_inner(size, self.dtype)
        if offset or stride != i.stride():
            # NOTE [inner view]: the inner tensor has the view's strides and offset, as the fake
            # one Dynamo replays from the base has (a slice of an input); Dynamo guards that the
            # two offsets agree. Meta's ``as_strided`` sets them on the dataless inner tensor.
            i = _AS_STRIDED.redispatch(_META, i, size, stride, offset)
        i._s, i._chain, i._dyn = self._s, self._chain, self._dyn
        i._view = (size, stride, offset)
        self._inner_t = i
    return i


def _flatten(self):
    return ["_inner"], None


def _unflatten(inner_tensors: dict, meta, outer_size, outer_stride):
    """A ``TpuTensor`` over ``inner``: a fake one while tracing; at run time, one holding the value
    a compiled graph computed (an output's inner tensor: ``output_inner``), or the tensor an
    input's inner tensor stands for (its storage and view)."""
    inner = inner_tensors["_inner"]
    d = inner.__dict__
    st = d.get("_s")
    if st is None:
        # The inner tensor's offset: a view replayed on a fake base (Dynamo fakeifying a slice
        # of an input) must land where the real view is, or Dynamo's check of it fails.
        t = torch.Tensor._make_wrapper_subclass(TpuTensor, outer_size, outer_stride,
                                                inner.storage_offset() or None, None,
                                                inner.dtype, torch.strided, inner.device,
                                                requires_grad=inner.requires_grad)
        t._inner_t = inner
        return t
    if "_out" not in d:
        size, stride, offset = d["_view"]
        t = make(st, inner._chain, size, stride, offset, inner.dtype)
        if d.get("_dyn"):
            t._dyn = d["_dyn"]
        return t
    size, stride = tuple(outer_size), tuple(outer_stride)
    # A storage of its own: the tensor may be written in place later, and ``inner`` (saved for
    # the backward pass) keeps the value it had here.
    v = st.val
    out = Storage(v, st.device, inner.dtype, stride)
    if v.node is not None:
        v.node.trace.track(out)
    return make(out, (), size, stride, 0, inner.dtype)


def wrap_inner(o) -> TpuTensor:
    """The ``TpuTensor`` whose inner tensor is ``o`` (a plain ``tpu`` tensor a graph made)."""
    return _unflatten({"_inner": o}, None, o.shape, o.stride())


def _traced_inner(t):
    """The inner tensor an op being traced runs on: a fake one; for a real tpu tensor met while
    tracing (a constant made in the traced code), a fake of its inner tensor."""
    if "_s" not in t.__dict__:
        return t._inner_t
    mode = torch._C._get_dispatch_mode(FAKE)
    if mode is None:
        raise RuntimeError("deferfuse internal error: a real tpu tensor in a traced op outside a "
                           "fake mode")
    return mode.from_tensor(t._inner)


def _lift_constant(func, t):
    """NOTE [traced constants]: ``torch.tensor(data, device="tpu")`` in traced code (a Hugging Face
    dynamic cache's empty ``keys``) makes a real ``tpu`` tensor and lifts it with ``lift_fresh``.
    AOTAutograd keeps a lifted tensor as a constant of the graph, and a constant must be real: a
    fake of the inner tensor failed ("Unexpected fake buffer"). The value is lifted on the CPU,
    where constants are plain tensors, and moved to ``tpu`` in the graph. A tensor of at most one
    element is made by a factory op instead: FakeTensorMode computes an op on such a constant for
    real ("constant propagation"), and a plain ``tpu`` tensor has no kernels."""
    with torch.utils._python_dispatch._disable_current_modes():
        cpu = t.cpu()
        one = cpu.item() if cpu.numel() == 1 else None
    aten = torch.ops.aten
    if cpu.numel() == 0:
        out = aten.empty.memory_format(tuple(cpu.shape), dtype=cpu.dtype, device=t.device)
    elif cpu.numel() == 1:
        out = aten.full.default(tuple(cpu.shape), one, dtype=cpu.dtype, device=t.device)
    else:
        out = aten._to_copy.default(func(cpu), device=t.device)
    return wrap_inner(out)


_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


_DTYPE_VIEWS = {torch.ops.aten.view_as_real.default: True,      # op -> does it want a complex input
                torch.ops.aten.view_as_complex.default: False}


def _replayed_dtype_view(func, base) -> bool:
    """NOTE [dtype views replayed]: fakeifying an input that is a view of another dtype than its
    base (RoPE's ``view_as_real`` of a complex product: TorchTitan's q and k, given to its compiled
    flex attention), PyTorch's MetaConverter (``meta_utils.view_from_base``) converts the fake base
    itself (``view_as_real``/``view_as_complex``) and then replays the input's view chain, which
    for a traceable subclass holds the conversion too: the second conversion meets a base already
    of the target kind and raised. That replay is an alias; the same op anywhere else keeps
    PyTorch's error. Only reached on that error path, so the frame walk costs nothing else."""
    if _DTYPE_VIEWS[func] == base.is_complex():     # the input it wants: not a replay
        return False
    f = sys._getframe(2)
    while f is not None:
        if (f.f_code.co_name == "view_from_base"
                and f.f_globals.get("__name__") == "torch._subclasses.meta_utils"):
            return True
        f = f.f_back
    return False


def traced_dispatch(func, args, kwargs):
    """An op on tensors being traced: run it on their inner tensors, wrap tpu results."""
    if func in _DTYPE_VIEWS and _replayed_dtype_view(func, args[0]):
        func, args, kwargs = torch.ops.aten.alias.default, (args[0],), {}
    if func in _LIFTS and type(args[0]) is TpuTensor and "_s" in args[0].__dict__:
        return _lift_constant(func, args[0])
    ua, uk = pytree.tree_map_only(TpuTensor, _traced_inner, (args, kwargs))
    out = func(*ua, **uk)
    return pytree.tree_map_only(
        torch.Tensor,
        lambda o: wrap_inner(o) if o.device.type == "tpu" and type(o) is not TpuTensor else o,
        out)


def output_inner(v, dtype, device: int = 0):
    """A plain inner tensor standing for the value ``v`` (a compiled graph's output, pending or
    ready): a storage of its own holding ``v``, kept among the storages the pending trace reads
    back (the backward pass may read it after a sync)."""
    i = _empty_inner(v.shape, dtype)
    st = Storage(v, device, dtype)
    if v.node is not None:
        v.node.trace.track(st)
    i._s = st
    i._chain = ()
    i._out = True
    return i


def install() -> None:
    TpuTensor._inner = property(_inner)
    TpuTensor.__tensor_flatten__ = _flatten
    TpuTensor.__tensor_unflatten__ = staticmethod(_unflatten)
    _keep_module_conversion()


def _keep_module_conversion() -> None:
    """``module.to("tpu")`` converts parameters as it did before tpu tensors were traceable:
    ``nn.Module._apply`` swaps a traceable wrapper subclass in with ``torch.utils.swap_tensors``,
    which refuses a CPU parameter that an autograd graph still holds ("Couldn't swap ...weight"
    after a CPU forward pass). A tpu parameter takes the new ``Parameter`` path, as a CUDA one
    does (so does a tpu tensor of a subclass's class: NOTE [tpu subclasses]); every other
    subclass keeps PyTorch's rule."""
    import torch.nn.modules.module as module
    orig = module.is_traceable_wrapper_subclass
    if getattr(orig, "_deferfuse", False):
        return

    def is_traceable_wrapper_subclass(t):
        return not isinstance(t, TpuTensor) and orig(t)
    is_traceable_wrapper_subclass._deferfuse = True
    module.is_traceable_wrapper_subclass = is_traceable_wrapper_subclass
