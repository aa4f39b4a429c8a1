"""indexing ops."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import op
