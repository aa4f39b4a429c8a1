"""random ops."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import op


@op("normal_.default", rng=True)
def normal_(self, mean=0.0, std=1.0, *, generator=None, key):
    return mean + std * jax.random.normal(key, self.shape if self is not None else (), self.dtype)


@op("uniform_.default", rng=True)
def uniform_(self, from_=0.0, to=1.0, *, generator=None, key):
    return jax.random.uniform(key, self.shape, self.dtype, from_, to)
