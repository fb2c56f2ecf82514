"""Paged attention over the KV block pool, called by the attention modules of engine/models: the
CPU backend (attention_backend "torch"; engine/executor/attention/flex_backend.py is the CUDA one, same interface).

Each layer calls `paged_attention` with q/k/v of the new tokens only (after RoPE), packed into one
batch:

    q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim]
    T = num_decodes (one token each, first) + the prefill chunks, back to back

It writes the new K/V into the layer's pool at `slot_mapping`, then reads each sequence's context
through its block table: decodes in one padded batch, prefill chunks one by one (SDPA's flash
kernel with is_causal when the chunk has no cached context before it).

The pool is head-major, [num_kv_heads, num_slots, head_dim] per layer: a block of one head is
block_size x head_dim contiguous values. On CPU in float32 or bfloat16 decode attention reads the blocks in
place in a small C kernel (engine/kernels/cpu.py). Elsewhere, and wherever that kernel cannot be
built, the decodes' blocks are gathered into a padded [kv_head, seq, position, head_dim] copy,
already in the layout SDPA reads, and masked.

Sliding window (Mistral, Qwen's sliding layers): a windowed layer's query at position i sees keys at
positions (i - window, i], as HF masks it. `TorchBackend` builds the window masks once a step, only
where some query reaches past its window; a windowed layer then uses them (and the torch decode
path, since the C kernel reads whole contexts), every other layer the plain causal ones.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.core.scheduler import ScheduledSeq
from engine.executor.attention.base import StepBatch, block_slots, empty_rows
from engine.kernels import cpu as cpu_kernel


@dataclass
class PrefillSegment:
    start: int  # rows of the packed batch: [start, end)
    end: int
    context_slots: torch.Tensor | None  # [context_len] slot ids, None when the chunk is the whole context
    mask: torch.Tensor | None  # [chunk_len, context_len] bool, True = attend; None = causal
    window_mask: torch.Tensor | None = None  # the same for windowed layers; None = the window covers it all
    _additive: dict[bool, torch.Tensor | None] = field(default_factory=dict, init=False, repr=False)

    def sdpa_mask(self, is_windowed: bool, dtype: torch.dtype) -> torch.Tensor | None:
        """A layer's mask as SDPA adds it to the scores (0, or -inf where hidden; q's dtype), converted at
        the step's first layer and reused by the others: SDPA converts a bool mask in every call (~0.2 ms a
        layer for a 256-token chunk over 1,500 of context on a 2-core VM), to the same values."""
        windowed = is_windowed and self.window_mask is not None
        if windowed not in self._additive:
            mask = self.window_mask if windowed else self.mask
            self._additive[windowed] = (
                None
                if mask is None
                else torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
                    ~mask, float("-inf")
                )
            )
        return self._additive[windowed]


class TorchBackend:
    """Builds each step's AttentionMetadata: block tables, masks and the decode kernel where it runs."""

    name = "torch"

    def __init__(self, device: torch.device, dtype: torch.dtype, sliding_window: int | None) -> None:
        self.device, self.dtype, self.sliding_window = device, dtype, sliding_window
        # decode attention straight from the block pool in C where it runs, else gather + SDPA
        kernel_runs = device.type == "cpu" and dtype in cpu_kernel.DecodeKernel.DTYPES
        self.decode_kernel = cpu_kernel.load(torch.get_num_threads()) if kernel_runs else None

    def build(self, batch: StepBatch) -> "AttentionMetadata":
        tables, lengths, mask, window_mask = self._decode_context(batch.decodes, batch.block_size)
        row_groups = _row_groups(batch.decodes, tables, lengths) if self.decode_kernel is not None else None
        return AttentionMetadata(
            batch.block_size,
            batch.slot_mapping,
            len(batch.decodes),
            tables,
            lengths,
            mask,
            self.decode_kernel,
            [self._segment(r0, r1, item, batch.block_size) for r0, r1, item in batch.prefills],
            window_mask,
            row_groups,
        )

    def _decode_context(self, decodes: list[ScheduledSeq], bs: int) -> tuple:
        """(block tables padded with block 0, context lengths, the torch path's additive mask, the mask of
        windowed layers when a decode reaches past the window) of the decodes."""
        if not decodes:
            return None, None, None, None
        dev, window = self.device, self.sliding_window
        max_blocks = max(len(d.seq.block_table) for d in decodes)
        tables = torch.tensor(
            [d.seq.block_table + [0] * (max_blocks - len(d.seq.block_table)) for d in decodes],
            dtype=torch.long,
            device=dev,
        )
        lengths = torch.tensor([d.start + 1 for d in decodes], dtype=torch.long, device=dev)
        key_pos, lens = torch.arange(max_blocks * bs, device=dev)[None, :], lengths[:, None]
        mask = None if self.decode_kernel is not None else self._additive(key_pos >= lens)
        needs_window = window is not None and max(d.start + 1 for d in decodes) > window
        # the query sits at lens - 1 and sees keys (lens - 1 - window, lens - 1]
        window_mask = self._additive((key_pos >= lens) | (key_pos < lens - window)) if needs_window else None
        return tables, lengths, mask, window_mask

    def _additive(self, masked: torch.Tensor) -> torch.Tensor:
        """[num_decodes, num_keys] bool, True = hidden -> [1, num_decodes, 1, num_keys] 0 or -inf."""
        mask = torch.zeros(masked.shape, dtype=self.dtype, device=self.device).masked_fill_(
            masked, float("-inf")
        )
        return mask[None, :, None, :]

    def _segment(self, row_start: int, row_end: int, item: ScheduledSeq, bs: int) -> "PrefillSegment":
        start, context_len, window = item.start, item.start + item.num_new_tokens, self.sliding_window
        needs_window = window is not None and context_len > window
        if start == 0 and not needs_window:
            return PrefillSegment(row_start, row_end, None, None)
        q_pos = torch.arange(start, context_len, device=self.device)[:, None]
        key_pos = torch.arange(context_len, device=self.device)[None, :]
        causal = key_pos <= q_pos
        if start == 0:  # the chunk is its whole context: no slots to read, a causal mask only where windowed
            return PrefillSegment(row_start, row_end, None, None, causal & (key_pos > q_pos - window))
        context_slots = block_slots(item.seq.block_table[: math.ceil(context_len / bs)], bs, self.device)[
            :context_len
        ]
        return PrefillSegment(
            row_start,
            row_end,
            context_slots,
            causal,
            causal & (key_pos > q_pos - window) if needs_window else None,
        )


def _row_groups(
    decodes: list[ScheduledSeq], tables: torch.Tensor | None, lengths: torch.Tensor | None
) -> tuple[torch.Tensor, ...] | None:
    """The decode kernel's (block tables, context lengths, row_starts) with each run of one sequence's rows at
    consecutive positions (a drafted step's verifying rows) as one entry, its blocks then read once for all
    of them: each run's last row's table and length; None where no sequence has more than one row."""
    starts = [0] + [
        i
        for i in range(1, len(decodes))
        if decodes[i].seq is not decodes[i - 1].seq or decodes[i].start != decodes[i - 1].start + 1
    ]
    if len(starts) >= len(decodes):  # none, or one row each
        return None
    bounds = torch.tensor([*starts, len(decodes)], dtype=torch.long, device=lengths.device)
    lasts = bounds[1:] - 1
    return tables[lasts], lengths[lasts], bounds


@dataclass
class AttentionMetadata:
    """What every attention layer of one step reads; the KV pool itself is owned by the layers."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    num_decodes: int
    decode_tables: torch.Tensor | None  # [num_decodes, max_blocks] block ids, each table padded with block 0
    decode_lens: torch.Tensor | None  # [num_decodes] context lengths, the new token included
    decode_mask: torch.Tensor | None  # torch path: [1, num_decodes, 1, max_blocks * block_size], 0 or -inf
    decode_kernel: (
        cpu_kernel.DecodeKernel | None
    )  # engine.kernels.cpu's, where it runs (CPU, float32 or bfloat16)
    prefills: list[PrefillSegment]
    decode_window_mask: torch.Tensor | None = None  # like decode_mask, for windowed layers past their window
    # the decode kernel's (tables, lengths, row_starts) where a sequence has several rows (_row_groups)
    decode_row_groups: tuple[torch.Tensor, ...] | None = None

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        is_windowed: bool,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        rows: int | None = None,
    ) -> torch.Tensor:
        if softcap is not None or sinks is not None:
            return eager_paged_attention(
                q, k, v, k_cache, v_cache, self, scale, is_windowed, softcap, sinks, rows
            )
        return paged_attention(q, k, v, k_cache, v_cache, self, scale, is_windowed, rows)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    is_windowed: bool = False,
    rows: int | None = None,
) -> torch.Tensor:
    """Write k/v [T, KVH, D] into the caches, attend q [T, H, D]; returns [T, H, D] ([rows, H, D], zeros
    past T)."""
    _write(k, v, k_cache, v_cache, meta)
    num_decodes = meta.num_decodes
    window_mask = meta.decode_window_mask if is_windowed else None
    out = empty_rows(q, rows)
    if num_decodes:  # the decodes' rows written in place (a decode-only step: the whole output)
        _decode(q[:num_decodes], k_cache, v_cache, meta, scale, window_mask, out[:num_decodes])
    for seg in meta.prefills:
        out[seg.start : seg.end] = _prefill(
            q, k, v, k_cache, v_cache, seg, seg.sdpa_mask(is_windowed, q.dtype), scale
        )
    return out


def _write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    """k/v [T, KVH, D] into the caches at the step's slots: in one C call where the decode kernel runs (two
    index_copy_ cost ~10 us each at a decode step's size on a 2-core VM, ~50 at a 458-token chunk's)."""
    if meta.decode_kernel is not None:
        meta.decode_kernel.write(k, v, meta.slot_mapping, k_cache, v_cache)
        return
    k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))


def eager_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    is_windowed: bool,
    softcap: float | None,
    sinks: torch.Tensor | None,
    rows: int | None = None,
) -> torch.Tensor:
    """paged_attention's result for models whose scores SDPA cannot compute (soft-capping, sinks): the
    scores written out, one sequence at a time, in HF's eager order."""
    _write(k, v, k_cache, v_cache, meta)
    out = empty_rows(q, rows)
    if meta.num_decodes:
        out[: meta.num_decodes] = _eager_decode(
            q[: meta.num_decodes], k_cache, v_cache, meta, scale, is_windowed, softcap, sinks
        )
    for seg in meta.prefills:
        mask = seg.window_mask if is_windowed and seg.window_mask is not None else seg.mask
        if seg.context_slots is None:
            ks, vs = k[seg.start : seg.end].transpose(0, 1), v[seg.start : seg.end].transpose(0, 1)
        else:
            ks, vs = _gather(k_cache, seg.context_slots, 1), _gather(v_cache, seg.context_slots, 1)
        out[seg.start : seg.end] = _eager(q[seg.start : seg.end], ks, vs, mask, scale, softcap, sinks)
    return out


def _eager_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    is_windowed: bool,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Every decode at once: q [B, H, D] over its blocks gathered padded ([KVH, B, S, D], as the torch
    decode path reads them), each row masked to its own context (and window) -> [B, H, D]."""
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    block_ids = meta.decode_tables.flatten()
    keys, values = (
        _gather(c, block_ids, meta.block_size).view(num_kv_heads, num_decodes, -1, head_dim)
        for c in (k_cache, v_cache)
    )
    qs = q.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bkgd,kbsd->bkgs", qs, keys) * scale  # [B, KVH, groups, S]
    if is_windowed and meta.decode_window_mask is not None:
        visible = meta.decode_window_mask[0, :, 0] == 0  # [B, S]
    else:
        visible = torch.arange(keys.shape[2], device=q.device)[None, :] < meta.decode_lens[:, None]
    sinks = None if sinks is None else sinks.view(1, num_kv_heads, -1, 1).expand(num_decodes, -1, -1, 1)
    probs = _eager_probs(scores, visible[:, None, None, :], softcap, sinks, values.dtype)
    return torch.einsum("bkgs,kbsd->bkgd", probs, values).reshape(num_decodes, num_heads, head_dim)


def _eager(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q [L, H, D] over keys/values [KVH, S, D]; `visible` [L, S] bool (None: causal, the queries being the
    last L positions) -> [L, H, D]."""
    num_queries, num_heads, _ = q.shape
    groups = num_heads // keys.shape[0]
    keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
    scores = q.transpose(0, 1) @ keys.transpose(1, 2) * scale  # [H, L, S]
    if visible is None:
        num_keys = keys.shape[1]
        visible = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device).tril(
            num_keys - num_queries
        )
    sinks = None if sinks is None else sinks.reshape(-1, 1, 1).expand(-1, num_queries, 1)
    return (_eager_probs(scores, visible, softcap, sinks, values.dtype) @ values).transpose(0, 1)


def _eager_probs(
    scores: torch.Tensor,
    visible: torch.Tensor,
    softcap: float | None,
    sinks: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Attention weights, in HF's eager order: soft-cap, mask (`visible` broadcasts to scores), softmax in
    float32; `sinks` (scores' shape with a last axis of 1) join the denominator and are dropped."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    logits = torch.cat([scores, sinks.to(scores.dtype)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(dtype)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window_mask: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """q [B, H, D] -> out [B, H, D] (contiguous)."""
    if meta.decode_kernel is not None and window_mask is None:  # reads the blocks in place
        tables, lens, row_starts = meta.decode_row_groups or (meta.decode_tables, meta.decode_lens, None)
        meta.decode_kernel(q, k_cache, v_cache, tables, lens, meta.block_size, scale, out, row_starts)
        return
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    block_ids = meta.decode_tables.flatten()
    keys, values = (
        _gather(c, block_ids, meta.block_size).view(num_kv_heads, num_decodes, -1, head_dim)
        for c in (k_cache, v_cache)
    )  # [KVH, B, max_blocks * block_size, D]
    # one query token: the query heads of a KV group become the "sequence" axis (no K/V repeat)
    q = q.view(num_decodes, num_kv_heads, -1, head_dim).transpose(0, 1)  # [KVH, B, groups, D]
    mask = window_mask if window_mask is not None else meta.decode_mask
    attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    out.copy_(attended.transpose(0, 1).reshape(num_decodes, num_heads, head_dim))


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: PrefillSegment,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One chunk: rows [seg.start, seg.end) of q [T, H, D] -> [L, H, D]."""
    qs = q[seg.start : seg.end].transpose(0, 1)  # [H, L, D]
    if seg.context_slots is None:
        ks, vs = k[seg.start : seg.end].transpose(0, 1), v[seg.start : seg.end].transpose(0, 1)
    else:
        ks, vs = _gather(k_cache, seg.context_slots, 1), _gather(v_cache, seg.context_slots, 1)
    # grouped-query K/V read as they are (enable_gqa), not repeated per query head into a copy: the same
    # result, bit for bit, and 10-40% faster on CPU at 64-256 tokens
    out = F.scaled_dot_product_attention(
        qs[None],
        ks[None],
        vs[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=ks.shape[0] != qs.shape[0],
    )
    return out[0].transpose(0, 1)


def _gather(cache: torch.Tensor, ids: torch.Tensor, rows_per_id: int) -> torch.Tensor:
    """[KVH, num_slots, D] -> [KVH, len(ids) * rows_per_id, D]: slot ids (rows_per_id 1) or block ids
    (block_size), in order. Head by head along dim 0: on CPU 3x faster than index_select on dim 1."""
    num_kv_heads, _, head_dim = cache.shape
    src = cache.view(num_kv_heads, -1, rows_per_id * head_dim)
    out = src.new_empty(num_kv_heads, len(ids), rows_per_id * head_dim)
    for head in range(num_kv_heads):
        torch.index_select(src[head], 0, ids, out=out[head])
    return out.view(num_kv_heads, -1, head_dim)
