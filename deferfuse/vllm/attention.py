"""Paged attention for vLLM on ``tpu``, in plain torch ops that deferfuse records and fuses.

KV cache of one layer: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (vLLM's logical
``[B, H, N, C]`` per-layer layout, keys in the first half of C, values in the second), as vLLM's
CPU backend lays it out.

- **write**: token t goes to slot ``slot_mapping[t]``, i.e. block ``slot // block_size``, row
  ``slot % block_size``: one ``index_put_`` per layer of the new keys and values.
- **attend**: each request's blocks are gathered through its block table row (only the blocks the
  longest sequence of the step needs), queries are laid out per request (a decode step is one query
  a request: no scatter), and ``scaled_dot_product_attention`` runs with a causal mask from each
  query's position. Its sizes change with the batch and the sequence length; deferfuse runs such
  regions padded to power-of-two buckets (docs/recompiles.md), so the programs grow with the
  logarithm of the length, not one a token.

What the metadata builder computes on the host from vLLM's host-side copies: where each token's
query sits in the per-request layout. Everything else stays on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

import deferfuse
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from . import buckets


class TpuAttentionBackend(AttentionBackend):
    """vLLM's attention backend for the tpu device (``TPU_PAGED`` in logs)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float32", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return TpuAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TpuAttentionMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class TpuAttentionMetadata:
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor        # (R + 1,) on the device
    seq_lens: torch.Tensor               # (R,)
    block_table: torch.Tensor            # (R, blocks the longest sequence needs)
    slot_mapping: torch.Tensor           # (T,)
    token_index: torch.Tensor | None     # (T,): r * max_query_len + i; None for a decode-only step
    # compiled mode (NOTE [vLLM buckets] in deferfuse/vllm/buckets.py): every size above padded
    # up to a bucket, the forward reads sizes from shapes only; query_pos is arange(max_query_len)
    padded: bool = False
    query_pos: torch.Tensor | None = None


class TpuAttentionMetadataBuilder(AttentionMetadataBuilder[TpuAttentionMetadata]):

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.device = device
        self.token_buckets = buckets.for_config(vllm_config)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TpuAttentionMetadata:
        m = common_attn_metadata
        r, t = m.num_reqs, m.num_actual_tokens
        qmax = int(m.max_query_len)
        blocks = max(1, -(-int(m.max_seq_len) // self.block_size))
        if self.token_buckets is not None:
            return self._build_padded(m, r, t, qmax, blocks)
        token_index = None
        if not (qmax == 1 and t == r):
            qsl = m.query_start_loc_cpu[: r + 1].numpy().astype(np.int64)
            qlens = np.diff(qsl)
            req = np.repeat(np.arange(r, dtype=np.int64), qlens)
            pos = np.arange(t, dtype=np.int64) - qsl[req]
            token_index = torch.from_numpy(req * qmax + pos).to(self.device)
        return TpuAttentionMetadata(
            num_actual_tokens=t, num_reqs=r, max_query_len=qmax, max_seq_len=int(m.max_seq_len),
            query_start_loc=m.query_start_loc[: r + 1], seq_lens=m.seq_lens[:r],
            block_table=m.block_table_tensor[:r, :blocks], slot_mapping=m.slot_mapping[:t],
            token_index=token_index)

    def _build_padded(self, m, r: int, t: int, qmax: int, blocks: int) -> TpuAttentionMetadata:
        """The metadata of a compiled-mode step, every size padded up to its bucket (NOTE [vLLM
        buckets]): T tokens to the runner's token bucket, R requests, the longest query and the
        KV blocks read to powers of two. Padding requests have no query and a sequence of length
        0 (they read the null block); padding tokens sit in a row of their own past the queries."""
        tb = buckets.up(t, self.token_buckets)
        nb = buckets.pow2(blocks)
        # decode-only steps too (a longest query of 1, padded to 2): one graph for every step
        rb, qb = buckets.pow2(r), min(buckets.pow2(qmax), buckets.pow2(tb))
        qsl = m.query_start_loc_cpu[: r + 1].numpy().astype(np.int64)
        qlens = np.diff(qsl)
        req = np.repeat(np.arange(r, dtype=np.int64), qlens)
        pos = np.arange(t, dtype=np.int64) - qsl[req]
        index = np.full(tb, rb * qb, dtype=np.int64)
        index[:t] = req * qb + pos
        token_index = torch.from_numpy(index).to(self.device)
        query_pos = torch.arange(qb, device=self.device)
        # tensors of their own, not views of the runner's buffers: Dynamo gives a view's base
        # size a symbol it cannot guard on (an IndexError building the guards)
        qsl = m.query_start_loc[: r + 1]
        qsl = torch.cat([qsl, qsl[-1:].expand(rb - r)]) if rb > r else qsl.clone()
        width = min(nb, m.block_table_tensor.shape[1])
        block_table = F.pad(m.block_table_tensor[:r, :width], (0, nb - width, 0, rb - r))
        return TpuAttentionMetadata(
            num_actual_tokens=tb, num_reqs=rb, max_query_len=qb, max_seq_len=int(m.max_seq_len),
            query_start_loc=qsl, seq_lens=F.pad(m.seq_lens[:r], (0, rb - r)),
            block_table=block_table, slot_mapping=m.slot_mapping[:t], token_index=token_index,
            padded=True, query_pos=query_pos)


class TpuAttentionImpl(AttentionImpl):

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto",
                 logits_soft_cap=None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks=None) -> None:
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap or sinks is not None:
            raise NotImplementedError("tpu attention: no ALiBi, sliding window, soft cap or sinks yet")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"tpu attention: {attn_type} attention is not supported yet")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        # on a real TPU, the Pallas kernel (NOTE [paged attention kernel] in pallas.py)
        self.kernel = None
        if deferfuse.platform() == "tpu":
            from .pallas import paged_attention
            self.kernel = paged_attention

    @torch._dynamo.dont_skip_tracing
    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        n = slot_mapping.shape[0]
        block_size = kv_cache.shape[2]
        # padded tokens have slot -1 (vLLM's PAD_SLOT_ID), which indexing would wrap to the last
        # block: send them to block 0, vLLM's null block, which no request reads
        slots = slot_mapping.to(torch.int64).clamp(min=0)
        kv = torch.cat([key[:n], value[:n]], dim=-1).to(kv_cache.dtype)
        if n == 1:
            # One token (a single request decoding): XLA turns a one-row scatter into a
            # dynamic-update-slice and fused it into the attention's read of the cache, which
            # then copied the whole cache every step (in compiled mode: 25x slower with a 256 MB
            # cache). A second row, into the null block, keeps it a scatter, done in place.
            slots = torch.cat([slots, slots.new_zeros(1)])
            kv = torch.cat([kv, kv])
        kv_cache[slots // block_size, :, slots % block_size] = kv

    @torch._dynamo.dont_skip_tracing
    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: TpuAttentionMetadata | None,
                output: torch.Tensor, output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("tpu attention: fused output quantization is not supported")
        if attn_metadata is None:        # a profiling run
            return output
        md = attn_metadata
        h, d = self.num_heads, self.head_size
        if md.padded:                   # sizes from shapes: symbols of the compiled graph
            t, r = query.shape[0], md.seq_lens.shape[0]
            qmax = 1 if md.query_pos is None else md.query_pos.shape[0]
            q = query.view(t, h, d)
        else:
            t, r, qmax = md.num_actual_tokens, md.num_reqs, md.max_query_len
            q = query[:t].view(t, h, d)
        if md.token_index is None:
            qr = q.view(r, 1, h, d)
        else:
            # padding tokens (compiled mode) go to one row past the requests' queries
            rows = r * qmax + int(md.padded)
            qr = q.new_zeros((rows, h, d)).index_copy_(0, md.token_index, q)[: r * qmax]
            qr = qr.view(r, qmax, h, d)
        # query i of request r sits at position seq_len - query_len + i and sees keys 0 .. that
        qlens = md.query_start_loc[1:] - md.query_start_loc[:-1]
        i = md.query_pos if md.query_pos is not None else torch.arange(qmax, device=q.device)
        qpos = (md.seq_lens - qlens)[:, None] + i[None, :]
        qpos = torch.where(i[None, :] < qlens[:, None], qpos, torch.zeros_like(qpos))
        if self.kernel is not None:
            out = self.kernel(qr, kv_cache, md.block_table.to(torch.int32), qpos.to(torch.int32),
                              self.scale, False)
        else:
            out = paged_attention_torch(qr, kv_cache, md.block_table, qpos, self.scale)
        if md.token_index is None:
            out = out.reshape(t, h * d)
        else:
            index = md.token_index.clamp(max=r * qmax - 1) if md.padded else md.token_index
            out = out.reshape(r * qmax, h, d).index_select(0, index).reshape(t, h * d)
        output[:t].copy_(out.view(output[:t].shape))
        return output


@torch._dynamo.dont_skip_tracing
def paged_attention_torch(qr: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                          qpos: torch.Tensor, scale: float) -> torch.Tensor:
    """Paged attention in torch ops: queries ``(R, Q, H, D)``, the layer's KV cache, the block
    table ``(R, NB)`` and each query's position ``(R, Q)`` (it sees keys 0 .. position); the
    output ``(R, Q, H, D)``. The Pallas kernel (deferfuse/vllm/pallas.py) computes the same."""
    r, _, h, d = qr.shape
    hkv = kv_cache.shape[1]
    # each request's context: (R, blocks, Hkv, bs, 2D) -> (R, Hkv, blocks * bs, 2D)
    ctx = kv_cache[block_table]
    nb, bs = ctx.shape[1], ctx.shape[3]
    ctx = ctx.permute(0, 2, 1, 3, 4).reshape(r, hkv, nb * bs, 2 * d)
    k, v = ctx[..., :d].to(qr.dtype), ctx[..., d:].to(qr.dtype)
    mask = torch.arange(nb * bs, device=qr.device)[None, None, :] <= qpos[:, :, None]
    out = F.scaled_dot_product_attention(qr.transpose(1, 2), k, v, attn_mask=mask[:, None],
                                         scale=scale, enable_gqa=hkv != h)
    return out.transpose(1, 2)


def compute_slot_mapping(num_tokens: int, max_num_tokens: int, query_start_loc: torch.Tensor,
                         positions: torch.Tensor, block_table: torch.Tensor, block_table_stride: int,
                         slot_mapping: torch.Tensor, KV_CACHE_BLOCK_SIZE: int, TOTAL_CP_WORLD_SIZE: int = 1,
                         TOTAL_CP_RANK: int = 0, CP_KV_CACHE_INTERLEAVE_SIZE: int = 1, PAD_ID: int = -1,
                         BLOCK_SIZE: int = 1024) -> None:
    """vLLM's ``ComputeSlotMappingKernel`` (a Triton kernel) in torch ops: token t of request r at
    position p goes to slot ``block_table[r, p // block_size] * block_size + p % block_size``;
    slots past the step's tokens are ``PAD_ID``."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("tpu: context parallelism is not supported")
    n = positions.shape[0]
    bs = KV_CACHE_BLOCK_SIZE
    tok = torch.arange(n, device=positions.device)
    req = (tok[:, None] >= query_start_loc[None, 1:]).sum(1)
    pos = positions[:n].to(torch.int64)
    block = block_table[req, pos // bs].to(torch.int64)
    slot_mapping[:n] = block * bs + pos % bs
    if max_num_tokens > n:
        slot_mapping[n:max_num_tokens] = PAD_ID
