"""JAX functions as PyTorch ops: ``@deferfuse.jax_op("mylib::name")``.

A JAX function becomes a ``torch.library`` custom op callable on ``tpu`` tensors in every mode: it
is a lowering like any aten op's (fused into defer regions and compiled graphs), its fake
implementation comes from ``jax.eval_shape``, and its backward from ``jax.vjp`` (another custom op,
lowered the same way) unless one is given. On CPU tensors it runs the same JAX function on the CPU
(through numpy), so a model with the op swapped in still runs, and compares, on CPU.

    @deferfuse.jax_op("mylib::rms_norm", static=("eps",))
    def rms_norm(x, w, eps=1e-6):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + eps)).astype(x.dtype) * w

Tensor arguments are the function's positional parameters without defaults; ``static`` names
the non-tensor ones (numbers, bools, tuples of ints), baked into the program as ``jax.jit``'s
static arguments are (each new value compiles again). Pallas kernels work the same way
(``interpret=True`` on a CPU-only machine).
"""
from __future__ import annotations

import inspect

import jax
import numpy as np
import torch

from .opinfo import clear
from .runtime.dtypes import TORCH_TO_NP, NP_TO_TORCH, numpy_to_torch, torch_to_numpy, x64
from .runtime.lowering import LOWERINGS, Lowering
from .runtime.lowering.padding import Refuse

_SCHEMA_TYPES = {bool: "bool", int: "int", float: "float", str: "str"}


def _static_type(default) -> str:
    if isinstance(default, (tuple, list)):
        return "int[]"
    return _SCHEMA_TYPES.get(type(default), "float")


def _on_cpu(fn, tensors, statics):
    """Run the JAX function on CPU tensors (the op's CPU kernel)."""
    arrays = [torch_to_numpy(t.detach().contiguous()) for t in tensors]
    with x64(True):
        out = fn(*arrays, **statics)
    if isinstance(out, (tuple, list)):
        return tuple(numpy_to_torch(np.asarray(o), NP_TO_TORCH[np.asarray(o).dtype]) for o in out)
    out = np.asarray(out)
    return numpy_to_torch(out, NP_TO_TORCH[out.dtype]).reshape(out.shape)


def jax_op(name: str, *, static=(), backward=None):
    """Decorator: the JAX function ``fn`` as the PyTorch custom op ``name`` ("namespace::op").
    ``backward(statics..., primals, cotangents) -> grads`` overrides the ``jax.vjp`` backward."""
    def deco(fn):
        params = list(inspect.signature(fn).parameters.values())
        tensors = [p.name for p in params if p.name not in static]
        statics = [p for p in params if p.name in static]
        outs = "Tensor"   # one tensor output; a tuple of outputs: Tensor[]
        tensor_args = [f"Tensor {t}" for t in tensors]
        static_args = [f"{_static_type(p.default)} {p.name}" for p in statics]
        defaults = ["" if p.default is inspect.Parameter.empty else f"={p.default!r}"
                    for p in statics]
        ns, _, opname = name.partition("::")
        lib = torch.library.Library(ns, "FRAGMENT")
        lib.define(f"{opname}({', '.join(tensor_args + [a + d for a, d in zip(static_args, defaults)])})"
                   f" -> {outs}")
        lib.define(f"{opname}_vjp({', '.join(tensor_args + ['Tensor cotangent'] + static_args)})"
                   " -> Tensor[]")
        op = getattr(getattr(torch.ops, ns), opname).default
        vjp_op = getattr(getattr(torch.ops, ns), opname + "_vjp").default

        def split(a, kw):
            t = list(a[:len(tensors)])
            s = {p.name: (a[len(tensors) + i] if len(a) > len(tensors) + i
                          else kw.get(p.name, p.default)) for i, p in enumerate(statics)}
            s = {k: (tuple(v) if isinstance(v, list) else v) for k, v in s.items()}
            return t, s

        def lowered(*a, **kw):
            t, s = split(a, kw)
            return fn(*t, **s)

        def vjp_lowered(*a, **kw):
            t = list(a[:len(tensors)])
            ct = a[len(tensors)]
            _, s = split(list(a[:len(tensors)]) + list(a[len(tensors) + 1:]), kw)
            if backward is not None:
                return list(backward(*t, ct, **s))
            _, pull = jax.vjp(lambda *xs: fn(*xs, **s), *t)
            return list(pull(ct.astype(fn_out_dtype(t, s))))

        def out_spec(t, s):
            with x64(True):     # as the lowering runs: a 64-bit result stays 64-bit
                return jax.eval_shape(lambda *xs: fn(*xs, **s), *t)

        def fn_out_dtype(t, s):
            return out_spec(t, s).dtype

        # NOTE [padding rules]: what padding would do to a user's function is unknown, so a
        # region where it touches a padded dim runs exactly.
        pad = Refuse("a user's JAX function (deferfuse.jax_op): what padding does to it is unknown")
        LOWERINGS[op] = Lowering(lowered, static=True, pad=pad)
        LOWERINGS[vjp_op] = Lowering(vjp_lowered, static=True, pad=pad)

        def fake(*a, **kw):
            t, s = split(a, kw)
            spec = out_spec([jax.ShapeDtypeStruct(tuple(x.shape), TORCH_TO_NP[x.dtype])
                             for x in t], s)
            return torch.empty(spec.shape, dtype=NP_TO_TORCH[np.dtype(spec.dtype)],
                               device=t[0].device)

        def fake_vjp(*a, **kw):
            return [torch.empty_like(x) for x in a[:len(tensors)]]

        def cpu(*a, **kw):
            t, s = split(a, kw)
            return _on_cpu(fn, t, s)

        def cpu_vjp(*a, **kw):
            t = list(a[:len(tensors)])
            _, s = split(t + list(a[len(tensors) + 1:]), kw)
            return list(_on_cpu(lambda *xs: vjp_lowered(*xs[:len(tensors)], xs[len(tensors)],
                                                        **s), t + [a[len(tensors)]], {}))

        lib.impl(opname, cpu, "CPU")
        lib.impl(opname + "_vjp", cpu_vjp, "CPU")
        torch.library.register_fake(op)(fake)
        torch.library.register_fake(vjp_op)(fake_vjp)

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs[:len(tensors)])
            ctx.statics = inputs[len(tensors):]

        def bwd(ctx, grad):
            grads = vjp_op(*ctx.saved_tensors, grad, *ctx.statics)
            return tuple(grads) + (None,) * len(ctx.statics)

        torch.library.register_autograd(op, bwd, setup_context=setup_context)
        _LIBS.append(lib)

        clear()
        # The op itself (an OpOverload): Dynamo captures a call of it into its graph, where a
        # Python wrapper in deferfuse's folder would be skipped (NOTE [dynamo skips deferfuse]).
        return op
    return deco


_LIBS: list = []    # the libraries holding the ops' definitions (they must stay alive)
