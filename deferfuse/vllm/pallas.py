"""Paged attention as a Pallas kernel, for vLLM on a real TPU (NOTE [paged attention kernel]).

NOTE [paged attention kernel]: the attention of deferfuse/vllm/attention.py, written in plain
torch ops, gathers each request's KV blocks through its block table into one contiguous context
(``kv_cache[block_table]``: a copy of every block the step reads) and runs
``scaled_dot_product_attention`` with a mask. On a TPU this kernel reads the blocks in place
instead: the grid is (request, block), the block table is prefetched into scalar memory, and each
step's KV block is the one the table names (the block spec's index map reads it), so Pallas's
pipeline copies exactly the blocks read, one after the other, while the previous one is used. The
softmax is computed online over the blocks (running maximum, sum and weighted values in scratch
memory), and written once after the last block.

Inputs (as the torch path has them): queries ``(R, Q, H, D)`` laid out per request, the layer's
KV cache ``(blocks, Hkv, block_size, 2 * D)`` (keys then values in the last dim), the block table
``(R, NB)`` (int32) and each query's position ``(R, Q)`` (it sees keys 0 .. position). Grouped
queries (``H`` a multiple of ``Hkv``) share their KV head. Every query sees key 0 at least (a
padding query has position 0), so no row of the softmax is empty.

``interpret=True`` runs the kernel in Pallas's TPU interpreter (any backend): how it is tested
on a machine without a TPU (tests/test_vllm.py), against the torch path.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import deferfuse

_NEG = -1e30    # a finite minus infinity: a block whose keys are all masked leaves no NaN


def _kernel(bt_ref, q_ref, qpos_ref, kv_ref, o_ref, m_ref, l_ref, acc_ref, *, scale: float,
            group: int):
    b = pl.program_id(1)
    nb = pl.num_programs(1)
    bs = kv_ref.shape[2]
    d = q_ref.shape[3]

    @pl.when(b == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    q = q_ref[0].astype(jnp.float32)                     # (Q, H, D)
    kv = kv_ref[0].astype(jnp.float32)                   # (Hkv, BS, 2D)
    k = jnp.repeat(kv[:, :, :d], group, axis=0)          # (H, BS, D)
    v = jnp.repeat(kv[:, :, d:], group, axis=0)
    s = jnp.einsum("qhd,hkd->hqk", q, k, preferred_element_type=jnp.float32) * scale
    pos = b * bs + jax.lax.broadcasted_iota(jnp.int32, (1, 1, bs), 2)
    valid = pos <= qpos_ref[0].reshape(1, -1, 1)         # (1, Q, BS)
    s = jnp.where(valid, s, _NEG)
    m_prev = m_ref[...]                                  # (H, Q, 1)
    m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    corr = jnp.exp(m_prev - m_new)
    l_ref[...] = l_ref[...] * corr + p.sum(axis=-1, keepdims=True)
    acc_ref[...] = acc_ref[...] * corr + jnp.einsum("hqk,hkd->hqd", p, v,
                                                    preferred_element_type=jnp.float32)
    m_ref[...] = m_new

    @pl.when(b == nb - 1)
    def _():
        out = acc_ref[...] / l_ref[...]                  # (H, Q, D)
        o_ref[0] = jnp.transpose(out, (1, 0, 2)).astype(o_ref.dtype)


def paged_attention_jax(q, kv_cache, block_table, qpos, *, scale: float, interpret: bool = False):
    """The kernel as a JAX function (see the module's docstring for the arguments)."""
    r, nq, h, d = q.shape
    _, hkv, bs, _ = kv_cache.shape
    nb = block_table.shape[1]
    bt = block_table.astype(jnp.int32).reshape(-1)
    qpos = qpos.astype(jnp.int32).reshape(r, 1, nq)
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(r, nb),
        in_specs=[
            pl.BlockSpec((1, nq, h, d), lambda i, j, bt: (i, 0, 0, 0)),
            pl.BlockSpec((1, 1, nq), lambda i, j, bt: (i, 0, 0)),
            # the paged read: step (i, j) gets the KV block request i's table names j-th
            pl.BlockSpec((1, hkv, bs, 2 * d), lambda i, j, bt: (bt[i * nb + j], 0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((1, nq, h, d), lambda i, j, bt: (i, 0, 0, 0)),
        scratch_shapes=[pltpu.VMEM((h, nq, 1), jnp.float32), pltpu.VMEM((h, nq, 1), jnp.float32),
                        pltpu.VMEM((h, nq, d), jnp.float32)],
    )
    kernel = functools.partial(_kernel, scale=float(scale), group=h // hkv)
    return pl.pallas_call(
        kernel, grid_spec=grid, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(bt, q, qpos, kv_cache)


@deferfuse.jax_op("deferfuse_vllm::paged_attention", static=("scale", "interpret"))
def paged_attention(q, kv_cache, block_table, qpos, scale=1.0, interpret=False):
    """``torch.ops.deferfuse_vllm.paged_attention``: the kernel as a PyTorch op on ``tpu``
    tensors (a lowering, fused into defer regions and compiled graphs like any op)."""
    return paged_attention_jax(q, kv_cache, block_table, qpos, scale=scale, interpret=interpret)


def use_kernel() -> bool:
    """Whether the attention runs the kernel: on a real TPU (JAX's platform ``tpu``)."""
    return deferfuse.platform() == "tpu"
