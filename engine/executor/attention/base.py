"""What every attention backend shares: the step batch it builds its per-step metadata from, what the
attention modules call on that metadata, and the slot arithmetic of the block pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from engine.core.scheduler import ScheduledSeq


@dataclass
class StepBatch:
    """A step's rows as attention needs them: the decodes first (one new token after some context), then
    the prefill chunks back to back; T rows in all."""

    block_size: int
    num_blocks: int
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    decodes: list[ScheduledSeq]
    prefills: list[tuple[int, int, ScheduledSeq]]  # (first row, end row) of each chunk in the packed batch


class StepAttention(Protocol):
    """What an attention layer calls once per step: the backend's metadata for that step."""

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
        """Write k/v [T, KVH, D] into the layer's caches at the step's slots, attend q [T, H, D]; [T, H, D],
        or [rows, H, D] with zeros past T (the padding rows a layer's dense halves carry: no copy to pad).
        `softcap`: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2); `sinks` [H]:
        one logit per head that joins each softmax's denominator and attends to nothing (GPT-OSS). Only
        the torch backend takes them (select_backend's `needs_eager`)."""
        ...


class AttentionBackend(Protocol):
    name: str  # as EngineConfig.attention_backend names it

    def build(self, batch: StepBatch) -> StepAttention:
        """The metadata every attention layer of this step reads."""
        ...


def empty_rows(like: torch.Tensor, rows: int | None) -> torch.Tensor:
    """An uninitialised tensor of like's shape with `rows` rows (None: like's), the rows past like's zero."""
    n = like.shape[0]
    out = like.new_empty(n if rows is None else rows, *like.shape[1:])
    if rows is not None and rows > n:
        out[n:].zero_()
    return out


def block_slots(block_ids: list[int], block_size: int, device: torch.device) -> torch.Tensor:
    """[len(block_ids) * block_size] the slots of those blocks, in order."""
    blocks = torch.tensor(block_ids, dtype=torch.long, device=device)
    return (blocks[:, None] * block_size + torch.arange(block_size, device=device)).flatten()
