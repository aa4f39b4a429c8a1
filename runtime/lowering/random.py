"""Random ops (``rng=True``: each call gets a ``key`` made from its generator's (seed, offset), NOTE
[rng offsets] in runtime/prng.py; a lowering draws from it once, or splits it).

In-place generators that overwrite ``self`` (normal_, uniform_, random_, ...) may receive
``self=None`` (the runtime does not read a tensor it overwrites whole), so they take their shape
and dtype from ``_avals`` (``meta=True``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import check, op
from .padding import Multinomial, Refuse

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("draws random numbers")


def _ct(dt):
    """The float type to draw in for output dtype ``dt`` (half types draw in float32)."""
    dt = np.dtype(dt)
    if dt == np.float64:
        return np.float64
    return np.float32


def _uniform(key, shape, dt, lo=0.0, hi=1.0):
    return jax.random.uniform(key, shape, _ct(dt), lo, hi)


def _normal(key, shape, dt):
    return jax.random.normal(key, shape, _ct(dt))


# --------------------------------------------------------------------------------------------
# in-place generators

@op("normal_.default", rng=True, meta=True)
def normal_(self, mean=0.0, std=1.0, *, generator=None, key, _avals):
    shape, dt = _avals[0]
    return (mean + std * _normal(key, shape, dt)).astype(dt)


@op("uniform_.default", rng=True, meta=True)
def uniform_(self, from_=0.0, to=1.0, *, generator=None, key, _avals):
    shape, dt = _avals[0]
    u = _uniform(key, shape, dt)
    return (from_ + (to - from_) * u).astype(dt)


@op("exponential_.default", rng=True, meta=True)
def exponential_(self, lambd=1.0, *, generator=None, key, _avals):
    shape, dt = _avals[0]
    return (jax.random.exponential(key, shape, _ct(dt)) / lambd).astype(dt)


@op("geometric_.default", rng=True, meta=True)
def geometric_(self, p, *, generator=None, key, _avals):
    shape, dt = _avals[0]
    ct = _ct(dt)
    u = jax.random.uniform(key, shape, ct, minval=jnp.finfo(ct).tiny, maxval=1.0)
    return jnp.maximum(jnp.ceil(jnp.log(u) / jnp.log1p(-jnp.asarray(p, ct))), 1).astype(dt)


@op("log_normal_.default", rng=True, meta=True)
def log_normal_(self, mean=1.0, std=2.0, *, generator=None, key, _avals):
    shape, dt = _avals[0]
    return jnp.exp(mean + std * _normal(key, shape, dt)).astype(dt)


@op("cauchy_.default", rng=True, meta=True)
def cauchy_(self, median=0.0, sigma=1.0, *, generator=None, key, _avals):
    shape, dt = _avals[0]
    return (median + sigma * jax.random.cauchy(key, shape, _ct(dt))).astype(dt)


def _bern(key, shape, dt, p):
    p = jnp.asarray(p)
    ct = np.float64 if p.dtype == np.float64 else np.float32
    return (jax.random.uniform(key, shape, ct) < p.astype(ct)).astype(dt)


@op("bernoulli_.float", "bernoulli_.Tensor", rng=True, meta=True)
def bernoulli_(self, p=0.5, *, generator=None, key, _avals):
    shape, dt = _avals[0]
    return _bern(key, shape, dt, p)


@op("bernoulli.p", "bernoulli.Tensor", rng=True, meta=True)
def bernoulli_p(self, p=0.5, *, generator=None, key, _avals):
    shape, dt = _avals[0]
    return _bern(key, shape, dt, p)


@op("bernoulli.default", rng=True, meta=True)
def bernoulli(self, *, generator=None, key, _avals):
    shape, dt = _avals[0]
    return _bern(key, shape, dt, self)


def _int_max(dt):
    """Largest value random_() draws for dtype ``dt`` (inclusive), as PyTorch does."""
    dt = np.dtype(dt)
    if dt == np.bool_:
        return 1
    if np.issubdtype(dt, np.integer):
        return int(np.iinfo(dt).max)
    return 2 ** (int(jnp.finfo(dt).nmant) + 1)   # every integer up to it is exact


def _randint(key, shape, dt, lo, hi):
    """Integers uniform in [lo, hi] (inclusive; Python ints) as dtype ``dt``."""
    n = hi - lo + 1
    if n <= 0:
        return jnp.full(shape, lo).astype(dt)
    if n < 2 ** 31 and -2 ** 31 <= lo and hi < 2 ** 31:
        # 32-bit path (fast on accelerators): bits % n < 2**31 and lo + it stays in [lo, hi].
        bits = jax.random.bits(key, shape, jnp.uint32) % np.uint32(n)
        return (bits.astype(jnp.int32) + np.int32(lo)).astype(dt)
    bits = jax.random.bits(key, shape, jnp.uint64)
    if n < 2 ** 64:
        bits = bits % np.uint64(n)
    # lo + bits, wrapping modulo 2**64 (the result lies in [lo, hi])
    return (bits + np.uint64(lo % 2 ** 64)).astype(jnp.int64).astype(dt)


@op("random_.default", rng=True, meta=True)
def random_(self, *, generator=None, key, _avals):
    shape, dt = _avals[0]
    return _randint(key, shape, dt, 0, _int_max(dt))


@op("random_.from", rng=True, meta=True)
def random_from(self, from_, to=None, *, generator=None, key, _avals):
    shape, dt = _avals[0]
    return _randint(key, shape, dt, from_, _int_max(dt) if to is None else to - 1)


@op("random_.to", rng=True, meta=True)
def random_to(self, to, *, generator=None, key, _avals):
    shape, dt = _avals[0]
    return _randint(key, shape, dt, 0, to - 1)


# --------------------------------------------------------------------------------------------
# functional / factory generators

@op("normal.Tensor_float", "normal.float_Tensor", "normal.Tensor_Tensor", rng=True, meta=True)
def normal(mean, std=1.0, *, generator=None, key, _avals):
    shape, dt = _avals[0]
    return (mean + std * _normal(key, shape, dt)).astype(dt)


@op("normal.float_float", rng=True, meta=True)
def normal_float_float(mean, std, size, *, generator=None, dtype=None, layout=None, device=None,
                       pin_memory=None, key, _avals):
    shape, dt = _avals[0]
    return (mean + std * _normal(key, shape, dt)).astype(dt)


@op("rand.default", "rand.generator", "rand_like.default", "rand_like.generator", rng=True, meta=True)
def rand(*args, key, _avals, **kw):
    shape, dt = _avals[0]
    return _uniform(key, shape, dt).astype(dt)


@op("randn.default", "randn.generator", "randn_like.default", "randn_like.generator", rng=True,
    meta=True)
def randn(*args, key, _avals, **kw):
    shape, dt = _avals[0]
    return _normal(key, shape, dt).astype(dt)


@op("randint.default", "randint.generator", rng=True, meta=True)
def randint(high, size, *, key, _avals, **kw):
    shape, dt = _avals[0]
    return _randint(key, shape, dt, 0, high - 1)


@op("randint.low", "randint.low_generator", rng=True, meta=True)
def randint_low(low, high, size, *, key, _avals, **kw):
    shape, dt = _avals[0]
    return _randint(key, shape, dt, low, high - 1)


@op("randint_like.default", "randint_like.generator", rng=True, meta=True)
def randint_like(self, high, *, key, _avals, **kw):
    shape, dt = _avals[0]
    return _randint(key, shape, dt, 0, high - 1)


@op("randint_like.low_dtype", "randint_like.low_generator_dtype", rng=True, meta=True)
def randint_like_low(self, low, high, *, key, _avals, **kw):
    shape, dt = _avals[0]
    return _randint(key, shape, dt, low, high - 1)


@op("randint_like.Tensor", "randint_like.Tensor_generator", rng=True, meta=True)
def randint_like_tensor(self, high, *, key, _avals, **kw):
    shape, dt = _avals[0]
    return jax.random.randint(key, shape, 0, high.astype(jnp.int64), jnp.int64).astype(dt)


@op("randperm.default", "randperm.generator", rng=True, meta=True)
def randperm(n, *, key, _avals, **kw):
    shape, dt = _avals[0]
    return jax.random.permutation(key, n).astype(dt)


@op("multinomial.default", rng=True, meta=True, pad=Multinomial())
def multinomial(p, num_samples, replacement=False, *, generator=None, key, _avals):
    shape, dt = _avals[0]
    ct = np.float64 if p.dtype == np.float64 else np.float32
    w = p.reshape(-1, p.shape[-1]).astype(ct)
    # CPU's checks (CUDA's are device asserts), raised when the flags are read.
    check((w < 0) | ~jnp.isfinite(w), RuntimeError,
          "probability tensor contains either `inf`, `nan` or element < 0")
    check(jnp.sum(jnp.where(w > 0, w, 0), axis=-1) <= 0, RuntimeError,
          "invalid multinomial distribution (sum of probabilities <= 0)")
    logits = jnp.where(w > 0, jnp.log(jnp.where(w > 0, w, 1)), -jnp.inf)
    if replacement:
        s = jax.random.categorical(key, logits, axis=-1, shape=(num_samples, w.shape[0])).T
    else:
        g = jax.random.gumbel(key, w.shape, ct) + logits
        s = lax.top_k(g, num_samples)[1]
    return s.reshape(shape).astype(dt)
