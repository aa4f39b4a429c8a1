"""The fused optimizer ops (``torch.optim.Adam``/``AdamW``/``SGD``/``Adagrad`` with ``fused=True``)
and ``torch.amp.GradScaler``'s two ops.

One op updates a whole parameter group: the lowering returns the new values of every list the op
writes (parameters, gradients, then the optimizer states), in the schema's order. Each element is
computed as PyTorch's CPU kernel does: the step's bias corrections in float64, half types in
float32, the first moment by ``lerp``, and nothing at all changed where ``found_inf`` is set (the
gradients stay scaled). ``grad_scale`` divides the gradients, and they are written back divided.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import op
from .padding import Refuse
from .foreach import _lerp, _up

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("an optimizer step: no padding rule")


def _is_zero(a) -> bool:
    return isinstance(a, (int, float)) and a == 0


def _double():
    """PyTorch's double for these coefficients: float64 (float32 where JAX runs without 64-bit
    types; deferfuse turns them on while it traces)."""
    return jax.dtypes.canonicalize_dtype(jnp.float64)


def _f64(x):
    """A scalar (a number, or a 0-d or one-element array) as a double."""
    return jnp.asarray(x, _double()).reshape(())


def _scaled(grads, grad_scale):
    """The gradients in compute precision, divided by ``grad_scale`` when given."""
    gs = [_up(g) for g in grads]
    if grad_scale is not None:
        gs = [g / grad_scale.reshape(()).astype(g.dtype) for g in gs]
    return gs


def _finish(new: list, old: list, found_inf) -> list:
    """``new`` in ``old``'s dtypes, or ``old`` itself where ``found_inf`` is set (AMP found an inf
    or a nan in the gradients: the step is skipped)."""
    new = [n.astype(o.dtype) for n, o in zip(new, old)]
    if found_inf is None:
        return new
    skip = found_inf.reshape(()) == 1
    return [jnp.where(skip, o, n) for n, o in zip(new, old)]


def _decayed(x, d, weight_decay, ct):
    """L2 weight decay folded into the gradient ``d`` (Adam, SGD, Adagrad)."""
    return d if _is_zero(weight_decay) else d + x * _f64(weight_decay).astype(ct)


def _adam(decoupled):
    def lower(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1,
              beta2, weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
        gs = _scaled(grads, grad_scale)
        lr, b1, b2, eps = _f64(lr), _f64(beta1), _f64(beta2), _f64(eps)
        new_p, new_m, new_v, new_mx = [], [], [], []
        for i, (p, g, m, v, step) in enumerate(zip(params, gs, exp_avgs, exp_avg_sqs,
                                                   state_steps)):
            ct = g.dtype
            x = _up(p)
            d = -g if maximize else g
            if not decoupled:
                d = _decayed(x, d, weight_decay, ct)
            elif not _is_zero(weight_decay):
                x = x * (1 - lr * _f64(weight_decay)).astype(ct)
            t = _f64(step)
            step_size = (lr / (1 - b1 ** t)).astype(ct)
            bc2_sqrt = jnp.sqrt(1 - b2 ** t).astype(ct)
            m = _lerp(m, d, (1 - b1).astype(ct))
            v = _up(v) * b2.astype(ct) + d * d * (1 - b2).astype(ct)
            if amsgrad:
                v_max = jnp.maximum(_up(max_exp_avg_sqs[i]), v)
                new_mx.append(v_max)
            denom = jnp.sqrt(v_max if amsgrad else v) / bc2_sqrt + eps.astype(ct)
            new_p.append(x - step_size * m / denom)
            new_m.append(m)
            new_v.append(v)
        return _finish(new_p + gs + new_m + new_v + new_mx,
                       [*params, *grads, *exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs], found_inf)
    return lower


op("_fused_adam_.default", "_fused_adam_.tensor_lr")(_adam(False))
op("_fused_adamw_.default", "_fused_adamw_.tensor_lr")(_adam(True))


@op("_fused_sgd_.default", "_fused_sgd_.tensor_lr")
def _fused_sgd_(params, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening,
                nesterov, maximize, is_first_step, grad_scale=None, found_inf=None):
    gs = _scaled(grads, grad_scale)
    lr, momentum, dampening = _f64(lr), _f64(momentum), _f64(dampening)
    new_p, new_buf = [], []
    for i, (p, g) in enumerate(zip(params, gs)):
        ct = g.dtype
        x = _up(p)
        d = _decayed(x, -g if maximize else g, weight_decay, ct)
        if momentum_buffer_list:        # empty exactly when momentum == 0
            mom = momentum.astype(ct)
            buf = d if is_first_step else (_up(momentum_buffer_list[i]) * mom
                                           + d * (1 - dampening).astype(ct))
            new_buf.append(buf)
            d = d + buf * mom if nesterov else buf
        new_p.append(x - d * lr.astype(ct))
    return _finish(new_p + gs + new_buf, [*params, *grads, *momentum_buffer_list], found_inf)


def _adagrad(steps_written):
    def lower(params, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps,
              maximize, grad_scale=None, found_inf=None):
        gs = _scaled(grads, grad_scale)
        lr, lr_decay, eps = _f64(lr), _f64(lr_decay), _f64(eps)
        new_p, new_s = [], []
        for p, g, s, step in zip(params, gs, state_sums, state_steps):
            ct = g.dtype
            x = _up(p)
            d = _decayed(x, -g if maximize else g, weight_decay, ct)
            clr = (lr / (1 + (_f64(step) - 1) * lr_decay)).astype(ct)
            s = _up(s) + d * d
            new_s.append(s)
            new_p.append(x - clr * d / (jnp.sqrt(s) + eps.astype(ct)))
        new, old = new_p + gs + new_s, [*params, *grads, *state_sums]
        if steps_written:       # the default overload's schema marks state_steps written
            new, old = new + list(state_steps), old + list(state_steps)
        return _finish(new, old, found_inf)
    return lower


op("_fused_adagrad_.default")(_adagrad(True))
op("_fused_adagrad_.tensor_lr")(_adagrad(False))


# --------------------------------------------------------------------------------------------
# torch.amp.GradScaler: unscale the gradients and flag infs; grow or back off the scale

@op("_amp_foreach_non_finite_check_and_unscale_.default")
def _amp_unscale_(grads, found_inf, inv_scale):
    """Each gradient times ``inv_scale`` (in float32 for half types); ``found_inf`` set to 1 where
    any gradient holds an inf or a nan, left as it was otherwise."""
    new, bad = [], jnp.zeros((), jnp.bool_)
    inv = inv_scale.reshape(())
    for g in grads:
        x = _up(g)
        bad = bad | ~jnp.all(jnp.isfinite(x))
        new.append((x * inv.astype(x.dtype)).astype(g.dtype))
    return new + [jnp.where(bad, jnp.ones_like(found_inf), found_inf)]


@op("_amp_update_scale_.default")
def _amp_update_scale_(scale, growth_tracker, found_inf, scale_growth_factor,
                       scale_backoff_factor, growth_interval):
    """After an inf: scale times the backoff factor, tracker reset. Otherwise the tracker counts
    the step, and at ``growth_interval`` steps the scale grows (if that stays finite)."""
    found = found_inf.reshape(scale.shape) != 0
    up = (scale.astype(_double()) * _f64(scale_growth_factor)).astype(scale.dtype)
    down = (scale.astype(_double()) * _f64(scale_backoff_factor)).astype(scale.dtype)
    succ = growth_tracker + 1
    grow = succ == growth_interval
    new_scale = jnp.where(found, down, jnp.where(grow & jnp.isfinite(up), up, scale))
    new_tracker = jnp.where(found | grow, jnp.zeros_like(succ), succ).astype(growth_tracker.dtype)
    return [new_scale, new_tracker]
