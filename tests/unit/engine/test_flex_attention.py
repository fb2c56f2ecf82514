"""The FlexAttention backend (engine/executor/attention/flex_backend.py, CUDA's by default): on CPU flex runs unfused,
reading every slot through the mask_mod, so these tests hold the mask_mod to the same tokens as the
torch backend (test_equivalence / test_owned_model_window) and, apart, the block mask (which only
the fused kernel reads) to listing every KV block a query sees, each once, and no other sequence's.
KV blocks under 16 tokens share a block of the mask (the fused kernel's narrowest key tile): then a
block of the mask is listed when it holds one of the sequence's blocks."""

import random

import torch

from engine.executor.attention.flex_backend import MIN_KV_BLOCK, Q_BLOCK, build_metadata

BLOCK_SIZE = 4
NUM_BLOCKS = 256


def _step(rng: random.Random, window: int | None):
    """A mixed step: decodes and prefill chunks (some after cached context), with tables that share
    prefix blocks; returns the metadata and each row's (sequence table, position)."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(3)]  # a cached prefix of 12 tokens that several sequences read
    decodes, chunks, rows = [], [], []
    for _ in range(rng.randrange(1, 6)):
        length = rng.randrange(1, 40)
        table = (shared if rng.random() < 0.5 and length > 12 else []) + []
        table += [free.pop() for _ in range(-(-length // BLOCK_SIZE) - len(table))]
        decodes.append((table, length))
        rows.append((table, length - 1))
    for _ in range(rng.randrange(1, 5)):
        start, end = rng.choice([(0, rng.randrange(1, 150)), (12, 12 + rng.randrange(1, 60))])
        table = (shared if start == 12 else []) + []
        table += [free.pop() for _ in range(-(-end // BLOCK_SIZE) - len(table))]
        chunks.append((table, start, end))
        rows.extend((table, p) for p in range(start, end))
    slots = torch.zeros(len(rows), dtype=torch.long)  # not read by the masks
    meta = build_metadata(
        BLOCK_SIZE, NUM_BLOCKS, slots, [t for t, _ in decodes], [n for _, n in decodes], chunks, window
    )
    return meta, rows


def _visible_blocks(table: list[int], pos: int, window: int | None) -> set[int]:
    first = 0 if window is None else max(pos - window + 1, 0)
    return {table[p // BLOCK_SIZE] for p in range(first, pos + 1)}


def test_block_masks_list_every_block_a_query_sees_once_and_no_other_sequences():
    rng = random.Random(0)
    for case in range(40):
        window = rng.choice([None, 5, 17])
        meta, rows = _step(rng, window)
        for call in meta.calls:
            for windowed in (False, True):
                mask = (
                    call.window_block_mask
                    if windowed and call.window_block_mask is not None
                    else call.block_mask
                )
                counts, indices = mask.kv_num_blocks, mask.kv_indices
                group = mask.BLOCK_SIZE[1] // BLOCK_SIZE  # KV blocks per block of the mask
                assert group == MIN_KV_BLOCK // BLOCK_SIZE
                for q_block in range(counts.shape[0] if call.batched else counts.shape[2]):
                    if call.batched:  # one decode per batch entry
                        n, listed = int(counts[q_block, 0, 0]), indices[q_block, 0, 0]
                        members = [rows[call.start + q_block]]
                    else:
                        n, listed = int(counts[0, 0, q_block]), indices[0, 0, q_block]
                        first = call.start + q_block * Q_BLOCK
                        members = rows[first : min(first + Q_BLOCK, call.end)]
                    listed = listed[:n].tolist()
                    assert len(set(listed)) == n, f"case {case}: a block listed twice"
                    seen = set().union(
                        *(_visible_blocks(t, p, window if windowed else None) for t, p in members)
                    )
                    assert {b // group for b in seen} <= set(listed), f"case {case}: visible blocks missing"
                    own = {b // group for t, _ in members for b in t}
                    assert set(listed) <= own, f"case {case}: the block mask reads another sequence's blocks"


def test_mask_mod_sees_exactly_the_positions_of_its_own_sequence():
    """Dense evaluation of each call's mask_mod against positions worked out from the tables."""
    rng = random.Random(1)
    for _ in range(10):
        window = rng.choice([None, 7])
        meta, rows = _step(rng, window)
        kv = torch.arange(NUM_BLOCKS * BLOCK_SIZE)
        for call in meta.calls:
            mask = call.window_block_mask or call.block_mask
            for row in range(call.start, call.end):
                table, pos = rows[row]
                b, q = (row - call.start, 0) if call.batched else (0, row - call.start)
                got = mask.mask_mod(torch.tensor(b), torch.tensor(0), torch.tensor(q), kv)
                expected = torch.zeros_like(got)
                effective = window if call.window_block_mask is not None else None
                lo = 0 if effective is None else max(pos - effective + 1, 0)
                for p in range(lo, pos + 1):
                    expected[table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE] = True
                assert torch.equal(got, expected)
