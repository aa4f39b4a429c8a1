"""The device's random numbers: counter-based Threefry keyed by a (seed, offset) pair.

NOTE [rng offsets]: like CUDA's Philox generator, a ``tpu`` generator is two host integers, a
64-bit seed and a 64-bit offset; an op that draws takes both as scalar inputs of its program and
the host advances the offset by the number of values the op draws (rounded up to 4, as CUDA's).
Nothing random is threaded through the trace, so reading or setting the state never waits for
the device, and DTensor's ``OffsetBasedRNGTracker``, which moves the offset around each random op,
works as it does on CUDA.

The values: element ``i`` of a draw at offset ``o`` is Threefry-2x32 of the counter ``o + i``
under the key made from the seed (JAX's partitionable Threefry with the counter shifted), so a
draw at offset ``o + k`` is the same stream as the one at ``o``, ``k`` values later: a shard of a
tensor drawn at its offset equals that slice of the whole tensor drawn at once. JAX functions
that split or fold in a key get keys hashed from (seed, offset, index) under other Threefry keys,
apart from every counter stream. The values are not CPU's or CUDA's (no two backends share them).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import define_prng_impl, threefry2x32_p

from .dtypes import x64
from .lowering import take_flags

_U32 = np.uint32
# Domain separation: keys for split and fold_in are hashed under the seed's key xor these
# (the fractional digits of pi), never under the seed's own key, which makes the counter streams.
_SPLIT = (_U32(0x243F6A88), _U32(0x85A308D3))
_FOLD = (_U32(0x13198A2E), _U32(0x03707344))


def _add64(hi, lo, n_lo):
    """(hi, lo) + n_lo as two uint32 words, with the carry."""
    s = lo + n_lo
    return hi + (s < lo).astype(_U32), s


def _seed(seed):
    seed = jnp.asarray(seed)
    u = lax.convert_element_type(seed, np.uint64) if seed.dtype.itemsize == 8 else \
        lax.convert_element_type(seed, np.uint32).astype(np.uint64)
    hi = lax.convert_element_type(lax.shift_right_logical(u, np.uint64(32)), _U32)
    lo = lax.convert_element_type(u & np.uint64(0xFFFFFFFF), _U32)
    z = jnp.zeros((), _U32)
    return jnp.stack([hi, lo, z, z])


def _random_bits(key, bit_width, shape):
    n = math.prod(shape)
    if n >= 2 ** 32:
        raise NotImplementedError("a random draw of 2**32 values or more in one op")
    hi, lo = _add64(key[2], key[3], lax.iota(_U32, n))
    hi = jnp.broadcast_to(hi, (n,))
    b1, b2 = threefry2x32_p.bind(key[0], key[1], hi, lo)
    b1, b2 = b1.reshape(shape), b2.reshape(shape)
    if bit_width == 64:
        return (b1.astype(np.uint64) << np.uint64(32)) | b2.astype(np.uint64)
    bits = b1 ^ b2
    return bits if bit_width == 32 else bits.astype(np.dtype(f"uint{bit_width}"))


def _hashed(key, tweak, words_hi, words_lo):
    """New keys (offset 0) whose seeds hash (seed, offset, words) under the seed's key ^ tweak."""
    k1, k2 = key[0] ^ tweak[0], key[1] ^ tweak[1]
    # First the (seed, offset) pair, then the index under it: no two (offset, index) collide.
    h1, h2 = threefry2x32_p.bind(k1, k2, key[2], key[3])
    s1, s2 = threefry2x32_p.bind(h1, h2, words_hi, words_lo)
    z = jnp.zeros_like(s1)
    return jnp.stack([s1, s2, z, z], axis=-1)


def _split(key, shape):
    n = math.prod(shape)
    idx = lax.iota(_U32, n)
    return _hashed(key, _SPLIT, jnp.zeros_like(idx), idx).reshape((*shape, 4))


def _fold_in(key, data):
    d = jnp.asarray(data).astype(_U32)
    return _hashed(key, _FOLD, jnp.zeros((), _U32), d)


IMPL = define_prng_impl(key_shape=(4,), seed=_seed, split=_split, random_bits=_random_bits,
                        fold_in=_fold_in, name="deferfuse_threefry_offset", tag="dfo")


def key(seed, offset):
    """The typed key of a draw at ``offset`` of the stream ``seed`` (both int64 scalars inside a
    traced program; the seed is the generator's uint64 seed read as int64)."""
    s = lax.bitcast_convert_type(jnp.asarray(seed, np.int64), np.uint64)
    o = lax.bitcast_convert_type(jnp.asarray(offset, np.int64), np.uint64)
    words = [lax.convert_element_type(lax.shift_right_logical(v, np.uint64(32)), _U32)
             for v in (s, o)]
    data = jnp.stack([words[0], lax.convert_element_type(s & np.uint64(0xFFFFFFFF), _U32),
                      words[1], lax.convert_element_type(o & np.uint64(0xFFFFFFFF), _U32)])
    return jax.random.wrap_key_data(data, impl=IMPL)


def draws(fn, avals, scalars) -> int:
    """How many counters ``fn(arrays, scalars)`` takes from its key (``avals``: (shape, dtype) or
    None per array): the sizes of the random-bits draws in its program, nested programs included
    (traced once; the caller keeps the answer)."""
    arrays = [None if a is None else jax.ShapeDtypeStruct(tuple(a[0]), a[1]) for a in avals]
    try:
        with x64(True):
            closed = jax.make_jaxpr(fn)(arrays, list(scalars))
    finally:
        take_flags()        # the checks this trace made belong to no program
    return _count(closed.jaxpr)


def _count(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "random_bits":
            n += math.prod(eqn.params["shape"])
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                if hasattr(sub, "eqns"):                # a Jaxpr
                    n += _count(sub)
                elif hasattr(getattr(sub, "jaxpr", None), "eqns"):    # a ClosedJaxpr
                    n += _count(sub.jaxpr)
    return n

