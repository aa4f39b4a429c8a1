"""Ops the op path runs as other ops of its own, then writes back or reads: every batch norm
variant and ``rrelu_with_noise`` (the lowered functional op, then the running statistics or the
noise written back), ``one_hot`` (its range check, as on CPU), ``equal``/``allclose`` (a Python
bool read back), ``_assert_async`` and ``_linalg_check_errors`` (CPU's error at the call), the
nested-tensor ops ``nn.TransformerEncoder`` asks for, and ops whose own CompositeExplicitAutograd
kernel runs on tpu tensors.

Apart from specials.py because none of them moves, allocates or rebinds a storage: specials.py
holds those (transfers, sync points, allocation, aliasing) and the table every handler is found
in; these are added to that table by ``register`` (device.register), as datadep.py's are.
"""
from __future__ import annotations

import torch

from .dispatch import _run, copy_into
from .engine import engine
from .opinfo import decompose, op_info
from .runtime.lowering import LOWERINGS
from .scheduler.policy import Sync
from .specials import _empty, register as add_specials

aten = torch.ops.aten


_BN_ARGS = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
# Batch norm variants: (their argument names, training (None: an argument), a reserve output).
_BN_VARIANTS = {
    aten.native_batch_norm.default: (_BN_ARGS, None, False),
    aten._native_batch_norm_legit.default: (_BN_ARGS, None, False),
    aten._native_batch_norm_legit.no_stats: (
        ("input", "weight", "bias", "training", "momentum", "eps"), None, False),
    aten._batch_norm_with_update.default: (
        ("input", "weight", "bias", "running_mean", "running_var", "momentum", "eps"), True, True),
}


def _h_batch_norm(func, args, kwargs):
    """Every batch norm variant runs the lowered functional op (CPU's statistics dtypes and
    shapes, deferfuse/meta.py), then writes the running statistics back in training mode
    (native_batch_norm writes them without an alias annotation)."""
    names, training, reserve = _BN_VARIANTS[func]
    a = dict(zip(names, args), **kwargs)
    if training is not None:
        a["training"] = training
    fn = aten._native_batch_norm_legit_functional.default
    if fn not in LOWERINGS:
        return decompose(func, args, kwargs)
    out, mean, invstd, new_mean, new_var = _run(
        fn, op_info(fn), tuple(a.get(n) for n in _BN_ARGS), {})
    if a["training"]:
        if a.get("running_mean") is not None:
            _write_stat(a["running_mean"], new_mean)
        if a.get("running_var") is not None:
            _write_stat(a["running_var"], new_var)
    if reserve:
        return out, mean, invstd, _empty((0,), torch.uint8, a["input"]._s.device)
    return out, mean, invstd


def _h_rrelu_with_noise(func, args, kwargs):
    """rrelu_with_noise writes ``noise`` in place and returns a new tensor (rrelu_with_noise_
    writes its input too, and returns it): run the lowered functional op, then write back (as
    batch norm's running statistics)."""
    fn = aten.rrelu_with_noise_functional.default
    out, noise = _run(fn, op_info(fn), args, kwargs)
    _write_stat(args[1], noise)
    if func is aten.rrelu_with_noise_.default:
        _write_stat(args[0], out)
        return args[0]
    return out


def _write_stat(dst, new) -> None:
    """``dst.copy_(new)``: a running statistic (a whole base tensor, as BatchNorm's buffers are)
    takes the new value itself, with no copy op recorded or run; anything else is copied."""
    if dst._chain or dst.dtype != new.dtype or dst.shape != new.shape or new._chain:
        copy_into(dst, new)
        return
    st = dst._s
    v = new._s.val
    if v.node is not None:
        v.node.trace.track_mut(st, v)
    st.val = v


def _h_one_hot(func, args, kwargs):
    """One op whose range check raises as on CPU (PyTorch's composite one_hot skips the check on
    PrivateUse1, so a class out of range gave a row of zeros). Without num_classes, the output's
    shape is max() + 1: a sync, as on every device."""
    x = args[0]
    n = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    if n == -1:
        if x.numel() == 0:
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
        n = int(aten.max.default(x).item()) + 1
    return _run(func, op_info(func), (x, n), {})


def _h_composite_explicit(func, args, kwargs):
    """An op whose only kernel is PyTorch's own CompositeExplicitAutograd one, written in ops
    that are lowered (the chunked linear_cross_entropy custom ops): that kernel itself, on tpu
    tensors, instead of a copy to CPU and back."""
    return func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **kwargs)


def _h_pack_padded_sequence(func, args, kwargs):
    """PyTorch's own kernel (CompositeExplicitAutograd): it reads the lengths (a CPU tensor) and
    cuts the tpu input with ordinary ops, so the packed data is on tpu and ``batch_sizes`` stays a
    CPU tensor, as ``PackedSequence`` requires (a CPU fallback brought both back to tpu)."""
    return func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **kwargs)


def _h_linalg_check_errors(func, args, kwargs):
    # LAPACK's info is checked on JAX (a flag), but PyTorch raises LinAlgError at the call on
    # every device (CUDA syncs for it), so code can catch it there: a sync point in defer mode.
    _run(func, op_info(func), args, kwargs)
    engine.sync(Sync.LINALG_CHECK, op=op_info(func).name)


def _h_equal(func, args, kwargs):
    a, b = args[0], args[1]
    if a.shape != b.shape:
        return False
    return bool(aten.eq.Tensor(a, b).all().item())


def _h_allclose(func, args, kwargs):
    a, b = args[0], args[1]
    rest = dict(zip(("rtol", "atol", "equal_nan"), args[2:]), **kwargs)
    return bool(aten.isclose.default(a, b, **rest).all().item())


def _h_assert_async(func, args, kwargs):
    """``torch._assert_async``: the element count is known here, so a tensor that is not one
    element raises CPU's error at once; the value is checked on the device (NOTE [device asserts]
    in runtime/lowering/reductions.py)."""
    n = args[0].numel()
    if n != 1:
        raise RuntimeError("Boolean value of Tensor with "
                           + ("no values" if n == 0 else "more than one value") + " is ambiguous")
    _run(func, op_info(func), args, kwargs)


def _h_not_left_aligned(func, args, kwargs):
    """``torch._nested_tensor_from_mask_left_aligned``: its one caller, ``nn.TransformerEncoder``,
    asks it whether to turn a padded batch into a nested tensor (eval, no_grad, a padding mask).
    tpu has no nested tensors, so the answer is False: PyTorch then runs its padded path, as CPU
    does for a mask that is not left-aligned. The valid positions are CPU's; the padded ones hold
    computed values where CPU's nested path gives zeros."""
    return False


def _h_nested_from_mask(func, args, kwargs):
    raise NotImplementedError(
        "nested tensors are not supported on the tpu device; nn.TransformerEncoder makes one in "
        "eval mode with a src_key_padding_mask when mask_check=False: keep mask_check=True (the "
        "default) or build it with enable_nested_tensor=False")


HANDLERS = {
    aten._linalg_check_errors.default: _h_linalg_check_errors,
    aten.equal.default: _h_equal,         # return a Python bool: computed on JAX, then read
    aten.allclose.default: _h_allclose,
    aten._assert_async.default: _h_assert_async,
    aten._assert_async.msg: _h_assert_async,
    aten.rrelu_with_noise.default: _h_rrelu_with_noise,
    aten.rrelu_with_noise_.default: _h_rrelu_with_noise,
    **{f: _h_batch_norm for f in _BN_VARIANTS},
    aten.one_hot.default: _h_one_hot,
    aten._pack_padded_sequence.default: _h_pack_padded_sequence,
    aten._nested_tensor_from_mask_left_aligned.default: _h_not_left_aligned,
    aten._nested_tensor_from_mask.default: _h_nested_from_mask,
}
for _name in ("_linear_cross_entropy_batch_chunked", "_linear_cross_entropy_batch_chunked_no_reduction"):
    _o = getattr(getattr(getattr(torch.ops, "torch_nn", None), _name, None), "default", None)
    if _o is None:
        try:    # registered when torch.nn.functional's linear_cross_entropy is first imported
            import torch.nn.modules.linear_cross_entropy  # noqa: F401
            _o = getattr(getattr(torch.ops.torch_nn, _name, None), "default", None)
        except (ImportError, AttributeError):
            _o = None
    if _o is not None:
        HANDLERS[_o] = _h_composite_explicit


def register() -> None:
    """Route the ops above to their handlers (specials.py's table)."""
    add_specials(HANDLERS)
