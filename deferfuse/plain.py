"""The Python half of the plain PrivateUse1 ``tpu`` tensor (issue 34; docs/cxx-plan.md).

A tpu tensor is a plain PrivateUse1 tensor made by the C++ extension ``deferfuse._tpu_tensor``
(NOTE [tensor representation]; NOTE [plain tensor] in _tpu_tensor.cpp): empty tensors and the core
view ops are C++ kernels, and every other op reaches one boxed C++ fallback that calls
``Plain.route`` here.

NOTE [plain router]: this first stage runs every op through the existing op path unchanged: each
plain tpu argument becomes a ``TpuTensor`` over the same ``Storage`` (the one its storage's DataPtr
context holds, made on first use), ``route.dispatch`` records or runs the op, and each ``TpuTensor``
result becomes a plain tensor again (an argument returned as itself, an out= tensor, is the
argument; a result over an argument's storage is a view of that argument's storage). A write binds
the new value to the shared ``Storage``, so every plain view of it sees it, as every TpuTensor view
does. The conversion costs two wrapper tensors an op more than today's path: it is the bridge to
replace kernel by kernel (docs/cxx-plan.md, STATUS), not the destination.
"""
from __future__ import annotations

import os
from weakref import ref as _weakref

import torch

from .config import config
from .engine import engine, user_error
from .runtime import transfer
from .runtime.viewchain import DSELECT, DSLICE, DSTRIDED
from .scheduler.records import Value, sig_id
from .tensor import Storage, TpuTensor, make

# NOTE [tensor representation]: a tpu tensor is the plain PrivateUse1 tensor of the C++ extension:
# its type is ``torch.Tensor``, a user's subclass of it is PyTorch's own ``as_subclass``, and Dynamo
# sees it as the device tensor it is. ``TpuTensor`` (tensor.py) is no user's tensor: it is the op
# path's argument type, the form the router gives a plain tensor (``as_tpu``: a TpuTensor over the
# same Storage and view) for the ops the C++ kernel does not record; the op path reading Storage
# records instead is the next step (docs/cxx-plan.md). When the extension cannot be loaded (not
# built, or built for another torch), ``import deferfuse`` raises ImportError naming the fix
# (``require``): there is no other representation to fall back to, and the build is part of the
# install, so the error means a broken install.
_local = engine.local
# the C++ recording kernel (NOTE [C++ recording kernel] in _tpu_tensor.cpp); 0: the router only
KERNEL = os.environ.get("DEFERFUSE_CXX_KERNEL", "1") != "0"
# a kernel hit's outputs hold their Value and get their Storage on first ask (NOTE [lazy storages]
# in _tpu_tensor.cpp); 0: each is made at the hit
LAZY = os.environ.get("DEFERFUSE_LAZY_STORAGES", "1") != "0"

aten = torch.ops.aten
# the view ops whose window may move (views._MOVING, and the steps unbind/split record)
_MOVING_OPS = (aten.slice.Tensor, aten.select.int, aten.as_strided.default)
# NOTE [plain _to_copy]: ops with a device= argument routed whole (route_whole leaves the others
# out): a cast and the *_like/new_* factories of a tpu tensor, one op each as on the wrapper
# (their composites' empty + copy_/fill_ were in-place writes: buckets refused them, and a
# ones_like before a loop was no longer a setup op, NOTE [setup first])
_DEVICE_WHOLE = ("_to_copy", "ones_like", "zeros_like", "full_like", "empty_like", "new_full",
                 "new_empty", "new_zeros", "new_ones")
_DEVICE_WHOLE_IDS = frozenset(id(getattr(aten, n).default) for n in _DEVICE_WHOLE)
# NOTE [plain split]: composite view ops left to PyTorch's own kernel, whose pieces are the C++
# view kernels (split -> narrow -> slice, unbind -> select), rather than routed whole
# (route_whole): routed, their results carried Python view steps, which have no C++ signature, so
# every op on them (and on their views: a GPT block's q, k, v and attention) was routed too.
# ``lift_fresh`` (``torch.tensor(data, device="tpu")``'s last step) is PyTorch's composite, which
# returns its argument, as on CPU: routed, it was an alias with a Python view step, so the new
# tensor was unkeyed (DynamicCache's first ``cat`` of its empty ``keys`` was routed)
_CXX_VIEWS = frozenset(("split.Tensor", "split_with_sizes.default", "unbind.int", "lift_fresh.default"))
_COMPOSITE = torch._C.DispatchKey.CompositeExplicitAutograd
_NONFUNCTIONAL = torch._C.DispatchKey.CompositeExplicitAutogradNonFunctional
# NOTE [functional direct]: a structured op's functional overload (``add.Tensor``, ``mm``,
# ``sum.dim_IntList``) reaches a backend without a kernel of its own through PyTorch's
# CompositeExplicitAutogradNonFunctional kernel: its C++ meta function, an ``empty_strided`` on
# the device, then the ``.out`` op through the boxed fallback (NOTE [fresh out]). These overloads
# are registered on PrivateUse1 to the fallback itself (``route_whole``), so the op arrives whole:
# the kernel's hit builds its outputs from the cached metadata, as for ``relu``, and a miss
# reaches the router as the functional op, whose op path infers the metadata and raises
# PyTorch's errors (broadcasting, promotion, devices) itself, as it did for the wrapper
# subclass. The list: every structured functional overload whose ``.out`` form mlp_train,
# gpt_train, small_ops and hf_generate routed (28 of their 29), with the binary, matmul, comparison,
# softmax and activation overloads of the same families a training step meets; then what
# hf_generate and wlm_lstm still ran through a meta function (``pow.Tensor_Scalar``, RMSNorm's
# ``x.pow(2)``; ``clip_grad_norm_``'s ``linalg_vector_norm``, ``clamp``, ``reciprocal``) and
# the unary, activation, reduction and pointwise families beside them. The in-place and out=
# overloads stay structured. An overload whose meta function checks a Python number's *value*
# (``pow.Tensor_Scalar``: an integer tensor to a negative integer power raises) joins only with
# that check made per call (``_VALUE_CHECKS``, NOTE [C++ value checks] in _tpu_tensor.cpp, and
# ``_meta_check`` on the router): numbers are runtime inputs, never in a key; their types are,
# so the checks of a number's type (``add``'s alpha) hold. A dtype the meta function refuses and
# the Python reference computes is checked on the router (``_DTYPE_CHECKS``: a dtype is in every
# key, so the router sees such a call first); ``maximum``/``minimum``, whose complex refusal is
# not checked there, stay structured. Off: ``DEFERFUSE_FUNCTIONAL_DIRECT=0`` (config).
FUNCTIONAL_DIRECT = (
    # routed as .out by the four workloads
    "add.Tensor", "sub.Tensor", "mul.Tensor", "mean.dim", "sum.dim_IntList", "cat",
    "_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward",
    "gelu", "gelu_backward", "silu", "tanh", "threshold_backward", "neg", "rsqrt", "sin", "cos",
    "cumsum", "argmax", "all", "any", "eq.Scalar", "lt.Scalar",
    "bitwise_and.Tensor", "bitwise_or.Tensor", "bitwise_not",
    # the same families
    "div.Tensor", "div.Tensor_mode", "mm", "addmm", "bmm", "_softmax", "_softmax_backward_data",
    "eq.Tensor", "ne.Tensor", "ne.Scalar", "lt.Tensor", "le.Tensor", "le.Scalar", "gt.Tensor",
    "gt.Scalar", "ge.Tensor", "ge.Scalar", "sigmoid", "sigmoid_backward", "tanh_backward",
    "exp", "log", "sqrt", "pow.Tensor_Tensor",
    # through a meta function on hf_generate (pow) and wlm_lstm (clip_grad_norm_), and their
    # families
    "pow.Tensor_Scalar", "linalg_vector_norm", "clamp", "clamp.Tensor", "clamp_min", "clamp_max",
    "reciprocal", "erf", "log1p", "expm1", "leaky_relu", "leaky_relu_backward", "elu",
    "elu_backward", "softplus", "softplus_backward", "amax", "amin", "max.dim", "min.dim", "topk",
    "baddbmm", "addcmul", "addcdiv", "lerp.Scalar", "lerp.Tensor",
)
# NOTE [C++ value checks] (_tpu_tensor.cpp): the meta checks of a Python number's value, as
# ``(kind, argument index, argument index or -1)``: 1, an integral base to a negative integer
# power; 2, the in-place backward of leaky_relu / elu (the bool at the second index) with a
# negative slope (the number at the first)
_VALUE_CHECKS = {
    "pow.Tensor_Scalar": (1, 1, -1),
    "leaky_relu_backward": (2, 2, 3),
    "elu_backward": (2, 1, 4),
}
# the dtypes whose refusal by the C++ meta function these overloads' Python references lack
# (found by tests/test_cxx_functional.py): a tensor argument of one of them makes the router run
# PyTorch's structured path, which raises. A dtype is in every key, so the router sees each such
# call (a miss), and the check costs nothing on a hit.
_COMPLEX = frozenset((torch.complex32, torch.complex64, torch.complex128))
_DTYPE_CHECKS = {
    "clamp": _COMPLEX, "clamp.Tensor": _COMPLEX, "clamp_min": _COMPLEX, "clamp_max": _COMPLEX,
    "max.dim": _COMPLEX, "min.dim": _COMPLEX, "topk": _COMPLEX | {torch.bool},
    "addcdiv": frozenset((torch.bool,)),
}
# the functional overloads whose alpha= the C++ meta function checks and PyTorch's Python
# reference (the op path's metadata) does not: a bool alpha for a non-bool result
_ALPHA_IDS = frozenset((id(aten.add.Tensor), id(aten.sub.Tensor)))


def _contig(size) -> tuple:
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _static(a):
    return tuple(a) if type(a) is list else a


class Plain:
    """The router the C++ fallback calls, and the conversions between plain tensors and the
    ``TpuTensor`` records the op path works on. One object (``PLAIN``), owning its caches."""

    def __init__(self, ext, dispatch):
        self.ext = ext
        self.dispatch = dispatch        # (func, args, kwargs) -> result: the existing op path
        self.ops = {}                   # (qualified name, overload) -> OpOverload (bounded by aten)
        self.steps = {}                 # C++ step name -> OpOverload
        self.is_plain = ext.is_plain
        self.functionals = {}           # .out op -> its functional op or None (NOTE [fresh out])
        self.out_names = {}             # op -> its one keyword-only output's name or None
        self.multi = {}                 # op -> (its keyword-only outputs, functional op) or None
        self.current = None             # the running route's {id(TpuTensor): (it, plain tensor)}
        self.direct = frozenset()       # ids of the NOTE [functional direct] overloads registered
        # id of a direct overload with checks -> (its NOTE [C++ value checks] entry or None,
        # the dtypes its meta function refuses or ())
        self.guards = {}
        self.attn_lib = None            # the torch_attn PrivateUse1 kernels (plain_torch.packed_kernels)
        # C++ signature id -> the op path's _sig (NOTE [C++ signatures]): one dict lookup per
        # argument instead of hashing its description; bounded (cleared when full, counted)
        self.sigs = {}
        self.sig_limit = 1 << 16
        self.sig_clears = 0
        # C++ signature id of a view -> (chain, _sig, _dyn) of its TpuTensor (NOTE [plain moving
        # windows]); bounded as ``sigs``
        self.moving = {}
        # NOTE [plain wrapper cache]: id(plain tensor) -> (weakref to it, its TpuTensor, the
        # Storage and C++ signature id it was made for, the TpuTensor's _sig then); bounded
        self.wrappers = {}
        self.wrapper_limit = 1 << 16
        self.wrapper_hits = self.wrapper_misses = self.wrapper_clears = 0

    # -- the fallback's two callbacks

    def resolve(self, name: str, overload: str):
        """The OpOverload of a schema (once per operator: the C++ side keeps it)."""
        ns, _, op = name.partition("::")
        packet = getattr(getattr(torch.ops, ns), op)
        return getattr(packet, overload or "default")

    def route(self, func, args, kwargs):
        """Run ``func`` on plain tpu tensors through the existing op path (NOTE [plain router])."""
        try:
            if id(func) in _DEVICE_WHOLE_IDS and not self.is_plain(args[0]):
                # NOTE [plain _to_copy]: a CPU input to a tpu device: PyTorch's composite
                return func._op_dk(_COMPOSITE, *args, **kwargs)
            if kwargs and id(func) in _ALPHA_IDS:
                _alpha_check(args, kwargs)
            check = self.guards.get(id(func))
            if check is not None:
                _meta_check(func, check, args, kwargs)
            name = self.out_name(func) if kwargs else None
            if kwargs and name is None:
                fresh = self._fresh_outs(func, args, kwargs)
                if fresh is not None:
                    return fresh
            out = kwargs.get(name) if name else None
            # a fresh out= that is a view of its storage (DDP's bucket views: mul.out into a
            # slice of a flat bucket) is not fresh: its Storage would be the result's, shaped
            # unlike the storage's base, which every other view of the bucket reads through its
            # chain
            if out is not None and type(out) is not TpuTensor and self.is_plain(out) \
                    and self.ext.storage(out) is None and self.ext.state(out)[2]:
                f = self.functional_of(func)
                if f is not None:
                    return self._into_fresh_out(f, args, kwargs, out, name)
            ins = {}
            stores = {}
            wargs = [self._in(a, ins, stores) for a in args]
            wkw = {k: self._in(v, ins, stores) for k, v in kwargs.items()} if kwargs else {}
            outer, self.current = self.current, ins
            try:
                out = self.dispatch(func, wargs, wkw)
            finally:
                self.current = outer
            return self._out(out, ins, stores)
        except Exception as e:
            if id(func) in self.direct:
                e = _structured_error(func, args, kwargs, e)
            # NOTE [user frames] (engine.py): the error ends in the user's frames, not the
            # router's (one deferfuse frame, this one, as on the wrapper subclass)
            raise user_error(e)

    def out_name(self, func):
        """The name of an op's one written argument when it is a keyword-only output (``out``, or
        ``grad_input`` of ``threshold_backward.grad_input``) and the op returns one value; else
        None (cached per op)."""
        n = self.out_names.get(func, False)
        if n is False:
            s = func._schema
            written = [a for a in s.arguments if a.alias_info is not None and a.alias_info.is_write]
            n = written[0].name if (len(written) == 1 and written[0].kwarg_only
                                    and len(s.returns) == 1) else None
            self.out_names[func] = n
        return n

    def functional_of(self, func):
        """The functional overload of an op whose one written argument is a keyword-only output
        (``add.out`` -> ``add.Tensor``, ``threshold_backward.grad_input`` -> its ``default``), or
        None (cached per op)."""
        f = self.functionals.get(func, False)
        if f is False:
            f = None
            s = func._schema
            name = self.out_name(func)
            if name is not None:
                want = [(a.name, str(a.type)) for a in s.arguments if a.name != name]
                ns, _, name = s.name.partition("::")
                packet = getattr(getattr(torch.ops, ns), name)
                for ov in packet.overloads():
                    o = getattr(packet, ov)
                    sc = o._schema
                    if (len(sc.returns) == 1 and all(a.alias_info is None for a in sc.arguments)
                            and [(a.name, str(a.type)) for a in sc.arguments] == want):
                        f = o
                        break
            self.functionals[func] = f
        return f

    def _into_fresh_out(self, f, args, kwargs, out, name="out"):
        """NOTE [fresh out]: PyTorch runs a structured op (``add``, ``mm``, ``sum``) on a backend as
        its meta function, an ``empty`` output on the device and the ``.out`` op. Recorded as an
        ``.out`` op, the op path would read the empty output as an input (an upload of zeros per
        op). An out tensor no Python code has seen (its storage holds no Storage yet) has nothing
        to keep: the functional op is recorded instead, and the out tensor's storage takes its
        result's Storage."""
        kw = {k: v for k, v in kwargs.items() if k != name}
        ins, stores = {}, {}
        wargs = [self._in(a, ins, stores) for a in args]
        wkw = {k: self._in(v, ins, stores) for k, v in kw.items()} if kw else {}
        res = self.dispatch(f, wargs, wkw)
        if (type(res) is TpuTensor and res.dtype == out.dtype and not res._chain
                and not res._dyn and id(res) not in ins):
            if res.shape != out.shape:
                torch.ops.aten.resize_.default(out, res.shape)     # numel 0 (PyTorch checked)
            if res.stride() == out.stride() and out.storage_offset() == 0:
                self.ext.set_storage(out, res._s)
                return out
        res = self._out(res, ins, stores)
        with torch.no_grad():
            return out.copy_(res)

    def multi_outs(self, func):
        """NOTE [fresh outs]: ``(names of the keyword-only outputs, functional op)`` of a
        structured op with several outputs (``max.dim_max``, ``topk.values``,
        ``nll_loss_forward.output``), or None (cached per op)."""
        got = self.multi.get(func, False)
        if got is False:
            got = None
            s = func._schema
            written = [a for a in s.arguments if a.alias_info is not None and a.alias_info.is_write]
            if len(written) > 1 and all(a.kwarg_only for a in written) \
                    and len(s.returns) == len(written):
                names = tuple(a.name for a in written)
                want = [(a.name, str(a.type)) for a in s.arguments if a.name not in names]
                ns, _, op = s.name.partition("::")
                packet = getattr(getattr(torch.ops, ns), op)
                for ov in packet.overloads():
                    o = getattr(packet, ov)
                    sc = o._schema
                    if (len(sc.returns) == len(names)
                            and all(a.alias_info is None for a in sc.arguments)
                            and [(a.name, str(a.type)) for a in sc.arguments] == want):
                        got = (names, o)
                        break
            self.multi[func] = got
        return got

    def _fresh_outs(self, func, args, kwargs):
        """NOTE [fresh outs]: NOTE [fresh out] for an op with several outputs: when every out=
        tensor is fresh (its storage holds no Storage yet: PyTorch's own empties for a structured
        op), the functional op is recorded and each out tensor takes its result's Storage (an
        out op would be an in-place write of each, which buckets refuse). None otherwise."""
        m = self.multi_outs(func)
        if m is None:
            return None
        names, f = m
        outs = [kwargs.get(n) for n in names]
        for o in outs:
            if (o is None or type(o) is TpuTensor or not self.is_plain(o)
                    or self.ext.storage(o) is not None):
                return None
        kw = {k: v for k, v in kwargs.items() if k not in names}
        ins, stores = {}, {}
        wargs = [self._in(a, ins, stores) for a in args]
        wkw = {k: self._in(v, ins, stores) for k, v in kw.items()} if kw else {}
        res = self.dispatch(f, wargs, wkw)
        if type(res) is not tuple and type(res) is not list or len(res) != len(outs):
            res = self._out(res, ins, stores)
            raise RuntimeError(f"{f} returned {type(res).__name__}, not {len(outs)} tensors")
        for r, o in zip(res, outs):
            if (type(r) is TpuTensor and r.dtype == o.dtype and not r._chain and not r._dyn
                    and id(r) not in ins):
                if r.shape != o.shape:
                    aten.resize_.default(o, r.shape)
                if r.stride() == o.stride() and o.storage_offset() == 0:
                    self.ext.set_storage(o, r._s)
                    continue
            with torch.no_grad():
                o.copy_(self._out(r, ins, stores))
        return tuple(outs)

    def resize_out(self, t, size, memory_format=None):
        """``specials.resize`` for an out= tensor of the wrong shape (route._resized): the plain
        tensor behind it is resized (the C++ ``resize_``), and ``t`` becomes its new wrapper."""
        got = self.current.get(id(t)) if self.current else None
        if got is None or got[0] is not t:
            return self.resize(t, size, memory_format)
        p = got[1]
        v = t._s.val
        if v.array is None and v.node is None and v.err is None:
            self.ext.set_storage(p, None)   # an empty value: nothing to keep, the storage may grow
        torch.ops.aten.resize_.default(p, size, memory_format=memory_format)
        self.rebind(t, self.wrapper(p))
        return t

    # -- the C++ recording kernel's two callbacks (NOTE [C++ recording kernel] in _tpu_tensor.cpp)

    def plan(self, func):
        """Whether the kernel may take ``func`` (its route is dispatch._run or an in-place
        foreach op's, it draws no random numbers, and a ``.out`` op's out= is its last argument),
        as ``(index of out or -1, [a Python number at this argument is a runtime input],
        whether each call is checked as NOTE [C++ foreach] says, the indexes of several out=
        tensors (NOTE [fresh outs]) or (), its NOTE [C++ value checks] entry or None)``, or
        None. Called once per op, after its first call through the router. Fresh out= tensors are
        keyed as the functional op's call (NOTE [fresh out]), any other as the op's own."""
        from . import dispatch, route
        args = func._schema.arguments
        out, f, outs = -1, func, ()
        name = self.out_name(func)
        if name is not None:
            out = next(i for i, a in enumerate(args) if a.name == name)
            if out != len(args) - 1:
                return None
            f = self.functional_of(func) or func
        else:
            m = self.multi_outs(func)
            if m is not None:
                # NOTE [fresh outs]: the out= tensors, the last arguments (keyword-only)
                outs = tuple(i for i, a in enumerate(args) if a.name in m[0])
                if outs != tuple(range(len(args) - len(outs), len(args))):
                    return None
                f = m[1]
        r = _kernel_route(f)
        # NOTE [C++ foreach] in _tpu_tensor.cpp: an in-place foreach op is dispatch._run once
        # the kernel checked the call as specials._h_foreach_inplace does
        foreach = r[0] is route._foreach
        if r[0] is not dispatch._run and not foreach:
            return None
        info = r[1]
        if info.low.rng:
            return None
        guard = self.guards.get(id(func))
        check = guard[0] if guard is not None else None     # NOTE [C++ value checks]
        if info.low.static:
            return out, [False] * len(args), foreach, outs, check
        return out, [(a.name in info.scalar_kw) if a.kwarg_only else (i in info.scalar_pos)
                     for i, a in enumerate(args)], foreach, outs, check

    def learn(self, func, args, kwargs, fresh, result):
        """The op cache's Entry the op path used for this call (the router ran it just now), as
        ``(Entry, tensor inputs, scalar inputs)`` when the kernel can record its hits: an Entry
        with new outputs only (``Entry.fast``; a tuple or a list of them, None where the router
        returned None: an ``output_mask`` False), no dynamic offsets, output metadata equal to the
        router's result; or, for an op writing its inputs (in place, out=, in-place foreach),
        ``(Entry, tensor inputs, scalar inputs, Entry.out[1], OpInfo.overwrites, the stack index
        of the argument it returns or -1 when it returns nothing)``; either followed by each tensor input's dynamic offsets (``_dyn``), which
        the kernel checks against the starts it left out of its key (NOTE [C++ moving windows]
        in _tpu_tensor.cpp). None otherwise (the kernel then leaves the key to the router)."""
        from . import dispatch, route
        f, kw = func, kwargs
        if fresh:
            name = self.out_name(func)
            if name is not None:
                f = self.functional_of(func)
                kw = {k: v for k, v in kwargs.items() if k != name}
            else:       # NOTE [fresh outs]: several
                m = self.multi_outs(func)
                f = m[1] if m is not None else None
                kw = {k: v for k, v in kwargs.items() if m is None or k not in m[0]}
        if f is None:
            return None
        r = _kernel_route(f)
        if r[0] is not dispatch._run and r[0] is not route._foreach:
            return None
        if f is aten.copy_.default:
            args, kw = args[:2], {}     # as specials._h_copy runs it (non_blocking dropped)
        elif f is aten._to_copy.default:
            # as specials._h_to_copy runs a cast on the tensor's own device (the kernel keys no
            # other, NOTE [C++ factories] in _tpu_tensor.cpp): dtype and memory_format, in the
            # call's order, the dtype named
            dtype = kw.get("dtype") or args[0].dtype
            kw = {k: v for k, v in kw.items() if k in ("dtype", "memory_format")}
            kw["dtype"] = dtype
            args = args[:1]
        ins, stores = {}, {}
        try:
            wargs = [self._in(a, ins, stores) for a in args]
            wkw = {k: self._in(v, ins, stores) for k, v in kw.items()}
            key, tensors, scalars, _ = dispatch.op_key(r[1], wargs, wkw)
        except Exception:
            return None
        e = dispatch._ops.get(key)
        if type(e) is not dispatch.Entry or e.out[2]:
            return None
        dyn = tuple(t._dyn for t in tensors)
        if e.fast is None:
            info = r[1]
            mut = e.out[1]
            if not mut or info.kind not in ("self_mut", "func_mut"):
                return None
            if not info.returns:        # "-> ()": the in-place foreach ops (NOTE [C++ foreach])
                ret = -1
            elif len(info.returns) != 1 or info.returns[0] is None:
                return None
            else:
                ret = info.returns[0][0]
            return (e, len(tensors), len(scalars), tuple(mut), bool(info.overwrites), ret, dyn)
        if type(e.fast) is tuple:
            metas, res = [e.fast], [result]
        elif (e.out[0][0] == "tuple" and type(result) is tuple
              or e.out[0][0] == "list" and type(result) is list):
            metas, res = e.fast, list(result)
        else:
            return None
        if len(metas) != len(res):
            return None
        for m, t in zip(metas, res):
            if m is None and t is None:     # an output_mask False (linear_backward): None there
                continue
            if (m is None or not isinstance(t, torch.Tensor) or not self.is_plain(t)
                    or t.dtype != m[0] or tuple(t.shape) != m[1]
                    or t.stride() != (m[2] or _contig(m[1])) or t.storage_offset() != 0):
                return None
        return e, len(tensors), len(scalars), dyn

    @staticmethod
    def run_hit(entry, ins, scalars, dev):
        """NOTE [C++ strict hits] in _tpu_tensor.cpp: a kernel hit in strict mode, run now as
        ``dispatch._run`` runs it (``engine.run_node``), the outputs' Storages returned (None for
        a None output), as ``record_storages`` returns them; NotImplemented in another mode or on
        any error, before anything is bound (the router then runs the op again and raises as the
        op path does). A signal arriving meanwhile is delivered when it returns, as in
        ``route.torch_dispatch`` (NOTE [interrupt safety])."""
        if _local.ts.mode != "strict":
            return NotImplemented
        with engine.interrupts:
            try:
                outs = engine.run_node(entry, ins, scalars, dev)
            except Exception:
                return NotImplemented
        return tuple([None if m is None else Storage(v, dev, m[0], m[2])
                      for m, v in zip(entry.made, outs)])

    def mixed(self, entry, cls, func, types, args, kwargs):
        """NOTE [mixed arguments]: an op reaching ``TpuTensor.__torch_dispatch__`` with a plain tpu
        tensor among its arguments (a tensor a factory made inside the op path: a decomposition's
        ``torch.empty(device="tpu")``, a lowered factory's result, beside ``TpuTensor``s). The op
        path reads every argument that is not a ``TpuTensor`` as a CPU tensor (silent garbage: its
        data pointer is the storage record), so each plain argument becomes its ``TpuTensor`` over
        the same Storage, and a result that is one of those becomes the plain argument again
        (``copy_`` returns its ``self``). Other results stay ``TpuTensor``s: the caller is inside
        the op path, and the router converts what reaches the user."""
        ins, stores = {}, {}
        wargs = tuple(self._in(a, ins, stores) for a in args)
        wkw = {k: self._in(v, ins, stores) for k, v in kwargs.items()} if kwargs else kwargs
        outer = self.current
        self.current = {**outer, **ins} if outer else ins
        try:
            out = entry(cls, func, types, wargs, wkw)
        finally:
            self.current = outer
        return self._back(out, ins)

    def _back(self, o, ins):
        if type(o) is TpuTensor:
            got = ins.get(id(o))
            return got[1] if got is not None and got[0] is o else o
        if type(o) is list or type(o) is tuple:
            return type(o)(self._back(x, ins) for x in o)
        return o

    def has_plain(self, args, kwargs) -> bool:
        """Whether a plain tpu tensor is among ``args``/``kwargs`` (tensor lists included)."""
        is_plain = self.is_plain
        for a in (args if not kwargs else (*args, *kwargs.values())):
            ta = type(a)
            if ta is TpuTensor:
                continue
            if ta is list or ta is tuple:
                for x in a:
                    if type(x) is not TpuTensor and isinstance(x, torch.Tensor) and is_plain(x):
                        return True
            elif isinstance(a, torch.Tensor) and is_plain(a):
                return True
        return False

    # -- storage hooks (NOTE [plain storage hooks] in _tpu_tensor.cpp)

    def grow(self, st: Storage, n: int) -> Storage:
        """A Storage of ``n`` elements holding ``st``'s elements first and zeros after (where CPU
        leaves them uninitialised): ``resize_`` past the end of a storage holding a value."""
        v = st.val
        if v.nbytes == 0 and any(v.shape):
            raise RuntimeError("resize_ of a tensor whose storage was freed with "
                               "untyped_storage().resize_(0) (NOTE [storage resize])")
        shape = v.shape
        base = make(st, (), shape, st.stride or _contig(shape), 0, st.dtype)
        cap = 1
        for s in shape:
            cap *= s
        with torch.no_grad():
            flat = aten.as_strided.default(base, (cap,), (1,), 0)
            grown = aten.cat.default([flat, aten.zeros.default(
                (n - cap,), dtype=st.dtype, device=base.device)])
        grown = self.wrapper(grown) if type(grown) is not TpuTensor else grown
        return grown._s

    @staticmethod
    def freed(st: Storage, free: bool) -> None:
        """``untyped_storage().resize_`` to 0 (``free``) or back to its bytes (NOTE [storage
        resize] in storage.py): the value is dropped, or an empty one of the base's shape."""
        v = st.val
        if free:
            if v.nbytes:
                st.val = Value(v.shape, v.dtype, 0)
        elif v.nbytes == 0:
            st.val = transfer.empty_value(v.shape, st.dtype)

    # -- plain -> TpuTensor

    def _in(self, a, ins, stores):
        if isinstance(a, torch.Tensor):
            if type(a) is TpuTensor or not self.is_plain(a):
                return a
            w = self.wrapper(a)
            ins[id(w)] = (w, a)
            stores.setdefault(id(w._s), a)
            return w
        if type(a) is list or type(a) is tuple:
            if a and any(isinstance(x, torch.Tensor) for x in a):
                return self._in_list(a, ins, stores)
        return a

    def _in_list(self, a, ins, stores):
        """``_in`` of each item of a tensor list (a foreach op's lists: every parameter of an
        optimizer group, several lists an op), with ``wrapper``'s cache hit inlined (NOTE [plain
        wrapper cache]): the same checks, without two calls per item."""
        out = []
        append = out.append
        T, is_plain, state, sig, cache = torch.Tensor, self.is_plain, self.ext.state, \
            self.ext.sig, self.wrappers
        for x in a:
            if type(x) is TpuTensor or not isinstance(x, T) or not is_plain(x):
                append(x if type(x) is not list and type(x) is not tuple
                       else self._in(x, ins, stores))
                continue
            got = cache.get(id(x))
            w = None
            if got is not None:
                st = state(x)[0]
                w = got[1]
                if (got[2] is st and st is not None and w._s is st and got[3] == sig(x)
                        and w._sig == got[4] and got[0]() is x):
                    self.wrapper_hits += 1
                else:
                    w = None
            if w is None:
                w = self.wrapper(x)
            ins[id(w)] = (w, x)
            stores.setdefault(id(w._s), x)
            append(w)
        return out if type(a) is list else tuple(out)

    def storage(self, p, st=None) -> Storage:
        """The Storage of plain tensor ``p``: the one its DataPtr context holds (``st`` when the
        caller read it), made on first use (an uninitialised value of its base tensor's shape, as
        ``torch.empty`` makes)."""
        if st is None:
            st = self.ext.storage(p)
        if st is None:
            size, stride, dtype = self.ext.base(p)
            st = Storage(transfer.empty_value(size, dtype), p.device.index or 0, dtype,
                         None if stride == _contig(size) else stride)
            self.ext.set_storage(p, st)
        return st

    def lazy_storage(self, v: Value, dev: int, dtype, stride) -> Storage:
        """NOTE [lazy storages] in _tpu_tensor.cpp: the Storage of a kernel hit's output made on
        its first reader's ask, as ``record_storages`` would have made it at the hit, and kept
        among the storages its pending value's trace reads back (under the engine's lock: that
        trace may be taking its outputs on another thread). A value in flight (NOTE [in flight])
        or no longer pending needs no trace's."""
        st = Storage(v, dev, dtype, stride)
        if v.node is not None:
            with engine.lock:
                n = v.node
                if n is not None:
                    storages = getattr(n.trace, "storages", None)    # a Job's: no trace's
                    if storages is not None:
                        storages.append(st.wr)
        return st

    def chain(self, p, st: Storage, raw=False, base=False) -> tuple:
        """``p``'s view chain in the Python path's form: (OpOverload, args, kwargs) steps (``raw``,
        ``base``: what ``ext.state`` read, when the caller has it)."""
        if raw is False:
            _, raw, base = self.ext.state(p)
        if raw is None:
            if base:
                return ()
            # PyTorch's own alias of the storage (a composite kernel's): one as_strided step
            b = self.ext.base(p)
            return ((aten.as_strided.default,
                     (tuple(p.shape), tuple(p.stride()), p.storage_offset(), st.val.shape,
                      b[1] if b else _contig(st.val.shape)), ()),)
        if type(raw) is tuple:
            return raw
        steps = []
        for item in raw:
            if type(item) is tuple and (not item or type(item[0]) is tuple):
                steps.extend(item)      # the steps set from Python, before the C++ ones
                continue
            name, args = item
            op = self.steps.get(name)
            if op is None:
                p_, _, ov = name.partition(".")
                op = self.steps[name] = getattr(getattr(aten, p_), ov)
            steps.append((op, tuple(_static(x) for x in args), ()))
        return tuple(steps)

    def wrapper(self, p) -> TpuTensor:
        """A TpuTensor over ``p``'s Storage with ``p``'s view chain and geometry.

        NOTE [plain wrapper cache]: the router wraps every plain argument of every routed op, and
        an optimizer's foreach ops pass the same parameters and states (lists of every parameter)
        each step: a wrapper (``make``) costs about 3 µs, four fifths of the router's time on a
        training step. So the wrapper of each plain tensor is kept while it still stands for the
        tensor: the same Storage in its DataPtr context, the same C++ signature id (which names
        the base geometry, the view steps and the tensor's own sizes, strides, offset and dtype),
        and not rebound by the op path since (``specials.rebind``, ``set_``, ``as_strided_`` set
        ``_s`` and ``_sig`` together). Keyed by the tensor's id, with a weak reference whose
        callback drops the entry when the tensor dies (so an id is never matched by another
        tensor, and a dead tensor's Storage is not kept); tensors without a C++ signature (Python
        view steps) are not kept. Bounded (cleared when full, counted)."""
        st, raw, base = self.ext.state(p)
        cid = self.ext.sig(p)
        k = id(p)
        got = self.wrappers.get(k)
        if got is not None:
            w = got[1]
            if (got[2] is st and st is not None and got[3] == cid and w._s is st
                    and w._sig == got[4] and got[0]() is p):
                self.wrapper_hits += 1
                return w
        t = self._wrap(p, st, raw, base, cid)
        if cid >= 0:
            self.wrapper_misses += 1
            ws = self.wrappers
            if len(ws) >= self.wrapper_limit:
                ws.clear()
                self.wrapper_clears += 1
            ref = _weakref(p, lambda r, k=k, ws=ws: ws.get(k, (None,))[0] is r and ws.pop(k))
            ws[k] = (ref, t, t._s, cid, t._sig)
        return t

    def _wrap(self, p, st, raw, base, cid) -> TpuTensor:
        """A new TpuTensor for ``p`` (``wrapper`` without its cache)."""
        st = self.storage(p, st)
        sig = self.sigs.get(cid) if cid >= 0 else None
        if base:
            t = make(st, (), p.shape, p.stride(), 0, p.dtype, sig)
        else:
            mv = self.moving.get(cid) if cid >= 0 else None
            if mv is None:
                mv = self._moving(p, st, self.chain(p, st, raw, base), cid)
            t = make(st, mv[0], p.shape, p.stride(), p.storage_offset(), p.dtype, mv[1])
            if mv[2]:
                t._dyn = mv[2]
            return t
        if sig is None and cid >= 0:
            if len(self.sigs) >= self.sig_limit:
                self.sigs.clear()
                self.sig_clears += 1
            self.sigs[cid] = t._sig
        return t

    def _moving(self, p, st: Storage, chain: tuple, cid: int) -> tuple:
        """NOTE [plain moving windows]: ``(view chain, signature, dynamic offsets)`` of the
        TpuTensor for view ``p``. The C++ view kernels record static steps (``t[i:i + 5]`` names
        ``i``), so the op path would see a new signature, and compile a new program, per offset.
        The chain is replayed here through the op path's view route from the base, which writes
        a window that moves as a dynamic step (NOTE [dynamic offsets]) with its offset a runtime
        input, as a TpuTensor view gets it. Cached by C++ signature id (a function of the base
        geometry and the static steps, so of the result; bounded, cleared when full). A chain the
        view route cannot replay, or whose replay differs in geometry, stays static."""
        from . import route
        got = None
        if chain and any(s[0] in _MOVING_OPS for s in chain):
            try:
                size, stride, dtype = self.ext.base(p)
                t = make(st, (), size, stride, 0, dtype)
                for op, args, kw in chain:
                    if op is aten.as_strided.default:
                        args = args[:3]
                    r = route._routes.get(id(op))
                    if r is None:
                        r = route._routes[id(op)] = route._route(op)
                    t = r[0](op, r[1], (t, *args), dict(kw))
                if (type(t) is TpuTensor and t.shape == p.shape and t.stride() == p.stride()
                        and t.storage_offset() == p.storage_offset() and t.dtype == p.dtype):
                    got = (t._chain, t._sig, t._dyn)
            except Exception:
                got = None
        if got is None:
            got = (chain, sig_id((st.val.shape, st.dtype, chain, tuple(p.shape), p.stride(),
                                  p.dtype)), ())
        if cid >= 0:
            if len(self.moving) >= self.sig_limit:
                self.moving.clear()
                self.sig_clears += 1
            self.moving[cid] = got
        return got

    # -- TpuTensor -> plain

    def _out(self, o, ins, stores):
        if type(o) is TpuTensor:
            got = ins.get(id(o))
            if got is not None and got[0] is o:
                return got[1]
            return self.plain(o, stores)
        if type(o) is list or type(o) is tuple:
            return type(o)(self._out(x, ins, stores) for x in o)
        return o

    def plain(self, w: TpuTensor, stores=None):
        """A plain tensor for the TpuTensor ``w``: a base over a new storage, or a view of a known
        plain tensor's storage."""
        ext = self.ext
        st = w._s
        size, stride, off = tuple(w.shape), tuple(w.stride()), w.storage_offset()
        chain = w._chain
        if w._dyn:
            chain = _static_chain(chain, w._dyn)
        of = stores.get(id(st)) if stores else None
        if of is None:
            if not chain and off == 0:
                return ext.make_base(size, stride, w.dtype, st.device, st)
            bshape = st.val.shape
            of = ext.make_base(bshape, st.stride or _contig(bshape), st.dtype, st.device, st)
            if stores is not None:
                stores[id(st)] = of
        if w.dtype != of.dtype:     # a dtype view (view_as_real, view(dtype)): its own dtype
            return ext.make_view(of, size, stride, off, chain, w.dtype)
        return ext.make_view(of, size, stride, off, chain)


def _structured_error(func, args, kwargs, e: Exception) -> Exception:
    """NOTE [functional direct]: the error of a functional overload that reached the router whole
    and failed in the op path, as PyTorch's structured path gives it: that path (its C++ meta
    function, then the ``.out`` op through the router, as with the setting off) runs on the same
    arguments, so a check the meta function makes raises with its type and message, where the op
    path's Python reference raised another (``nll_loss``'s AssertionError for a weight of the
    wrong size). ``e`` when that path raises nothing (its ``.out`` op ran: no meta check fired)."""
    try:
        with torch.no_grad():
            func._op_dk(_NONFUNCTIONAL, *args, **kwargs)
    except Exception as s:
        return s
    return e


def _meta_check(func, check, args, kwargs) -> None:
    """NOTE [functional direct]: the checks of a direct overload's C++ meta function that the op
    path's Python reference lacks: the router's side of the kernel's per-call check of a number's
    value (NOTE [C++ value checks]), and the dtypes the meta function refuses (``_DTYPE_CHECKS``).
    A call that fails one raises as PyTorch's structured path raises it (its C++ meta function,
    run by ``_structured_error``)."""
    value, dtypes = check
    bad = False
    if value is not None and len(args) > max(value[1], value[2]):
        kind, i, j = value
        v = args[i]
        if kind == 1:
            base = args[0]
            bad = (isinstance(base, torch.Tensor) and not base.dtype.is_floating_point
                   and not base.dtype.is_complex and type(v) is int and v < 0)
        else:
            bad = args[j] is True and type(v) in (int, float) and v < 0
    if not bad and dtypes:
        bad = any(isinstance(a, torch.Tensor) and a.dtype in dtypes for a in args)
    if bad:
        e = _structured_error(func, args, kwargs, None)
        if e is not None:
            raise e


def _alpha_check(args, kwargs) -> None:
    """NOTE [functional direct]: ``add``/``sub``'s alpha check that their C++ meta function makes
    (``alpha_check``) and their Python reference does not: a bool alpha needs a bool result."""
    alpha = kwargs.get("alpha")
    if type(alpha) is bool and torch.result_type(args[0], args[1]) is not torch.bool:
        raise RuntimeError("Boolean alpha only supported for Boolean results.")


def _kernel_route(f):
    """``route._routes``' entry for ``f`` (made on first use), as the C++ kernel sees it: a
    ``copy_`` between two tpu tensors of one device (the only ``copy_`` the kernel keys: a CPU
    source or another device is not a plain tensor of the call's device) is
    ``specials._h_copy``'s last step, ``dispatch._run`` of the lowered ``copy_``; a ``_to_copy``
    of a tpu tensor to its own device (the only one the kernel keys, NOTE [C++ factories] in
    _tpu_tensor.cpp) is ``specials._h_to_copy``'s last step, ``dispatch._run`` of ``_to_copy``."""
    from . import dispatch, route
    if f is aten.copy_.default or f is aten._to_copy.default:
        return dispatch._run, dispatch.op_info(f)
    r = route._routes.get(id(f))
    if r is None:       # the functional op not called yet (an out= op's first calls)
        r = route._routes[id(f)] = route._route(f)
    return r


def _static_chain(chain, dyn) -> tuple:
    """A chain with its dynamic steps (NOTE [dynamic offsets] in runtime/viewchain.py) at the
    offsets ``dyn`` written as the static view steps they stand for."""
    out, k = [], 0
    for step in chain:
        kind, args = step[0], step[1]
        if kind == DSELECT:
            out.append((aten.select.int, (args[0], dyn[k]), ()))
            k += 1
        elif kind == DSLICE:
            dim, length, st = args
            out.append((aten.slice.Tensor, (dim, dyn[k], dyn[k] + length * st, st), ()))
            k += 1
        elif kind == DSTRIDED:
            out.append((aten.as_strided.default, (args[0], args[1], dyn[k], args[2], args[3]), ()))
            k += 1
        else:
            out.append(step)
    return tuple(out)


PLAIN: Plain | None = None


def route_whole(composites=()) -> int:
    """NOTE [whole ops]: an aten op with a CompositeExplicitAutograd kernel reaches TpuTensor's
    ``__torch_dispatch__`` whole (the Python key is above that kernel), but on a plain tensor the
    backend key runs it: convolution became PrivateUse1's ``convolution_overrideable``, which the
    op path has no lowering for, and ``native_group_norm`` PyTorch's math version, not the op
    path's (CPU's bits). Each such op without a PrivateUse1 kernel of its own goes to the router
    whole, as it reaches the op path today. Called last in device registration (after the
    factories' kernels); the number of ops. (Structured ops' CompositeExplicitAutogradNonFunctional
    kernels stay: they reach the router as ``.out`` ops, NOTE [fresh out].) ``composites``:
    CompositeImplicitAutograd ops whose AutogradPrivateUse1 kernel runs them whole below
    autograd (``linear``, NOTE [whole composites] in device.py), which the op path takes whole."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    names = list(composites)
    for n in torch._C._dispatch_get_all_op_names():
        if n.startswith("aten::") and not has(n, "PrivateUse1") and (
                has(n, "CompositeExplicitAutograd") or _nonfunctional_composite(n)):
            op, _, ov = n[6:].partition(".")
            # an op with a device= argument reaches PrivateUse1 for a CPU input too
            # (``_to_copy(cpu, device="tpu")``): its composite kernel runs, as today
            if not any(a.name == "device" for a in torch._C._get_schema("aten::" + op, ov).arguments):
                names.append(n[6:])
    # NOTE [plain _to_copy]: a cast or move of a tpu tensor is one op (specials._h_to_copy), not
    # its composite's empty + copy_ (an in-place write, which refuses buckets); a CPU input
    # reaching it (``_to_copy(cpu, device="tpu")``) runs the composite (Plain.route)
    names.extend(_DEVICE_WHOLE)
    direct = functional_direct()
    PLAIN.direct = frozenset(id(_overload(n)) for n in direct)
    PLAIN.guards = {id(_overload(n)): (_VALUE_CHECKS.get(n), _DTYPE_CHECKS.get(n, ()))
                    for n in direct if n in _VALUE_CHECKS or n in _DTYPE_CHECKS}
    names.extend(direct)
    names = [n for n in names if n not in _CXX_VIEWS and n + ".default" not in _CXX_VIEWS]
    PLAIN.ext.route_whole(names)
    return len(names)


def _overload(name: str):
    op, _, ov = name.partition(".")
    return getattr(getattr(aten, op), ov or "default")


def functional_direct() -> list:
    """NOTE [functional direct]: the names of ``FUNCTIONAL_DIRECT`` that are still structured
    functional overloads without a PrivateUse1 kernel (a C++ Meta kernel and PyTorch's
    CompositeExplicitAutogradNonFunctional one), looked up defensively: an overload another torch
    lacks or changed is left to its structured path. Empty when ``config.functional_direct`` is
    off."""
    if not config.functional_direct:
        return []
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    out = []
    for n in FUNCTIONAL_DIRECT:
        q = "aten::" + n
        try:
            if (has(q, "PrivateUse1") or not has(q, "CompositeExplicitAutogradNonFunctional")
                    or "RegisterMeta" not in torch._C._dispatch_dump(q)):
                continue
        except RuntimeError:
            continue
        out.append(n)
    return out


def _nonfunctional_composite(n: str) -> bool:
    """An op whose only composite kernel is a CompositeExplicitAutogradNonFunctional one that is not
    a structured op's (those have a C++ Meta kernel and reach the router as ``.out`` ops, NOTE
    [fresh out]): ``select_backward``, ``select_scatter``, ``slice_scatter``, ``diag_embed``,
    ``pixel_shuffle`` ... (NOTE [whole ops]: the wrapper receives them whole; decomposed here,
    ``select_backward`` recorded ``zeros`` and a copy through a ``select`` view, two ops)."""
    return (torch._C._dispatch_has_kernel_for_dispatch_key(n, "CompositeExplicitAutogradNonFunctional")
            and "RegisterMeta" not in torch._C._dispatch_dump(n))


def install() -> Plain:
    """Register the C++ kernels, allocator and fallback (device.register, the plain tensor)."""
    global PLAIN
    from . import cxxext, plain_torch, route, specials
    ext = cxxext.require()
    # The op path's entry as a TpuTensor op reaches it: the C record path first (NOTE [C record
    # path] in _fastpath.c), which hands what it does not take to ``dispatch``'s Python path.
    raw = TpuTensor.__dict__["__torch_dispatch__"].__func__
    types = (TpuTensor,)

    fake_mode, real = torch._C._get_dispatch_mode, plain_torch.real_ops
    FAKE = torch._C._TorchDispatchModeKey.FAKE

    def c_dispatch(func, args, kwargs):
        if fake_mode(FAKE) is not None:     # NOTE [real ops under a fake mode] (plain_torch.py)
            return real(raw, func, types, args, kwargs)
        return raw(TpuTensor, func, types, tuple(args), kwargs)
    PLAIN = Plain(ext, c_dispatch)
    has_plain, mixed = PLAIN.has_plain, PLAIN.mixed

    def checked(cls, func, types, args=(), kwargs=None):
        # NOTE [mixed arguments]
        if has_plain(args, kwargs):
            return mixed(raw, cls, func, types, args, kwargs)
        return raw(cls, func, types, args, kwargs)
    TpuTensor.__torch_dispatch__ = classmethod(checked)
    from . import tensor
    tensor.PLAIN.is_plain, tensor.PLAIN.wrapper, tensor.PLAIN.storage = \
        ext.is_plain, PLAIN.wrapper, PLAIN.storage
    PLAIN.resize, PLAIN.rebind = specials.resize, specials.rebind
    # out= tensors of the wrong shape are resized on the plain tensor (NOTE [plain router])
    route.resize = PLAIN.resize_out
    # and resize_/resize_as_ called by a decomposition on the router's wrappers (PyTorch's
    # _maybe_resize_out on arange's out=): the plain tensor is resized, not only its wrapper
    specials.resize = PLAIN.resize_out
    from .tensor import _DEVICES
    ext.install(PLAIN.route, PLAIN.resolve, len(_DEVICES))
    if KERNEL:
        # NOTE [C++ recording kernel]: cache hits recorded in C++; its table holds Entries, so it
        # is dropped with the per-op programs (NOTE [JIT mappings])
        from . import _fastpath
        from .engine import engine
        ext.install_kernel(PLAIN.plan, PLAIN.learn, _fastpath.record_storages, PLAIN.storage)
        # NOTE [C++ node hand-over] in _fastpath.c: the kernel calls record_storages' body in C
        ext.install_record_capi(_fastpath.record_capi)
        ext.install_strict(PLAIN.run_hit)      # NOTE [C++ strict hits] in _tpu_tensor.cpp
        if LAZY:    # NOTE [lazy storages] in _tpu_tensor.cpp
            ext.install_lazy(PLAIN.lazy_storage)
            engine.lazy_outputs = ext.lazy_outputs
        engine.runner.also_evict = (*engine.runner.also_evict, ext.kernel_clear)
        # deferfuse.clear_caches() drops the op cache and the OpInfos its Entries name: the kernel's
        # Entries go with them (a hit on a stale Entry recorded ops under OpInfos no new region
        # shares: "the closest one has aten.mul.Tensor where this has aten.mul.Tensor", a
        # compile per call and no buckets after a clear_caches)
        clear = engine.clear_caches

        def clear_caches():
            clear()
            ext.kernel_clear()
            PLAIN.moving.clear()
        engine.clear_caches = clear_caches
    ext.set_storage_hooks(PLAIN.grow, PLAIN.freed)
    import ctypes
    import deferfuse_autoload
    lib = deferfuse_autoload.LOADER.hooks_lib
    if lib is not None:     # the C++ hooks: untyped_storage().resize_ (FSDP2)
        lib.deferfuse_set_storage_resize(ctypes.c_void_p(ext.storage_resize_address()))
    plain_torch.serialization()
    plain_torch.sparse_refusals()
    plain_torch.host_reads(PLAIN.is_plain)
    PLAIN.attn_lib = plain_torch.packed_kernels(PLAIN.route)
    from .distributed import group
    group.plain_collectives()
    return PLAIN


def is_tpu(t) -> bool:
    """A plain tpu tensor (the autograd wrappers' test of what is on tpu)."""
    return PLAIN is not None and isinstance(t, torch.Tensor) and PLAIN.is_plain(t)
