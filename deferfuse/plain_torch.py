"""What the plain tpu tensor changes of PyTorch's Python side, installed once by
``plain.install``: varlen attention's custom ops routed whole (``packed_kernels``), real ops under
Dynamo's fake mode (``real_ops``), sparse layouts refused with the op path's message
(``sparse_refusals``), ``copy.deepcopy`` and ``torch.save`` of a tensor without host storage
(``serialization``), and ``repr``/``tolist`` read in one host copy (``host_reads``)."""
from __future__ import annotations

import copy

import torch

from .tensor import TpuTensor

aten = torch.ops.aten

def packed_kernels(route):
    """NOTE [packed boundaries] (packed.py) on plain tensors: varlen attention's custom ops are
    ``custom_op``s with no device types, whose Python body is a CompositeExplicitAutograd kernel
    that a backend without a kernel of its own runs, so a plain tensor reached the op path only
    as the body's ``aten._flash_attention_forward`` (the boundaries unpadded: a program per
    number of sequences). A PrivateUse1 kernel for each routes the custom op itself, as the
    wrapper's ``__torch_dispatch__`` sees it. Registered before ``torch.nn.attention.varlen`` is
    imported (the dispatcher keeps a kernel for an op defined later), so importing deferfuse never
    imports that module (it imports Dynamo). Returns the ``Library`` (kept by its owner)."""
    lib = torch.library.Library("torch_attn", "IMPL")
    for name in ("_varlen_attn", "_varlen_attn_out", "_varlen_attn_backward"):
        def kernel(*args, _name=name, **kwargs):
            return route(getattr(torch.ops.torch_attn, _name).default, args, kwargs)
        lib.impl(name, kernel, "PrivateUse1")
    return lib


def real_ops(raw, func, types, args, kwargs):
    """NOTE [real ops under a fake mode]: an op on real plain tensors can reach the fallback
    while Dynamo's FakeTensorMode is active: ``torch.tensor(data, device="tpu")`` in traced code
    moves its CPU data to the device with the Python key excluded, and FakeTensorMode runs ops
    on small real constants for real ("constant propagation"). Plain tensors reaching the router
    are always real, and the op path's records hold real values, so the op runs with the fake mode
    unset, as it would outside the trace."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        return raw(TpuTensor, func, types, tuple(args), kwargs)


# sparse tensors PyTorch builds on tpu (``sparse_cpu.to("tpu")``'s _to_copy), by layout key
_SPARSE = (("_sparse_coo_tensor_with_dims_and_tensors", "SparsePrivateUse1", torch.sparse_coo),
           ("_sparse_compressed_tensor_unsafe", "SparseCsrPrivateUse1", None))
_sparse_lib = None


def sparse_refusals() -> None:
    """A sparse tensor moved to tpu raises the op path's refusal (fallback.py: tpu tensors are
    dense), as a ``TpuTensor`` argument made it raise; with plain arguments PyTorch dispatched the
    sparse constructor to the SparsePrivateUse1 key, which has no kernel ("Could not run")."""
    global _sparse_lib
    if _sparse_lib is not None:
        return
    _sparse_lib = torch.library.Library("aten", "IMPL")
    for name, key, layout in _SPARSE:
        op = getattr(aten, name).default

        def refuse(*args, _op=op, _layout=layout, **kwargs):
            lay = _layout or kwargs.get("layout")
            raise NotImplementedError(
                f"{_op} gives a {lay} tensor; tpu tensors are dense (strided) only. Keep sparse "
                "and other layouts on CPU, and move dense tensors to tpu")
        _sparse_lib.impl(name, refuse, key)


def serialization() -> None:
    """``copy.deepcopy`` and ``torch.save`` of plain tpu tensors as PyTorch treats a PrivateUse1
    tensor without storage (a clone; a CPU copy rebuilt on the device, NOTE [tpu checkpoints]
    in serialization.py): their storage holds no host memory to copy or pickle."""
    from .tensor import is_tpu
    T = torch.Tensor
    deepcopy, reduce = T.__deepcopy__, T._reduce_ex_internal

    def __deepcopy__(self, memo):
        if (not self.is_leaf or type(self) is not T or self.device.type != "tpu"
                or not is_tpu(self) or torch.overrides.has_torch_function_unary(self)):
            return deepcopy(self, memo)
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
            if self.requires_grad:
                new.requires_grad_()
            if self.grad is not None:
                new.grad = self.grad.__deepcopy__(memo)
            self._clear_non_serializable_cached_data()
            new.__dict__ = copy.deepcopy(self.__dict__, memo)
        memo[id(self)] = new
        return new

    def _reduce_ex_internal(self, proto):
        if self.device.type != "tpu" or not is_tpu(self):
            return reduce(self, proto)
        if torch.serialization._serialization_tls.skip_data:
            raise RuntimeError("Cannot serialize tensors on backends with no storage under "
                               "skip_data context manager")
        return (torch._utils._rebuild_device_tensor_from_cpu_tensor,
                (self.detach().cpu(), self.dtype, str(self.device), self.requires_grad))
    T.__deepcopy__ = __deepcopy__
    T._reduce_ex_internal = _reduce_ex_internal


def host_reads(is_plain) -> None:
    """NOTE [plain host reads]: ``repr`` and ``tolist`` of a plain tpu tensor read its values in
    one copy to the host, synced with the reason the wrapper subclass gives (``print``,
    ``tolist``: ``deferfuse.metrics()["syncs"]``, the report's sync sites), instead of
    PyTorch's own printing, which runs ops on the device and reads their results one ``item`` at
    a time. ``repr`` keeps PyTorch's own frame (``device=``, ``dtype=``, ``grad_fn=``, a
    Parameter's header): only the values' text is formatted from the host copy, as PyTorch
    formats a CPU tensor's. ``is_plain``: the extension's test of a plain tpu tensor."""
    from . import dispatch
    from .tensor import as_tpu
    T = torch.Tensor
    repr_, tolist = T.__repr__, T.tolist
    tensor_str = torch._tensor_str._tensor_str
    has_tf = torch.overrides.has_torch_function_unary

    def ours(t):
        return (t.device.type == "tpu" and is_plain(t)
                and t.layout == torch.strided and not has_tf(t))

    def __repr__(self, *, tensor_contents=None):
        if tensor_contents is None and ours(self):
            try:
                cpu = dispatch.to_cpu(as_tpu(self.detach()), "print")
            except Exception as e:
                raise dispatch.user_error(e)    # NOTE [user frames] (engine.py)
            if cpu.numel():
                # the indent of "tensor(", the prefix PyTorch's _str_intern prints
                tensor_contents = tensor_str(cpu, len("tensor("))
        return repr_(self, tensor_contents=tensor_contents)

    def tolist_(self):
        if ours(self):
            return dispatch._tolist(as_tpu(self.detach()))
        return tolist(self)
    T.__repr__ = __repr__
    T.tolist = tolist_
