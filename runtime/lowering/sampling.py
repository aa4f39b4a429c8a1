"""Grid sampling (``F.grid_sample``, 4-D and 5-D) and its backward."""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp

from . import op
from .padding import Refuse
from .nn import _acc
from .precision import HALF, acc, round_to

# Ops of this family with no rule of their own (NOTE [padding rules] in padding.py)
PAD = Refuse("grid sampling interpolates between positions")


# --------------------------------------------------------------------------------------------
# grid_sampler_2d and 3d; the backward ops are the vjp of this forward (PyTorch's CPU kernel:
# grid_sampler_unnormalize, compute_source_index, bilinear / nearest (round half to even) /
# bicubic (A = -0.75) taps, taps out of bounds read 0)

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


# --------------------------------------------------------------------------------------------
# Half precision: PyTorch's CPU grid samplers compute bfloat16 and float16 in the input's dtype,
# one rounded operation at a time (GridSampler.cpp's scalar kernels and the helpers of
# GridSampler.h and UpSample.h), so a coordinate can even land on another pixel than a float32
# computation's. This follows those kernels step for step, rounding where they round.

def _half_unnormalize(coord, size, align, r):
    if align:
        return r(r(r(coord + 1) / 2) * r(jnp.float32(size - 1)))
    return r(r(r(r(coord + 1) * r(jnp.float32(size))) - 1) / 2)


def _half_clip(coord, size):
    return jnp.minimum(jnp.float32(size - 1), jnp.maximum(coord, 0.0))


def _half_reflect(coord, twice_low, twice_high, r):
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low, span = r(jnp.float32(twice_low) / 2), r(jnp.float32(twice_high - twice_low) / 2)
    coord = jnp.abs(r(coord - low))
    extra = r(jnp.fmod(coord, span))
    flips = jnp.floor(r(coord / span))
    return jnp.where(jnp.fmod(flips, 2) == 0, r(extra + low), r(r(span - extra) + low))


def _half_pad(coord, size, padding, align, r):
    if padding == 1:
        return _half_clip(coord, size)
    if padding == 2:
        coord = (_half_reflect(coord, 0, 2 * (size - 1), r) if align
                 else _half_reflect(coord, -1, 2 * size - 1, r))
        return _half_clip(coord, size)
    return coord


def _half_cubic_coeffs(t, r):
    a = -0.75

    def near(x):    # ((A + 2) * x - (A + 3)) * x * x + 1
        return r(r(r(r(r((a + 2) * x) - (a + 3)) * x) * x) + 1)

    def far(x):     # ((A * x - 5 * A) * x + 8 * A) * x - 4 * A
        return r(r(r(r(r(r(a * x) - 5 * a) * x) + 8 * a) * x) - 4 * a)
    return far(r(t + 1)), near(t), near(r(1 - t)), far(r(r(1 - t) + 1))


def _half_sum(terms, r):
    """``res = 0; res += t`` for each term, as the kernels accumulate (each sum rounded)."""
    out = None
    for t in terms:
        out = t if out is None else r(out + t)
    return out


def _grid_sample_half(inp, grid, mode, padding, align, dt):
    r = functools.partial(round_to, dtype=dt)
    x, g = acc(inp), acc(grid)
    sizes = x.shape[2:][::-1]                      # W, H (, D)
    coords = [_half_unnormalize(g[..., k], size, align, r) for k, size in enumerate(sizes)]
    if mode == 2:                                  # bicubic (2-D)
        (ix, iy), (w, h) = coords, sizes
        x0, y0 = jnp.floor(ix), jnp.floor(iy)
        cx, cy = _half_cubic_coeffs(r(ix - x0), r), _half_cubic_coeffs(r(iy - y0), r)

        def tap(xx, yy):       # get_value_bounded: pad, truncate, read (0 outside)
            xx = _half_pad(xx, w, padding, align, r).astype(jnp.int64)
            yy = _half_pad(yy, h, padding, align, r).astype(jnp.int64)
            return _gs_taps(x, (xx, yy))
        rows = []
        for j in range(4):
            yj = r(y0 - 1 + j)
            vals = [tap(r(x0 - 1 + i), yj) for i in range(4)]
            rows.append(_half_sum([r(v * c[:, None]) for v, c in zip(vals, cx)], r))
        return _half_sum([r(v * c[:, None]) for v, c in zip(rows, cy)], r)
    coords = [_half_pad(c, size, padding, align, r) for c, size in zip(coords, sizes)]
    if mode == 1:
        return _gs_taps(x, [jnp.round(c).astype(jnp.int64) for c in coords])
    lows = [jnp.floor(c) for c in coords]
    # Corners in the kernels' order (z, then y, then x: tnw, tne, tsw, tse, bnw ...); each weight
    # is a product of (far - c) or (c - near) factors, x first, rounded after each step.
    terms = []
    for corner in itertools.product((0, 1), repeat=len(coords)):
        corner = corner[::-1]                       # x varies fastest
        wgt = None
        for up, c, lo in zip(corner, coords, lows):
            f = r(c - lo) if up else r((lo + 1) - c)
            wgt = f if wgt is None else r(wgt * f)
        tap = _gs_taps(x, [(lo + up).astype(jnp.int64) for lo, up in zip(lows, corner)])
        terms.append(r(tap * wgt[:, None]))
    return _half_sum(terms, r)


def _sample(inp, grid, mode, padding, align):
    if inp.dtype in HALF:
        return _grid_sample_half(inp, grid, mode, padding, align, inp.dtype)
    return _grid_sample(_acc(inp), _acc(grid), mode, padding, align)


@op("grid_sampler_2d.default")
def grid_sampler_2d(inp, grid, interpolation_mode, padding_mode, align_corners):
    return _sample(inp, grid, interpolation_mode, padding_mode, align_corners)


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
    return _sample(inp, grid, interpolation_mode, padding_mode, align_corners)
