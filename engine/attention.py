"""Paged attention behind transformers' AttentionInterface.

The HF model runs unchanged with `attn_implementation="pagedserve"`; each attention layer calls
`paged_attention` with q/k/v of the new tokens only (after RoPE), packed into one row:

    query [1, num_heads, T, head_dim], key/value [1, num_kv_heads, T, head_dim]
    T = num_decodes (one token each, first) + the prefill chunks, back to back

It writes the new K/V into the block pool at `slot_mapping`, then reads each sequence's context
through its block table: decodes in one padded batch, prefill chunks one by one (SDPA's flash
kernel with is_causal when the chunk has no cached context before it).

The pool is head-major, [num_kv_heads, num_slots, head_dim] per layer: a block of one head is
block_size x head_dim contiguous values. On CPU in float32 decode attention reads the blocks in
place in a small C kernel (engine/cpu_kernel.py). Elsewhere, and wherever that kernel cannot be
built, the decodes' blocks are gathered into a padded [kv_head, seq, position, head_dim] copy,
already in the layout SDPA reads, and masked.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.cpu_kernel import DecodeKernel

ATTN_IMPLEMENTATION = "pagedserve"


@dataclass
class PrefillSegment:
    start: int  # rows of the packed batch: [start, end)
    end: int
    context_slots: torch.Tensor | None  # [context_len] slot ids, None when the chunk is the whole context
    mask: torch.Tensor | None  # [chunk_len, context_len] bool, True = attend


@dataclass
class AttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [num_kv_heads, num_slots, head_dim]
    block_size: int
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    num_decodes: int
    decode_tables: torch.Tensor | None  # [num_decodes, max_blocks] block ids, each table padded with block 0
    decode_lens: torch.Tensor | None  # [num_decodes] context lengths, the new token included
    decode_mask: torch.Tensor | None  # torch path: [1, num_decodes, 1, max_blocks * block_size], 0 or -inf
    decode_kernel: DecodeKernel | None  # engine.cpu_kernel's, where it runs (CPU, float32)
    prefills: list[PrefillSegment]


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs) -> tuple[torch.Tensor, None]:
    meta: AttentionMetadata = kwargs["paged_metadata"]
    k_cache, v_cache = meta.kv_caches[module.layer_idx]
    q, k, v = query[0], key[0], value[0]  # [H, T, D], [KVH, T, D]
    k_cache.index_copy_(1, meta.slot_mapping, k)
    v_cache.index_copy_(1, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[:, :meta.num_decodes] = _decode(q[:, :meta.num_decodes], k_cache, v_cache, meta, scaling)
    for seg in meta.prefills:
        out[:, seg.start:seg.end] = _prefill(q, k, v, k_cache, v_cache, seg, scaling)
    return out.transpose(0, 1).unsqueeze(0), None  # [1, T, H, D]


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
            scaling: float | None) -> torch.Tensor:
    num_heads, num_decodes, head_dim = q.shape
    scale = head_dim**-0.5 if scaling is None else scaling
    if meta.decode_kernel is not None:  # reads the blocks in place
        out = meta.decode_kernel(q.transpose(0, 1), k_cache, v_cache, meta.decode_tables, meta.decode_lens,
                                 meta.block_size, scale)
        return out.transpose(0, 1)
    num_kv_heads = k_cache.shape[0]
    groups = num_heads // num_kv_heads
    block_ids = meta.decode_tables.flatten()
    keys, values = (_gather(c, block_ids, meta.block_size).view(num_kv_heads, num_decodes, -1, head_dim)
                    for c in (k_cache, v_cache))  # [KVH, B, max_blocks * block_size, D]
    # one query token: the query heads of a KV group become the "sequence" axis (no K/V repeat)
    q = q.view(num_kv_heads, groups, num_decodes, head_dim).transpose(1, 2)  # [KVH, B, groups, D]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.decode_mask, scale=scale)
    return out.transpose(1, 2).reshape(num_heads, num_decodes, head_dim)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             seg: PrefillSegment, scaling: float | None) -> torch.Tensor:
    qs = q[:, seg.start:seg.end]  # [H, L, D]
    if seg.context_slots is None:
        ks, vs = k[:, seg.start:seg.end], v[:, seg.start:seg.end]
    else:
        ks, vs = _gather(k_cache, seg.context_slots, 1), _gather(v_cache, seg.context_slots, 1)
    ks, vs = _repeat_kv(ks, qs.shape[0]), _repeat_kv(vs, qs.shape[0])
    out = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=seg.mask,
                                         is_causal=seg.mask is None, scale=scaling)
    return out[0]  # [H, L, D]


def _gather(cache: torch.Tensor, ids: torch.Tensor, rows_per_id: int) -> torch.Tensor:
    """[KVH, num_slots, D] -> [KVH, len(ids) * rows_per_id, D]: slot ids (rows_per_id 1) or block ids
    (block_size), in order. Head by head along dim 0: on CPU 3x faster than index_select on dim 1."""
    num_kv_heads, _, head_dim = cache.shape
    src = cache.view(num_kv_heads, -1, rows_per_id * head_dim)
    out = src.new_empty(num_kv_heads, len(ids), rows_per_id * head_dim)
    for head in range(num_kv_heads):
        torch.index_select(src[head], 0, ids, out=out[head])
    return out.view(num_kv_heads, -1, head_dim)


def _repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[KVH, L, D] -> [H, L, D] for grouped-query attention."""
    groups = num_heads // x.shape[0]
    if groups == 1:
        return x
    return x[:, None].expand(x.shape[0], groups, *x.shape[1:]).reshape(num_heads, *x.shape[1:])


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
