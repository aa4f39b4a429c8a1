"""Grid sampling (``F.grid_sample``, 4-D and 5-D) and its backward."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

from . import op
from .nn import _acc


# --------------------------------------------------------------------------------------------
# grid_sampler_2d: PyTorch's forward decomposes into ops that are lowered; its backward has no
# decomposition, so it is the vjp of this forward (PyTorch's CPU kernel: grid_sampler_unnormalize,
# compute_source_index, bilinear / nearest (round half to even) / bicubic (A = -0.75) taps, taps out
# of bounds read 0)

def _gs_unnormalize(coord, size, align):
    return (coord + 1) / 2 * (size - 1) if align else ((coord + 1) * size - 1) / 2


def _gs_reflect(coord, twice_low, twice_high):
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    coord = jnp.abs(coord - low)
    extra = jnp.fmod(coord, span)
    flips = jnp.floor(coord / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + low, span - extra + low)


def _gs_pad(coord, size, padding, align):
    """Border clips to the edge; reflection mirrors at the edges (then clips, as PyTorch does)."""
    if padding == 1:
        return jnp.clip(coord, 0, size - 1)
    if padding == 2:
        coord = _gs_reflect(coord, 0, 2 * (size - 1)) if align else _gs_reflect(coord, -1, 2 * size - 1)
        return jnp.clip(coord, 0, size - 1)
    return coord


def _gs_taps(inp, idx):
    """inp (N, C, *spatial) at integer coordinates ``idx`` (x first: the last spatial dim), each
    (N, *out): (N, C, *out), 0 outside."""
    n, c = inp.shape[:2]
    sizes = inp.shape[2:][::-1]                 # W, H (, D): the order of the grid's coordinates
    inside, flat, stride = True, 0, 1
    for i, size in zip(idx, sizes):
        inside = inside & (i >= 0) & (i < size)
        flat = flat + jnp.clip(i, 0, size - 1) * stride
        stride *= size
    vals = jnp.take_along_axis(inp.reshape(n, c, -1), flat.astype(jnp.int32).reshape(n, 1, -1),
                               axis=2)
    return jnp.where(inside[:, None], vals.reshape(n, c, *idx[0].shape[1:]), 0)


def _cubic_weights(t, a=-0.75):
    def near(x):
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return far(t + 1), near(t), near(1 - t), far(2 - t)


def _grid_sample(inp, grid, mode, padding, align):
    """2-D (N, C, H, W) or 3-D (N, C, D, H, W) input; the grid's last axis is x, y (, z)."""
    sizes = inp.shape[2:][::-1]
    coords = [_gs_unnormalize(grid[..., k], size, align) for k, size in enumerate(sizes)]
    if mode == 2:                       # bicubic (2-D only): padding applies to each tap
        (ix, iy), (w, h) = coords, sizes
        x0, y0 = jnp.floor(ix), jnp.floor(iy)
        wx, wy = _cubic_weights(ix - x0), _cubic_weights(iy - y0)
        out = 0
        for j in range(4):
            yj = _gs_pad(y0 - 1 + j, h, padding, align).astype(jnp.int64)
            for i in range(4):
                xi = _gs_pad(x0 - 1 + i, w, padding, align).astype(jnp.int64)
                out = out + _gs_taps(inp, (xi, yj)) * (wx[i] * wy[j])[:, None]
        return out
    coords = [_gs_pad(c, size, padding, align) for c, size in zip(coords, sizes)]
    if mode == 1:
        return _gs_taps(inp, [jnp.round(c).astype(jnp.int64) for c in coords])
    lows = [jnp.floor(c) for c in coords]
    fracs = [c - lo for c, lo in zip(coords, lows)]
    lows = [lo.astype(jnp.int64) for lo in lows]
    out = 0
    for corner in itertools.product((0, 1), repeat=len(coords)):   # (bi/tri)linear
        wgt = 1
        for up, t in zip(corner, fracs):
            wgt = wgt * (t if up else 1 - t)
        out = out + _gs_taps(inp, [lo + up for lo, up in zip(lows, corner)]) * wgt[:, None]
    return out


@op("grid_sampler_2d_backward.default", "grid_sampler_3d_backward.default")
def grid_sampler_backward(grad_output, inp, grid, interpolation_mode, padding_mode,
                             align_corners, output_mask):
    x, g = _acc(inp), _acc(grid)
    _, vjp = jax.vjp(lambda a, b: _grid_sample(a, b, interpolation_mode, padding_mode,
                                               align_corners), x, g)
    gi, gg = vjp(_acc(grad_output))
    return (gi if output_mask[0] else None), gg


@op("grid_sampler_3d.default")
def grid_sampler_3d(inp, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sample(_acc(inp), _acc(grid), interpolation_mode, padding_mode, align_corners)
