"""Paged attention behind transformers' AttentionInterface.

The HF model runs unchanged with `attn_implementation="pagedserve"`; each attention layer calls
`paged_attention` with q/k/v of the new tokens only (after RoPE), packed into one row:

    query [1, num_heads, T, head_dim], key/value [1, num_kv_heads, T, head_dim]
    T = num_decodes (one token each, first) + the prefill chunks, back to back

It writes the new K/V into the block pool at `slot_mapping`, then reads each sequence's context
through its block table: decodes in one padded batch, prefill chunks one by one (SDPA's flash
kernel with is_causal when the chunk has no cached context before it).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "pagedserve"


@dataclass
class PrefillSegment:
    start: int  # rows of the packed batch: [start, end)
    end: int
    context_slots: torch.Tensor | None  # [context_len] slot ids, None when the chunk is the whole context
    mask: torch.Tensor | None  # [chunk_len, context_len] bool, True = attend


@dataclass
class AttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [num_slots, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    num_decodes: int
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] slot ids (padding masked)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] bool
    prefills: list[PrefillSegment]


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs) -> tuple[torch.Tensor, None]:
    meta: AttentionMetadata = kwargs["paged_metadata"]
    k_cache, v_cache = meta.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, KVH, D]
    v = value[0].transpose(0, 1)
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[:meta.num_decodes] = _decode(q[:meta.num_decodes], k_cache, v_cache, meta, scaling)
    for seg in meta.prefills:
        out[seg.start:seg.end] = _prefill(q, k, v, k_cache, v_cache, seg, scaling)
    return out.unsqueeze(0), None  # [1, T, H, D]


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
            scaling: float | None) -> torch.Tensor:
    num_decodes, num_heads, head_dim = q.shape
    keys = k_cache[meta.decode_slots].transpose(1, 2)  # [B, KVH, L, D]
    values = v_cache[meta.decode_slots].transpose(1, 2)
    groups = num_heads // keys.shape[1]
    # one query token: fold the query heads of a KV group into the "sequence" axis (no K/V repeat)
    q = q.view(num_decodes, keys.shape[1], groups, head_dim)  # [B, KVH, groups, D]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.decode_mask, scale=scaling)
    return out.reshape(num_decodes, num_heads, head_dim)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             seg: PrefillSegment, scaling: float | None) -> torch.Tensor:
    qs = q[seg.start:seg.end].transpose(0, 1)  # [H, L, D]
    if seg.context_slots is None:
        ks, vs = k[seg.start:seg.end], v[seg.start:seg.end]
    else:
        ks, vs = k_cache[seg.context_slots], v_cache[seg.context_slots]
    ks, vs = _repeat_kv(ks.transpose(0, 1), qs.shape[0]), _repeat_kv(vs.transpose(0, 1), qs.shape[0])
    out = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=seg.mask,
                                         is_causal=seg.mask is None, scale=scaling)
    return out[0].transpose(0, 1)  # [L, H, D]


def _repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[KVH, L, D] -> [H, L, D] for grouped-query attention."""
    groups = num_heads // x.shape[0]
    if groups == 1:
        return x
    return x[:, None].expand(x.shape[0], groups, *x.shape[1:]).reshape(num_heads, *x.shape[1:])


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
