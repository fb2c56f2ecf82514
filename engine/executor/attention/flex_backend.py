"""Paged attention with FlexAttention: the CUDA backend (attention_backend "flex"; on CPU it runs
unfused, for the tests that hold it to the torch backend of engine/executor/attention/torch_backend.py).

The KV pool is already flex's key layout: a layer's [num_kv_heads, num_slots, head_dim] is
[1, KVH, S, D] with no copy, one long key axis of every slot. Nothing is gathered: a block mask says,
per block of queries, which KV blocks the kernel reads, and a mask_mod which slots of those a query
sees. Slot s of a sequence's block b holds its position logical(b) * block_size + s % block_size,
logical(b) being b's index in that sequence's block table (-1: not its block); a query sees the
positions up to its own (and, in a windowed layer, no more than `window` of them).

Two calls per layer, whatever the mix:
- decodes, batched [num_decodes, H, 1, D] against the pool broadcast over the batch, each row's
  block mask its own block table (flex's decoding kernel);
- every prefill chunk in one varlen call, packed [1, H, num_prefill_tokens, D]: a block of
  Q_BLOCK query rows reads the union of the tables of the sequences in it (a block shared by a
  prefix, once), and the mask keeps each row to its own sequence.
"""

from dataclasses import dataclass
from functools import cache

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from engine.executor.attention.base import StepBatch, empty_rows

Q_BLOCK = 128  # query rows per block of the block mask (flex's default tile)
MIN_KV_BLOCK = 16  # the narrowest key tile a Triton dot takes: smaller KV blocks share a block of the mask


@dataclass
class FlexCall:
    """One flex_attention call over rows [start, end) of the packed batch."""

    start: int
    end: int
    batched: bool  # decodes: one row per batch entry; else the rows packed as one sequence
    block_mask: BlockMask
    window_block_mask: BlockMask | None  # for windowed layers; None: the window hides nothing here

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, is_windowed: bool
    ) -> torch.Tensor:
        """q [L, H, D] (this call's rows), keys/values [1, KVH, S, D] -> [L, H, D]."""
        mask = (
            self.window_block_mask if is_windowed and self.window_block_mask is not None else self.block_mask
        )
        qs = q[:, :, None] if self.batched else q.transpose(0, 1)[None]  # [L, H, 1, D] or [1, H, L, D]
        out = _flex(q.device.type)(
            qs,
            keys,
            values,
            block_mask=mask,
            scale=scale,
            enable_gqa=True,
            kernel_options=_kernel_options(q, mask.BLOCK_SIZE[1]),
        )
        return out[:, :, 0] if self.batched else out[0].transpose(0, 1)


@dataclass
class FlexMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    calls: list[FlexCall]  # the decodes', then the prefill chunks'; either may be absent

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
        """Write k/v [T, KVH, D] into the caches, attend q [T, H, D]; returns [T, H, D] ([rows, H, D], zeros
        past T)."""
        if softcap is not None or sinks is not None:  # select_backend never picks flex for such a model
            raise ValueError("the flex backend does not soft-cap scores or take attention sinks")
        k_cache.index_copy_(1, self.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, self.slot_mapping, v.transpose(0, 1))
        out = empty_rows(q, rows)
        for call in self.calls:
            out[call.start : call.end] = call.attend(
                q[call.start : call.end], k_cache[None], v_cache[None], scale, is_windowed
            )
        return out


@cache
def _flex(device_type: str):
    """flex_attention compiled into a fused kernel on CUDA (shapes change every step: dynamic); on CPU
    the unfused reference (the CPU engine's own backend is engine/executor/attention/torch_backend.py)."""
    if device_type == "cuda":
        # Dynamic shapes still specialise sizes of 1 (one decode, one chunk, one block of queries), and
        # a windowed layer's mask is another closure: a model compiles up to ~14 variants, more when a
        # process serves several. Past dynamo's limit (8) flex falls back to its unfused path, which
        # materialises scores over the whole KV pool (seen on an H200: the benchmark timed out).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        return torch.compile(flex_attention, dynamic=True)
    return flex_attention


def _kernel_options(q: torch.Tensor, kv_block: int) -> dict | None:
    """The fused kernel's tiles, which must divide the mask's blocks (Inductor's default key tile, 64 or
    128, does not divide a 16-token KV block: it refuses to lower). fp32 tiles take twice the shared
    memory, so they are half as wide. One kernel for decodes and prefills alike: the decoding kernel's
    own tiling would not honour these."""
    if q.device.type != "cuda":
        return None
    tile = 32 if q.dtype == torch.float32 else 64
    return {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": tile, "BLOCK_N": min(tile, kv_block)}


class FlexBackend:
    """Builds each step's FlexMetadata: the block masks of its decode and prefill calls."""

    name = "flex"

    def __init__(self, sliding_window: int | None) -> None:
        self.sliding_window = sliding_window

    def build(self, batch: StepBatch) -> "FlexMetadata":
        return build_metadata(
            batch.block_size,
            batch.num_blocks,
            batch.slot_mapping,
            [d.seq.block_table for d in batch.decodes],
            [d.start + 1 for d in batch.decodes],
            [
                (item.seq.block_table, item.start, item.start + item.num_new_tokens)
                for _, _, item in batch.prefills
            ],
            self.sliding_window,
        )


def build_metadata(
    block_size: int,
    num_blocks: int,
    slot_mapping: torch.Tensor,
    decode_tables: list[list[int]],
    decode_lens: list[int],
    prefills: list[tuple[list[int], int, int]],
    window: int | None,
) -> FlexMetadata:
    """The step's masks. decode_tables / decode_lens: each decode's block table and context length (its
    new token included), rows [0, num_decodes). prefills: (block table, first position, end position)
    of each chunk, rows back to back after the decodes."""
    device = slot_mapping.device
    group = max(1, MIN_KV_BLOCK // block_size)  # KV blocks per block of the mask (a power of two)
    calls = []
    if decode_tables:
        positions = torch.tensor(decode_lens, dtype=torch.int64, device=device) - 1
        calls.append(_decode_call(block_size, group, num_blocks, decode_tables, positions, window))
    if prefills:
        calls.append(
            _prefill_call(block_size, group, num_blocks, prefills, len(decode_tables), window, device)
        )
    return FlexMetadata(slot_mapping, calls)


def _logical_blocks(tables: list[list[int]], num_blocks: int, device: torch.device) -> torch.Tensor:
    """[num_seqs, num_blocks] int64: each physical block's index in each sequence's table, -1 if absent."""
    logical = torch.full((len(tables), num_blocks), -1, dtype=torch.int64, device=device)
    seq = torch.tensor([i for i, t in enumerate(tables) for _ in t], dtype=torch.int64, device=device)
    block = torch.tensor([b for t in tables for b in t], dtype=torch.int64, device=device)
    index = torch.tensor([j for t in tables for j in range(len(t))], dtype=torch.int64, device=device)
    logical[seq, block] = index
    return logical


def _visible(block_size: int, logical: torch.Tensor, seq, pos, kv_idx, window: int | None):
    """Slot kv_idx holds a position of sequence `seq` that a query at `pos` sees."""
    block = logical[seq, kv_idx // block_size]
    key_pos = block * block_size + kv_idx % block_size
    visible = (block >= 0) & (key_pos <= pos)
    return visible & (key_pos > pos - window) if window is not None else visible


# One mask_mod per call kind, each closing over tensors only (and the window, fixed per model), so a
# compiled kernel is reused from step to step rather than recompiled for new closure types.
def _decode_mask_mod(block_size: int, logical: torch.Tensor, positions: torch.Tensor, window: int | None):
    def mask_mod(b, h, q_idx, kv_idx):  # batch row b is decode b
        return _visible(block_size, logical, b, positions[b], kv_idx, window)

    return mask_mod


def _prefill_mask_mod(
    block_size: int, logical: torch.Tensor, row_seq: torch.Tensor, row_pos: torch.Tensor, window: int | None
):
    def mask_mod(b, h, q_idx, kv_idx):  # packed row q_idx is a token of chunk row_seq[q_idx]
        return _visible(block_size, logical, row_seq[q_idx], row_pos[q_idx], kv_idx, window)

    return mask_mod


def _decode_call(
    block_size: int,
    group: int,
    num_blocks: int,
    tables: list[list[int]],
    positions: torch.Tensor,
    window: int | None,
) -> FlexCall:
    device = positions.device
    num_slots = num_blocks * block_size
    num_mask_blocks = -(-num_blocks // group)
    used = [t[: pos // block_size + 1] for t, pos in zip(tables, positions.tolist(), strict=True)]
    logical = _logical_blocks(used, num_blocks, device)
    reads = [sorted({b // group for b in t}) for t in used]  # each mask block once
    width = max(map(len, reads))
    # the kernel wants a row as wide as the key axis has blocks of the mask
    indices = torch.zeros(len(used), num_mask_blocks, dtype=torch.int32, device=device)
    indices[:, :width] = torch.tensor([r + [0] * (width - len(r)) for r in reads], dtype=torch.int32)
    counts = torch.tensor([len(r) for r in reads], dtype=torch.int32, device=device)
    num = len(used)

    def block_mask(win: int | None) -> BlockMask:
        return BlockMask.from_kv_blocks(
            counts.view(num, 1, 1),
            indices.view(num, 1, 1, num_mask_blocks),
            BLOCK_SIZE=(Q_BLOCK, block_size * group),
            seq_lengths=(1, num_slots),
            compute_q_blocks=False,  # q-side indices serve only the backward
            mask_mod=_decode_mask_mod(block_size, logical, positions, win),
        )

    needs_window = window is not None and int(positions.max()) >= window
    return FlexCall(0, num, True, block_mask(None), block_mask(window) if needs_window else None)


def _prefill_call(
    block_size: int,
    group: int,
    num_blocks: int,
    chunks: list[tuple[list[int], int, int]],
    row0: int,
    window: int | None,
    device: torch.device,
) -> FlexCall:
    num_slots = num_blocks * block_size
    num_mask_blocks = -(-num_blocks // group)
    # a chunk reads its sequence's blocks up to the one holding its last position
    used = [table[: (end - 1) // block_size + 1] for table, _, end in chunks]
    logical = _logical_blocks(used, num_blocks, device)
    row_seq = torch.tensor(
        [i for i, (_, start, end) in enumerate(chunks) for _ in range(start, end)],
        dtype=torch.int64,
        device=device,
    )
    row_pos = torch.tensor(
        [p for _, start, end in chunks for p in range(start, end)], dtype=torch.int64, device=device
    )
    num_rows = len(row_seq)
    num_q_blocks = -(-num_rows // Q_BLOCK)
    # which sequences each block of query rows holds, then the union of their KV blocks
    holds = torch.zeros(num_q_blocks, len(chunks), dtype=torch.float32, device=device)
    holds[torch.arange(num_rows, device=device) // Q_BLOCK, row_seq] = 1.0
    reads = (holds @ (logical >= 0).float()) > 0  # [num_q_blocks, num_blocks]
    reads = torch.nn.functional.pad(reads, (0, num_mask_blocks * group - num_blocks))
    reads = reads.view(num_q_blocks, num_mask_blocks, group).any(-1)  # [num_q_blocks, num_mask_blocks]
    counts = reads.sum(-1, dtype=torch.int32)
    indices = torch.argsort((~reads).to(torch.int8), dim=-1, stable=True).to(
        torch.int32
    )  # the read ones first

    def block_mask(win: int | None) -> BlockMask:
        return BlockMask.from_kv_blocks(
            counts.view(1, 1, -1),
            indices.view(1, 1, num_q_blocks, num_mask_blocks),
            BLOCK_SIZE=(Q_BLOCK, block_size * group),
            seq_lengths=(num_rows, num_slots),
            compute_q_blocks=False,
            mask_mod=_prefill_mask_mod(block_size, logical, row_seq, row_pos, win),
        )

    needs_window = window is not None and max(end for _, _, end in chunks) > window
    return FlexCall(
        row0, row0 + num_rows, False, block_mask(None), block_mask(window) if needs_window else None
    )
